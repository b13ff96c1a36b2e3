"""The typed logprob contract: what a call must compute, checked before any backend is chosen.

A contract describes one logical lm_head logprob call (vocab split, inactive rows, reduction,
outputs, execution dtype, platform); it holds no tensors. Every field is validated at
construction and a bad value raises ``LogprobContractError`` naming the field and the value.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from enum import Enum, StrEnum
from typing import Any, TypeVar

import torch

from kernels.errors import KernelInputError
from kernels.sharding import MIN_VOCAB_TILE, ShardingSpec
from kernels.validation import EXECUTION_DTYPES, IGNORE_INDEX, dtype_name

PLATFORMS = ("cpu", "cuda")
# How the ranks of a tp > 1 call run: one after another in the caller, or as torch.distributed processes.
TP_MODES = ("emulated", "distributed")
EXECUTION_DTYPE_NAMES = tuple(dtype_name(d) for d in EXECUTION_DTYPES)
FLOAT_RESULT_DTYPE_NAMES = tuple(dtype_name(d) for d in (torch.float32, torch.float64))
TRANSPORTS = ("all_gather",)


class LogprobContractError(KernelInputError):
    """A contract field with a value no call can honour; the message names the field and the value."""


class MaskMode(StrEnum):
    """How a call marks the rows that take no part in the loss."""

    IGNORE_INDEX = "ignore_index"  # inactive rows hold the sentinel target id
    ACTIVE_MASK = "active_mask"  # a separate boolean mask; inactive targets may hold any value


class DeterminismScope(StrEnum):
    """Which bitwise promise the reduction keeps.

    FIXED_TOPOLOGY: the same inputs, call layout and TP degree give the same bits, run after run.
    CROSS_TP_BITWISE: additionally, every TP degree gives the same bits as TP=1.
    """

    FIXED_TOPOLOGY = "fixed_topology"
    CROSS_TP_BITWISE = "cross_tp_bitwise"


class MergeOrder(StrEnum):
    """The structure of the partials the TP merge combines."""

    GLOBAL_TILE = "global_tile"  # one partial per vocab_tile of the whole vocab, merged the same for every grouping
    RANK_SHARD = "rank_shard"  # one partial (or a backend-chosen split) per rank, merged Megatron-style


E = TypeVar("E", bound=Enum)


def parse_choice(field_name: str, value: Any, vocabulary: type[E]) -> E:
    """``value`` (a member or its string) as a member of ``vocabulary``, or a LogprobContractError."""
    try:
        return vocabulary(value)
    except ValueError:
        valid = ", ".join(m.value for m in vocabulary)
        raise LogprobContractError(f"{field_name} must be one of {valid}; got {value!r}") from None


def parse_name(field_name: str, value: Any, valid: tuple[str, ...]) -> str:
    """A dtype or platform given as a string or ``torch.dtype``, normalized to its name."""
    name = dtype_name(value) if isinstance(value, torch.dtype) else value
    if name not in valid:
        raise LogprobContractError(f"{field_name} must be one of {', '.join(valid)}; got {value!r}")
    return name


def check_bool(field_name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise LogprobContractError(f"{field_name} must be a bool; got {value!r}")


@dataclass(frozen=True)
class MaskSpec:
    """How inactive rows of targets[T] are marked; ``ignore_index`` is None in ACTIVE_MASK mode."""

    mode: MaskMode = MaskMode.IGNORE_INDEX
    ignore_index: int | None = IGNORE_INDEX

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", parse_choice("mask.mode", self.mode, MaskMode))
        if self.mode is MaskMode.ACTIVE_MASK:
            if self.ignore_index is not None:
                # Two sources of truth for one row's activity would disagree sooner or later.
                raise LogprobContractError(
                    f"mask.ignore_index must be None in active_mask mode; got {self.ignore_index!r}"
                )
            return
        if not isinstance(self.ignore_index, int) or isinstance(self.ignore_index, bool) or self.ignore_index >= 0:
            # A non-negative sentinel could be a real token id.
            raise LogprobContractError(
                f"mask.ignore_index must be a negative int in ignore_index mode; got {self.ignore_index!r}"
            )


@dataclass(frozen=True)
class ReductionSpec:
    """How per-shard logits[T, Vshard] become lse[T]: partial dtype, transport, merge order, tile."""

    vocab_tile: int
    determinism_scope: DeterminismScope = DeterminismScope.CROSS_TP_BITWISE
    merge_order: MergeOrder = MergeOrder.GLOBAL_TILE
    partial_dtype: str = "float32"
    transport: str = "all_gather"

    def __post_init__(self) -> None:
        if (
            not isinstance(self.vocab_tile, int)
            or self.vocab_tile < MIN_VOCAB_TILE
            or self.vocab_tile & (self.vocab_tile - 1)
        ):
            raise LogprobContractError(
                f"reduction.vocab_tile must be a power of two >= {MIN_VOCAB_TILE}; got {self.vocab_tile!r}"
            )
        scope = parse_choice("reduction.determinism_scope", self.determinism_scope, DeterminismScope)
        order = parse_choice("reduction.merge_order", self.merge_order, MergeOrder)
        object.__setattr__(self, "determinism_scope", scope)
        object.__setattr__(self, "merge_order", order)
        partial = parse_name("reduction.partial_dtype", self.partial_dtype, FLOAT_RESULT_DTYPE_NAMES)
        object.__setattr__(self, "partial_dtype", partial)
        if self.transport not in TRANSPORTS:
            raise LogprobContractError(
                f"reduction.transport must be one of {', '.join(TRANSPORTS)}; got {self.transport!r}"
            )
        if scope is DeterminismScope.CROSS_TP_BITWISE and order is not MergeOrder.GLOBAL_TILE:
            # Per-shard sums group the vocab differently for each TP degree, so their bits differ.
            raise LogprobContractError(
                f"reduction.merge_order must be global_tile for cross_tp_bitwise; got {order.value!r}"
            )


@dataclass(frozen=True)
class LogprobOutputSpec:
    """logp[T] and lse[T] in ``dtype``, replicated on every rank; ``export_lse`` asks for lse too."""

    dtype: str = "float32"
    export_lse: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_name("output.dtype", self.dtype, FLOAT_RESULT_DTYPE_NAMES))
        check_bool("output.export_lse", self.export_lse)


@dataclass(frozen=True)
class LogprobContract:
    """One logical logprob call: hidden[T, H] in ``dtype`` on ``platform``, vocab split by ``sharding``."""

    sharding: ShardingSpec
    reduction: ReductionSpec
    dtype: str
    platform: str
    mask: MaskSpec = field(default_factory=MaskSpec)
    output: LogprobOutputSpec = field(default_factory=LogprobOutputSpec)

    def __post_init__(self) -> None:
        for name, kind in (
            ("sharding", ShardingSpec),
            ("reduction", ReductionSpec),
            ("mask", MaskSpec),
            ("output", LogprobOutputSpec),
        ):
            if not isinstance(getattr(self, name), kind):
                raise LogprobContractError(f"{name} must be a {kind.__name__}; got {getattr(self, name)!r}")
        object.__setattr__(self, "dtype", parse_name("dtype", self.dtype, EXECUTION_DTYPE_NAMES))
        object.__setattr__(self, "platform", parse_name("platform", self.platform, PLATFORMS))
        if self.reduction.vocab_tile != self.sharding.vocab_tile:
            raise LogprobContractError(
                f"reduction.vocab_tile={self.reduction.vocab_tile!r} differs from "
                f"sharding.vocab_tile={self.sharding.vocab_tile!r}; shards are made of whole reduction tiles"
            )

    @classmethod
    def even(
        cls,
        vocab_size: int,
        vocab_tile: int,
        tp: int,
        *,
        dtype: str | torch.dtype,
        platform: str,
        rank: int = 0,
        determinism_scope: DeterminismScope | str = DeterminismScope.CROSS_TP_BITWISE,
        merge_order: MergeOrder | str = MergeOrder.GLOBAL_TILE,
        partial_dtype: str | torch.dtype = "float32",
        **specs: Any,
    ) -> LogprobContract:
        """The contract of an even vocab split, as ``kernels.lm_head_logprob`` runs it."""
        sharding = ShardingSpec.even(vocab_size, vocab_tile, tp, rank)
        reduction = ReductionSpec(vocab_tile, determinism_scope, merge_order, partial_dtype)
        return cls(sharding, reduction, dtype, platform, **specs)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (enums as their strings, bounds as lists)."""
        return json.loads(json.dumps(asdict(self)))

    def cross_rank_fingerprint(self) -> str:
        """sha256 of every field except the rank, so all ranks of one call agree on it."""
        payload = self.to_dict()
        del payload["sharding"]["rank"]
        return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
