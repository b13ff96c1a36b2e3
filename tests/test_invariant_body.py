"""The invariant body's ops (kernels/body.py) on fresh random inputs: within the whole-model contract's bounds of
float64 (rlsweep.module_accuracy), and a row's bits the same in every way a trainer or an engine calls them."""

from __future__ import annotations

import secrets

import pytest
import torch
from conftest import triton_runs_on

from kernels import body
from kernels.bitwise import bit_pattern
from kernels.errors import KernelInputError, NoBackwardError
from rlsweep.module_accuracy import attention_reference

pytest.importorskip("transformers")  # rlsweep.module_accuracy's references sit beside the whole-model code


@pytest.fixture
def triton_device(device):
    if not triton_runs_on(device):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    return device


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bit_pattern(a.cpu()), bit_pattern(b.cpu()))


def causal(length: int, keys: int | None = None) -> torch.Tensor:
    keys = length if keys is None else keys
    return torch.ones(length, keys, dtype=torch.bool).tril(keys - length)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_is_within_its_bound_and_gives_each_row_the_same_bits_in_every_layout(triton_device, dtype):
    """bf16 as the body runs; fp32 too, whose output is not rounded to 8 bits: a reduction order that moved shows."""
    seed = secrets.randbits(31)
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = (4, 2, 32) if triton_device == "cpu" else (16, 8, 128)
    lengths = [int(n) for n in torch.randint(3, 80, (3,), generator=generator)]
    total = sum(lengths)

    def normal(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(triton_device)

    q, k, v = normal(1, heads, total, dim), normal(1, kv_heads, total, dim) * 2, normal(1, kv_heads, total, dim)
    scale = dim**-0.5
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    segment = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    packed_mask = (causal(total) & (segment[:, None] == segment[None, :]))[None, None].to(triton_device)
    packed = body.attention(q, k, v, packed_mask, scale)  # [1, T, H, D]
    # scaling: 1/sqrt(dim), as the config-free call implies
    reference, bound, rows, _ = attention_reference(None, (q, k, v, packed_mask), {}, packed, None)
    errors = (packed.double() - reference).abs()
    assert bool((errors <= bound)[rows].all()), f"seed {seed}: max error / bound {float((errors / bound)[rows].max())}"

    width = max(lengths)
    for side in ("right", "left"):  # one padded batch, attention mask from the padding
        qb, kb, vb = (torch.zeros(len(lengths), t.shape[1], width, dim, dtype=t.dtype, device=triton_device)
                      for t in (q, k, v))  # fmt: skip
        real = torch.zeros(len(lengths), width, dtype=torch.bool)
        for row, (start, n) in enumerate(zip(starts, lengths, strict=True)):
            where = slice(0, n) if side == "right" else slice(width - n, width)
            qb[row, :, where], kb[row, :, where], vb[row, :, where] = (t[0, :, start : start + n] for t in (q, k, v))
            real[row, where] = True
        mask = (causal(width)[None] & real[:, None, :])[:, None].to(triton_device)
        batch = body.attention(qb, kb, vb, mask, scale)
        for row, (start, n) in enumerate(zip(starts, lengths, strict=True)):
            where = slice(0, n) if side == "right" else slice(width - n, width)
            assert same_bits(batch[row, where], packed[0, start : start + n]), f"seed {seed}: {side}-padded row {row}"

    for start, n in zip(starts, lengths, strict=True):  # alone, chunked against a cache, and decode steps
        own = (t[:, :, start : start + n] for t in (q, k, v))
        qs, ks, vs = own
        assert same_bits(body.attention(qs, ks, vs, None, scale)[0], packed[0, start : start + n]), f"seed {seed}"
        chunk = 1 + n // 3
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            part = body.attention(qs[:, :, lo:hi], ks[:, :, :hi], vs[:, :, :hi], None, scale)
            assert same_bits(part[0], packed[0, start + lo : start + hi]), f"seed {seed}: chunk at {lo} of {n}"
        step = body.attention(qs[:, :, -1:], ks, vs, None, scale)
        assert same_bits(step[0, 0], packed[0, start + n - 1]), f"seed {seed}: decode step"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_silu_and_linear_are_within_bound_and_rows_do_not_depend_on_the_call(triton_device, dtype):
    from rlsweep.module_accuracy import linear_reference, rmsnorm_reference

    seed = secrets.randbits(31)
    generator = torch.Generator().manual_seed(seed)
    rows, width, out = int(torch.randint(20, 90, (1,), generator=generator)), 128, 96
    x = (torch.randn(rows, width, generator=generator) * 3).to(dtype).to(triton_device)
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter((1 + 0.1 * torch.randn(width, generator=generator)).to(dtype))
    norm.variance_epsilon = 1e-6
    norm = norm.to(triton_device)
    linear = torch.nn.Linear(width, out, bias=True, dtype=dtype, device=triton_device)  # Qwen2's q, k, v have one
    linear.weight.data = (torch.randn(out, width, generator=generator) / width**0.5).to(linear.weight)
    linear.bias.data = torch.randn(out, generator=generator).to(linear.bias)
    outputs = {
        "rmsnorm": (body.rms_norm(x, norm.weight, norm.variance_epsilon),
                    lambda rows: body.rms_norm(rows, norm.weight, norm.variance_epsilon)),
        "silu": (body.silu(x), body.silu),
        "linear": (body.linear(x, linear.weight, linear.bias),
                   lambda rows: body.linear(rows, linear.weight, linear.bias)),
    }  # fmt: skip
    for name, (whole, call) in outputs.items():
        for pick in (
            slice(0, 1),
            slice(rows - 1, rows),
            slice(3, rows // 2),
            torch.randperm(rows, generator=generator),
        ):
            assert same_bits(call(x[pick]), whole[pick]), f"seed {seed}: {name} rows {pick}"
    y64, bound = rmsnorm_reference(norm, x, outputs["rmsnorm"][0], norm.variance_epsilon)
    assert bool(((outputs["rmsnorm"][0].double() - y64).abs() <= bound).all()), f"seed {seed}"
    y64, bound = linear_reference(linear, x, outputs["linear"][0])
    assert bool(((outputs["linear"][0].double() - y64).abs() <= bound).all()), f"seed {seed}"
    silu64 = torch.nn.functional.silu(x.double())
    unit = 2**-8 if dtype == torch.bfloat16 else 2**-20  # half a bf16 ulp; fp32: a few ulps of exp and divide
    assert bool(((outputs["silu"][0].double() - silu64).abs() <= silu64.abs() * unit + 1e-30).all()), f"seed {seed}"


@pytest.mark.interpreter
def test_a_gradient_through_the_invariant_body_is_refused_in_one_line():
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(16, 32, dtype=torch.bfloat16)
    out = body.linear(x, weight)
    assert out.requires_grad  # recorded as a trainer's forward records it
    with pytest.raises(NoBackwardError, match="forward-only") as refused:
        out.float().sum().backward()
    assert "\n" not in str(refused.value)


@pytest.mark.interpreter
def test_an_attention_mask_that_is_not_one_run_of_keys_per_row_is_refused():
    q = torch.randn(1, 2, 4, 16, dtype=torch.bfloat16)
    mask = causal(4)[None, None].clone()
    mask[0, 0, 3, 1] = False  # query 3 sees keys 0, 2, 3: a hole
    with pytest.raises(KernelInputError, match=r"batch 0, query 3\) allows 3 keys that are not one contiguous run"):
        body.attention(q, q, q, mask, 0.25)
