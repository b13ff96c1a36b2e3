"""The Triton interpreter as kernels/interpreter.py leaves it: a device function's call patches the language
modules once per launch instead of once per call, and every value is what the interpreter computed before."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interpreter

triton = pytest.importorskip("triton")
tl = triton.language

import kernels  # noqa: E402  (installs the once-per-launch patching when triton is imported)
from kernels.interpreter import patch_device_calls_once  # noqa: E402


@triton.jit
def scaled_row_sum(x, scale):
    return tl.sum(x * scale, axis=0)


@triton.jit
def row_sums_kernel(x_ptr, out_ptr, N: tl.constexpr, STEPS: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, N)
    total = 0.0
    for step in range(STEPS):  # a device function of this module, and tl.sum (of triton.language's), every step
        total += scaled_row_sum(tl.load(x_ptr + row * N + cols), step + 1.0)
    tl.store(out_ptr + row, total + tl.cdiv(N, 2))


def test_a_device_function_patches_the_language_once_per_launch_and_computes_what_it_did(monkeypatch):
    from triton.runtime import interpreter

    assert kernels.launches.watch_triton_launches  # the package is what installed it
    assert patch_device_calls_once() is True
    calls = []
    patch_lang = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn.__module__) or patch_lang(fn))
    rows, n, steps = 6, 32, 5
    x = torch.randn(rows, n, dtype=torch.float32)
    out = torch.empty(rows, dtype=torch.float32)
    row_sums_kernel[(rows,)](x, out, N=n, STEPS=steps)
    # The launch patches this module's view; tl.sum and tl.cdiv (triton.language.standard) patch theirs once. Before,
    # every one of the rows x steps x 2 device calls patched again.
    assert sorted(calls) == sorted([__name__, "triton.language.standard"]), calls
    expected = torch.zeros(rows, dtype=torch.float32)
    for step in range(steps):  # the kernel's own order: fp32 sums of x * (step + 1), added step by step
        expected += (x * (step + 1.0)).sum(dim=1)
    torch.testing.assert_close(out, expected + (n + 1) // 2, rtol=1e-6, atol=1e-5)
    calls.clear()
    again = torch.empty_like(out)
    row_sums_kernel[(rows,)](x, again, N=n, STEPS=steps)
    assert len(calls) == 2, calls  # a second launch patches afresh: the first one's state is not relied on
    assert torch.equal(again.view(torch.int32), out.view(torch.int32))
