"""The gold: float64 logits and logsumexp from the same (bf16 or fp32) inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.backend import (
    MEGATRON_MERGE_OPS,
    SEGMENT_PARTIALS_OPS,
    ShardPartials,
    gather_target_logit,
    megatron_merge,
    register_backend,
    segment_partials,
)
from kernels.capability import ImplementationKind, LogprobBackendCapability
from kernels.contract import EXECUTION_DTYPE_NAMES, DeterminismScope, MergeOrder
from kernels.provenance import NodeProvenance, observe
from kernels.sharding import ShardingSpec
from kernels.validation import dtype_name


@register_backend(
    "reference",
    kernels={"matmul": {"aten::mm"}, "logprob": SEGMENT_PARTIALS_OPS, "tp_merge": MEGATRON_MERGE_OPS},
    # float64 partials and outputs: the gold, never a stand-in for an fp32 contract.
    capability=LogprobBackendCapability(
        implementation_kind=ImplementationKind.REFERENCE,
        dtypes=frozenset(EXECUTION_DTYPE_NAMES),
        determinism_scopes=frozenset({DeterminismScope.FIXED_TOPOLOGY}),
        merge_orders=frozenset({MergeOrder.RANK_SHARD}),
        partial_dtype=dtype_name(torch.float64),
        output_dtype=dtype_name(torch.float64),
    ),
)
class ReferenceBackend:
    id: str

    def matmul(self, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, NodeProvenance]:
        logits = torch.ops.aten.mm.default(hidden.double(), weight.double().T)
        return logits, observe("matmul", self.id, logits)

    def shard_partials(
        self, logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor, sharding: ShardingSpec
    ) -> tuple[ShardPartials, NodeProvenance]:
        x = logits.double()
        m, s = segment_partials(x)
        partials = ShardPartials(m[:, None], s[:, None], gather_target_logit(x, local_targets, owned), owned)
        return partials, observe("logprob", self.id, s)

    def merge(self, partials: Sequence[ShardPartials]) -> tuple[torch.Tensor, NodeProvenance]:
        lse = megatron_merge(partials)
        return lse, observe("tp_merge", self.id, lse)
