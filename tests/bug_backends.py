"""Realistic kernel bugs, each a few changed lines of the correct toy backend (tests/toy_backend.py): the negative
controls of verdict power (tests/test_verdict_power.py). Every one registers as ``bug_<name>`` and claims what the
correct backend claims, bitwise tp invariance included, as a backend with the bug would.

The classes of docs/contract.md#verdict-power: (a) a hair-wide temperature, (b) a cross-rank sum in bf16, (c)
padding columns in the reduction, (d) no max subtraction, (e) a bug on one token in fifty, (f) a per-rank fold in a
backend that claims bitwise tp invariance, (g) a matmul of lower precision and a dropped partial tile.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from toy_backend import TILE_OPS, ToyBackend, tile_partials

import kernels
from kernels.backend import STOCK_MATMUL_OPS, gather_target_logit, stock_matmul

TEMPERATURE_ERROR = 1e-4  # (a): logits divided by 1 + this
TF32_MANTISSA_BITS = 10  # (g): what a TF32 accumulator keeps of fp32's 23


def register(name: str):
    return kernels.register_backend(
        f"bug_{name}",
        kernels={"matmul": STOCK_MATMUL_OPS, "logprob": TILE_OPS, "tp_merge": TILE_OPS},
        capability=kernels.BACKENDS["toy"].capability,
        replace=True,
    )


def padded_partials(x: torch.Tensor, sharding: kernels.ShardingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The toy backend's per-tile partials of a shard, its padding tiles as the identity (-inf, 0)."""
    maxes, sums = tile_partials(x, sharding.vocab_tile)
    tiles = sharding.tiles_per_shard[sharding.rank]
    maxes = torch.cat([maxes, maxes.new_full((x.shape[0], tiles - maxes.shape[1]), float("-inf"))], dim=1)
    sums = torch.cat([sums, sums.new_zeros((x.shape[0], tiles - sums.shape[1]))], dim=1)
    return maxes, sums


class PartialsBug(ToyBackend):
    """The toy backend with ``reduced`` (the logits its partials are taken of) and ``target_logit`` as the places a
    bug may sit."""

    def reduced(self, x: torch.Tensor, sharding: kernels.ShardingSpec) -> torch.Tensor:
        return x

    def target_logit(self, x, local_targets, owned, sharding):
        return gather_target_logit(x, local_targets, owned)

    def shard_partials(self, logits, local_targets, owned, sharding: kernels.ShardingSpec):
        x = self.reduced(logits.float(), sharding)
        maxes, sums = padded_partials(x, sharding)
        partials = kernels.ShardPartials(maxes, sums, self.target_logit(x, local_targets, owned, sharding), owned)
        return partials, kernels.observe("logprob", self.id, sums)


@register("temperature")
class Temperature(PartialsBug):
    """(a) logits divided by (1 + 1e-4) before the softmax: a temperature off by a hair."""

    def reduced(self, x, sharding):
        return x / (1 + TEMPERATURE_ERROR)


@register("scaled_matmul")
class ScaledMatmul(ToyBackend):
    """(a) the same scale in the matmul's epilogue, before its output is rounded to bf16."""

    def matmul(self, hidden, weight):
        wide = torch.ops.aten.mm.default(hidden.float(), weight.float().T)
        logits = (wide / (1 + TEMPERATURE_ERROR)).to(hidden.dtype)
        return logits, kernels.observe("matmul", self.id, logits)


@register("bf16_allreduce")
class Bf16AllReduce(ToyBackend):
    """(b) every rank folds its tiles in fp32, and the ranks' sums are all-reduced in bf16."""

    def merge(self, partials: Sequence[kernels.ShardPartials]):
        maxes = torch.cat([p.maxes for p in partials], dim=1)
        top = torch.ops.aten.amax.default(maxes, [1])
        safe = torch.where(top == float("-inf"), 0.0, top)
        total = torch.zeros_like(top)
        for part in partials:
            rank_sum = torch.ops.aten.sum.dim_IntList(part.sumexps * torch.exp(part.maxes - safe[:, None]), [1])
            total = total + (rank_sum.to(torch.bfloat16).float() if len(partials) > 1 else rank_sum)
        lse = top + torch.log(total)
        return lse, kernels.observe("tp_merge", self.id, lse)


