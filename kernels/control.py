"""Negative control: deliberately layout-variant, so a harness that misses it is blind.

Its vocab split count follows the number of rows in the call, cycling through 1..SPLIT_CYCLE, and each split's
sumexp is kept to 16 mantissa bits before the merge, so two calls whose row counts differ by less than SPLIT_CYCLE
(a 1-row call and a 64-row one, a batch of 445 rows and the same with 64 filler rows) give different bits in most
rows.
(An fp32 reorder alone hides below the ulp of an lse near 16; 2**-17 relative per split does not,
and stays well inside the fp32 accuracy row.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.backend import (
    MEGATRON_MERGE_OPS,
    SEGMENT_PARTIALS_OPS,
    STOCK_MATMUL_OPS,
    ShardPartials,
    gather_target_logit,
    megatron_merge,
    register_backend,
    segment_partials,
    stock_matmul,
)
from kernels.capability import ImplementationKind, LogprobBackendCapability
from kernels.contract import EXECUTION_DTYPE_NAMES, DeterminismScope, MergeOrder
from kernels.provenance import NodeProvenance, observe
from kernels.sharding import ShardingSpec

SPLIT_CYCLE = 61  # prime: needles of 1, 7, 64 and 257 filler rows all move a call's count off its cycle position
KEPT_MANTISSA_BITS = 16


def split_count(rows: int) -> int:
    """The layout-dependent choice that makes this backend variant: 1 + (rows - 1) mod SPLIT_CYCLE. A cap instead
    would make every call past it split alike, blind to batch size exactly where batches are large."""
    return 1 + (max(rows, 1) - 1) % SPLIT_CYCLE


def keep_mantissa_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round to ``bits`` mantissa bits (relative error <= 2**-(bits + 1))."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2**bits) / 2**bits, exponent)


@register_backend(
    "control",
    kernels={"matmul": STOCK_MATMUL_OPS, "logprob": SEGMENT_PARTIALS_OPS, "tp_merge": MEGATRON_MERGE_OPS},
    # Its split count is a function of the row count only, so a repeated call repeats its bits
    # (fixed_topology holds); it changes with the call layout and tp, which is the point of it.
    capability=LogprobBackendCapability(
        implementation_kind=ImplementationKind.NEGATIVE_CONTROL,
        dtypes=frozenset(EXECUTION_DTYPE_NAMES),
        determinism_scopes=frozenset({DeterminismScope.FIXED_TOPOLOGY}),
        merge_orders=frozenset({MergeOrder.RANK_SHARD}),
    ),
)
class ControlBackend:
    id: str

    def matmul(self, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, NodeProvenance]:
        logits = stock_matmul(hidden, weight)  # the variance under test is in the logprob node only
        return logits, observe("matmul", self.id, logits, tf32=False)

    def shard_partials(
        self, logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor, sharding: ShardingSpec
    ) -> tuple[ShardPartials, NodeProvenance]:
        x = logits.float()
        splits = split_count(x.shape[0])
        pairs = [segment_partials(chunk) for chunk in torch.tensor_split(x, splits, dim=1)]
        maxes = torch.stack([m for m, _ in pairs], dim=1)
        sums = keep_mantissa_bits(torch.stack([s for _, s in pairs], dim=1), KEPT_MANTISSA_BITS)
        partials = ShardPartials(maxes, sums, gather_target_logit(x, local_targets, owned), owned)
        return partials, observe("logprob", self.id, sums, splits=splits)

    def merge(self, partials: Sequence[ShardPartials]) -> tuple[torch.Tensor, NodeProvenance]:
        lse = megatron_merge(partials)
        return lse, observe("tp_merge", self.id, lse)
