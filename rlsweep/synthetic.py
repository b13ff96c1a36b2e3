"""Counter-based values: each element is a pure function of (seed, stream, row, col).

Only integer arithmetic and correctly rounded IEEE operations (+, *, casts) are used, so the
values are bit-identical on every machine and device, and independent of how many are made.
"""

from __future__ import annotations

import math

import torch

from rlsweep.errors import ConfigError

# Streams keep unrelated quantities uncorrelated even under the same seed.
STREAMS = {
    "weight": 1,
    "hidden": 2,
    "filler_hidden": 3,
    "target": 4,
    "filler_target": 5,
    "grad_logp": 6,
    "prompt_token": 7,
    "sample": 8,
}
STREAM_BITS = 8  # a stream's key is seed * 2**STREAM_BITS + stream id, taken modulo 2**64
assert max(STREAMS.values()) < 1 << STREAM_BITS
# Seeds that differ by a multiple of 2**56 share a key (seed -1 is seed 2**56 - 1): only [0, SEED_LIMIT) are distinct.
SEED_LIMIT = 1 << (64 - STREAM_BITS)
MASK64 = (1 << 64) - 1
UNIFORMS_PER_NORMAL = 4  # Irwin-Hall: the sum of 4 uniforms has std sqrt(4/12)
GENERATION_ROWS = 8192  # synthetic weights are made in row blocks of this many rows, to bound memory
NORMAL_WORKING_ARRAYS = 5  # normal_matrix holds up to 5 int64/float64 [R, C] temporaries at once (measured)


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


def check_seed(seed: int, key: str) -> None:
    """``seed`` must be an integer in [0, SEED_LIMIT): outside it, two seeds share one stream key."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ConfigError(
            f"{key}={seed!r} is outside the seeds that give distinct streams: an integer in "
            f"[0, 2**{64 - STREAM_BITS} - 1] (0 to {SEED_LIMIT - 1}); larger or negative seeds alias one in that range"
        )


def counter_bits(seed: int, stream: str, rows: torch.Tensor, cols: torch.Tensor, draw: int = 0) -> torch.Tensor:
    """64 random bits per (row, col): rows[R, 1] and cols[1, C] broadcast to [R, C] int64."""
    stream_key = seed * (1 << STREAM_BITS) + STREAMS[stream]
    key = splitmix64(torch.tensor(signed64(stream_key), dtype=torch.int64, device=rows.device))
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
    seed: int,
    stream: str,
    row_ids: torch.Tensor,
    width: int,
    *,
    scale: float | torch.Tensor,
    dtype: torch.dtype,
    mean: float = 0.0,
) -> torch.Tensor:
    """[len(row_ids), width] normals times ``scale`` (a float, or float64 [len(row_ids)]: one per row), plus ``mean``,
    in ``dtype``, on row_ids' device. Scaled and shifted in float64 before the one cast, so a row's scale s gives the
    bits a float s gives."""
    cols = torch.arange(width, dtype=torch.int64, device=row_ids.device)[None, :]
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device=row_ids.device, dtype=torch.float64)[:, None]
    values = standard_normal(seed, stream, row_ids.to(torch.int64)[:, None], cols) * scale
    return (mean + values if mean else values).to(dtype)


def normal_matrix_bytes(rows: int, width: int) -> int:
    """Peak working bytes of ``normal_matrix`` for [rows, width], its result excluded."""
    return NORMAL_WORKING_ARRAYS * rows * width * 8
