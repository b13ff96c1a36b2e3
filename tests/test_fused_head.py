"""A library's fused head (kernels/recipes.py, ``head_logprob``): Liger-Kernel's fused linear cross-entropy, called as
the library itself, judged on logp alone (it computes no lse) at tp = 1, its Triton kernel observed though the library
launches it itself, and red by a margin for the bugs a training stack ships with it (tests/fused_head_bugs.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import liger_interpreted
from rlsweep_fixtures import compose_run

import kernels
from kernels.validation import IGNORE_INDEX
from rlsweep.config import run_spec
from rlsweep.errors import ConfigError
from rlsweep.exitcodes import ExitCode

TESTS = Path(__file__).parent
needs_liger = pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None, reason="Liger-Kernel is not installed (pip install -e '.[liger]')"
)

LIGER_KERNEL = "liger_kernel.ops.cross_entropy.liger_cross_entropy_kernel"
ROWS, HIDDEN, VOCAB = 21, 32, 1000


def liger_inputs(make_inputs):
    inp = make_inputs(ROWS, HIDDEN, VOCAB, torch.bfloat16, "cpu")
    targets = inp.targets.clone()
    targets[[3, 11]] = IGNORE_INDEX  # inactive rows, as a prompt token's
    return inp, targets


@needs_liger
@pytest.mark.interpreter
@liger_interpreted
def test_liger_is_called_as_the_library_and_judged_on_logp_alone(make_inputs):
    inp, targets = liger_inputs(make_inputs)
    with kernels.observed_provenance():
        result = kernels.lm_head_logprob(inp.hidden, inp.weight, targets, backend="liger")
    logits = inp.hidden.double() @ inp.weight.double().T
    active = targets != IGNORE_INDEX
    gold = (logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1) - torch.logsumexp(logits, 1))[active]
    bound = kernels.rounding_bound(inp.hidden, inp.weight, targets, logits_dtype=torch.bfloat16).logp[active]
    error = (result.logp.double()[active] - gold).abs()
    assert bool((error <= bound).all()), f"seed {inp.seed}: max error / bound {float((error / bound).max()):.3g}"
    assert bool(error.max() > 0)  # its bf16 logits are not float64: a head that returned the gold would be suspect
    assert not result.has_lse and bool(result.lse.isnan().all())
    assert kernels.bit_view(result.logp[~active]).tolist() == [0, 0]  # +0.0, not the library's -0.0
    nodes = result.provenance.nodes
    assert kernels.provenance_mismatches(dict.fromkeys(kernels.OP_NODES, "liger"), result.provenance) == []
    for node in kernels.OP_NODES:  # one call is every node, and the library's own Triton launch is seen in it
        assert LIGER_KERNEL in nodes[node].kernels and nodes[node].node == node


TRITON_HEAD = """
import torch
import triton
import triton.language as tl

import kernels
from kernels.stacks import LIGER_CAPABILITY


@triton.jit
def negate_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, -tl.load(x_ptr + offsets, mask=mask), mask=mask)


class OwnTritonHead:
    def head_logprob(self, hidden, weight, targets):
        logits = (hidden.float() @ weight.float().T)
        loss = torch.logsumexp(logits, -1) - logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
        out = torch.empty_like(loss)
        negate_kernel[(1,)](loss, out, loss.numel(), BLOCK=32)  # launched as a library does: not launch_triton
        return out


def register(declared_kernel):
    ops = {"aten::matmul", "aten::mm", "aten::logsumexp"} | set(declared_kernel)
    kernels.register_backend("own_triton", kernels=dict.fromkeys(kernels.OP_NODES, ops),
                             capability=LIGER_CAPABILITY, replace=True)(OwnTritonHead)
