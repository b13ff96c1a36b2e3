"""Finite inputs give finite logp and lse or a typed error naming the row whose logits overflowed."""

from __future__ import annotations

import pytest
import torch
from conftest import triton_runs_on

import kernels

ROWS, HIDDEN, VOCAB, TILE = 5, 16, 100, 64
OVERFLOWING_ROWS = (2, 4)


def overflowing_inputs(dtype: torch.dtype, device: str):
    """Finite hidden[T, H] and weight[V, H] whose products in rows 2 and 4 exceed fp32 (3e38 * 2 per logit)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    weight[:, 0] = 2.0
    hidden[OVERFLOWING_ROWS[0], 0] = 3e38
    hidden[OVERFLOWING_ROWS[1], 0] = -3e38
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    return hidden.to(dtype).to(device), weight.to(dtype).to(device), targets.to(device)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_logits_that_overflow_the_execution_dtype_raise_naming_the_first_row(backend, dtype, tp, device):
    if backend == "triton" and not triton_runs_on(device):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    hidden, weight, targets = overflowing_inputs(dtype, device)
    reference = kernels.lm_head_logprob(hidden, weight, targets, backend="reference")
    assert bool(reference.lse.isfinite().all()), "float64 holds these logits: the inputs themselves are fine"

    with pytest.raises(
        kernels.NonFiniteOutputError,
        match=rf"row {OVERFLOWING_ROWS[0]}: (lse|logp) is (nan|inf|-inf) although every input is finite: .* "
        rf"overflowed the execution dtype {kernels.dtype_name(dtype)}",
    ) as err:
        kernels.lm_head_logprob(hidden, weight, targets, backend=backend, tp=tp, vocab_tile=TILE)
    assert err.value.row == OVERFLOWING_ROWS[0]
    assert isinstance(err.value, kernels.KernelInputError)


@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_finite_logits_whose_logp_leaves_fp32_raise(backend, device):
    """logp = logit - lse: -3e38 - 3e38 overflows fp32 although every logit is finite."""
    if backend == "triton" and not triton_runs_on(device):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    logits = torch.zeros(3, VOCAB, device=device)
    logits[1, 0], logits[1, 1] = 3e38, -3e38
    targets = torch.tensor([0, 1, 2], device=device)

    with pytest.raises(kernels.NonFiniteOutputError, match=r"row 1: logp is -inf although every input is finite"):
        kernels.logprob(logits, targets, backend=backend, vocab_tile=TILE)


def test_the_error_is_typed_in_distributed_mode_too():
    """The check runs in the caller on the gathered result, so a rank's overflow is not a bare RuntimeError."""
    hidden, weight, targets = overflowing_inputs(torch.float32, "cpu")
    with pytest.raises(kernels.NonFiniteOutputError, match=rf"row {OVERFLOWING_ROWS[0]}: "):
        kernels.lm_head_logprob(hidden, weight, targets, backend="aten", tp=2, tp_mode="distributed", vocab_tile=TILE)


@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_float64_logits_past_the_float32_range_are_named_as_inputs(backend, device):
    """A backend that reduces logits in float32 reads a float64 logit past its range as ±inf: the logit is named,
    not an overflow of the float64 it fits in; the reference, which reduces in float64, computes it."""
    if backend == "triton" and not triton_runs_on(device):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    logits = torch.zeros(3, VOCAB, dtype=torch.float64, device=device)
    logits[1, 5] = 1e39
    targets = torch.tensor([0, 5, 2], device=device)
    assert bool(kernels.logprob(logits, targets, backend="reference", vocab_tile=TILE).lse.isfinite().all())
    with pytest.raises(
        kernels.NonFiniteInputError, match=r"logits holds 1e\+39 at index \(1, 5\), past the largest finite float32"
    ):
        kernels.logprob(logits, targets, backend=backend, vocab_tile=TILE)
