"""Kernel-level provenance: the kernels each node launched, recorded where launched, vs its backend's declaration."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import replace

import pytest
import torch
from conftest import triton_runs_on

import kernels
from kernels.launches import recording_launches
from kernels.triton_backend import INTERPRETER_TILING, TritonBackend

ROWS, HIDDEN, VOCAB, TILE = 3, 16, 40, 16
BUILTIN = tuple(kernels.BACKENDS)  # read at import, before any test registers a toy backend
TRITON_DECLARED = kernels.BACKENDS["triton"].declared_kernels
TRITON_CAPABILITY = kernels.BACKENDS["triton"].capability
needs_triton = pytest.mark.interpreter

pytestmark = pytest.mark.usefixtures("isolated_registries")


def run(make_inputs, backend: str, tp: int, **kwargs) -> kernels.LogprobResult:
    inp = make_inputs(ROWS, HIDDEN, VOCAB, torch.float32, "cpu")
    return kernels.lm_head_logprob(
        inp.hidden, inp.weight, inp.targets, backend=backend, tp=tp, vocab_tile=TILE, **kwargs
    )


def torch_matmul(backend, hidden: torch.Tensor, weight: torch.Tensor):
    logits = kernels.launch_torch(torch.ops.aten.mm.default, hidden, weight.T)
    return logits, kernels.observe("matmul", backend.id, logits)


def torch_mm_in_triton_matmul(backend_id: str) -> str:
    """The one line a backend declaring Triton's kernels gets for running torch's mm in its matmul node."""
    declared = ", ".join(sorted(TRITON_DECLARED["matmul"]))
    return (
        f"node 'matmul': backend {backend_id!r} launched 'aten::mm', which it does not declare for the node "
        f"(declared: {declared})"
    )


class TritonWithTorchMatmul(TritonBackend):
    """Triton's logprob and merge, but its matmul node runs torch's mm."""

    matmul = torch_matmul


class TritonWithUnrecordedMatmul(TritonBackend):
    """A matmul node that bypasses the launch helpers, so nothing it ran is recorded."""

    def matmul(self, hidden, weight):
        logits = hidden @ weight.T
        return logits, kernels.observe("matmul", self.id, logits)


class TritonFallingBackOnNarrowShards(TritonBackend):
    """Triton's matmul, except on a shard narrower than whole tiles (the last rank's, when the vocab is padded)."""

    def matmul(self, hidden, weight):
        if weight.shape[0] % TILE:
            return torch_matmul(self, hidden, weight)
        return super().matmul(hidden, weight)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("backend", BUILTIN)
def test_every_builtin_launches_only_what_it_declares(backend, tp, make_inputs):
    if backend == "triton" and not triton_runs_on("cpu"):
        pytest.skip("Triton interpreter is off")
    provenance = run(make_inputs, backend, tp).provenance
    assert kernels.provenance_mismatches(dict.fromkeys(kernels.OP_NODES, backend), provenance) == []
    assert all(node.kernels for node in provenance.nodes.values())
    record = provenance.to_dict()
    assert json.loads(json.dumps(record)) == record
    assert [launch["kernel"] for launch in record["nodes"]["matmul"]["launches"]] == list(
        provenance.nodes["matmul"].kernels
    )


@needs_triton
def test_a_triton_launch_is_named_by_the_function_launched_and_keeps_its_configuration(make_inputs):
    inp = make_inputs(ROWS, HIDDEN, VOCAB, torch.float32, "cpu")
    _, provenance = kernels.matmul(inp.hidden, inp.weight, backend="triton")
    (launch,) = provenance.launches
    assert launch.kernel == "kernels.triton_kernels.invariant_matmul_kernel"  # the interpreter's: pointer loads
    assert launch.kernel in TRITON_DECLARED["matmul"]
    tiling = INTERPRETER_TILING
    expected = {"BLOCK_M": tiling.block_m, "BLOCK_N": tiling.block_n, "BLOCK_K": tiling.block_k}
    assert launch.config.items() >= {**expected, "num_warps": tiling.num_warps}.items()


@needs_triton
def test_a_triton_backend_that_runs_torch_mm_is_reported_by_name(make_inputs):
    kernels.register_backend("toy", kernels=TRITON_DECLARED, capability=TRITON_CAPABILITY)(TritonWithTorchMatmul)
    provenance = run(make_inputs, "toy", 2).provenance
    expected = torch_mm_in_triton_matmul("toy")
    assert kernels.provenance_mismatches(dict.fromkeys(kernels.OP_NODES, "toy"), provenance) == [expected]
    # The dispatched op (toy declared triton's capability with its kernels) refuses the result the same way.
    op = kernels.get_logprob_op(
        kernels.LogprobContract.even(VOCAB, TILE, 2, dtype=torch.float32, platform="cpu"), "toy"
    )
    inp = make_inputs(ROWS, HIDDEN, VOCAB, torch.float32, "cpu")
    with pytest.raises(kernels.ProvenanceMismatchError, match=re.escape(expected)):
        op(inp.hidden, inp.weight, inp.targets)


@needs_triton
def test_a_node_whose_work_bypasses_the_launch_helpers_is_reported_as_launching_nothing(make_inputs):
    kernels.register_backend("toy", kernels=TRITON_DECLARED, capability=TRITON_CAPABILITY)(TritonWithUnrecordedMatmul)
    provenance = run(make_inputs, "toy", 1).provenance
    assert kernels.provenance_mismatches({}, provenance) == ["node 'matmul': backend 'toy' launched no kernel"]


@needs_triton
def test_a_fallback_on_one_rank_only_is_reported(make_inputs):
    assert kernels.padded_vocab_size(VOCAB, TILE, 2) // 2 < VOCAB  # the last rank's real shard is not whole tiles
    kernels.register_backend("toy", kernels=TRITON_DECLARED, capability=TRITON_CAPABILITY)(
        TritonFallingBackOnNarrowShards
    )
    matmul = run(make_inputs, "toy", 2).provenance.nodes["matmul"]
    assert matmul.kernels == ("kernels.triton_kernels.invariant_matmul_kernel", "aten::mm")
    only_matmul = kernels.Provenance({"matmul": matmul}, 2, "emulated")
    assert kernels.provenance_mismatches({}, only_matmul) == [torch_mm_in_triton_matmul("toy")]


def test_a_declared_kernel_that_did_not_launch_is_no_mismatch(make_inputs):
    # Only launched-but-undeclared counts; a comparison run the other way round would report 'aten::addmm'.
    aten = kernels.BACKENDS["aten"]
    declared = {**aten.declared_kernels, "matmul": {"aten::mm", "aten::addmm"}}
    kernels.register_backend("toy", kernels=declared, capability=aten.capability)(type(aten))
    provenance = run(make_inputs, "toy", 2).provenance
    assert provenance.nodes["matmul"].kernels == ("aten::mm",)
    assert kernels.provenance_mismatches(dict.fromkeys(kernels.OP_NODES, "toy"), provenance) == []


def test_a_backend_without_a_declaration_has_every_launch_reported(make_inputs):
    ran = run(make_inputs, "aten", 2).provenance
    nodes = {name: replace(node, backend="unregistered") for name, node in ran.nodes.items()}
    problems = kernels.provenance_mismatches({}, replace(ran, nodes=nodes))
    assert len(problems) == sum(len(node.kernels) for node in nodes.values())
    assert all("'unregistered' has no declaration in kernels.BACKENDS" in line for line in problems)


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ({"matmul": {"aten::mm"}, "logprob": {"aten::amax"}}, "exactly the nodes"),
        ({"matmul": "aten::mm", "logprob": {"aten::amax"}, "tp_merge": {"aten::sum"}}, "node 'matmul'"),
        ({"matmul": set(), "logprob": {"aten::amax"}, "tp_merge": {"aten::sum"}}, "node 'matmul'"),
    ],
)
def test_registration_refuses_an_incomplete_declaration(declared, message):
    aten = kernels.BACKENDS["aten"]
    with pytest.raises(ValueError, match=re.escape(message)):
        kernels.register_backend("toy", kernels=declared, capability=aten.capability)(type(aten))
    assert "toy" not in kernels.BACKENDS


def test_launches_are_recorded_per_call_and_never_leak_between_threads():
    x = torch.ones(2, 3)
    kernels.launch_torch(torch.ops.aten.amax.default, x, [1])  # outside any node call: recorded nowhere
    with recording_launches() as outer:
        kernels.launch_torch(torch.ops.aten.amax.default, x, [1])
        with recording_launches() as inner:
            kernels.launch_torch(torch.ops.aten.sum.dim_IntList, x, [1])
    assert [launch.kernel for launch in outer] == ["aten::amax"]
    assert [launch.kernel for launch in inner] == ["aten::sum.dim_IntList"]

    both_recording = threading.Barrier(2)
    seen = {}

    def record(op):
        with recording_launches() as launches:
            both_recording.wait()  # both threads are inside a recorder before either launches
            kernels.launch_torch(op, x, [1])
            both_recording.wait()
        seen[op.name()] = [launch.kernel for launch in launches]

    threads = [
        threading.Thread(target=record, args=(op,))
        for op in (torch.ops.aten.amax.default, torch.ops.aten.sum.dim_IntList)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"aten::amax": ["aten::amax"], "aten::sum.dim_IntList": ["aten::sum.dim_IntList"]}


@pytest.mark.slow
def test_distributed_ranks_report_their_own_launches(make_inputs):
    provenance = run(make_inputs, "aten", 2, tp_mode="distributed").provenance
    assert provenance.tp_mode == "distributed"
    assert kernels.provenance_mismatches(dict.fromkeys(kernels.OP_NODES, "aten"), provenance) == []
    assert provenance.nodes["matmul"].kernels == ("aten::mm",)
