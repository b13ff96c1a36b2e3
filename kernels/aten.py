"""Stock PyTorch: matmul in the execution dtype, fp32 log_softmax + gather, Megatron-style TP."""

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


@register_backend(
    "aten",
    kernels={
        "matmul": STOCK_MATMUL_OPS,
        # tp = 1 is one call (logits_logprob), recorded for both nodes: log_softmax and logsumexp.
        "logprob": SEGMENT_PARTIALS_OPS | {"aten::log_softmax", "aten::logsumexp"},
        "tp_merge": MEGATRON_MERGE_OPS | {"aten::log_softmax", "aten::logsumexp"},
    },
    # Megatron-style per-shard (max, sumexp): the grouping of the vocab sum changes with tp.
    capability=LogprobBackendCapability(
        implementation_kind=ImplementationKind.PRODUCTION,
        dtypes=frozenset(EXECUTION_DTYPE_NAMES),
        determinism_scopes=frozenset({DeterminismScope.FIXED_TOPOLOGY}),
        merge_orders=frozenset({MergeOrder.RANK_SHARD}),
    ),
)
class AtenBackend:
    id: str

    def matmul(self, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, NodeProvenance]:
        logits = stock_matmul(hidden, weight)
        return logits, observe("matmul", self.id, logits, tf32=False)

    def shard_partials(
        self, logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor, sharding: ShardingSpec
    ) -> tuple[ShardPartials, NodeProvenance]:
        x = logits.float()
        m, s = segment_partials(x)
        tgt = gather_target_logit(x, local_targets, owned)
        partials = ShardPartials(m[:, None], s[:, None], tgt, owned)
        return partials, observe("logprob", self.id, s, segments="per_shard")

    def merge(self, partials: Sequence[ShardPartials]) -> tuple[torch.Tensor, NodeProvenance]:
        lse = megatron_merge(partials)
        return lse, observe("tp_merge", self.id, lse)

    # TP = 1 as a user writes it (the trainer's recipe, kernels.recipes): one call, both outputs.
    def logits_logprob(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits[T, V] -> fp32 log_softmax then gather for logp, torch.logsumexp for lse."""
        x = logits.float()
        logp = torch.log_softmax(x, -1).gather(1, targets[:, None]).squeeze(1)
        return logp, torch.logsumexp(x, -1)
