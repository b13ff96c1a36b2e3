"""What each built-in backend honours, registered on both platforms (triton on cpu = its interpreter).

Registration order is the order ``auto`` tries production backends in. A claim here must be one the
backend keeps; layout (row-count) invariance is never claimed, because that is what sweeps measure.
"""

from __future__ import annotations

import torch

from kernels.capability import ImplementationKind, LogprobBackendCapability
from kernels.contract import EXECUTION_DTYPE_NAMES, PLATFORMS, DeterminismScope, MergeOrder
from kernels.dispatch import register_logprob_backend
from kernels.provenance import dtype_name

_FIXED = frozenset({DeterminismScope.FIXED_TOPOLOGY})

BUILTIN_CAPABILITIES = {
    # Fixed global vocab tiles merged left to right: the same bits for every TP degree
    # (tests/test_kernel_invariance.py checks tp = 2, 4, 8 against tp = 1 bitwise).
    "triton": LogprobBackendCapability(
        implementation_kind=ImplementationKind.PRODUCTION,
        dtypes=frozenset(EXECUTION_DTYPE_NAMES),
        determinism_scopes=frozenset(DeterminismScope),
        merge_orders=frozenset({MergeOrder.GLOBAL_TILE}),
    ),
    # Megatron-style per-shard (max, sumexp): the grouping of the vocab sum changes with tp.
    "aten": LogprobBackendCapability(
        implementation_kind=ImplementationKind.PRODUCTION,
        dtypes=frozenset(EXECUTION_DTYPE_NAMES),
        determinism_scopes=_FIXED,
        merge_orders=frozenset({MergeOrder.RANK_SHARD}),
    ),
    # float64 partials and outputs: the gold, never a stand-in for an fp32 contract.
    "reference": LogprobBackendCapability(
        implementation_kind=ImplementationKind.REFERENCE,
        dtypes=frozenset(EXECUTION_DTYPE_NAMES),
        determinism_scopes=_FIXED,
        merge_orders=frozenset({MergeOrder.RANK_SHARD}),
        partial_dtype=dtype_name(torch.float64),
        output_dtype=dtype_name(torch.float64),
    ),
    # Its split count is a function of the row count only, so a repeated call repeats its bits
    # (fixed_topology holds); it changes with the call layout and tp, which is the point of it.
    "control": LogprobBackendCapability(
        implementation_kind=ImplementationKind.NEGATIVE_CONTROL,
        dtypes=frozenset(EXECUTION_DTYPE_NAMES),
        determinism_scopes=_FIXED,
        merge_orders=frozenset({MergeOrder.RANK_SHARD}),
    ),
}

for _platform in PLATFORMS:
    for _backend_id, _capability in BUILTIN_CAPABILITIES.items():
        register_logprob_backend(_platform, _backend_id, _capability)
