"""A backend registered from a module of its own, as a user's is, that computes as ``aten`` and fails on demand.

tests/test_distributed_ranks.py runs it on distributed ranks: a rank process imports this module to find it. A call
whose first hidden value is one of ``FAULTS`` makes rank 1 fail that way inside its matmul; any other call computes
what ``aten`` computes, so it runs distributed and emulated alike. Declared a negative control: never chosen by
``auto``.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

import kernels
from kernels.aten import AtenBackend

RAISE, DIE = 1001.0, 1002.0  # hidden[0, 0] of a call that makes rank 1 raise, or die by SIGKILL
FAULTS = (RAISE, DIE)


@kernels.register_backend(
    "rank_faults",
    kernels={node: kernels.BACKENDS["aten"].declared_kernels[node] for node in kernels.OP_NODES},
    capability=kernels.LogprobBackendCapability(
        implementation_kind=kernels.ImplementationKind.NEGATIVE_CONTROL,
        dtypes=frozenset(kernels.EXECUTION_DTYPE_NAMES),
        determinism_scopes=frozenset({kernels.DeterminismScope.FIXED_TOPOLOGY}),
        merge_orders=frozenset({kernels.MergeOrder.RANK_SHARD}),
        platforms=frozenset({"cpu"}),
    ),
)
class RankFaults(AtenBackend):
    def matmul(self, hidden: torch.Tensor, weight: torch.Tensor):
        if dist.is_initialized() and dist.get_rank() == 1 and hidden.numel():
            fault = hidden[0, 0].item()
            if fault == RAISE:
                raise RuntimeError("rank_faults: rank 1 raises as asked")
            if fault == DIE:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().matmul(hidden, weight)
