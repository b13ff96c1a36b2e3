"""The kernels package stands alone: it runs where rlsweep, Hydra and OmegaConf cannot be imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
for name in ("rlsweep", "hydra", "omegaconf"):
    sys.modules[name] = None  # any import of these now raises ImportError
import torch
import kernels

gen = torch.Generator().manual_seed(0)
hidden = torch.randn(5, 32, generator=gen).bfloat16()
weight = (torch.randn(300, 32, generator=gen) / 4).bfloat16()
targets = torch.randint(0, 300, (5,), generator=gen)
result = kernels.lm_head_logprob(hidden, weight, targets, backend="aten", tp=2)
reference = kernels.lm_head_logprob(hidden, weight, targets, backend="reference")
bound = kernels.rounding_bound(hidden, weight, targets, logits_dtype=torch.bfloat16)
assert bool(((result.logp.double() - reference.logp).abs() <= bound.logp).all())
print("ok", sorted(name for name in sys.modules if name.split(".")[0] in ("rlsweep", "hydra", "omegaconf")
                   and sys.modules[name] is not None))
"""


def test_kernels_import_and_run_without_rlsweep_hydra_or_omegaconf():
    root = Path(__file__).parent.parent
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "ok []"
