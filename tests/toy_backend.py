"""A backend of a user's own, in one module: what docs/extending.md walks through, run end to end by
tests/test_extending.py from a profile in tests/toy_conf/ given with ``--config-dir``.

It computes the lm_head logprob the plain way (fp32 partials per vocab tile, merged left to right), so it
is accurate and, because its tiles are global, bitwise invariant to layout and tp.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import kernels
from kernels.backend import STOCK_MATMUL_OPS, gather_target_logit, stock_matmul

TILE_OPS = frozenset({"aten::amax", "aten::sum"})


def tile_partials(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x[T, W] (W a multiple of ``tile`` after padding with -inf) -> per-tile (max, sumexp) [T, W / tile]."""
    rows, width = x.shape
    padded = torch.full((rows, -(-width // tile) * tile), float("-inf"), dtype=x.dtype, device=x.device)
    padded[:, :width] = x
    tiles = padded.view(rows, -1, tile)
    maxes = torch.ops.aten.amax.default(tiles, [2])
    safe = torch.where(maxes == float("-inf"), 0.0, maxes)
    sums = torch.ops.aten.sum.dim_IntList(torch.exp(tiles - safe[..., None]), [2])
    return maxes, sums


@kernels.register_backend(
    "toy",
    kernels={"matmul": STOCK_MATMUL_OPS, "logprob": TILE_OPS, "tp_merge": TILE_OPS},
    capability=kernels.LogprobBackendCapability(
        implementation_kind=kernels.ImplementationKind.PRODUCTION,
        dtypes=frozenset(kernels.EXECUTION_DTYPE_NAMES),
        determinism_scopes=frozenset(kernels.DeterminismScope),
        merge_orders=frozenset({kernels.MergeOrder.GLOBAL_TILE}),
        platforms=frozenset({"cpu"}),
        tp_modes=frozenset({"emulated"}),
    ),
)
class ToyBackend:
    id: str

    def matmul(self, hidden: torch.Tensor, weight: torch.Tensor):
        logits = stock_matmul(hidden, weight)
        return logits, kernels.observe("matmul", self.id, logits)

    def shard_partials(self, logits, local_targets, owned, sharding: kernels.ShardingSpec):
        x = logits.float()
        maxes, sums = tile_partials(x, sharding.vocab_tile)
        tiles = sharding.tiles_per_shard[sharding.rank]  # the shard's tiles, padding included
        maxes = torch.cat([maxes, maxes.new_full((x.shape[0], tiles - maxes.shape[1]), float("-inf"))], dim=1)
        sums = torch.cat([sums, sums.new_zeros((x.shape[0], tiles - sums.shape[1]))], dim=1)
        partials = kernels.ShardPartials(maxes, sums, gather_target_logit(x, local_targets, owned), owned)
        return partials, kernels.observe("logprob", self.id, sums)

    def merge(self, partials: Sequence[kernels.ShardPartials]):
        maxes = torch.cat([p.maxes for p in partials], dim=1)
        sums = torch.cat([p.sumexps for p in partials], dim=1)
        top = torch.ops.aten.amax.default(maxes, [1])  # exact in any order
        safe = torch.where(top == float("-inf"), 0.0, top)
        total = torch.zeros_like(sums[:, 0])
        for tile in range(maxes.shape[1]):  # left to right over the global tiles: the same sum for every tp
            total = total + sums[:, tile] * torch.exp(maxes[:, tile] - safe)
        lse = top + torch.log(total)
        return lse, kernels.observe("tp_merge", self.id, lse)
