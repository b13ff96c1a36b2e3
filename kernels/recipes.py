"""The trainer's recipe: a backend that is one function from logits to (logp, lse), as a trainer's own code is.

A ``LogitsLogprob`` backend (``kernels.backend``) gives only ``logits_logprob``; the harness makes its nodes of it
(docs/extending.md):
- ``matmul``: the backend's ``lm_head(hidden, weight)`` where it has one, else the stock matmul;
- tp = 1: one call over the whole vocab, recorded as both the ``logprob`` and the ``tp_merge`` node;
- tp > 1: one call per rank over its shard, whose lse is the rank's partial (one segment: ``(lse, 1)``) and, on
  the rank that owns a row's target, whose logp plus lse is the target logit; the ``tp_merge`` node is one more
  call, over each row's shard lses, whose lse is the row's. So the user writes nothing for tp > 1, the merge is the
  user's own reduction, and what the function does to the target is judged at every tp.
Every record is made here, from the tensor the backend returned and what the dispatcher saw (``call_node``).

A ``HeadLogprob`` backend (a library's fused head, ``head_logprob``) is one call from hidden states to logp, recorded
as every node (``head_node``); it computes no lse and runs at tp = 1 only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from kernels.backend import HeadLogprob, LogitsLogprob, ShardPartials, stock_matmul
from kernels.errors import KernelInputError, ShapeMismatchError, TPConfigError
from kernels.provenance import NodeProvenance, observe
from kernels.sharding import ShardingSpec


def is_trainer_recipe(impl: object) -> bool:
    """Whether ``impl`` reduces through ``logits_logprob`` alone (no ``shard_partials``/``merge`` of its own)."""
    return hasattr(impl, "logits_logprob") and not hasattr(impl, "shard_partials")


def is_head_recipe(impl: object) -> bool:
    """Whether ``impl`` is a fused head: one call from hidden states to logp (``head_logprob``)."""
    return hasattr(impl, "head_logprob")


def refuse_head_recipe(impl: object, call: str) -> None:
    """KernelInputError for ``call`` (``kernels.matmul``, ``kernels.logprob``) on a fused head: it has no node to
    call on its own, no logits in or out."""
    if is_head_recipe(impl):
        raise KernelInputError(
            f"{call} cannot run backend {impl.id!r}: it is a fused head, hidden states to logp in one call, with no "
            "logits in or out; call kernels.lm_head_logprob"
        )


def head_node(
    impl: HeadLogprob, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, world_size: int
) -> tuple[torch.Tensor, NodeProvenance]:
    """The fused head's one call, its logp checked: one [T] floating tensor on the hidden states' device."""
    if world_size != 1:
        raise TPConfigError(
            f"backend {impl.id!r} computes logp in one fused call over the whole vocab and has no tensor-parallel "
            f"path; got tp={world_size}: use tp=1"
        )
    logp = impl.head_logprob(hidden, weight, targets)
    rows = hidden.shape[0]
    if not isinstance(logp, torch.Tensor):
        raise TypeError(f"backend {impl.id!r}: head_logprob must return a tensor logp; got {type(logp).__name__}")
    if logp.shape != (rows,) or not logp.is_floating_point() or logp.device != hidden.device:
        raise ShapeMismatchError(
            f"backend {impl.id!r}: head_logprob returned logp of shape {tuple(logp.shape)}, dtype {logp.dtype} on "
            f"{logp.device}; expected shape ({rows},), a floating dtype, on {hidden.device}"
        )
    return logp, observe("logprob", impl.id, logp)


def logits_logprob(impl: LogitsLogprob, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``impl.logits_logprob`` with its outputs checked: two [T] floating tensors on the logits' device."""
    outputs = impl.logits_logprob(logits, targets)
    if not (isinstance(outputs, tuple) and len(outputs) == 2 and all(isinstance(x, torch.Tensor) for x in outputs)):
        raise TypeError(
            f"backend {impl.id!r}: logits_logprob must return a tuple (logp, lse) of two tensors; got "
            f"{type(outputs).__name__}"
        )
    rows = logits.shape[0]
    for name, tensor in zip(("logp", "lse"), outputs, strict=True):
        if tensor.shape != (rows,) or not tensor.is_floating_point() or tensor.device != logits.device:
            raise ShapeMismatchError(
                f"backend {impl.id!r}: logits_logprob returned {name} of shape {tuple(tensor.shape)}, dtype "
                f"{tensor.dtype} on {tensor.device}; expected shape ({rows},), a floating dtype, on {logits.device}"
            )
    return outputs


def matmul_node(impl: LogitsLogprob, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, NodeProvenance]:
    """The ``matmul`` node: the backend's own ``lm_head``, or the stock matmul in the execution dtype."""
    logits = impl.lm_head(hidden, weight) if hasattr(impl, "lm_head") else stock_matmul(hidden, weight)
    return logits, observe("matmul", impl.id, logits)


def whole_vocab_node(
    impl: LogitsLogprob, logits: torch.Tensor, safe_targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, NodeProvenance]:
    """tp = 1: the one call over every column (a target of an inactive row is 0 here, its logp discarded)."""
    logp, lse = logits_logprob(impl, logits, safe_targets)
    return logp, lse, observe("logprob", impl.id, logp)


def shard_partials_node(
    impl: LogitsLogprob, logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor, sharding: ShardingSpec
) -> tuple[ShardPartials, NodeProvenance]:
    """tp > 1, one rank: the shard's lse as its one segment ``(lse, 1)``, and on the rank that owns a row's target the
    target logit as the function computed it, its logp plus its lse over the shard (so its own gather and log-softmax
    are judged at every tp, not at tp = 1 alone); a shard without real columns is the identity ``(-inf, 0)``, the
    function not called."""
    rows = logits.shape[0]
    if logits.shape[1] == 0:
        maxes = logits.new_full((rows, 1), float("-inf"), dtype=torch.float32)
        partials = ShardPartials(maxes, torch.zeros_like(maxes), maxes.new_zeros((rows,)), owned)
        return partials, observe("logprob", impl.id, maxes, segments="per_shard")
    logp, lse = logits_logprob(impl, logits, local_targets)
    target = torch.where(owned, logp.to(lse.dtype) + lse, torch.zeros_like(lse))
    partials = ShardPartials(lse[:, None], torch.ones_like(lse)[:, None], target, owned)
    return partials, observe("logprob", impl.id, lse, segments="per_shard")


def merge_node(impl: LogitsLogprob, partials: Sequence[ShardPartials]) -> tuple[torch.Tensor, NodeProvenance]:
    """Every rank's partials -> lse [T]: the backend's own function over each row's segment lses (``max +
    log(sumexp)``, exactly the shard's lse for its ``(lse, 1)``), in rank order."""
    maxes = torch.cat([p.maxes for p in partials], dim=1)
    sumexps = torch.cat([p.sumexps for p in partials], dim=1)
    segment_lses = maxes + torch.log(sumexps)
    _, lse = logits_logprob(impl, segment_lses, torch.zeros(maxes.shape[0], dtype=torch.long, device=maxes.device))
    return lse, observe("tp_merge", impl.id, lse)


# The harness's node for each node method a trainer recipe does not have.
TRAINER_NODES = {"matmul": matmul_node, "shard_partials": shard_partials_node, "merge": merge_node}


def node_method(impl: object, name: str) -> Callable[..., tuple]:
    """``impl``'s own node method ``name``, or, for a trainer recipe, the harness's, made of its ``logits_logprob``."""
    return functools.partial(TRAINER_NODES[name], impl) if is_trainer_recipe(impl) else getattr(impl, name)
