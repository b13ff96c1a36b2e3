"""Per-rank work and the merge, shared by both TP modes: what one rank computes, and how all ranks' partials
become the replicated result.

``kernels.lm_head`` runs these in the caller (``tp_mode="emulated"``), ``kernels.distributed`` in rank
processes (``tp_mode="distributed"``); this module imports neither (docs/kernels.md#vocab-parallel-tp).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kernels import recipes
from kernels.backend import LogprobBackend, ShardPartials, WholeVocab
from kernels.errors import InputChangedError, NonFiniteOutputError, ShapeMismatchError, TPConfigError
from kernels.provenance import NodeProvenance, Provenance, across_ranks, call_node
from kernels.sharding import ShardingSpec
from kernels.validation import (
    IGNORE_INDEX,
    ValueChecks,
    changed_since_checked,
    dtype_name,
    explain_target_range,
    out_of_range,
    screen_sum,
)


@dataclass(frozen=True)
class LogprobResult:
    """Per-row outputs of one call, replicated on every rank.

    ``logp``/``lse`` are [T] fp32 (float64 for the reference backend); ``logp`` is 0 where the row
    is inactive (target == ignore_index). ``owner_rank`` [T] is the rank whose shard holds the
    target, -1 for inactive rows.
    """

    logp: torch.Tensor
    lse: torch.Tensor
    active: torch.Tensor
    owner_rank: torch.Tensor
    provenance: Provenance
    logits: torch.Tensor | None = None  # keep_logits: the [T, V] logits the reduction read; None if never stored
    has_lse: bool = True  # False: the backend computes no lse (``capability.exports_lse``), and ``lse`` is NaN


@dataclass(frozen=True)
class RankOutput:
    """What one rank computes before any communication."""

    logits: torch.Tensor | None  # None: a fused backend never materializes them
    partials: ShardPartials | None  # None: the backend reduces the full vocab itself (TP = 1)
    matmul: NodeProvenance | None
    logprob: NodeProvenance | None
    whole: WholeVocab | None = None  # TP = 1 on a backend with ``whole_vocab``: the outputs, already merged
    tp_merge: NodeProvenance | None = None  # the record of that merge
    head_logp: torch.Tensor | None = None  # a fused head's (``head_logprob``) logp: the whole call, no lse


def check_vocab_geometry(impl: LogprobBackend, sharding: ShardingSpec, device: torch.device) -> None:
    """Before any launch: TPConfigError for a tile wider than the backend's kernels can hold on ``device``
    (``max_vocab_tile``), ShapeMismatchError for a padded vocab wider than they can index (``max_vocab_columns``)."""
    limit = impl.max_vocab_tile(device) if hasattr(impl, "max_vocab_tile") else None
    if limit is not None and sharding.vocab_tile > limit:
        raise TPConfigError(
            f"vocab_tile={sharding.vocab_tile} is wider than backend {impl.id!r} can reduce on {device.type}: its "
            f"kernels hold at most {limit} vocab columns per program there; use a power of two in [16, {limit}]"
        )
    columns = getattr(impl, "max_vocab_columns", None)
    if columns is not None and sharding.padded_vocab_size > columns:
        raise ShapeMismatchError(
            f"a vocab of {sharding.vocab_size} columns (padded to {sharding.padded_vocab_size}) is wider than "
            f"backend {impl.id!r} can reduce: its kernels index at most {columns} columns"
        )


def require_finite(
    result: LogprobResult, execution_dtype: torch.dtype, checks: ValueChecks, *, first: Callable[[], None] | None = None
) -> None:
    """Queue in ``checks`` the check that no row's lse or logp is NaN or ±Inf, which finite inputs give only by
    overflow. ``first`` runs before that verdict is explained (a backend that leaves non-finite logits to its
    kernel names a non-finite input there). Every input is checked finite too, so any non-finite output is an
    overflow; [T] is cheap to scan."""
    explain = functools.partial(explain_nonfinite_row, result, execution_dtype, first)
    checks.add_sum(screen_sum(result.lse + result.logp if result.has_lse else result.logp), explain)


def require_status(
    result: LogprobResult,
    whole: WholeVocab,
    targets: torch.Tensor,
    vocab_size: int,
    execution_dtype: torch.dtype,
    checks: ValueChecks,
    *,
    first: Callable[[], None] | None = None,
    deferred: bool = False,
) -> None:
    """Queue the verdict a ``whole_vocab`` kernel wrote itself (``WholeVocab.status``) in place of the target-range
    check and ``require_finite``'s screen: its status words, read with the call's other checks, explained by the
    same errors in the same order (an out-of-range target before a non-finite output). ``deferred``: the caller
    reads ``checks`` after the call returned (``checks=``), so the inputs may have been written since."""
    explain = functools.partial(
        explain_status, whole.status, result, targets, vocab_size, execution_dtype, first, deferred=deferred
    )
    checks.add(whole.status, explain)


def explain_status(
    status: torch.Tensor,
    result: LogprobResult,
    targets: torch.Tensor,
    vocab_size: int,
    execution_dtype: torch.dtype,
    first: Callable[[], None] | None,
    *,
    deferred: bool,
) -> None:
    bits = functools.reduce(operator.or_, status.tolist(), 0)
    if bits & 1:
        bad = out_of_range(targets, vocab_size)
        if bool(bad.any()):
            explain_target_range(targets, bad, vocab_size)
        if deferred:  # the kernel saw a target out of range that is no longer there
            raise InputChangedError(changed_since_checked("targets", "every target is in range now"))
    if bits & 2:
        explain_nonfinite_row(result, execution_dtype, first)
    # A status word is the kernel's own verdict, not a screen that can raise a false alarm: one that nothing explains
    # means the kernel did not compute what the call checked, so its outputs are not returned.
    raise RuntimeError(
        f"the kernel's status words hold {bits:#x} (bit 0: a target out of range, bit 1: a non-finite output), but "
        f"every target is in range and every output finite: its outputs are not to be trusted"
    )


def explain_nonfinite_row(
    result: LogprobResult, execution_dtype: torch.dtype, first: Callable[[], None] | None
) -> None:
    if first is not None:
        first()
    lse_bad = ~torch.isfinite(result.lse) if result.has_lse else torch.zeros_like(result.active)
    bad = lse_bad | ~torch.isfinite(result.logp)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        name = "lse" if bool(lse_bad[row]) else "logp"
        raise NonFiniteOutputError(
            f"row {row}: {name} is {getattr(result, name)[row].item()} although every input is finite: the row's "
            f"logits, or logp = logit - lse, overflowed the execution dtype {dtype_name(execution_dtype)} "
            f"(largest finite {torch.finfo(execution_dtype).max:.4g}); scale hidden or weight down",
            row=row,
        )


def rank_forward(
    impl: LogprobBackend, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, sharding: ShardingSpec
) -> RankOutput:
    """One rank's work: its shard's logits, then its partials (at once, where the backend fuses them)."""
    lo, hi = sharding.real_shard
    if recipes.is_head_recipe(impl):
        logp, prov = call_node(functools.partial(recipes.head_node, impl), hidden, weight, targets, sharding.world_size)
        nodes = {node: replace(prov, node=node) for node in ("matmul", "tp_merge")}
        return RankOutput(None, None, nodes["matmul"], prov, tp_merge=nodes["tp_merge"], head_logp=logp)
    if hasattr(impl, "fused_partials"):
        owned, local_targets = shard_targets(targets, sharding)
        partials, prov = call_node(impl.fused_partials, hidden, weight[lo:hi], local_targets, owned, sharding)
        return RankOutput(None, partials, replace(prov, node="matmul"), prov)  # one kernel ran both nodes
    logits, matmul_prov = call_node(recipes.node_method(impl, "matmul"), hidden, weight[lo:hi])
    return rank_logprob(impl, logits, targets, sharding, matmul_provenance=matmul_prov)


def rank_logprob(
    impl: LogprobBackend,
    shard_logits: torch.Tensor,
    targets: torch.Tensor,
    sharding: ShardingSpec,
    *,
    matmul_provenance: NodeProvenance | None,
) -> RankOutput:
    if sharding.world_size == 1 and hasattr(impl, "whole_vocab"):
        whole, prov, merge_prov = call_node(impl.whole_vocab, shard_logits, targets, sharding)
        return RankOutput(shard_logits, None, matmul_provenance, prov, whole, merge_prov)
    if sharding.world_size == 1 and hasattr(impl, "logits_logprob"):
        return RankOutput(shard_logits, None, matmul_provenance, None)  # ``finish`` makes the one call
    owned, local_targets = shard_targets(targets, sharding)
    partials_node = recipes.node_method(impl, "shard_partials")
    partials, prov = call_node(partials_node, shard_logits, local_targets, owned, sharding)
    return RankOutput(shard_logits, partials, matmul_provenance, prov)


def shard_targets(targets: torch.Tensor, sharding: ShardingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(owned [T]: the target falls in this rank's shard, its shard-local column [T], 0 where not owned)."""
    lo, hi = sharding.shard
    owned = (targets >= lo) & (targets < hi)
    return owned, torch.where(owned, targets - lo, torch.zeros_like(targets))


