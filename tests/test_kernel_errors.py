"""Bad inputs raise typed errors that name the offending value, and no result is returned: shapes and dtypes
before any work is done, values (queued beside the kernels) before the call returns."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from conftest import DEVICES, triton_runs_on

import kernels


def good_inputs(rows: int = 4, hidden: int = 16, vocab: int = 100):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(rows, hidden, generator=gen),
        torch.randn(vocab, hidden, generator=gen),
        torch.randint(0, vocab, (rows,), generator=gen),
    )


@pytest.mark.parametrize("bad", [100, 1000, -1, -99, -101])
def test_target_outside_vocab_names_first_bad_index(bad):
    hidden, weight, targets = good_inputs()
    targets[2] = bad
    targets[3] = bad
    with pytest.raises(kernels.TargetOutOfRangeError, match=rf"target id {bad} at row 2 is outside \[0, 100\)") as err:
        kernels.lm_head_logprob(hidden, weight, targets, backend="aten")
    assert (err.value.position, err.value.value) == (2, bad)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "triton_fused", "aten", "reference"])
@pytest.mark.parametrize("call", ["lm_head_logprob", "logprob"])
def test_target_outside_vocab_is_refused_by_every_backend_and_call(backend, call):
    hidden, weight, targets = good_inputs(vocab=300)
    targets[1], targets[3] = 300, -7  # the first bad row is named, whatever the kernels did with it meanwhile
    if call == "logprob":
        run = lambda: kernels.logprob(hidden @ weight.T, targets, backend=backend, vocab_tile=64)  # noqa: E731
    else:
        run = lambda: kernels.lm_head_logprob(hidden, weight, targets, backend=backend, vocab_tile=64)  # noqa: E731
    with pytest.raises(kernels.TargetOutOfRangeError, match=r"target id 300 at row 1 is outside \[0, 300\)"):
        run()


def test_the_first_failed_check_is_the_one_raised():
    """Value checks run queued; the error is still the one an up-front check in call order would raise."""
    hidden, weight, targets = good_inputs()
    hidden[2, 5] = float("nan")
    targets[0] = 100
    with pytest.raises(kernels.NonFiniteInputError, match=r"hidden holds a non-finite value nan at index \(2, 5\)"):
        kernels.lm_head_logprob(hidden, weight, targets, backend="aten")
    with pytest.raises(kernels.NonFiniteInputError, match=r"hidden holds"):
        kernels.matmul(hidden, weight, backend="aten")


@pytest.mark.parametrize("name", ["hidden", "weight"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_inputs_are_refused(name, value):
    hidden, weight, targets = good_inputs()
    (hidden if name == "hidden" else weight)[1, 3] = value
    with pytest.raises(
        kernels.NonFiniteInputError, match=rf"{name} holds a non-finite value {value} at index \(1, 3\)"
    ):
        kernels.lm_head_logprob(hidden, weight, targets, backend="reference")


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda h, w, t: (h[:, :8], w, t), kernels.ShapeMismatchError, r"hidden \(4, 8\) vs weight \(100, 16\)"),
        (lambda h, w, t: (h[0], w, t), kernels.ShapeMismatchError, r"hidden must be \[T, H\], got shape \(16,\)"),
        (
            lambda h, w, t: (h, w, t[:3]),
            kernels.ShapeMismatchError,
            r"targets must be \[T\] with T=4, got shape \(3,\)",
        ),
        (lambda h, w, t: (h, w, t.float()), kernels.DtypeMismatchError, r"targets have dtype torch.float32"),
        (lambda h, w, t: (h.half(), w.half(), t), kernels.DtypeMismatchError, r"hidden has dtype torch.float16"),
        (lambda h, w, t: (h.bfloat16(), w, t), kernels.DtypeMismatchError, r"hidden is torch.bfloat16 but weight is"),
    ],
    ids=["hidden-size", "hidden-rank", "target-rows", "target-dtype", "fp16", "mixed-dtypes"],
)
def test_shape_and_dtype_mismatches_raise_before_work(mutate, error, match):
    with pytest.raises(error, match=match):
        kernels.lm_head_logprob(*mutate(*good_inputs()), backend="aten")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp": 0}, r"tp must be an integer >= 1, got 0"),
        ({"tp": 2.0}, r"tp must be an integer >= 1, got 2.0"),
        ({"vocab_tile": 100}, r"vocab_tile must be a power of two >= 16, got 100"),
        ({"tp_mode": "threads"}, r"tp_mode must be one of \('emulated', 'distributed'\), got 'threads'"),
    ],
)
def test_tp_requests_the_geometry_cannot_serve(kwargs, match):
    with pytest.raises(kernels.KernelInputError, match=match):
        kernels.lm_head_logprob(*good_inputs(), backend="aten", **kwargs)


def test_unknown_backend_lists_the_available_ones():
    available = r"unknown backend 'cublas'; available: aten, compiled, control"
    with pytest.raises(kernels.BackendUnavailableError, match=available):
        kernels.lm_head_logprob(*good_inputs(), backend="cublas")


@pytest.mark.parametrize("backend", [["aten"], {"id": "aten"}, None])
def test_a_backend_id_that_is_no_string_is_refused_as_unknown(backend):
    """An unhashable id reached a dict lookup as a bare TypeError; every entry point names it as unknown."""
    hidden, weight, targets = good_inputs()
    shown = re.escape(repr(backend))
    with pytest.raises(kernels.BackendUnavailableError, match=rf"unknown backend {shown}; available: aten"):
        kernels.lm_head_logprob(hidden, weight, targets, backend=backend)
    with pytest.raises(kernels.BackendUnavailableError, match=rf"unknown backend {shown}"):
        kernels.matmul(hidden, weight, backend=backend)
    with pytest.raises(kernels.BackendUnavailableError, match=rf"unknown backend {shown}"):
        kernels.distributed_ranks(backend, kernels.ShardingSpec.even(100, 16, 2), "cpu").__enter__()
    contract = kernels.LogprobContract.even(100, 16, 1, dtype=torch.float32, platform="cpu")
    with pytest.raises(kernels.LogprobDispatchError, match=rf"must be 'auto' or a backend id \(triton, .*got {shown}"):
        kernels.get_logprob_op(contract, backend)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() >= 2, reason="needs exactly one GPU")
def test_distributed_with_more_ranks_than_gpus_fails_before_any_work():
    hidden, weight, targets = (t.cuda() for t in good_inputs())
    with pytest.raises(kernels.TPConfigError, match=r"tp=2 needs 2 GPUs \(one per rank\); this machine has 1"):
        kernels.lm_head_logprob(hidden, weight, targets, backend="triton", tp=2, tp_mode="distributed", vocab_tile=64)


@pytest.mark.interpreter  # the CPU limit is the Triton interpreter's
def test_vocab_tile_wider_than_a_triton_block_is_refused_before_any_launch(monkeypatch):
    from triton.language import TRITON_MAX_TENSOR_NUMEL

    from kernels import triton_backend, triton_kernels

    limit = kernels.BACKENDS["triton"].max_vocab_tile(torch.device("cpu"))
    assert limit * triton_backend.INTERPRETER_PARTIAL_ROWS == TRITON_MAX_TENSOR_NUMEL  # the block is rows x tile
    hidden, weight, targets = good_inputs()

    # The widest tile runs (and agrees with float64); the next power of two is one Triton refuses, untyped.
    result = kernels.lm_head_logprob(hidden, weight, targets, backend="triton", vocab_tile=limit)
    reference = kernels.lm_head_logprob(hidden, weight, targets, backend="reference")
    bound = kernels.rounding_bound(hidden, weight, targets, logits_dtype=hidden.dtype)  # the contract's v2 rule
    assert bool(((result.lse.double() - reference.lse).abs() <= bound.lse).all())
    partials = torch.empty(hidden.shape[0], 1)
    with pytest.raises(Exception, match=rf"numel \({2 * limit * triton_backend.INTERPRETER_PARTIAL_ROWS}\) exceeds"):
        triton_kernels.tile_partials_kernel[(1, 1)](
            torch.zeros(hidden.shape[0], 2 * limit), partials, partials, hidden.shape[0], 2 * limit, 2 * limit, 1, 1, 1,
            ROWS=triton_backend.INTERPRETER_PARTIAL_ROWS, TILE=2 * limit, TILES=1,
        )  # fmt: skip

    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(triton_backend, "launch_triton", no_launch)
    match = rf"vocab_tile={2 * limit} is wider than backend 'triton' can reduce on cpu: .* \[16, {limit}\]"
    with pytest.raises(kernels.TPConfigError, match=match):
        kernels.lm_head_logprob(hidden, weight, targets, backend="triton", vocab_tile=2 * limit)
    with pytest.raises(kernels.TPConfigError, match=match):
        kernels.logprob(hidden @ weight.T, targets, backend="triton", vocab_tile=2 * limit)


@pytest.mark.interpreter
def test_a_vocab_wider_than_the_triton_kernels_index_is_refused_before_any_work(monkeypatch):
    """2**31 columns would overflow the kernels' int32 column index and their fixed-point sum: refused up front,
    naming the width, for every call and Triton backend (the logits below are never written or read)."""
    from kernels import triton_backend

    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(triton_backend, "launch_triton", no_launch)
    logits = torch.empty((1, 2**31), dtype=torch.bfloat16)
    with pytest.raises(kernels.ShapeMismatchError, match=r"vocab of 2147483648 columns .* at most 2147483647"):
        kernels.logprob(logits, torch.zeros(1, dtype=torch.int64), backend="triton")
    hidden, weight, targets = good_inputs(vocab=300)
    for backend in ("triton", "triton_fused"):
        monkeypatch.setattr(type(kernels.BACKENDS[backend]), "max_vocab_columns", 319)
        with pytest.raises(kernels.ShapeMismatchError, match=rf"vocab of 300 columns \(padded to 320\).*'{backend}'"):
            kernels.lm_head_logprob(hidden, weight, targets, backend=backend, vocab_tile=64)
    monkeypatch.undo()
    for backend in ("triton", "triton_fused"):  # with a limit one column wider the same call runs
        monkeypatch.setattr(type(kernels.BACKENDS[backend]), "max_vocab_columns", 320)
        kernels.lm_head_logprob(hidden, weight, targets, backend=backend, vocab_tile=64)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "aten"])
def test_caller_owned_checks_raise_when_the_caller_reads_them(backend):
    """A call given ``checks`` returns without waiting; the caller's raise_first() raises what the call would have,
    in call order across calls, and a good call queues nothing that fails."""
    hidden, weight, targets = good_inputs(vocab=300)
    checks = kernels.ValueChecks()
    kernels.lm_head_logprob(hidden, weight, targets, backend=backend, vocab_tile=64, checks=checks)
    kernels.logprob(hidden @ weight.T, targets, backend=backend, vocab_tile=64, checks=checks)
    checks.raise_first()  # nothing wrong: returns

    bad = targets.clone()
    bad[2] = 300
    nan_hidden = hidden.clone()
    nan_hidden[1, 0] = float("nan")
    kernels.logprob(hidden @ weight.T, bad, backend=backend, vocab_tile=64, checks=checks)  # no raise yet
    kernels.matmul(nan_hidden, weight, backend=backend, checks=checks)
    with pytest.raises(kernels.TargetOutOfRangeError, match=r"target id 300 at row 2"):
        checks.raise_first()
    checks.raise_first()  # read once: the queue is empty again


@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_a_call_that_raises_leaves_none_of_its_checks_in_the_callers(backend, monkeypatch):
    """A call given ``checks`` that raises up front after queuing a check returned nothing: none of its checks reach
    the caller's, whose read raises the other calls' errors only (those queued meanwhile too), never the failed
    call's as theirs."""
    hidden, weight, targets = good_inputs(vocab=300)
    checks = kernels.ValueChecks()
    bad = targets.clone()
    bad[2] = 300
    kernels.lm_head_logprob(hidden, weight, bad, backend=backend, vocab_tile=64, checks=checks)
    nan_hidden = hidden.clone()
    nan_hidden[1, 0] = float("nan")  # its check is queued before the targets' shape is looked at
    with pytest.raises(kernels.ShapeMismatchError, match=r"targets must be \[T\] with T=4"):
        kernels.lm_head_logprob(nan_hidden, weight, targets[:3], backend=backend, vocab_tile=64, checks=checks)
    with pytest.raises(kernels.TargetOutOfRangeError, match=r"target id 300 at row 2"):
        checks.raise_first()
    if backend == "triton":  # a tile the Triton kernels refuse (on CPU tensors only in the interpreter)
        with pytest.raises(kernels.TPConfigError, match=r"vocab_tile=65536"):
            kernels.lm_head_logprob(nan_hidden, weight, targets, backend=backend, vocab_tile=65536, checks=checks)
    checks.raise_first()  # nothing of the failed calls is left to raise

    def another_call_meanwhile(impl, sharding, device):  # as another thread sharing the checks would
        monkeypatch.undo()
        kernels.lm_head_logprob(hidden, weight, bad, backend="aten", vocab_tile=64, checks=checks)
        raise kernels.TPConfigError("this call fails")

    monkeypatch.setattr(kernels.lm_head, "check_vocab_geometry", another_call_meanwhile)
    with pytest.raises(kernels.TPConfigError, match=r"this call fails"):
        kernels.lm_head_logprob(nan_hidden, weight, targets, backend=backend, vocab_tile=64, checks=checks)
    with pytest.raises(kernels.TargetOutOfRangeError, match=r"target id 300 at row 2"):  # the other call's, kept
        checks.raise_first()


