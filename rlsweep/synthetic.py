"""Counter-based values: each element is a pure function of (seed, stream, row, col).

Only integer arithmetic and correctly rounded IEEE operations (+, *, casts) are used, so the
values are bit-identical on every machine and device, and independent of how many are made.
"""

from __future__ import annotations

import math

import torch

# Streams keep unrelated quantities uncorrelated even under the same seed.
STREAMS = {"weight": 1, "hidden": 2, "filler_hidden": 3, "target": 4, "filler_target": 5}
MASK64 = (1 << 64) - 1
UNIFORMS_PER_NORMAL = 4  # Irwin-Hall: the sum of 4 uniforms has std sqrt(4/12)


def signed64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


MIX1 = signed64(0xBF58476D1CE4E5B9)
MIX2 = signed64(0x94D049BB133111EB)
GOLDEN = signed64(0x9E3779B97F4A7C15)


def shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer on int64 tensors (multiplication wraps modulo 2^64)."""
    x = (x ^ shift_right(x, 30)) * MIX1
    x = (x ^ shift_right(x, 27)) * MIX2
    return x ^ shift_right(x, 31)


def counter_bits(seed: int, stream: str, rows: torch.Tensor, cols: torch.Tensor, draw: int = 0) -> torch.Tensor:
    """64 random bits per (row, col): rows[R, 1] and cols[1, C] broadcast to [R, C] int64."""
    key = splitmix64(torch.tensor(signed64(seed * 0x100 + STREAMS[stream]), dtype=torch.int64, device=rows.device))
    x = key + rows * signed64(0x1000003 * GOLDEN) + cols * GOLDEN + draw * signed64(0xD6E8FEB86659FD93)
    return splitmix64(splitmix64(x))


def uniform(seed: int, stream: str, rows: torch.Tensor, cols: torch.Tensor, draw: int = 0) -> torch.Tensor:
    """float64 in [0, 1) with 53 random bits: exact, no transcendental functions."""
    return shift_right(counter_bits(seed, stream, rows, cols, draw), 11).double() * 2.0**-53


def standard_normal(seed: int, stream: str, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Approximately N(0, 1) float64 values [R, C]: a scaled sum of uniforms (exact arithmetic)."""
    total = sum(uniform(seed, stream, rows, cols, draw) for draw in range(UNIFORMS_PER_NORMAL))
    return (total - UNIFORMS_PER_NORMAL / 2) * math.sqrt(12 / UNIFORMS_PER_NORMAL)


def normal_matrix(
    seed: int, stream: str, row_ids: torch.Tensor, width: int, *, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """[len(row_ids), width] normals times ``scale`` in ``dtype``, on row_ids' device."""
    cols = torch.arange(width, dtype=torch.int64, device=row_ids.device)[None, :]
    return (standard_normal(seed, stream, row_ids.to(torch.int64)[:, None], cols) * scale).to(dtype)
