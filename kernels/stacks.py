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
"""

from __future__ import annotations

import functools

import torch

from kernels.backend import STOCK_MATMUL_OPS, register_backend
from kernels.capability import ImplementationKind, LogprobBackendCapability
from kernels.contract import EXECUTION_DTYPE_NAMES, DeterminismScope, MergeOrder
from kernels.launches import COMPILED_GRAPH_KERNEL

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