@pytest.mark.parametrize("device", DEVICES)
def test_sent_verdicts_and_later_ones_raise_in_the_order_they_were_queued(device):
    """``send()`` ships the verdicts queued so far; ``raise_first()`` reads them and the later ones together, and
    the first failure in queue order is the one raised, whichever element of a verdict of several failed."""
    raised = []

    def failing(name: str):
        def explain():
            raised.append(name)
            raise kernels.NonFiniteInputError(name)

        return explain

    def verdicts(*bad: bool) -> kernels.ValueChecks:
        checks = kernels.ValueChecks()
        checks.add_sum(torch.tensor(float("nan") if bad[0] else 1.0, device=device), failing("first"))
        checks.add(torch.tensor([False, bad[1], False], device=device), failing("second"))
        words = torch.zeros(100, dtype=torch.int32, device=device)  # one per row block: more than a list is read for
        words[97] = 2 if bad[2] else 0
        checks.send()
        checks.add(words, failing("third"))
        checks.send()  # once only: the third stays to be read by raise_first
        return checks

    verdicts(False, False, False).raise_first()
    cases = {(True, True, True): "first", (False, True, True): "second", (False, False, True): "third"}
    cases[True, False, False] = "first"
    for bad, want in cases.items():
        with pytest.raises(kernels.NonFiniteInputError, match=want):
            verdicts(*bad).raise_first()
    assert raised == list(cases.values())


