"""``python -m rlsweep`` (or ``rlsweep``): one run, or a Hydra multirun of runs gated at its end.

Exit codes are ``rlsweep.exitcodes.ExitCode`` (docs/sweeps.md). Hydra is told to re-raise errors
(HYDRA_FULL_ERROR) so that every failure, Hydra's own included, ends here as one line and exit 1; the
sweep gate runs after Hydra returns, where no exception can be turned into a warning.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rlsweep import CONF_DIR
from rlsweep.callbacks import SESSION, require_callback
from rlsweep.check import gate_directory
from rlsweep.config import register_configs, run_spec, saved_config_sha256
from rlsweep.errors import ConfigError, RlsweepError
from rlsweep.exitcodes import ExitCode, guarded, one_line, stop_on_sigterm
from rlsweep.job import run_job
from rlsweep.manifest import HYDRA_CONFIG
from rlsweep.run import choose_triton_mode
from rlsweep.tables import RunLocation

PROG = "rlsweep"

register_configs()
choose_triton_mode()


class JobFailed(RlsweepError):
    """A sweep job that stopped on an error: Hydra's sweeper re-raises it once the batch is done (exit 1)."""


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def app(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.RUN:  # its error is this process's one line, not Hydra's "Error executing job"
        location = RunLocation.single(Path(cfg.tables_dir or hydra_cfg.runtime.output_dir))
        SESSION.code = guarded(PROG, lambda: run_at(cfg, location, resume=False, standalone=True))
        return
    SESSION.multirun = True
    try:
        require_callback()
        if cfg.tables_dir is not None:
            raise ConfigError(f"tables_dir={cfg.tables_dir!r} in a sweep: the jobs write into the sweep's datasets")
        location = RunLocation.sweep_job(
            Path(hydra_cfg.runtime.output_dir), Path(hydra_cfg.sweep.dir), hydra_cfg.job.num
        )
        run_at(cfg, location, resume=True, standalone=False)
    except Exception as err:
        overrides = " ".join(hydra_cfg.overrides.task)
        SESSION.job_error = f"job #{hydra_cfg.job.num} ({overrides}) failed: {one_line(err)}"  # its progress line
        raise JobFailed(SESSION.job_error) from err


def run_at(cfg: DictConfig, location: RunLocation, *, resume: bool, standalone: bool) -> ExitCode:
    """The run of a composed config at ``location``: its RunSpec is parsed here, at the top, and nowhere else.

    A ``sys.exit()`` inside the run (a backend module's, a library's) is its error: let through, exit 0 ended the
    process GREEN with no tables, and in a sweep skipped the other jobs and the gate.
    """
    # The manifest names the config Hydra saved beside the tables only where one is: not with tables_dir elsewhere,
    # nor with hydra.output_subdir=null; a run whose saved config is later deleted is then incomplete.
    saved = saved_config_sha256(cfg) if (location.run_dir / HYDRA_CONFIG).is_file() else None
    try:
        return run_job(lambda: run_spec(cfg), location, resume=resume, standalone=standalone, saved_config_sha256=saved)
    except SystemExit as stop:
        raise RlsweepError(f"the run ended early through sys.exit({stop.code!r}), before its verdicts") from None


def command() -> ExitCode:
    app()
    if SESSION.sweep_dir is not None:
        return gate_directory(SESSION.sweep_dir)
    if SESSION.multirun:  # the sweep's start callback never recorded it: nothing would gate its jobs
        raise RlsweepError("the sweep's jobs ran but its start callback did not record the sweep, so no gate judged it")
    return SESSION.code if SESSION.code is not None else ExitCode.GREEN


def main() -> int:
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # read by Hydra when it reports an error: re-raise it to us
    sys.argv[0] = PROG  # usage lines and shell completion name the command, not __main__.py
    stop_on_sigterm()
    return int(guarded(PROG, command))


if __name__ == "__main__":
    sys.exit(main())
