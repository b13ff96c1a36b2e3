"""The backward of the lm_head logprob for backends whose forward runs kernels autograd cannot see (Triton).

With p = softmax(logits) and, per row, g_logp and g_lse the upstream gradients of logp and lse:
d logits = g_logp * (onehot(target) - p) + g_lse * p, zero on inactive rows' logp part (their logp is the
constant 0). Then d hidden = d logits @ weight and d weight = d logits.T @ hidden.

Nothing [T, V] is kept from the forward: the backward recomputes the logits one global vocab tile at a time with
the backend's own matmul (the forward's bits), and walks the tiles of every rank in global tile order, the
padding tiles skipped. d hidden is one fp32 accumulator carried from tile to tile and from rank to rank, so a
row's d hidden is the same sum in the same order whatever the call's other rows and whatever the tp degree;
each rank's d weight rows are its own tiles' products, summed over the call's rows in row order, so they do not
change with tp. The products run through the backend's ``gradient_matmul`` (for Triton: the invariant matmul in
fp32), so no row's bits depend on where it sits in the call (docs/kernels.md, "Gradients").
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.backend import LogprobBackend
from kernels.sharding import ShardingSpec
from kernels.validation import IGNORE_INDEX


class TiledLogprobBackward(torch.autograd.Function):
    """Attach the tiled backward to a forward computed without autograd (logp[T], lse[T] given)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        logp: torch.Tensor,
        lse: torch.Tensor,
        targets: torch.Tensor,
        impl: LogprobBackend,
        sharding: ShardingSpec,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.impl, ctx.sharding = impl, sharding
        return logp.clone(), lse.clone()

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_lse: torch.Tensor | None):
        hidden, weight, targets, lse = ctx.saved_tensors
        d_hidden, d_weight = tiled_gradients(ctx.impl, hidden, weight, targets, lse, g_logp, g_lse, ctx.sharding)
        return (
            d_hidden if ctx.needs_input_grad[0] else None,
            d_weight if ctx.needs_input_grad[1] else None,
            None, None, None, None, None,
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
    """(d hidden [T, H], d weight [V, H]) in the inputs' dtypes, accumulated in fp32 in global tile order."""
    rows = hidden.shape[0]
    active = targets != IGNORE_INDEX
    zero = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
    g_logp = zero if g_logp is None else torch.where(active, g_logp.float(), zero)
    g_lse = zero if g_lse is None else g_lse.float()
    scale = g_lse - g_logp  # d logits = g_logp * onehot + (g_lse - g_logp) * p
    hidden_fp32 = hidden.detach().float()
    d_hidden = torch.zeros((rows, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    tile = sharding.vocab_tile
    for rank in range(sharding.world_size):
        lo, hi = sharding.for_rank(rank).real_shard
        for start in range(lo, hi, tile):  # this rank's real tiles, in global order; padding tiles add nothing
            stop = min(start + tile, hi)
            w_tile = weight.detach()[start:stop]
            logits, _ = impl.matmul(hidden.detach(), w_tile)  # the forward's logits of this tile, bit for bit
            d_logits = scale[:, None] * torch.exp(logits.float() - lse[:, None])
            owned = active & (targets >= start) & (targets < stop)
            columns = torch.where(owned, targets - start, 0)
            d_logits.scatter_add_(1, columns[:, None], torch.where(owned, g_logp, zero)[:, None])
            d_hidden = d_hidden + impl.gradient_matmul(d_logits, w_tile.float().T)
            d_weight[start:stop] = impl.gradient_matmul(d_logits.T, hidden_fp32.T)
    return d_hidden.to(hidden.dtype), d_weight.to(weight.dtype)