def test_checks_must_be_value_checks():
    hidden, weight, _ = good_inputs()
    with pytest.raises(kernels.KernelInputError, match=r"checks must be a kernels.ValueChecks or None, got list"):
        kernels.matmul(hidden, weight, backend="aten", checks=[])


@pytest.mark.interpreter
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_a_status_word_nothing_explains_fails_the_call(bits, monkeypatch):
    """The Triton kernels' status words are their own verdict: a flag that no bad target or non-finite output
    explains means the kernel did not compute what was checked, so the call raises rather than returns."""
    from kernels.triton_backend import TritonBackend

    if not triton_runs_on("cpu"):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    whole_vocab = TritonBackend.whole_vocab

    def flagged(self, logits, targets, sharding):
        whole, *records = whole_vocab(self, logits, targets, sharding)
        whole.status.fill_(bits)
        return (whole, *records)

    monkeypatch.setattr(TritonBackend, "whole_vocab", flagged)
    hidden, weight, targets = good_inputs(vocab=300)
    with pytest.raises(RuntimeError, match=rf"status words hold {bits:#x}.*not to be trusted"):
        kernels.logprob(hidden @ weight.T, targets, backend="triton", vocab_tile=64)


@pytest.mark.parametrize("backend", ["aten", "triton", "triton_fused"])
def test_inference_tensors_are_accepted_and_checked_on_every_call(backend):
    """A weight made under torch.inference_mode (as a rollout engine's is) counts no versions, so it is never
    taken as unchanged since its last check: a NaN written into it in place is found on the next call."""
    if backend.startswith("triton") and not triton_runs_on("cpu"):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    with torch.inference_mode():
        hidden, weight, targets = good_inputs(vocab=300)
    for _ in range(2):  # the second call finds it unchanged, were inference tensors counted
        kernels.lm_head_logprob(hidden, weight, targets, backend=backend, vocab_tile=64)
        kernels.matmul(hidden, weight, backend=backend)
    with torch.inference_mode():
        weight[17, 3] = float("nan")
    with pytest.raises(kernels.NonFiniteInputError, match=r"weight holds a non-finite value nan at index \(17, 3\)"):
        kernels.lm_head_logprob(hidden, weight, targets, backend=backend, vocab_tile=64)
    with pytest.raises(kernels.NonFiniteInputError, match=r"weight holds a non-finite value nan at index \(17, 3\)"):
        kernels.matmul(hidden, weight, backend=backend)