"""


@pytest.mark.interpreter
def test_a_triton_kernel_a_library_launches_itself_is_observed(make_inputs, tmp_path, monkeypatch, isolated_registries):
    """The launch goes through Triton's own launcher, not ``launch_triton``: undeclared, it is red by its name."""
    (tmp_path / "own_triton_head.py").write_text(TRITON_HEAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    import own_triton_head

    name = "own_triton_head.negate_kernel"
    inp, targets = liger_inputs(make_inputs)
    for declared, expected in (([], [name]), ([name], [])):
        own_triton_head.register(declared)
        with kernels.observed_provenance():
            result = kernels.lm_head_logprob(inp.hidden, inp.weight, targets, backend="own_triton")
        assert name in result.provenance.nodes["logprob"].kernels
        problems = kernels.provenance_mismatches(dict.fromkeys(kernels.OP_NODES, "own_triton"), result.provenance)
        # Undeclared: one line per node (the call is every node), each naming the kernel; declared: none.
        assert len(problems) == 3 * len(expected) and all(name in p for p in problems), problems


def test_triton_launches_are_watched_whichever_is_imported_first():
    """Watched from the moment triton is imported, also when that is after kernels (a library imported lazily)."""
    probe = (
        "from triton.runtime import jit, interpreter; "
        "print(all(hasattr(c.run, '__wrapped__') for c in (jit.JITFunction, interpreter.InterpretedFunction)))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    for first in ("import kernels; import triton", "import triton; import kernels"):
        done = subprocess.run([sys.executable, "-c", f"{first}; {probe}"], capture_output=True, text=True, env=env)
        assert done.stdout.strip() == "True", (first, done.stdout, done.stderr)


def test_a_fused_head_is_refused_where_it_has_no_path(make_inputs):
    inp, targets = liger_inputs(make_inputs)
    with pytest.raises(kernels.TPConfigError, match=r"backend 'liger' .* no tensor-parallel path; got tp=2: use tp=1"):
        kernels.lm_head_logprob(inp.hidden, inp.weight, targets, backend="liger", tp=2)
    for call in (
        lambda: kernels.matmul(inp.hidden, inp.weight, backend="liger"),
        lambda: kernels.logprob(inp.hidden @ inp.weight.T, targets.clamp(min=0), backend="liger"),
    ):
        with pytest.raises(kernels.KernelInputError, match=r"fused head.*call kernels\.lm_head_logprob"):
            call()
    sharding = kernels.ShardingSpec.even(VOCAB, 256, 1)
    reduction = kernels.ReductionSpec(256, "fixed_topology", "rank_shard")
    with pytest.raises(kernels.LogprobDispatchError, match="lse export requested but the backend does not export lse"):
        kernels.get_logprob_op(kernels.LogprobContract(sharding, reduction, "bfloat16", "cpu"), "liger")
    output = kernels.LogprobOutputSpec(export_lse=False)
    op = kernels.get_logprob_op(kernels.LogprobContract(sharding, reduction, "bfloat16", "cpu", output=output), "liger")
    assert op.backend_id == "liger"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["profile=liger_cpu_bf16", "tp=2"], "tp=2: profile 'liger_cpu_bf16' runs backend 'liger', which runs at tp 1"),
        (["profile=liger_cpu_bf16", "profile.tensors=[logp,lse]"], r"backend 'liger' computes \['logp'\]"),
        (["profile=cpu_bf16", "profile.tensors=[logp]"], r"backend 'aten' computes \['logp', 'lse'\]"),
        (["profile=cpu_bf16", "profile.tensors=[lse]"], r"tensors=\['lse'\] is not one of \['logp', 'lse'\]"),
    ],
)
def test_a_profile_whose_tensors_or_tp_its_backend_cannot_give_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_spec(compose_run(*overrides))


BUGS = ("liger_z_loss_cpu", "liger_temperature_cpu", "liger_last_row_cpu")


@needs_liger
@pytest.mark.slow
@pytest.mark.interpreter  # liger_cpu_bf16: its kernel under the Triton interpreter
@liger_interpreted
def test_liger_is_green_beside_stock_pytorch_and_its_realistic_bugs_are_red_by_a_margin(tmp_path):
    """On the default workload (its logit regimes are where a head's error shows), one cell: the correct library is
    GREEN with a logp-only parity row against stock PyTorch; a leaked z-loss, a hair-wide temperature and a dropped
    row, each with the library's own declarations, are red on accuracy by at least twice the bound."""
    from test_extending import rlsweep

    profiles = ",".join(("liger_cpu_bf16", "cpu_bf16", *BUGS))
    done = rlsweep(tmp_path, f"profile={profiles}", "workload=hunt", "layout.cells=[BN/packed]")
    assert done.returncode == ExitCode.RED, done.stdout + done.stderr
    checks = pd.read_parquet(tmp_path / "checks")
    liger = checks[checks["profile"] == "liger_cpu_bf16"]
    assert liger["passed"].all(), liger[~liger["passed"]]["detail"].tolist()
    assert set(liger["tensor"]) == {"", "weight", "logp"}  # nothing judged on the lse it never computed
    parity = pd.read_parquet(tmp_path / "sweep_checks.parquet").query("judgment == 'backend_parity'")
    stock = parity[parity["detail"].str.startswith("cpu_bf16 tp=1 (emulated) vs liger_cpu_bf16 tp=1")]
    assert stock["tensor"].tolist() == ["logp"] and stock["passed"].all(), stock["detail"].tolist()
    provenance = liger[liger["metric"] == "mismatched_nodes"]["detail"]
    assert provenance.str.contains(LIGER_KERNEL).all(), provenance.tolist()
    assert bool(pd.read_parquet(tmp_path / "tokens").query("profile == 'liger_cpu_bf16'")["lse"].isna().all())
    for bug in BUGS:
        rows = checks[(checks["profile"] == bug) & (checks["judgment"] == "forward_accuracy")]
        assert not rows["passed"].any() and rows["value"].min() >= 2, (bug, rows["detail"].tolist())
        provenance = checks[(checks["profile"] == bug) & (checks["judgment"] == "provenance")]
        assert provenance["passed"].all(), (bug, provenance["detail"].tolist())
