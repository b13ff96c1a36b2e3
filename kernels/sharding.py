"""Vocab-parallel sharding: the padded vocab split into contiguous shards of whole tiles."""

from __future__ import annotations

from dataclasses import dataclass

from kernels.errors import TPConfigError


def padded_vocab_size(vocab_size: int, vocab_tile: int, world_size: int) -> int:
    """Smallest multiple of ``vocab_tile * world_size`` that is >= ``vocab_size``."""
    check_tile_geometry(vocab_size, vocab_tile, world_size)
    quantum = vocab_tile * world_size
    return -(-vocab_size // quantum) * quantum


def check_tile_geometry(vocab_size: int, vocab_tile: int, world_size: int) -> None:
    """Raise TPConfigError unless vocab, tile and TP degree describe a servable split."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise TPConfigError(f"tp must be an integer >= 1, got {world_size!r}")
    if not isinstance(vocab_tile, int) or vocab_tile < 16 or vocab_tile & (vocab_tile - 1):
        raise TPConfigError(f"vocab_tile must be a power of two >= 16, got {vocab_tile!r}")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise TPConfigError(f"vocab size must be an integer >= 1, got {vocab_size!r}")


@dataclass(frozen=True)
class ShardingSpec:
    """One rank's view of a vocab split: ``bounds[r] = (lo, hi)`` columns of the padded vocab."""

    rank: int
    world_size: int
    vocab_size: int
    padded_vocab_size: int
    vocab_tile: int
    bounds: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        check_tile_geometry(self.vocab_size, self.vocab_tile, self.world_size)
        if not 0 <= self.rank < self.world_size:
            raise TPConfigError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
        if self.padded_vocab_size < self.vocab_size or self.padded_vocab_size % self.vocab_tile:
            raise TPConfigError(
                f"padded_vocab_size must be a multiple of vocab_tile={self.vocab_tile} that is "
                f">= vocab_size={self.vocab_size}, got {self.padded_vocab_size!r}"
            )
        if len(self.bounds) != self.world_size:
            raise TPConfigError(f"bounds must hold one (lo, hi) per rank ({self.world_size}), got {self.bounds!r}")
        expected_lo = 0
        for r, (lo, hi) in enumerate(self.bounds):
            if lo != expected_lo or hi <= lo or lo % self.vocab_tile or hi % self.vocab_tile:
                raise TPConfigError(
                    f"bounds must partition [0, {self.padded_vocab_size}) contiguously in whole "
                    f"tiles of {self.vocab_tile}; rank {r} has {(lo, hi)!r}"
                )
            expected_lo = hi
        if expected_lo != self.padded_vocab_size:
            raise TPConfigError(f"bounds end at {expected_lo}, not at padded_vocab_size={self.padded_vocab_size}")

    @classmethod
    def even(cls, vocab_size: int, vocab_tile: int, world_size: int, rank: int = 0) -> ShardingSpec:
        """Equal shards of the padded vocab, the split every built-in backend uses."""
        padded = padded_vocab_size(vocab_size, vocab_tile, world_size)
        width = padded // world_size
        bounds = tuple((r * width, (r + 1) * width) for r in range(world_size))
        return cls(rank, world_size, vocab_size, padded, vocab_tile, bounds)

    def for_rank(self, rank: int) -> ShardingSpec:
        """The same split seen from another rank."""
        return ShardingSpec(
            rank, self.world_size, self.vocab_size, self.padded_vocab_size, self.vocab_tile, self.bounds
        )

    @property
    def shard(self) -> tuple[int, int]:
        """This rank's (lo, hi) in padded-vocab columns."""
        return self.bounds[self.rank]

    @property
    def real_shard(self) -> tuple[int, int]:
        """This rank's (lo, hi) clipped to real vocab columns; lo == hi for an all-padding shard."""
        lo, hi = self.shard
        return min(lo, self.vocab_size), min(hi, self.vocab_size)

    @property
    def tiles_per_shard(self) -> tuple[int, ...]:
        return tuple((hi - lo) // self.vocab_tile for lo, hi in self.bounds)

    def owner_rank(self, token_id: int) -> int:
        """The rank whose shard holds ``token_id``."""
        if not 0 <= token_id < self.vocab_size:
            raise TPConfigError(f"token id {token_id!r} is outside [0, {self.vocab_size})")
        for r, (lo, hi) in enumerate(self.bounds):
            if lo <= token_id < hi:
                return r
        raise AssertionError("bounds cover the padded vocab")  # unreachable after validation
