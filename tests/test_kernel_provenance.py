"""Kernel-level provenance: the kernels each node launched, recorded where launched, vs its backend's declaration."""

from __future__ import annotations

import contextvars
import json
import re
import threading
from dataclasses import replace

import pytest
import torch
from conftest import liger_interpreted, triton_runs_on

import kernels
from kernels.launches import (
    COMPILED_GRAPH_KERNEL,
    bookkeeping,
    observed_provenance,
    observing_dispatcher,
    recording_launches,
)
from kernels.provenance import call_node
from kernels.triton_backend import INTERPRETER_FORWARD_TILING, TritonBackend

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
    logits = torch.ops.aten.mm.default(hidden, weight.T)
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


class TritonWithDirectMatmul(TritonBackend):
    """A matmul node that calls torch directly, through no helper: the dispatcher still sees it."""

    def matmul(self, hidden, weight):
        logits = hidden @ weight.T
        return logits, kernels.observe("matmul", self.id, logits)


class TritonWithCachedMatmul(TritonBackend):
    """A matmul node that computes nothing: it hands back logits it holds (here: zeros of the right shape)."""

    def matmul(self, hidden, weight):
        logits = hidden.new_zeros((hidden.shape[0], weight.shape[0]))
        return logits, kernels.observe("matmul", self.id, logits)


class TritonFallingBackOnNarrowShards(TritonBackend):
    """Triton's matmul, except on a shard narrower than whole tiles (the last rank's, when the vocab is padded)."""

    def matmul(self, hidden, weight):
        if weight.shape[0] % TILE:
            return torch_matmul(self, hidden, weight)
        return super().matmul(hidden, weight)


# Every built-in at tp 1 and 2, where its capability has that tp (liger: 1 only); one that runs Triton kernels on
# these CPU inputs needs the interpreter.
RUNNABLE = [
    pytest.param(
        backend,
        tp,
        marks=[pytest.mark.interpreter] * getattr(kernels.BACKENDS[backend], "runs_triton", False)
        + [liger_interpreted] * (backend == "liger"),
    )
    for backend in BUILTIN
    for tp in (1, 2)
    if (sizes := kernels.BACKENDS[backend].capability.tp_sizes) is None or tp in sizes
]


@pytest.mark.parametrize(("backend", "tp"), RUNNABLE)
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
    tiling = INTERPRETER_FORWARD_TILING
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
def test_a_torch_op_called_through_no_helper_is_observed_by_the_dispatcher(make_inputs):
    """Provenance took what a backend launched through its helpers on trust: a node that called torch directly was
    reported as launching nothing, and one that passed an object with a made-up name() passed as that name."""
    kernels.register_backend("toy", kernels=TRITON_DECLARED, capability=TRITON_CAPABILITY)(TritonWithDirectMatmul)
    provenance = run(make_inputs, "toy", 1).provenance
    declared = ", ".join(sorted(TRITON_DECLARED["matmul"]))
    assert kernels.provenance_mismatches({}, provenance) == [
        f"node 'matmul': backend 'toy' launched 'aten::matmul', which it does not declare for the node "
        f"(declared: {declared})"
    ]


@needs_triton
def test_a_node_that_computes_nothing_is_reported_as_launching_nothing(make_inputs):
    kernels.register_backend("toy", kernels=TRITON_DECLARED, capability=TRITON_CAPABILITY)(TritonWithCachedMatmul)
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


def node(method, *args):
    """``call_node`` of a function that returns its output: what the node's record says it launched."""
    *_, record = call_node(lambda *a: (out := method(*a), kernels.observe("logprob", "aten", out)), *args)
    return list(record.kernels)


def test_the_dispatcher_is_observed_op_by_op_outermost_first_and_only_inside_a_node_call():
    x = torch.randn(4, 9)
    torch.log_softmax(x, -1)  # outside any node call: recorded nowhere
    # log_softmax runs _log_softmax, logsumexp runs amax and sum: each is recorded as what was called; elementwise
    # ops, copies and views are not recorded at all.
    assert node(lambda x: torch.log_softmax(x.exp().T.contiguous(), 0).sum(), x) == ["aten::log_softmax", "aten::sum"]
    assert node(lambda x: torch.logsumexp(torch.maximum(x, -x), -1), x) == ["aten::logsumexp"]
    assert node(lambda x: (x * 2).clamp_min(0), x) == []


def test_a_reduction_run_on_another_thread_during_the_node_is_observed():
    """The profiler watched the calling thread only: a node could hide an undeclared reduction in a thread."""

    def hidden(x):
        thread = threading.Thread(target=torch.logsumexp, args=(x, -1))
        thread.start()
        thread.join()
        return x.amax(1)

    assert node(hidden, torch.randn(4, 9)) == ["aten::logsumexp", "aten::amax"]