@register("padding_zero")
class PaddingZero(PartialsBug):
    """(c) the shard padded to whole tiles with logit 0 instead of -inf: padding columns join the sum."""

    def reduced(self, x, sharding):
        width = sharding.tiles_per_shard[sharding.rank] * sharding.vocab_tile
        return torch.cat([x, x.new_zeros((x.shape[0], width - x.shape[1]))], dim=1)


@register("no_max")
class NoMax(ToyBackend):
    """(d) a log-sum-exp without max subtraction: exp of the raw logits, which overflows past ~88.7 in fp32."""

    def shard_partials(self, logits, local_targets, owned, sharding):
        x = logits.float()
        maxes, sums = padded_partials(x, sharding)
        live = maxes > float("-inf")
        raw = torch.where(live, sums * torch.exp(torch.where(live, maxes, 0.0)), 0.0)  # sum exp(x), no shift
        zeros = torch.where(live, 0.0, float("-inf"))
        partials = kernels.ShardPartials(zeros, raw, gather_target_logit(x, local_targets, owned), owned)
        return partials, kernels.observe("logprob", self.id, raw)


@register("boundary_target")
class BoundaryTarget(PartialsBug):
    """(e) a target on the first column of a tile read from the column before it (an off-by-one at tile edges)."""

    def target_logit(self, x, local_targets, owned, sharding):
        edge = (local_targets % sharding.vocab_tile == 0) & (local_targets > 0)
        return gather_target_logit(x, torch.where(edge, local_targets - 1, local_targets), owned)


@register("last_row")
class LastRow(ToyBackend):
    """(e) the last row of an odd-sized call merged without its last tile (a partial row block dropped)."""

    def merge(self, partials):
        lse, record = super().merge(partials)
        if lse.shape[0] % 2:
            dropped = [kernels.ShardPartials(p.maxes.clone(), p.sumexps.clone(), p.target_logit, p.owned)
                       for p in partials]  # fmt: skip
            dropped[-1].sumexps[-1, -1] = 0.0
            lse = lse.clone()
            lse[-1] = super().merge(dropped)[0][-1]
        return lse, record


@register("rank_fold")
class RankFold(ToyBackend):
    """(f) each rank folds its own tiles first, then the ranks are merged: the sum's order changes with tp by less
    than an ulp of lse, in a backend that claims bitwise tp invariance."""

    def merge(self, partials):
        top = torch.ops.aten.amax.default(torch.cat([p.maxes for p in partials], dim=1), [1])
        safe = torch.where(top == float("-inf"), 0.0, top)
        total = torch.zeros_like(top)
        for part in partials:
            rank_sum = torch.zeros_like(top)
            for tile in range(part.maxes.shape[1]):
                rank_sum = rank_sum + part.sumexps[:, tile] * torch.exp(part.maxes[:, tile] - safe)
            total = total + rank_sum
        lse = top + torch.log(total)
        return lse, kernels.observe("tp_merge", self.id, lse)


@register("tf32")
class Tf32Matmul(ToyBackend):
    """(g) the fp32 accumulator kept at TF32's 10 mantissa bits before the bf16 output is rounded."""

    def matmul(self, hidden, weight):
        wide = torch.ops.aten.mm.default(hidden.float(), weight.float().T)
        drop = 23 - TF32_MANTISSA_BITS
        bits = wide.view(torch.int32)
        rounded = ((bits + (1 << (drop - 1)) - 1 + ((bits >> drop) & 1)) >> drop) << drop  # to nearest, ties even
        logits = rounded.view(torch.float32).to(hidden.dtype)
        return logits, kernels.observe("matmul", self.id, logits)


@register("partial_tile")
class PartialTile(ToyBackend):
    """(g) a matmul in blocks of 256 vocab columns that never computes the last, partial block (left at 0)."""

    def matmul(self, hidden, weight):
        logits = stock_matmul(hidden, weight)
        whole = logits.shape[1] // 256 * 256
        logits = logits.clone()
        logits[:, whole:] = 0
        return logits, kernels.observe("matmul", self.id, logits)


BUGS = ("temperature", "scaled_matmul", "bf16_allreduce", "padding_zero", "no_max", "boundary_target", "last_row",
        "rank_fold", "tf32", "partial_tile")  # fmt: skip
