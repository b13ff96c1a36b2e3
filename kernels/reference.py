"""The gold: float64 logits and logsumexp from the same (bf16 or fp32) inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.backend import (
    ShardPartials,
    gather_target_logit,
    megatron_merge,
    register_backend,
    segment_partials,
)
from kernels.provenance import NodeProvenance, observe
from kernels.sharding import ShardingSpec


@register_backend("reference")
class ReferenceBackend:
    id: str

    def matmul(self, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, NodeProvenance]:
        logits = hidden.double() @ weight.double().T
        return logits, observe("matmul", self.id, "reference.mm_float64", logits)

    def shard_partials(
        self, logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor, sharding: ShardingSpec
    ) -> tuple[ShardPartials, NodeProvenance]:
        x = logits.double()
        m, s = segment_partials(x)
        partials = ShardPartials(m[:, None], s[:, None], gather_target_logit(x, local_targets, owned), owned)
        return partials, observe("logprob", self.id, "reference.max_sumexp_float64", s)

    def merge(self, partials: Sequence[ShardPartials]) -> tuple[torch.Tensor, NodeProvenance]:
        lse = megatron_merge(partials)
        return lse, observe("tp_merge", self.id, "reference.merge_float64", lse)
