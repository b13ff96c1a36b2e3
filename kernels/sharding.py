"""Vocab-parallel sharding: the padded vocab split into contiguous shards of whole tiles."""

from __future__ import annotations

from dataclasses import dataclass

from kernels.errors import TPConfigError

MIN_VOCAB_TILE = 16  # the narrowest vocab tile: tiles are powers of two from here up


def padded_vocab_size(vocab_size: int, vocab_tile: int, world_size: int) -> int:
    """Smallest multiple of ``vocab_tile * world_size`` that is >= ``vocab_size``."""
    check_tile_geometry(vocab_size, vocab_tile, world_size)
    quantum = vocab_tile * world_size
    return -(-vocab_size // quantum) * quantum


def is_integer(value: object) -> bool:
    """An int and not a bool (``True`` is an int to Python, never a size or an index here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_tile_geometry(vocab_size: int, vocab_tile: int, world_size: int) -> None:
    """Raise TPConfigError unless vocab, tile and TP degree describe a servable split."""
    if not is_integer(world_size) or world_size < 1:
        raise TPConfigError(f"tp must be an integer >= 1, got {world_size!r}")
    if not is_integer(vocab_tile) or vocab_tile < MIN_VOCAB_TILE or vocab_tile & (vocab_tile - 1):
        raise TPConfigError(f"vocab_tile must be a power of two >= {MIN_VOCAB_TILE}, got {vocab_tile!r}")
    if not is_integer(vocab_size) or vocab_size < 1:
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
        if not is_integer(self.rank) or not 0 <= self.rank < self.world_size:
            raise TPConfigError(f"rank must be an integer in [0, {self.world_size}), got {self.rank!r}")
        padded = self.padded_vocab_size
        if not is_integer(padded) or padded < self.vocab_size or padded % self.vocab_tile:
            raise TPConfigError(
                f"padded_vocab_size must be an integer multiple of vocab_tile={self.vocab_tile} that is "
                f">= vocab_size={self.vocab_size}, got {self.padded_vocab_size!r}"
            )
        pairs = isinstance(self.bounds, tuple) and all(
            isinstance(pair, tuple) and len(pair) == 2 and all(map(is_integer, pair)) for pair in self.bounds
        )
        if not pairs or len(self.bounds) != self.world_size:
            raise TPConfigError(
                f"bounds must be a tuple of one (lo, hi) integer pair per rank ({self.world_size}), got {self.bounds!r}"
            )
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
        if not is_integer(token_id) or not 0 <= token_id < self.vocab_size:
            raise TPConfigError(f"token id {token_id!r} is not an integer in [0, {self.vocab_size})")
        for r, (lo, hi) in enumerate(self.bounds):
            if lo <= token_id < hi:
                return r
        raise AssertionError("bounds cover the padded vocab")  # unreachable after validation