@pytest.mark.parametrize("backend", ["aten", "triton", "triton_fused"])
def test_an_overflow_is_not_blamed_while_an_input_holds_a_non_finite_value(backend):
    """A weight is checked once per version; a write its version counter does not see (through ``.data``) is found
    when an output is not finite, and named as the input it is rather than as an overflow of finite inputs."""
    if backend.startswith("triton") and not triton_runs_on("cpu"):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    hidden, weight, targets = good_inputs()
    hidden = -hidden.abs() - 0.1  # every logit of row v gets -weight[v, 0] * |hidden[:, 0]|: +inf below
    kernels.lm_head_logprob(hidden, weight, targets, backend=backend, vocab_tile=16)
    weight.data[7, 0] = float("-inf")
    with pytest.raises(kernels.NonFiniteInputError, match=r"weight holds a non-finite value -inf at index \(7, 0\)"):
        kernels.lm_head_logprob(hidden, weight, targets, backend=backend, vocab_tile=16)


@pytest.mark.parametrize("backend", ["aten", "triton", "triton_fused"])
def test_inputs_viewed_as_negated_give_the_values_they_read_as(backend):
    """``x.conj().imag`` is a view PyTorch marks negated, over memory holding the other sign; kernels read memory."""
    if backend.startswith("triton") and not triton_runs_on("cpu"):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    hidden, weight, targets = good_inputs(vocab=300)
    negated = torch.complex(torch.zeros_like(hidden), -hidden).conj().imag  # reads as hidden
    assert negated.is_neg() and torch.equal(negated, hidden)
    want = kernels.lm_head_logprob(hidden, weight, targets, backend=backend, vocab_tile=64)
    got = kernels.lm_head_logprob(negated, weight, targets, backend=backend, vocab_tile=64)
    assert kernels.first_bit_difference(want.logp, got.logp) is None
    logits, _ = kernels.matmul(negated, weight, backend=backend)
    assert kernels.first_bit_difference(kernels.matmul(hidden, weight, backend=backend)[0], logits) is None


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda h, w, t: (h, w, t.tolist()), r"targets must be a torch.Tensor, got list"),
        (lambda h, w, t: (h.to_sparse(), w, t), r"hidden is a tensor of layout torch.sparse_coo"),
        (lambda h, w, t: (h, w.to("meta"), t), r"weight is a tensor on the meta device"),
        (lambda h, w, t: (h, w.numpy(), t), r"weight must be a torch.Tensor, got ndarray"),
        (lambda h, w, t: (h.tolist(), w, t), r"hidden must be a torch.Tensor, got list"),
    ],
    ids=["list", "sparse", "meta", "weight-array", "hidden-list"],
)
@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_inputs_that_are_not_dense_tensors_are_refused_by_name(backend, mutate, match):
    with pytest.raises(kernels.KernelInputError, match=match):
        kernels.lm_head_logprob(*mutate(*good_inputs()), backend=backend, vocab_tile=16)
    contract = kernels.LogprobContract.even(100, 16, 1, dtype=torch.float32, platform="cpu")
    with pytest.raises(kernels.KernelInputError, match=match):  # the dispatched op checks them first
        kernels.get_logprob_op(contract, "triton")(*mutate(*good_inputs()))


