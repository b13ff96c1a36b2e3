"""The composed op: lm_head matmul, per-shard partials and the TP merge, for any backend and TP degree.

``lm_head_logprob`` is the public edge: it turns ``tp`` and ``vocab_tile`` into a ``ShardingSpec`` once and
hands it to ``sharded_lm_head_logprob``, which the dispatched op (``kernels.dispatch.LogprobOp``) calls with
its contract's spec. The per-rank work and the merge are in ``kernels.ranks``; real rank processes in
``kernels.distributed`` (docs/kernels.md#vocab-parallel-tp).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import replace

import torch

from kernels import grad, recipes
from kernels.backend import BACKENDS, LogprobBackend, get_backend
from kernels.contract import TP_MODES
from kernels.distributed import distributed_gradients, run_distributed
from kernels.errors import InputChangedError, KernelInputError, ShapeMismatchError
from kernels.provenance import NodeProvenance, call_node
from kernels.ranks import (
    LogprobResult,
    check_vocab_geometry,
    finish,
    rank_forward,
    rank_logprob,
    require_finite,
    require_status,
)
from kernels.sharding import ShardingSpec
from kernels.validation import (
    ValueChecks,
    changed_since_checked,
    check_finite,
    check_lm_head_inputs,
    check_logits_inputs,
    check_matmul_shapes,
    check_matmul_values,
    check_target_range,
    check_tensor,
    explain_narrowing,
    resolved,
)

DEFAULT_VOCAB_TILE = 1024
# What a call does with a NaN or +-Inf logp or lse of finite inputs: raise NonFiniteOutputError (the default), or
# return it, so a harness can judge the overflow as a verdict of the backend instead of stopping at the first one.
NONFINITE_OUTPUTS = ("raise", "return")
THROUGH_LM_HEAD = "differentiate through kernels.lm_head_logprob, "  # a gradient the Triton backends compute


def matmul(
    hidden: torch.Tensor, weight: torch.Tensor, *, backend: str, checks: ValueChecks | None = None
) -> tuple[torch.Tensor, NodeProvenance]:
    """hidden[T, H] @ weight[V, H].T -> logits[T, V] in the execution dtype (float64 for reference).

    ``checks``: queue the checks of values there and return without waiting for the device; the caller's
    ``checks.raise_first()`` raises them later (docs/kernels.md#errors). By default the call reads them itself."""
    impl = get_backend(backend)
    recipes.refuse_head_recipe(impl, "kernels.matmul")
    with call_checks(checks) as pending:
        check_matmul_shapes(hidden, weight)
        check_matmul_values(hidden, weight, pending)
        hidden, weight = resolved(hidden), resolved(weight)
        if checks is None:  # every check is of an input: its verdict reaches the host while the kernel runs
            pending.send()
        logits, provenance = call_node(recipes.node_method(impl, "matmul"), hidden, weight)
        require_graph(impl, "kernels.matmul", {"hidden": hidden, "weight": weight}, logits, instead=THROUGH_LM_HEAD)
        return logits, provenance


def logprob(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    backend: str,
    vocab_tile: int = DEFAULT_VOCAB_TILE,
    checks: ValueChecks | None = None,
) -> LogprobResult:
    """logits[T, V] + targets[T] -> fp32 logp[T] and lse[T] (TP=1). ``checks`` as for ``matmul``."""
    impl = get_backend(backend)
    recipes.refuse_head_recipe(impl, "kernels.logprob")
    in_kernel = getattr(impl, "checks_finite_logits", False)  # the kernel poisons its result instead of a scan
    with call_checks(checks) as pending:
        check_logits_inputs(logits, targets, pending, values=not in_kernel)
        logits, targets = resolved(logits), resolved(targets)
        vocab = logits.shape[1]
        sharding = ShardingSpec.even(vocab, vocab_tile, 1)
        check_vocab_geometry(impl, sharding, logits.device)
        # The partials are launched first: a rank owns only targets inside its shard, so an out-of-range one is
        # never read there; the range check and its safe targets are queued while the kernel runs, before
        # ``finish`` uses them.
        ranks = [rank_logprob(impl, logits, targets, sharding, matmul_provenance=None)]
        whole = ranks[0].whole  # a backend's one-launch TP = 1 path checks the targets and its outputs itself
        safe_targets = targets if whole is not None else check_target_range(targets, vocab, pending)
        result = finish(impl, safe_targets, sharding, ranks, tp_mode="emulated")
        require_graph(impl, "kernels.logprob", {"logits": logits}, result.logp, result.lse, instead=THROUGH_LM_HEAD)
        # A non-finite input is named as one, as the up-front scan would, before an overflow is considered; logp
        # and lse are computed in their own dtype, whatever the logits' (float64 ones are reduced in float32).
        deferred = checks is not None
        name_input = functools.partial(explain_logits, logits, result.lse, deferred)
        reduced = result.lse.dtype
        if whole is not None:
            require_status(result, whole, targets, vocab, reduced, pending, first=name_input, deferred=deferred)
        else:
            require_finite(result, reduced, pending, first=name_input)
        return result


def require_graph(
    impl: LogprobBackend, call: str, inputs: dict[str, torch.Tensor], *outputs: torch.Tensor, instead: str = ""
) -> None:
    """KernelInputError where autograd is on and an input requires grad, but the backend's outputs carry no graph
    (its kernels run outside autograd): their gradient would be missing without a word. ``instead``: a way to a
    gradient the message offers first."""
    wanting = [name for name, tensor in inputs.items() if tensor.requires_grad]
    if torch.is_grad_enabled() and wanting and not any(output.requires_grad for output in outputs):
        raise KernelInputError(
            f"{call} computes no gradient with backend {impl.id!r}: its kernels run outside autograd, but "
            f"{' and '.join(wanting)} {'require' if len(wanting) > 1 else 'requires'} grad; {instead}detach the "
            f"input, or call under torch.no_grad()"
        )


def explain_logits(logits: torch.Tensor, lse: torch.Tensor, deferred: bool) -> None:
    """Before a non-finite output of ``logprob`` is blamed on an overflow: the NonFiniteInputError of a NaN or ±Inf
    logit, or of one past the range of lse's dtype, which the backend reduces them in; then, for checks read after
    the call (``deferred``), InputChangedError where a row's lse is not finite, which finite logits never give (max
    + log of a sum of at most V): the kernel read a logit that is gone."""
    check_finite("logits", logits)
    explain_narrowing("logits", logits, lse.dtype)
    if deferred and not bool(torch.isfinite(lse).all()):
        raise InputChangedError(changed_since_checked("logits", "every value is finite now"))


@contextlib.contextmanager
def call_checks(checks: ValueChecks | None) -> Iterator[ValueChecks]:
    """The ``ValueChecks`` a call queues its value checks in, its own: read (``raise_first``) when its block ends
    without an error, or, given the caller's ``checks``, queued there then, for the caller to read. A call that
    raises returns nothing, so none of its checks reach the caller's, where they would read as another call's."""
    if checks is not None and not isinstance(checks, ValueChecks):
        raise KernelInputError(f"checks must be a kernels.ValueChecks or None, got {type(checks).__name__}")
    own = ValueChecks()
    yield own
    if checks is None:
        own.raise_first()
    else:
        checks.take(own)


def lm_head_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    backend: str,
    tp: int = 1,
    tp_mode: str = "emulated",
    vocab_tile: int = DEFAULT_VOCAB_TILE,
    checks: ValueChecks | None = None,
    keep_logits: bool = False,
    nonfinite: str = "raise",
) -> LogprobResult:
    """hidden[T, H], weight[V, H], targets[T] -> logp and lse of each row's target, vocab split over ``tp`` ranks.
    ``checks`` as for ``matmul`` (``tp_mode="distributed"`` still reads the input checks before its ranks start);
    ``keep_logits`` and ``nonfinite`` as for ``sharded_lm_head_logprob``."""
    check_tensor("weight", weight)  # its vocab sizes the split
    if weight.dim() != 2:
        raise ShapeMismatchError(f"weight must be [V, H], got shape {tuple(weight.shape)}")
    sharding = ShardingSpec.even(weight.shape[0], vocab_tile, tp)  # raises TPConfigError for tp or tile
    return sharded_lm_head_logprob(
        hidden, weight, targets, backend=backend, sharding=sharding, tp_mode=tp_mode, checks=checks,
        keep_logits=keep_logits, nonfinite=nonfinite,
    )  # fmt: skip


