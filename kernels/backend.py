"""The backend interface and the one registry of backends.

A backend supplies three op nodes for one rank's vocab shard: ``matmul`` (hidden @ weight.T),
``shard_partials`` (per-segment (max, sumexp) and the owned target logits) and ``merge``
(all ranks' partials in rank order -> lse). ``kernels.lm_head`` composes them for any TP degree.
Registering a backend (``register_backend``) declares, per op node, the kernels that node may launch,
and the contracts it honours (its ``LogprobBackendCapability``, which dispatch reads; docs/dispatch.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kernels.capability import DispatchPolicy, LogprobBackendCapability
from kernels.contract import PLATFORMS, LogprobContractError
from kernels.errors import BackendUnavailableError
from kernels.launches import aten_overloads, reducing_op
from kernels.sharding import ShardingSpec

if TYPE_CHECKING:  # kernels.provenance looks declarations up in BACKENDS, so it imports this module
    from kernels.provenance import NodeProvenance

# The op nodes a logprob call is made of; profiles name a required backend for each.
OP_NODES = ("matmul", "logprob", "tp_merge")

# What the shared helpers below run, by the names the dispatcher observes (``kernels.launches``); backends built on
# them declare these.
STOCK_MATMUL_OPS = frozenset({"aten::mm"})
SEGMENT_PARTIALS_OPS = frozenset({"aten::amax", "aten::sum"})
MEGATRON_MERGE_OPS = frozenset({"aten::amax", "aten::sum"})


@dataclass(frozen=True)
class ShardPartials:
    """One rank's contribution to a row's logsumexp and target logit.

    ``maxes``/``sumexps`` are [T, k]: k segments of the shard in vocab order (one per tile for
    tiled backends, one per shard for Megatron-style ones). ``target_logit`` is [T], valid where
    ``owned`` is true (the target id falls in this rank's shard).
    """

    maxes: torch.Tensor
    sumexps: torch.Tensor
    target_logit: torch.Tensor
    owned: torch.Tensor


@dataclass(frozen=True)
class WholeVocab:
    """A TP = 1 call reduced by the backend in one step (``whole_vocab``): per-row outputs as ``LogprobResult``
    holds them, and ``status``, int32 words the kernel wrote (one per block of rows, none needs zeroing first): bit
    0, a target outside the vocab that is not ignore_index; bit 1, a non-finite lse or logp. The caller reads them
    before returning (``kernels.ranks``)."""

    logp: torch.Tensor
    lse: torch.Tensor
    active: torch.Tensor
    owner_rank: torch.Tensor
    status: torch.Tensor


class LogprobBackend(Protocol):
    """The three op nodes; optionally ``max_vocab_tile(device) -> int`` and ``max_vocab_columns``, the widest
    padded vocab its kernels can index, both checked before any launch (``kernels.ranks.check_vocab_geometry``)."""

    id: str
    declared_kernels: Mapping[str, frozenset[str]]  # op node -> the kernel names it may launch
    capability: LogprobBackendCapability  # the contracts it honours, read by dispatch

    def matmul(self, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, NodeProvenance]:
        """hidden[T, H] @ weight[V, H].T -> logits[T, V]."""

    def shard_partials(
        self, logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor, sharding: ShardingSpec
    ) -> tuple[ShardPartials, NodeProvenance]:
        """logits[T, Vshard_real] -> this rank's partials."""

    def merge(self, partials: Sequence[ShardPartials]) -> tuple[torch.Tensor, NodeProvenance]:
        """Partials of every rank, in rank order -> lse[T]."""


class LogitsLogprob(Protocol):
    """The trainer's recipe (``kernels.recipes``): logits over a vocab -> (logp, lse), computed as the trainer's own
    code computes them; optionally ``lm_head(hidden, weight) -> logits`` for the matmul node (else the stock
    matmul). The harness applies it per shard at tp > 1 and records every node; a backend with its own
    ``shard_partials`` and ``merge`` as well uses them at tp > 1 and this at tp = 1 (``aten`` does)."""

    id: str
    declared_kernels: Mapping[str, frozenset[str]]
    capability: LogprobBackendCapability

    def logits_logprob(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits[T, V] in the execution dtype, targets[T] int64 in [0, V) -> (logp[T], lse[T]) in fp32."""


class HeadLogprob(Protocol):
    """A library's fused head (``kernels.recipes``): hidden states and weight straight to logp, as Liger-Kernel's
    fused linear cross-entropy gives it (its per-token loss negated), with no logits and no lse to show. One call
    is every node; it has no tensor-parallel path (its capability says ``tp_sizes={1}``, ``exports_lse=False``)."""

    id: str
    declared_kernels: Mapping[str, frozenset[str]]
    capability: LogprobBackendCapability

    def head_logprob(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden[T, H], weight[V, H], targets[T] int64 in [0, V) or ``IGNORE_INDEX`` -> logp[T] in fp32."""


# The methods that make each recipe: one of these sets, complete, is what a registered class must have.
RECIPES = {
    "three nodes": ("matmul", "shard_partials", "merge"),
    "fused": ("fused_partials", "shard_partials", "merge"),
    "trainer": ("logits_logprob",),
    "fused head": ("head_logprob",),
}


def check_recipe(backend_id: str, cls: type) -> None:
    """A LogprobContractError unless ``cls`` implements one recipe in full (``RECIPES``): a half-written one would
    fail only at its first call, or run another path than its author meant."""
    if any(all(callable(getattr(cls, name, None)) for name in names) for names in RECIPES.values()):
        return
    offered = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in RECIPES.items())
    have = [name for names in RECIPES.values() for name in names if callable(getattr(cls, name, None))]
    raise LogprobContractError(
        f"backend {backend_id!r} ({cls.__name__}) implements no recipe in full (it has "
        f"{', '.join(dict.fromkeys(have)) or 'none of their methods'}); implement one of: {offered}"
    )


# backend id -> instance, in registration order (the order ``auto`` dispatch tries production backends in).
BACKENDS: dict[str, LogprobBackend] = {}


def register_backend(
    backend_id: str,
    *,
    kernels: Mapping[str, Iterable[str]],
    capability: LogprobBackendCapability,
    replace: bool = False,
) -> Callable[[type], type]:
    """Class decorator: instantiate the backend and make it reachable by ``backend_id`` with its declarations.

    ``kernels`` maps every op node to the names of the kernels it may launch: a Triton kernel's
    ``module.function`` or an aten overload's ``op.name()`` (see ``kernels.launches``); a bad one raises
    ``ValueError``. ``capability`` says which contracts (platforms and tp modes included) the backend honours.
    A bad id or capability, or an id already registered without ``replace=True``, raises ``LogprobContractError``.
    Re-registering with ``replace=True`` keeps the id's place in the registration order.
    """
    if not isinstance(backend_id, str) or not backend_id or backend_id != backend_id.strip():
        raise LogprobContractError(
            f"backend_id must be a non-empty string without surrounding spaces; got {backend_id!r}"
        )
    if backend_id in {policy.value for policy in DispatchPolicy}:
        raise LogprobContractError(f"backend_id {backend_id!r} is a dispatch policy name and cannot name a backend")
    declared = _declared_kernels(backend_id, kernels)
    if not isinstance(capability, LogprobBackendCapability):
        raise LogprobContractError(f"capability must be a LogprobBackendCapability; got {capability!r}")

    def decorate(cls: type) -> type:
        check_recipe(backend_id, cls)
        if backend_id in BACKENDS and not replace:
            raise LogprobContractError(
                f"backend {backend_id!r} is already registered; pass replace=True to redeclare it"
            )
        instance = cls()
        instance.id = backend_id
        instance.declared_kernels = declared
        instance.capability = capability
        BACKENDS[backend_id] = instance
        return cls

    return decorate


def unregister_backend(backend_id: str) -> LogprobBackend:
    """Remove ``backend_id`` from the registry and return its instance."""
    if not isinstance(backend_id, str) or backend_id not in BACKENDS:
        raise LogprobContractError(f"backend {backend_id!r} is not registered")
    return BACKENDS.pop(backend_id)


def registered_backends(platform: str | None = None) -> dict[str, LogprobBackendCapability]:
    """A copy of every backend's capability, in registration order; only those declared for ``platform`` if given."""
    if platform is not None and platform not in PLATFORMS:
        raise LogprobContractError(f"platform must be one of {', '.join(PLATFORMS)}; got {platform!r}")
    return {
        backend_id: impl.capability
        for backend_id, impl in BACKENDS.items()
        if platform is None or platform in impl.capability.platforms
    }


def _declared_kernels(backend_id: str, kernels: Mapping[str, Iterable[str]]) -> dict[str, frozenset[str]]:
    if not isinstance(kernels, Mapping) or set(kernels) != set(OP_NODES):
        raise ValueError(
            f"backend {backend_id!r} must declare kernels for exactly the nodes {OP_NODES}; got {kernels!r}"
        )
    declared = {}
    for node in OP_NODES:
        names = kernels[node]
        if isinstance(names, str) or not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(
                f"backend {backend_id!r}, node {node!r}: declare a non-empty set of kernel names, not {names!r}"
            )
        for name in names:
            refuse_unobservable(backend_id, node, name)
        declared[node] = frozenset(names)
    return declared


def refuse_unobservable(backend_id: str, node: str, name: str) -> None:
    """A declared torch op is one the dispatcher observer records (``kernels.launches``): an overload name or an
    elementwise op would never match what ran, and the node would be red however right it is."""
    namespace, _, op = name.partition("::")
    if namespace != "aten":
        return
    where = f"backend {backend_id!r}, node {node!r}: {name!r}"
    packet = op.split(".")[0]
    if "." in op:
        raise ValueError(f"{where} names an overload; torch ops are observed by name: declare 'aten::{packet}'")
    if not aten_overloads(packet):
        raise ValueError(f"{where}: torch has no op {packet!r} (torch {torch.__version__})")
    if not reducing_op(op):
        raise ValueError(
            f"{where} is not recorded: only matmuls, reductions, softmaxes and the like decide the bits and are "
            "observed (kernels.launches.reducing_op), elementwise ops, copies and views are not; leave it out"
        )


def get_backend(backend_id: str) -> LogprobBackend:
    if not isinstance(backend_id, str) or backend_id not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {backend_id!r}; available: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[backend_id]


def stores_logits(backend_id: str) -> bool:
    """Whether ``backend_id``'s matmul node stores the logits its reduction reads (a fused backend keeps them in
    registers, and a fused head never has them, so a caller can judge its reduction only against float64 products:
    ``kernels.reduction_bound``)."""
    impl = get_backend(backend_id)
    return not (hasattr(impl, "fused_partials") or hasattr(impl, "head_logprob"))


def declared_kernels(backend_id: str, node: str) -> frozenset[str]:
    """The kernels ``backend_id`` declares for ``node``; nothing for an id with no registered declaration."""
    return getattr(BACKENDS.get(backend_id), "declared_kernels", {}).get(node, frozenset())


@contextmanager
def strict_fp32_accumulation():
    """TF32 off and no reduced-precision bf16 reductions in cuBLAS for the duration of a call."""
    cuda_matmul = torch.backends.cuda.matmul
    saved = (
        cuda_matmul.allow_tf32,
        cuda_matmul.allow_bf16_reduced_precision_reduction,
        torch.backends.cudnn.allow_tf32,
    )
    cuda_matmul.allow_tf32 = False
    cuda_matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        (
            cuda_matmul.allow_tf32,
            cuda_matmul.allow_bf16_reduced_precision_reduction,
            torch.backends.cudnn.allow_tf32,
        ) = saved


def stock_matmul(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden[T, H] @ weight[V, H].T in the execution dtype through cuBLAS / CPU BLAS, fp32 accumulation."""
    with strict_fp32_accumulation():
        return torch.ops.aten.mm.default(hidden, weight.T)


def segment_partials(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x[T, W] -> (max[T], sumexp[T]) with an empty segment as the identity (-inf, 0)."""
    if x.shape[1] == 0:
        rows = x.shape[0]
        return x.new_full((rows,), float("-inf")), x.new_zeros((rows,))
    m = torch.ops.aten.amax.default(x, [1])
    return m, torch.ops.aten.sum.dim_IntList(torch.exp(x - m[:, None]), [1])


def megatron_merge(partials: Sequence[ShardPartials]) -> torch.Tensor:
    """Partials of every rank -> lse[T]: global max, rescaled sums added, as Megatron does."""
    maxes = torch.cat([p.maxes for p in partials], dim=1)
    sumexps = torch.cat([p.sumexps for p in partials], dim=1)
    global_max = torch.ops.aten.amax.default(maxes, [1])
    scale = torch.where(maxes == float("-inf"), 0.0, torch.exp(maxes - global_max[:, None]))
    return global_max + torch.log(torch.ops.aten.sum.dim_IntList(sumexps * scale, [1]))


def gather_target_logit(logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """The target column of each owned row, 0 elsewhere; an exact copy, no arithmetic."""
    if logits.shape[1] == 0:
        return logits.new_zeros((logits.shape[0],))
    picked = logits.gather(1, local_targets[:, None].clamp(0, logits.shape[1] - 1)).squeeze(1)
    return torch.where(owned, picked, torch.zeros_like(picked))