@pytest.mark.parametrize("backend", ["triton", "triton_fused"])
def test_a_second_derivative_through_the_tiled_backward_raises(backend):
    """The tiled backward carries no graph: differentiating it again would drop the term silently."""
    if not triton_runs_on("cpu"):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    hidden, weight, targets = good_inputs(vocab=300)
    hidden.requires_grad_()
    result = kernels.lm_head_logprob(hidden, weight, targets, backend=backend, vocab_tile=64)
    with pytest.raises(RuntimeError, match=r"cannot be differentiated again \(create_graph=True\)"):
        torch.autograd.grad(result.logp.sum(), hidden, create_graph=True)
    (d_hidden,) = torch.autograd.grad(result.logp.sum(), hidden)  # a first derivative is served
    assert d_hidden.shape == hidden.shape


@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_an_input_changed_before_its_deferred_check_is_read_raises(backend):
    """A check read after the call (``checks=``) found a bad value that is no longer there: the outputs were
    computed from it, so reading the checks raises rather than finding the inputs fine."""
    hidden, weight, targets = good_inputs(vocab=300)
    checks = kernels.ValueChecks()
    bad_hidden = hidden.clone()
    bad_hidden[1, 2] = float("nan")
    kernels.matmul(bad_hidden, weight, backend=backend, checks=checks)
    bad_hidden[1, 2] = 0.0
    with pytest.raises(kernels.InputChangedError, match=r"hidden changed after the call that queued its check"):
        checks.raise_first()
    bad_targets = targets.clone()
    bad_targets[3] = 300
    kernels.lm_head_logprob(hidden, weight, bad_targets, backend=backend, vocab_tile=64, checks=checks)
    bad_targets[3] = 1
    with pytest.raises(kernels.InputChangedError, match=r"targets changed after .* target 1 at row 3"):
        checks.raise_first()


