"""The backward of the lm_head logprob for backends whose forward runs kernels autograd cannot see (Triton).

With p = softmax(logits) and, per row, g_logp and g_lse the upstream gradients of logp and lse:
d logits = g_logp * onehot(target) + (g_lse - g_logp) * p, with g_logp taken as 0 on inactive rows (their logp
is the constant 0). Then d hidden = d logits @ weight and d weight = d logits.T @ hidden.

Nothing [T, V] is kept from the forward: each rank's backend (``shard_gradients``) recomputes its shard's logits
a chunk of whole vocab tiles at a time, rounds d logits to the inputs' dtype, and multiplies. d hidden is one
fp32 accumulator carried from chunk to chunk and from rank to rank in global vocab order, so a row's d hidden is
the same sum in the same order whatever the call's other rows and whatever the tp degree; each rank's d weight
rows are its own columns' products, summed over the call's rows in row order, so they do not change with tp
(docs/kernels.md, "Gradients").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.backend import LogprobBackend
from kernels.ranks import shard_targets
from kernels.sharding import ShardingSpec
from kernels.validation import IGNORE_INDEX


@dataclass(frozen=True)
class Upstream:
    """Per-row fp32 coefficients of d logits = g_target * onehot(target) + scale * p."""

    g_target: torch.Tensor  # [T] g_logp, 0 on inactive rows
    scale: torch.Tensor  # [T] g_lse - g_target

    @classmethod
    def of(cls, targets: torch.Tensor, g_logp: torch.Tensor | None, g_lse: torch.Tensor | None) -> Upstream:
        """From autograd's upstream gradients of logp and lse (None: zero)."""
        zero = torch.zeros(targets.shape[0], dtype=torch.float32, device=targets.device)
        g_target = zero if g_logp is None else torch.where(targets != IGNORE_INDEX, g_logp.float(), zero)
        g_lse = zero if g_lse is None else g_lse.float()
        return cls(g_target, g_lse - g_target)


def has_tiled_backward(impl: LogprobBackend) -> bool:
    """Whether ``impl`` runs kernels autograd cannot see and supplies ``shard_gradients`` for them (the Triton
    backends); the others are torch operators, which autograd differentiates in the emulated mode only."""
    return hasattr(impl, "shard_gradients")


class TiledLogprobBackward(torch.autograd.Function):
    """Attach a backward to a forward computed without autograd (logp[T], lse[T] given): ``gradients(hidden,
    weight, targets, lse, g_logp, g_lse) -> (d hidden, d weight)``, ``tiled_gradients`` bound to a backend and a
    split, or ``kernels.distributed.distributed_gradients`` (the same sums on the rank processes)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        logp: torch.Tensor,
        lse: torch.Tensor,
        targets: torch.Tensor,
        gradients: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.gradients = gradients
        return logp.clone(), lse.clone()

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_lse: torch.Tensor | None):
        if torch.is_grad_enabled():  # create_graph=True: the gradients would carry no graph, so a second one is lost
            raise RuntimeError(
                "lm_head_logprob's tiled backward computes no graph of its own, so it cannot be differentiated "
                "again (create_graph=True): a second derivative through it would be silently zero; use "
                "backend='aten' or 'reference', whose torch ops autograd differentiates twice"
            )
        hidden, weight, targets, lse = ctx.saved_tensors
        d_hidden, d_weight = ctx.gradients(hidden.detach(), weight.detach(), targets, lse, g_logp, g_lse)
        return (
            d_hidden if ctx.needs_input_grad[0] else None,
            d_weight if ctx.needs_input_grad[1] else None,
            None, None, None, None,
        )  # fmt: skip


def tiled_gradients(
    impl: LogprobBackend,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    g_logp: torch.Tensor | None,
    g_lse: torch.Tensor | None,
    sharding: ShardingSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d hidden [T, H], d weight [V, H]) in the inputs' dtypes: every rank's part in this process, in rank order."""
    upstream = Upstream.of(targets, g_logp, g_lse)
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    d_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    for rank in range(sharding.world_size):
        view = sharding.for_rank(rank)
        lo, hi = view.real_shard
        rank_gradients(impl, hidden, weight, targets, lse, upstream, view, d_hidden, d_weight[lo:hi])
    return d_hidden.to(hidden.dtype), d_weight


def rank_gradients(
    impl: LogprobBackend,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    upstream: Upstream,
    sharding: ShardingSpec,
    d_hidden: torch.Tensor,
    d_weight_rows: torch.Tensor,
) -> None:
    """One rank's part: d weight of its real shard's rows, written to ``d_weight_rows`` [real shard, H], and its
    products added to the fp32 ``d_hidden`` [T, H], which must hold the sum of every earlier rank's (an
    all-padding shard adds nothing)."""
    lo, hi = sharding.real_shard
    if hi <= lo:
        return
    owned, local = shard_targets(targets, sharding)
    local = torch.where(owned, local, -1)
    impl.shard_gradients(
        hidden.detach(), weight.detach()[lo:hi], local, lse, upstream.scale, upstream.g_target,
        d_hidden, d_weight_rows, sharding,
    )  # fmt: skip