def finish(
    impl: LogprobBackend,
    targets: torch.Tensor,
    sharding: ShardingSpec,
    ranks: list[RankOutput],
    *,
    tp_mode: str,
    keep_logits: bool = False,
) -> LogprobResult:
    """Merge every rank's partials (identical on each rank) into the replicated result.

    ``keep_logits``: the result also carries the logits the ranks' matmul nodes stored, their real shards side by
    side ([T, V], in vocab order), so a caller can judge the reduction on the very values it read; a fused backend
    stores none, and then neither does the result."""
    stored = [out.logits for out in ranks]
    kept = torch.cat(stored, dim=1) if keep_logits and all(x is not None for x in stored) else None
    head = ranks[0]
    if head.head_logp is not None:  # one fused call computed logp from the hidden states, and no lse
        active = targets != IGNORE_INDEX
        logp = torch.where(active, head.head_logp, torch.zeros_like(head.head_logp))
        nodes = {"matmul": head.matmul, "logprob": head.logprob, "tp_merge": head.tp_merge}
        provenance = Provenance(nodes=nodes, tp=1, tp_mode=tp_mode)
        lse = torch.full_like(logp, float("nan"))
        return LogprobResult(logp, lse, active, torch.where(active, 0, -1), provenance, has_lse=False)
    whole = ranks[0].whole
    if whole is not None:  # the backend reduced, merged and finished the rows itself
        nodes = {"logprob": ranks[0].logprob, "tp_merge": ranks[0].tp_merge}
        if ranks[0].matmul is not None:
            nodes = {"matmul": ranks[0].matmul, **nodes}
        provenance = Provenance(nodes=nodes, tp=1, tp_mode=tp_mode)
        return LogprobResult(whole.logp, whole.lse, whole.active, whole.owner_rank, provenance, kept)
    active = targets != IGNORE_INDEX
    if ranks[0].partials is None:
        logits = ranks[0].logits
        whole_vocab = functools.partial(recipes.whole_vocab_node, impl)
        logp, lse, logprob_prov = call_node(whole_vocab, logits, torch.where(active, targets, 0))
        merge_prov = replace(logprob_prov, node="tp_merge")  # one call computed both
        owner = torch.where(active, 0, -1)
    else:
        owner = torch.full_like(targets, -1, dtype=torch.int64)
        target_logit = torch.zeros_like(ranks[0].partials.target_logit)
        for rank, out in enumerate(ranks):
            owner = torch.where(out.partials.owned, rank, owner)
            target_logit = torch.where(out.partials.owned, out.partials.target_logit, target_logit)
        lse, merge_prov = call_node(recipes.node_method(impl, "merge"), [out.partials for out in ranks])
        logp = target_logit.to(lse.dtype) - lse
        logprob_prov = across_ranks([out.logprob for out in ranks])
    logp = torch.where(active, logp, torch.zeros_like(logp))
    nodes = {"logprob": logprob_prov, "tp_merge": merge_prov}
    if ranks[0].matmul is not None:
        nodes = {"matmul": across_ranks([out.matmul for out in ranks]), **nodes}
    provenance = Provenance(nodes=nodes, tp=sharding.world_size, tp_mode=tp_mode)
    return LogprobResult(logp=logp, lse=lse, active=active, owner_rank=owner, provenance=provenance, logits=kept)