@pytest.mark.parametrize("backend", ["aten", "triton", "triton_fused"])
def test_logits_or_targets_changed_before_a_deferred_logprob_check_is_read_raise(backend):
    """``logprob`` on the Triton backends checks targets and logits inside its kernel (status words): a flag whose
    cause was written away after the call is an input that changed, not a kernel fault or an overflow; an overflow
    of finite logits is still named as one."""
    if backend.startswith("triton") and not triton_runs_on("cpu"):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    hidden, weight, targets = good_inputs(vocab=300)
    logits, checks = hidden @ weight.T, kernels.ValueChecks()
    bad_targets = targets.clone()
    bad_targets[3] = 300
    kernels.logprob(logits, bad_targets, backend=backend, vocab_tile=64, checks=checks)
    bad_targets[3] = 1
    with pytest.raises(kernels.InputChangedError, match=r"targets changed after the call that queued its check"):
        checks.raise_first()
    bad_logits = logits.clone()
    bad_logits[2, 7] = float("nan")
    kernels.logprob(bad_logits, targets, backend=backend, vocab_tile=64, checks=checks)
    bad_logits[2, 7] = 0.0
    with pytest.raises(kernels.InputChangedError, match=r"logits changed after .* every value is finite now"):
        checks.raise_first()
    logits[1, (targets[1] + 1) % 300], logits[1, targets[1]] = 3e38, -3e38  # finite; logp leaves fp32
    kernels.logprob(logits, targets, backend=backend, vocab_tile=64, checks=checks)
    with pytest.raises(kernels.NonFiniteOutputError, match=r"row 1: logp is -inf although every input is finite"):
        checks.raise_first()


def test_rank_groups_compute_on_the_cpu_or_cuda_only():
    with pytest.raises(kernels.TPConfigError, match=r"device_type must be one of \('cpu', 'cuda'\), got 'tpu'"):
        with kernels.distributed_ranks("aten", kernels.ShardingSpec.even(100, 16, 2), "tpu"):
            pass


def test_bit_patterns_read_the_values_a_view_reads_as_and_refuse_what_has_none_by_name():
    """A negated or conjugated view's bits are those of the values it reads as (a bare RuntimeError before); a
    non-tensor, a meta or sparse tensor, a 16-byte or a quantized element have no bits to view and are refused."""
    values = torch.tensor([1.5, -0.0, 2.0])
    negated = torch.complex(torch.zeros(3), -values).conj().imag
    assert negated.is_neg()
    assert torch.equal(kernels.bit_pattern(negated), kernels.bit_pattern(values))
    assert kernels.first_bit_difference(negated, values) is None
    assert kernels.first_bit_difference(negated, torch.tensor([1.5, 0.0, 2.0])) == 1
    conjugated = torch.tensor([1 + 2j]).conj()
    assert torch.equal(kernels.bit_pattern(conjugated), kernels.bit_pattern(conjugated.resolve_conj()))
    sparse = values.to_sparse()
    refusals = [
        (lambda: kernels.first_bit_difference([1.0], values), kernels.KernelInputError, r"lhs must be a torch.Tensor"),
        (lambda: kernels.bit_pattern(values.to("meta")), kernels.KernelInputError, r"tensor is a tensor on the meta"),
        (lambda: kernels.first_bit_difference(values, sparse), kernels.KernelInputError, r"rhs is a .*sparse"),
        (lambda: kernels.bit_view(torch.zeros(2, dtype=torch.complex128)), kernels.DtypeMismatchError, r"16 bytes"),
    ]
    for call, error, match in refusals:
        with pytest.raises(error, match=match):
            call()
    with warnings.catch_warnings():  # newer torch warns that quantization is deprecated
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_tensor(values, 1.0, 0, torch.quint8)
    with pytest.raises(kernels.DtypeMismatchError, match=r"quantized tensor .*int_repr"):  # its view crashed torch
        kernels.bit_pattern(quantized)
