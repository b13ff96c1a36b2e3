"""The Triton kernels' float conversions against torch's, bit for bit: fp32 -> bf16 logits and bf16 -> fp32 loads."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import triton_runs_on

import kernels
from kernels import triton_kernels
from kernels.triton_kernels import round_to_bf16, widen_to_fp32

BLOCK = 1024

# fp32 bit patterns at the edges of rounding to bf16 (the low 16 bits are the ones dropped).
EDGE_BITS = [
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,  # ties: kept lsb even (stays) and odd (rounds up)
    0x3F807FFF, 0x3F808001, 0x3F817FFF, 0x3F818001,  # one below and above a tie
    0x3F7FFFFF, 0x3F7F8000, 0x3FFFFFFF, 0xBF7FFFFF,  # the mantissa carry steps the exponent
    0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,  # largest finite bf16; just below, at, above its overflow tie
    0xFF7F7FFF, 0xFF7F8000, 0xFF7FFFFF, 0x7F000000,  # ... negative; a large exact value
    0x00000001, 0x00008000, 0x00018000, 0x00008001,  # fp32 subnormals: smallest, ties to even and to odd
    0x0000FFFF, 0x007F7FFF, 0x007FFFFF, 0x807FFFFF,  # ... largest subnormal carries into the smallest normal
    0x00800000, 0x00807FFF, 0x00808000, 0x00818000,  # smallest normal and its ties
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # ±0, ±inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,  # NaN: quiet, negative, signalling with low payloads
    0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC08000,  # ... payloads in the dropped and the kept half
]  # fmt: skip


def as_fp32(bits: list[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def fp32_samples(seed: int) -> torch.Tensor:
    """The edge patterns, every bit pattern class at random, and normal values over many magnitudes, both signs."""
    gen = torch.Generator().manual_seed(seed)
    random_bits = torch.randint(0, 2**32, (1 << 16,), generator=gen, dtype=torch.int64)
    scales = 2.0 ** torch.randint(-130, 126, (1 << 14,), generator=gen).double()
    magnitudes = (torch.randn(1 << 14, generator=gen, dtype=torch.float64) * scales).float()
    return torch.cat([as_fp32(EDGE_BITS), as_fp32(random_bits), magnitudes])


def torch_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """torch's x.to(bfloat16) bits on x's device; each NaN as c10::BFloat16 converts it (a 0-d tensor).

    Torch's own NaN bits differ by path (measured, torch 2.13 CPU: 0x7FC0 from the scalar conversion, 0xFFFF from
    the vectorised one); the kernels write c10::BFloat16's, so the comparison takes that one for every NaN.
    """
    bits = torch.where(x.isnan(), 0, x.to(torch.bfloat16).view(torch.int16).to(torch.int32))
    for i in x.isnan().nonzero().flatten().tolist():
        bits[i] = torch.tensor(x[i].item()).to(torch.bfloat16).view(torch.int16).item()
    return bits.to(torch.int16)


@triton.jit
def round_to_bf16_probe(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offsets < n
    tl.store(y_ptr + offsets, round_to_bf16(tl.load(x_ptr + offsets, mask=live)), mask=live)


@triton.jit
def widen_to_fp32_probe(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offsets < n
    tl.store(y_ptr + offsets, widen_to_fp32(tl.load(x_ptr + offsets, mask=live)), mask=live)


def run_probe(probe, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    probe[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), BLOCK=BLOCK)
    return out


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, inputs: torch.Tensor) -> None:
    differ = (got.cpu() != want.cpu()).nonzero().flatten()
    if differ.numel():
        shown = [
            f"{int(inputs.view(torch.int32)[i]) & 0xFFFFFFFF:#010x} -> {int(got[i]) & 0xFFFF:#06x}, "
            f"torch {int(want[i]) & 0xFFFF:#06x}"
            for i in differ[:8].tolist()
        ]
        raise AssertionError(f"{differ.numel()} of {got.numel()} conversions differ from torch: {shown}")


@pytest.fixture
def triton_device(device) -> str:
    if not triton_runs_on(device):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    return device


def test_canonical_nan_is_torchs():
    assert torch.tensor(float("nan")).to(torch.bfloat16).view(torch.int16).item() == triton_kernels.BF16_NAN_BITS


@pytest.mark.parametrize("seed", [0, 1])
def test_round_to_bf16_is_torchs_conversion_bit_for_bit(seed, triton_device):
    x = fp32_samples(seed)
    got = run_probe(round_to_bf16_probe, x.to(triton_device), torch.bfloat16).view(torch.int16)
    assert_same_bits(got, torch_bf16_bits(x.to(triton_device)).cpu(), x)


def test_widen_to_fp32_is_exact_for_every_bf16(triton_device):
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    got = run_probe(widen_to_fp32_probe, every_bf16.to(triton_device), torch.float32)
    assert torch.equal(kernels.bit_pattern(got), kernels.bit_pattern(every_bf16.float()))


# Below this the last of the three parts would be an fp32 subnormal, which a bf16 cannot hold in full.
SMALLEST_SPLIT = 2.0**-100


def bf16_parts(x: torch.Tensor) -> torch.Tensor:
    """[n, 3] bf16 whose row sums are x exactly: three truncations of x's 24-bit significand."""
    parts, rest = [], x
    for _ in range(3):
        part = (rest.view(torch.int32) & ~0xFFFF).view(torch.float32)  # the upper half: a bf16, exactly
        parts.append(part)
        rest = rest - part  # exact: part is a truncation of rest
    assert not bool(rest.any()), "x must be finite with |x| >= SMALLEST_SPLIT"
    return torch.stack(parts, dim=1).to(torch.bfloat16)


def test_matmul_stores_logits_rounded_like_torch(triton_device):
    """The matmul's epilogue is the rounding under test: K = 3 parts of x against ones accumulate to x exactly."""
    x = torch.cat([as_fp32(EDGE_BITS), fp32_samples(2)[-256:]])
    x = x[x.isfinite() & (x.abs() >= SMALLEST_SPLIT)]
    hidden = bf16_parts(x)
    assert torch.equal(hidden.float().sum(dim=1).view(torch.int32), x.view(torch.int32))  # every order is exact
    weight = torch.ones(8, 3, dtype=torch.bfloat16)

    logits, _ = kernels.matmul(hidden.to(triton_device), weight.to(triton_device), backend="triton")

    want = torch_bf16_bits(x)[:, None].expand(-1, weight.shape[0])
    for column in range(weight.shape[0]):
        assert_same_bits(logits.view(torch.int16)[:, column].cpu(), want[:, column], x)
