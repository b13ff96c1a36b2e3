"""The Triton interpreter as kernels/interpreter.py leaves it: the language modules a module's functions see are
patched once per process instead of at every launch and device call, and every value is what the interpreter
computed before."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interpreter

triton = pytest.importorskip("triton")
tl = triton.language

import kernels  # noqa: E402  (installs the once-per-launch patching when triton is imported)
from kernels.interpreter import patch_language_once  # noqa: E402


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


def test_the_language_is_patched_once_per_module_and_every_launch_computes_what_it_did(monkeypatch):
    import inspect

    from triton.runtime import interpreter

    assert kernels.launches.watch_triton_launches  # the package is what installed it
    assert patch_language_once() is True
    rows, n, steps = 6, 32, 5
    x = torch.randn(rows, n, dtype=torch.float32)
    out = torch.empty(rows, dtype=torch.float32)
    row_sums_kernel[(rows,)](x, out, N=n, STEPS=steps)
    assert tl.load.__name__ == "<lambda>", "the launch restored triton.language: the next one would patch it again"
    expected = torch.zeros(rows, dtype=torch.float32)
    for step in range(steps):  # the kernel's own order: fp32 sums of x * (step + 1), added step by step
        expected += (x * (step + 1.0)).sum(dim=1)
    torch.testing.assert_close(out, expected + (n + 1) // 2, rtol=1e-6, atol=1e-5)
    # A second launch (its programs' rows x steps x 2 device calls included) patches nothing: no getmembers walk.
    walks = []
    getmembers = inspect.getmembers
    monkeypatch.setattr(interpreter.inspect, "getmembers", lambda *a, **k: walks.append(a) or getmembers(*a, **k))
    again = torch.empty_like(out)
    row_sums_kernel[(rows,)](x, again, N=n, STEPS=steps)
    assert walks == []
    assert torch.equal(again.view(torch.int32), out.view(torch.int32))


@triton.jit
def hashed_index_kernel(out_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, N)
    tl.store(out_ptr + row * N + cols, cols * 1103515245 + row * 12345)  # int32: wraps for cols >= 2


def test_integer_overflow_checks_are_skipped_only_where_their_asserts_are_dropped_and_change_no_value():
    """Without ``debug`` the interpreter's overflow checks of int32 arithmetic only fed an assert that is dropped:
    they are off, and a kernel whose index arithmetic wraps stores the same values with them on."""
    import dataclasses

    from triton.runtime import interpreter

    assert patch_language_once() is True
    options = interpreter.interpreter_builder.options
    assert options.debug is False and options.sanitize_overflow is False
    rows, n = 3, 16
    skipped = torch.empty(rows * n, dtype=torch.int32)
    hashed_index_kernel[(rows,)](skipped, N=n)
    interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=True)
    try:
        checked = torch.empty_like(skipped)
        hashed_index_kernel[(rows,)](checked, N=n)
    finally:
        interpreter.interpreter_builder.options = options
    expected = torch.arange(n, dtype=torch.int64) * 1103515245 + torch.arange(rows, dtype=torch.int64)[:, None] * 12345
    expected = ((expected + 2**31) % 2**32 - 2**31).to(torch.int32).reshape(-1)  # two's-complement wrap
    assert torch.equal(checked, expected) and torch.equal(skipped, expected)


def test_bf16_fp32_casts_give_the_interpreters_own_bits_for_every_pattern():
    """The shift that replaces the interpreter's bf16 <-> fp32 conversion where no input is subnormal gives that
    conversion's bits: every bf16 pattern widened, fp32 of every exponent (subnormals, zeros, infs and NaNs
    included) narrowed, contiguous or strided; and a rounding conversion (RTNE) is still the interpreter's."""
    import numpy as np
    from triton.runtime import interpreter

    assert patch_language_once() is True
    fast = interpreter._convert_float
    own = fast.__wrapped__
    assert fast is not own
    bf16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    assert np.array_equal(fast(bf16, tl.bfloat16, tl.float32, None), own(bf16, tl.bfloat16, tl.float32, None))
    rng = np.random.default_rng(7)
    exponents = np.arange(256, dtype=np.uint32)[:, None] << 23
    bits = exponents | rng.integers(0, 2**23, (256, 512), dtype=np.uint32) | (rng.integers(0, 2, (256, 512)) << 31)
    bits[:, :4] = np.array([0, 0x80000000, 0x7F800001, 0xFF800000], dtype=np.uint32)
    fp32 = bits.astype(np.uint32).view(np.float32)
    for x in (fp32, fp32[1:], fp32[1:, ::3], fp32[200:201, 7:9]):  # with and without subnormals
        narrowed = fast(x, tl.float32, tl.bfloat16, None)
        assert narrowed.dtype == np.uint16 and np.array_equal(narrowed, own(x, tl.float32, tl.bfloat16, None))
    rtne = interpreter._ir.ROUNDING_MODE.RTNE
    assert np.array_equal(fast(fp32[1:], tl.float32, tl.bfloat16, rtne), own(fp32[1:], tl.float32, tl.bfloat16, rtne))


def test_numpy_dtypes_are_the_interpreters_own_for_scalars_blocks_and_pointers():
    from triton.runtime import interpreter

    assert patch_language_once() is True
    remembered, own = interpreter._get_np_dtype, interpreter._get_np_dtype.__wrapped__
    assert remembered is not own
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
               tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]  # fmt: skip
    types = [*scalars, *(tl.pointer_type(t) for t in scalars)]
    types += [tl.block_type(t, [4, 8]) for t in types]
    for tt in types * 2:  # the second pass answers from what the first remembered
        assert remembered(tt) == own(tt), tt
