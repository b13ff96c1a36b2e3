"""The logprob code RL trainers run, as built-in backends of the trainer's recipe (``kernels.recipes``).

Each is the algorithm of a named library version, judged beside rlsweep's own kernels (docs/stacks.md has what
each was measured to do). TRL is not imported: its install pulls ``transformers``, whose ``kernels`` dependency
takes this package's import name; the functions below follow TRL 1.16.0's ``trl.trainer.utils.
selective_log_softmax`` line for line in what they compute.

- ``trl_loop``: that function's branch for bf16 and fp16 logits, which TRL takes because "the logsumexp approach
  is unstable with bfloat16": a loop over rows, each ``log_softmax`` in the logits' own dtype, then ``gather``.
  Its logp is a bf16 value (exactly widened to fp32 for the tables); lse is each row's ``logsumexp`` in the same
  dtype, the reduction that ``log_softmax`` subtracts.
- ``trl_logsumexp``: the branch for fp32 and fp64 logits: ``gather`` minus a loop of per-row ``logsumexp``, run
  on logits widened to fp32 first, as trainers that upcast before the head's reduction do.
- ``compiled``: fp32 ``log_softmax`` then ``gather`` (and ``logsumexp`` for lse) under
  ``torch.compile(dynamic=True)``, as a trainer that compiles its loss runs it.
- ``liger``: Liger-Kernel's fused linear cross-entropy (``LigerFusedLinearCrossEntropyFunction``, the optional
  ``liger`` extra), the training stack's fused head: the library itself is called, and its per-token loss negated
  is logp. It computes no lse and has no tensor-parallel path (a fused head, ``kernels.recipes.head_node``).
"""

from __future__ import annotations

import functools

import torch

from kernels.backend import OP_NODES, STOCK_MATMUL_OPS, register_backend
from kernels.capability import ImplementationKind, LogprobBackendCapability
from kernels.contract import EXECUTION_DTYPE_NAMES, DeterminismScope, MergeOrder
from kernels.errors import BackendUnavailableError
from kernels.launches import COMPILED_GRAPH_KERNEL
from kernels.validation import IGNORE_INDEX

# Each runs its reduction once per shard and once more over the shards' lses: Megatron's topology, its own order.
TRAINER_CAPABILITY = LogprobBackendCapability(
    implementation_kind=ImplementationKind.OBSERVED_STACK,  # judged when named, never chosen by ``auto``
    dtypes=frozenset(EXECUTION_DTYPE_NAMES),
    determinism_scopes=frozenset({DeterminismScope.FIXED_TOPOLOGY}),
    merge_orders=frozenset({MergeOrder.RANK_SHARD}),
)


def reduces_with(*ops: str) -> dict[str, frozenset[str]]:
    """A trainer recipe's declaration: the stock matmul, then ``ops`` in both the logprob and the merge node."""
    return {"matmul": STOCK_MATMUL_OPS, "logprob": frozenset(ops), "tp_merge": frozenset(ops)}


@register_backend(
    "trl_loop", kernels=reduces_with("aten::log_softmax", "aten::logsumexp"), capability=TRAINER_CAPABILITY
)
class TrlLoopBackend:
    id: str

    def logits_logprob(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logps, lses = [], []
        for row_logits, row_target in zip(logits, targets, strict=True):
            row_logps = torch.log_softmax(row_logits, dim=-1)
            logps.append(row_logps.gather(-1, row_target[None]).squeeze(-1))
            lses.append(torch.logsumexp(row_logits, dim=-1))
        return torch.stack(logps).float(), torch.stack(lses).float()


@register_backend("trl_logsumexp", kernels=reduces_with("aten::logsumexp"), capability=TRAINER_CAPABILITY)
class TrlLogsumexpBackend:
    id: str

    def logits_logprob(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        selected = torch.gather(logits, dim=-1, index=targets[:, None]).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return selected - lse, lse


def log_softmax_gather(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log_softmax then gather, and the row's logsumexp: the plain trainer's code."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    return logp, torch.logsumexp(logits, dim=-1)


@functools.cache
def compiled_log_softmax_gather():
    """Compiled at the first call, not at import: torch.compile imports triton, whose interpreter mode must be chosen
    before (``rlsweep.run.choose_triton_mode``)."""
    return torch.compile(log_softmax_gather, dynamic=True)


@register_backend("compiled", kernels=reduces_with(COMPILED_GRAPH_KERNEL), capability=TRAINER_CAPABILITY)
class CompiledBackend:
    id: str

    def logits_logprob(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return compiled_log_softmax_gather()(logits, targets)


# What one call of Liger-Kernel's fused linear cross-entropy runs, as observed: its count of the active targets
# (``sum``), a matmul per chunk of rows (``matmul``, or ``mm`` into a reused buffer where it can) and its Triton
# cross-entropy kernel per chunk. One call is every node, so each node declares all of it.
LIGER_KERNELS = frozenset(
    {"aten::sum", "aten::matmul", "aten::mm", "liger_kernel.ops.cross_entropy.liger_cross_entropy_kernel"}
)
LIGER_CAPABILITY = LogprobBackendCapability(
    implementation_kind=ImplementationKind.OBSERVED_STACK,
    dtypes=frozenset(EXECUTION_DTYPE_NAMES),
    determinism_scopes=frozenset({DeterminismScope.FIXED_TOPOLOGY}),
    merge_orders=frozenset({MergeOrder.RANK_SHARD}),
    tp_modes=frozenset({"emulated"}),
    tp_sizes=frozenset({1}),  # one fused call over the whole vocab: no path for a vocab split over ranks
    exports_lse=False,  # it returns the per-token loss; its lse stays inside the kernel
)


@functools.cache
def liger_function():
    """Liger-Kernel's autograd function, imported at the first call: an optional extra, whose import also imports
    triton (in interpreter mode on the CPU: ``rlsweep.run.choose_triton_mode`` runs first)."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except ImportError as err:
        raise BackendUnavailableError(
            f"backend 'liger' needs Liger-Kernel, which is not installed here ({err}); install the extra: "
            "pip install -e '.[liger]'"
        ) from err
    return LigerFusedLinearCrossEntropyFunction


@register_backend("liger", kernels=dict.fromkeys(OP_NODES, LIGER_KERNELS),
                  capability=LIGER_CAPABILITY)  # fmt: skip
class LigerBackend:
    id: str
    runs_triton = True  # its cross-entropy kernel is Triton's: on the CPU, under the interpreter

    def head_logprob(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Positional, as its forward takes them: bias, class weights, ignore_index, z-loss scale, label smoothing,
        # reduction. "none" gives the fp32 loss of each row, lse - target logit; an ignored row's is 0.
        loss = liger_function().apply(hidden, weight, targets, None, None, IGNORE_INDEX, 0.0, 0.0, "none")[0]
        return -loss
