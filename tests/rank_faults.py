"""A backend registered from a module of its own, as a user's is, that computes as ``aten`` and fails on demand.

tests/test_distributed_ranks.py runs it on distributed ranks: a rank process imports this module to find it. A call
whose first hidden value is one of ``FAULTS`` makes a rank fail that way inside its matmul; any other call computes
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
SHM_FULL = 1003.0  # hidden[0, 0] of a call whose result rank 0 cannot send: /dev/shm is full from then on
FAULTS = (RAISE, DIE, SHM_FULL)


def shm_full(*args, **kwargs):
    """In place of ``torch.UntypedStorage._share_fd_cpu_``: what torch raises when /dev/shm is full."""
    raise RuntimeError("unable to allocate shared memory(shm) for file </torch_0_0_0>: No space left on device (28)")


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
        rank, fault = (dist.get_rank(), hidden[0, 0].item()) if dist.is_initialized() and hidden.numel() else (0, 0)
        if rank == 1 and fault == RAISE:
            raise RuntimeError("rank_faults: rank 1 raises as asked")
        if rank == 1 and fault == DIE:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0 and fault == SHM_FULL:
            torch.UntypedStorage._share_fd_cpu_ = shm_full
        return super().matmul(hidden, weight)