def sharded_lm_head_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    backend: str,
    sharding: ShardingSpec,
    tp_mode: str,
    checks: ValueChecks | None = None,
    keep_logits: bool = False,
    nonfinite: str = "raise",
) -> LogprobResult:
    """``lm_head_logprob`` with the vocab split given as a ``ShardingSpec`` of weight's vocab (any rank's view).

    ``keep_logits``: the result carries the logits the reduction read (``LogprobResult.logits``) where the backend
    stored them and the ranks run in this process (``tp_mode="emulated"``); else None. ``nonfinite``: one of
    ``NONFINITE_OUTPUTS``; inputs are checked as always, so "return" hands back only the kernel's own overflow."""
    impl = get_backend(backend)
    if tp_mode not in TP_MODES:
        raise KernelInputError(f"tp_mode must be one of {TP_MODES}, got {tp_mode!r}")
    if nonfinite not in NONFINITE_OUTPUTS:
        raise KernelInputError(f"nonfinite must be one of {NONFINITE_OUTPUTS}, got {nonfinite!r}")
    if not isinstance(sharding, ShardingSpec):
        raise KernelInputError(f"sharding must be a ShardingSpec, got {sharding!r}")
    with call_checks(checks) as pending:
        check_lm_head_inputs(hidden, weight, targets, pending)
        hidden, weight, targets = resolved(hidden), resolved(weight), resolved(targets)
        if weight.shape[0] != sharding.vocab_size:
            raise ShapeMismatchError(
                f"weight has {weight.shape[0]} vocab rows but the sharding splits a vocab of {sharding.vocab_size}"
            )
        check_vocab_geometry(impl, sharding, hidden.device)
        targets = check_target_range(targets, sharding.vocab_size, pending)
        wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        tiled = grad.has_tiled_backward(impl)  # else a backend of torch ops, which autograd differentiates itself
        if tp_mode == "distributed":
            if wants_grad and not tiled:  # the rank processes' torch ops carry no graph: a silent no-gradient
                differentiable = [name for name, backend in BACKENDS.items() if grad.has_tiled_backward(backend)]
                raise KernelInputError(
                    f"tp_mode='distributed' computes no gradient with backend {impl.id!r}: its ranks' autograd "
                    f"graphs stay in their processes; differentiate it with tp_mode='emulated' (the same bits), use "
                    f"a backend with a tiled backward ({', '.join(differentiable)}), or call under torch.no_grad()"
                )
            pending.raise_first()  # the rank processes get checked inputs only
            with torch.no_grad():
                result = run_distributed(backend, hidden, weight, targets, sharding)
            gradients = functools.partial(distributed_gradients, backend, sharding=sharding)
        elif wants_grad and tiled:
            with torch.no_grad():
                result = emulated(impl, hidden, weight, targets, sharding, keep_logits=keep_logits)
            gradients = functools.partial(grad.tiled_gradients, impl, sharding=sharding)
        else:
            result = emulated(impl, hidden, weight, targets, sharding, keep_logits=keep_logits)
        if wants_grad and tiled:
            logp, lse = grad.TiledLogprobBackward.apply(hidden, weight, result.logp, result.lse, targets, gradients)
            result = replace(result, logp=logp, lse=lse)
        if wants_grad:  # a backend of its own may run kernels outside autograd and have no tiled backward
            inputs = {"hidden": hidden, "weight": weight}
            require_graph(impl, "kernels.lm_head_logprob", inputs, result.logp, result.lse)
        # In the caller's process, typed in both tp modes. The inputs are looked at again before an overflow is
        # blamed: a weight checked once may since have been written where its version counter does not see.
        name_input = functools.partial(check_finite_inputs, {"hidden": hidden, "weight": weight})
        if nonfinite == "raise":
            require_finite(result, hidden.dtype, pending, first=name_input)
        return result


def check_finite_inputs(tensors: dict[str, torch.Tensor]) -> None:
    """``check_finite`` of each named input, at once, in order."""
    for name, tensor in tensors.items():
        check_finite(name, tensor)


def emulated(
    impl: LogprobBackend,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    sharding: ShardingSpec,
    *,
    keep_logits: bool = False,
) -> LogprobResult:
    """Every rank's forward in this process, one after the other, then the merge."""
    ranks = [rank_forward(impl, hidden, weight, targets, sharding.for_rank(r)) for r in range(sharding.world_size)]
    return finish(impl, targets, sharding, ranks, tp_mode="emulated", keep_logits=keep_logits)
