"""Stock PyTorch: matmul in the execution dtype, fp32 log_softmax + gather, Megatron-style TP."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.backend import (
    ShardPartials,
    gather_target_logit,
    megatron_merge,
    register_backend,
    segment_partials,
    stock_matmul,
)
from kernels.provenance import NodeProvenance, observe
from kernels.sharding import ShardingSpec


@register_backend("aten")
class AtenBackend:
    id: str

    def matmul(self, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, NodeProvenance]:
        logits = stock_matmul(hidden, weight)
        return logits, observe("matmul", self.id, "aten.mm", logits, tf32=False)

    def shard_partials(
        self, logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor, sharding: ShardingSpec
    ) -> tuple[ShardPartials, NodeProvenance]:
        x = logits.float()
        m, s = segment_partials(x)
        tgt = gather_target_logit(x, local_targets, owned)
        partials = ShardPartials(m[:, None], s[:, None], tgt, owned)
        return partials, observe("logprob", self.id, "aten.shard_max_sumexp", s, segments="per_shard")

    def merge(self, partials: Sequence[ShardPartials]) -> tuple[torch.Tensor, NodeProvenance]:
        lse = megatron_merge(partials)
        return lse, observe("tp_merge", self.id, "aten.megatron_max_sum", lse)

    def full_vocab_logprob(
        self, logits: torch.Tensor, safe_targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, NodeProvenance]:
        """TP=1 as a user writes it: fp32 log_softmax, gather, and torch.logsumexp for lse."""
        x = logits.float()
        logp = torch.log_softmax(x, dim=-1).gather(1, safe_targets[:, None]).squeeze(1)
        lse = torch.logsumexp(x, dim=-1)
        return logp, lse, observe("logprob", self.id, "aten.log_softmax_gather", logp)
