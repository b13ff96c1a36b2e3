"""rlsweep: sweeps lm_head logprob kernels for accuracy, layout/TP invariance and provenance."""

from pathlib import Path

# The shipped configs: the `conf` package installed beside `rlsweep`, found by path rather than imported, so a
# `conf/` folder in the user's working directory (common in Hydra projects) cannot shadow it.
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