def test_rlsweeps_own_bookkeeping_is_not_recorded_while_every_other_threads_ops_are():
    """rlsweep's own copies inside an observed block (the first-divergence hooks) run with this thread's record
    functions off: none of their ops is the node's, nested blocks included; an op another thread runs meanwhile is
    recorded as ever, and a range a node opens under the name rlsweep once used hides nothing."""
    x = torch.randn(4, 9)

    def forged(x):
        with torch.autograd.profiler.record_function("rlsweep.bookkeeping"):
            return x.sum(1)

    assert node(forged, x) == ["aten::sum"]
    with observed_provenance(), recording_launches() as launches, observing_dispatcher():
        with bookkeeping():
            x.sum(1)
            with bookkeeping():
                x.mean(1)
            x.std(1)
            thread = threading.Thread(target=lambda: x.logsumexp(1))
            thread.start()
            thread.join()
        x.amax(1)
    assert [launch.kernel for launch in launches] == ["aten::logsumexp", "aten::amax"]
    # Outside an observed block it changes nothing: a profiler of one's own still sees its ops.
    with torch.autograd.profiler.profile() as own, bookkeeping():
        x.sum(1)
    assert "aten::sum" in {event.name for event in own.function_events}


def test_a_node_that_names_a_range_as_torch_compile_does_hides_nothing():
    """What torch.compile runs while it compiles is left out under the profiler range its dynamo opens; a node that
    opens a range of that name without compiling anything hides nothing."""

    def forged(x):
        with torch.autograd.profiler.record_function("dynamo"):
            return torch.logsumexp(x, -1)

    assert node(forged, torch.randn(4, 9)) == ["aten::logsumexp"]


def test_outside_observed_provenance_a_call_observes_nothing_and_no_check_passes_it(make_inputs):
    """Observing costs milliseconds a node, which a training step should not pay: a plain lm_head_logprob call does
    not observe, says so, and fails every provenance check; a dispatched op observes whatever its caller does."""
    fresh = contextvars.Context()  # the default context, without the suite's observed_provenance()
    provenance = fresh.run(run, make_inputs, "aten", 2).provenance
    assert not any(node.observed for node in provenance.nodes.values())
    problems = kernels.provenance_mismatches(dict.fromkeys(kernels.OP_NODES, "aten"), provenance)
    assert len(problems) == 3 and all("so what it launched was not observed" in line for line in problems)
    fixed = {"determinism_scope": kernels.DeterminismScope.FIXED_TOPOLOGY, "merge_order": kernels.MergeOrder.RANK_SHARD}
    contract = kernels.LogprobContract.even(VOCAB, TILE, 2, dtype=torch.float32, platform="cpu", **fixed)
    op = kernels.get_logprob_op(contract, "aten")
    inp = make_inputs(ROWS, HIDDEN, VOCAB, torch.float32, "cpu")
    result = fresh.run(op, inp.hidden, inp.weight, inp.targets)
    assert all(node.observed and node.kernels for node in result.provenance.nodes.values())


def test_a_custom_op_is_observed_by_its_own_name():
    with torch.library._scoped_library("rlsweep_test", "FRAGMENT") as lib:
        lib.define("rowsum(Tensor x) -> Tensor")
        lib.impl("rowsum", lambda x: x.sum(-1), "CPU")
        assert node(torch.ops.rlsweep_test.rowsum, torch.randn(3, 5)) == ["rlsweep_test::rowsum"]


@pytest.mark.slow
def test_a_compiled_function_is_observed_as_its_compiled_graph():
    """A function under torch.compile runs kernels no dispatcher sees; the graph that ran is recorded by its cache
    key. The same function run eagerly is its ops."""
    function = torch.compile(lambda x: torch.log_softmax(x, -1)[:, 0], dynamic=True)
    x = torch.randn(5, 7)
    (launch,) = call_node(lambda x: (y := function(x), kernels.observe("logprob", "aten", y)), x)[-1].launches
    assert launch.kernel == COMPILED_GRAPH_KERNEL and launch.config["graph"]
    with torch.compiler.set_stance("force_eager"):
        assert node(function, x) == ["aten::log_softmax"]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("aten::sum.dim_IntList", "names an overload"),
        ("aten::exp", "is not recorded"),
        ("aten::summ", "torch has no op 'summ'"),
    ],
)
def test_a_declaration_that_could_never_match_what_the_dispatcher_sees_is_refused(name, why):
    aten = kernels.BACKENDS["aten"]
    declared = {**aten.declared_kernels, "tp_merge": {name}}
    with pytest.raises(ValueError, match=re.escape(why)):
        kernels.register_backend("toy", kernels=declared, capability=aten.capability)(type(aten))


@pytest.mark.slow
def test_distributed_ranks_report_their_own_launches(make_inputs):
    provenance = run(make_inputs, "aten", 2, tp_mode="distributed").provenance
    assert provenance.tp_mode == "distributed"
    assert kernels.provenance_mismatches(dict.fromkeys(kernels.OP_NODES, "aten"), provenance) == []
    assert provenance.nodes["matmul"].kernels == ("aten::mm",)


@torch.library.custom_op("rlsweep_test::version_query", mutates_args=())
def version_query() -> int:
    return 7


@torch.library.custom_op("rlsweep_test::double_it", mutates_args=())
def double_it(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_custom_op_that_touches_no_tensor_is_not_a_launch_and_one_that_does_is():
    """A library's version query while it imports (seen on CUDA: torchvision::_cuda_version inside Liger-Kernel's
    first call) computes nothing on the node's tensors; a custom op that takes a tensor is recorded whatever it does."""
    with observed_provenance(), recording_launches() as launches, observing_dispatcher():
        torch.ops.rlsweep_test.version_query()
        torch.ops.rlsweep_test.double_it(torch.ones(3))
    assert [launch.kernel for launch in launches] == ["rlsweep_test::double_it"]
