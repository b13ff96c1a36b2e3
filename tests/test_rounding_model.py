"""The rounding-error model (kernels.rounding_bound): it holds for correct kernels, is tight, and catches truncation.

The bound is the v2 contract's accuracy row; docs/contract.md derives it.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import triton_runs_on
from rlsweep_fixtures import run_rlsweep

import kernels
from kernels.aten import AtenBackend
from kernels.provenance import observe
from kernels.rounding import half_ulp


def bound_inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 16, generator=gen), torch.randn(50, 16, generator=gen), torch.tensor([0, 49, -100, 7])


def with_value(tensor: torch.Tensor, index, value) -> torch.Tensor:
    changed = tensor.clone()
    changed[index] = value
    return changed


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda h, w, t, d: (h, w, with_value(t, 1, 50), d), kernels.TargetOutOfRangeError, r"target id 50 at row 1"),
        (lambda h, w, t, d: (h, w, with_value(t, 3, -5), d), kernels.TargetOutOfRangeError, r"target id -5 at row 3"),
        (lambda h, w, t, d: (h, w, t[:3], d), kernels.ShapeMismatchError, r"targets must be \[T\] with T=4"),
        (lambda h, w, t, d: (h, w, torch.cat([t, t]), d), kernels.ShapeMismatchError, r"targets must be \[T\]"),
        (lambda h, w, t, d: (h[:, :8], w, t, d), kernels.ShapeMismatchError, r"hidden size differs"),
        (lambda h, w, t, d: (with_value(h, (2, 3), math.nan), w, t, d), kernels.NonFiniteInputError, r"hidden"),
        (lambda h, w, t, d: (h, w, t, "bfloat16"), kernels.DtypeMismatchError, r"logits_dtype must be a torch dtype"),
        (lambda h, w, t, d: (h, w, t, torch.float64), kernels.DtypeMismatchError, r"bfloat16, float16, float32"),
        (lambda h, w, t, d: (h, w, t, [torch.bfloat16]), kernels.DtypeMismatchError, r"logits_dtype .*; got \["),
    ],
    ids=[
        *("target-V", "target-negative", "short-targets", "long-targets", "hidden-size", "nan", "dtype-name"),
        *("fp64", "dtype-list"),
    ],
)
@pytest.mark.parametrize("bound", ["rounding_bound", "gradient_bound"])
def test_the_bounds_refuse_inputs_the_kernels_refuse(bound, mutate, error, match):
    """A bound of inputs no kernel accepts bounds nothing: the same typed errors, naming the value."""
    hidden, weight, targets, logits_dtype = mutate(*bound_inputs(), torch.bfloat16)
    upstream = torch.ones(targets.shape)
    with pytest.raises(error, match=match):
        if bound == "rounding_bound":
            kernels.rounding_bound(hidden, weight, targets, logits_dtype=logits_dtype)
        else:
            kernels.gradient_bound(hidden, weight, targets, upstream, upstream, logits_dtype=logits_dtype)


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ({"calls": [[0.5, 1], [2, 3]]}, kernels.DtypeMismatchError, r"calls must hold integer row indices"),
        ({"calls": [[True, True, False, False]]}, kernels.DtypeMismatchError, r"integer row indices; .* torch.bool"),
        ({"lse_bound": torch.ones(3)}, kernels.ShapeMismatchError, r"lse_bound must be \[T\] with T=4, got \(3,\)"),
        ({"g_logp": [1.0, 1.0, 1.0, 1.0]}, kernels.KernelInputError, r"g_logp must be a torch.Tensor, got list"),
        ({"calls": torch.arange(4)}, kernels.ShapeMismatchError, r"each a 1-D sequence of row indices; .* shape \(\)"),
        ({"calls": [[[0, 1], [2, 3]]]}, kernels.ShapeMismatchError, r"each a 1-D sequence .* shape \(2, 2\)"),
        ({"calls": "0123"}, kernels.DtypeMismatchError, r"calls must hold sequences of integer row indices; got .*'0'"),
    ],
    ids=["float-rows", "bool-rows", "short-lse-bound", "list-upstream", "one-tensor", "2-d-call", "string"],
)
def test_the_gradient_bound_refuses_arguments_it_would_misread(extra, error, match):
    """Float or bool row indices were truncated to other rows (a bound of another partition), a short lse bound and
    a list of upstream gradients raised IndexError and AttributeError from inside, and calls given as one tensor of
    rows or a string a RuntimeError and a TypeError."""
    hidden, weight, targets = bound_inputs()
    arguments = {"g_logp": torch.ones(4), "g_lse": torch.ones(4), **extra}
    g_logp, g_lse = arguments.pop("g_logp"), arguments.pop("g_lse")
    with pytest.raises(error, match=match):
        kernels.gradient_bound(hidden, weight, targets, g_logp, g_lse, logits_dtype=torch.bfloat16, **arguments)


def test_bits_compare_for_every_width_and_refuse_tensors_that_differ_in_shape_or_dtype():
    flags = torch.tensor([True, False, True])
    assert kernels.first_bit_difference(flags, flags.clone()) is None
    assert kernels.first_bit_difference(flags, torch.tensor([True, True, True])) == 1
    with pytest.raises(kernels.ShapeMismatchError, match=r"cannot compare bits of torch.bool\(3,\) and torch.bool"):
        kernels.first_bit_difference(flags, flags[:2])
    with pytest.raises(kernels.DtypeMismatchError, match=r"torch.float32\(3,\) and torch.float64\(3,\)"):
        kernels.first_bit_difference(torch.zeros(3), torch.zeros(3, dtype=torch.float64))


def test_half_ulp_is_half_the_bf16_spacing_in_every_binade():
    values = torch.tensor([1.0, 1.5, 2.0, 3.99, 4.0, 60.0, 2.0**-130, 0.0], dtype=torch.float64)
    spacing = torch.tensor([2.0**-7, 2.0**-7, 2.0**-6, 2.0**-6, 2.0**-5, 2.0**-2, 2.0**-133, 2.0**-133])
    assert torch.equal(half_ulp(values, torch.bfloat16), spacing.double() / 2)
    # Round-to-nearest of random fp32 values never errs by more than that. (From float64, torch rounds twice,
    # via fp32, and can miss by 2**-29 relative: the model's fp32 accumulation term covers that case.)
    x = torch.randn(100_000) * 50
    error = (x.to(torch.bfloat16).double() - x.double()).abs()
    assert bool((error <= half_ulp(x.double().abs(), torch.bfloat16)).all())


class TruncatingBackend(AtenBackend):
    """Stock PyTorch whose matmul truncates its fp32 logits to bf16 (round toward zero): the accuracy control."""

    def matmul(self, hidden, weight):
        exact = torch.ops.aten.mm.default(hidden.float(), weight.float().T)
        truncated = (exact.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)  # keep the top 16 bits
        return truncated, observe("matmul", self.id, truncated)


def ratio(result, reference, bound, tensor: str) -> float:
    err = (getattr(result, tensor).double() - getattr(reference, tensor)).abs()
    return float((err / getattr(bound, tensor)).max())


def test_truncation_is_red_on_a_workload_large_enough_to_be_certain(make_inputs, isolated_registries):
    aten = kernels.BACKENDS["aten"]
    kernels.register_backend("truncating", kernels=aten.declared_kernels, capability=aten.capability)(TruncatingBackend)
    # Truncating the top logit by more than half an ulp pushes its lse past the bound; that happens to about
    # half the rows, so among 256 rows it is certain (a miss has probability ~2**-256).
    inp = make_inputs(256, 64, 8192, torch.bfloat16, "cpu")
    reference = kernels.lm_head_logprob(inp.hidden, inp.weight, inp.targets, backend="reference")
    bound = kernels.rounding_bound(inp.hidden, inp.weight, inp.targets, logits_dtype=torch.bfloat16)
    truncated = kernels.lm_head_logprob(inp.hidden, inp.weight, inp.targets, backend="truncating")
    stock = kernels.lm_head_logprob(inp.hidden, inp.weight, inp.targets, backend="aten")
    assert ratio(truncated, reference, bound, "lse") > 1, f"seed {inp.seed}"
    assert ratio(stock, reference, bound, "lse") <= 1 and ratio(stock, reference, bound, "logp") <= 1


@pytest.mark.parametrize("scale", [1.0, 8.0], ids=["random", "peaked"])
def test_the_bound_is_tight_and_holds_on_peaked_rows(scale, make_inputs):
    """Stock PyTorch uses a real share of the bound on random rows; on rows 8x peakier the bound grows with them."""
    inp = make_inputs(64, 96, 3001, torch.float32, "cpu")
    hidden = (inp.hidden * scale).bfloat16()
    weight = inp.weight.bfloat16()
    reference = kernels.lm_head_logprob(hidden, weight, inp.targets, backend="reference")
    bound = kernels.rounding_bound(hidden, weight, inp.targets, logits_dtype=torch.bfloat16)
    stock = kernels.lm_head_logprob(hidden, weight, inp.targets, backend="aten")
    for tensor in ("logp", "lse"):
        assert 0.2 < ratio(stock, reference, bound, tensor) <= 1, (tensor, inp.seed)


def bf16_rounded_limit(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> float:
    """max |logp of the exact logits rounded to nearest bf16 - logp of the exact logits|, all in float64."""
    x = hidden.double() @ weight.double().T
    rounded = x.to(torch.bfloat16).double()

    def logp(logits: torch.Tensor) -> torch.Tensor:
        return logits.gather(1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=1)

    return float((logp(rounded) - logp(x)).abs().max())


@pytest.mark.parametrize("seed", [11])  # more seeds and shapes: tests/test_kernel_accuracy.py (rounding_bound)
def test_triton_on_the_cpu_is_as_accurate_as_bf16_logits_allow(seed, device, make_inputs):
    """Round-to-nearest logits: within 1.05x the exact limit of bf16-rounded logits (truncation gave ~1.7x)."""
    if not triton_runs_on(device):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    inp = make_inputs(64, 96, 50257, torch.bfloat16, device, seed=seed)
    reference = kernels.lm_head_logprob(inp.hidden, inp.weight, inp.targets, backend="reference")
    result = kernels.lm_head_logprob(inp.hidden, inp.weight, inp.targets, backend="triton", vocab_tile=1024)
    error = float((result.logp.double() - reference.logp).abs().max())
    limit = bf16_rounded_limit(inp.hidden.cpu(), inp.weight.cpu(), inp.targets.cpu())
    assert error <= 1.05 * limit, (error, limit, math.log2(error / limit))


@pytest.mark.parametrize("profile", ["cpu_bf16", "triton_cpu_bf16"])
def test_whole_runs_are_green_under_v2_on_peaked_rows(tmp_path, profile):
    done = run_rlsweep(tmp_path, f"profile={profile}", "workload=peaked", "layout=smoke")
    assert done.returncode == 0, done.stdout + done.stderr
