"""Logprob kernels for the lm_head: reference, stock PyTorch, Triton invariant and a negative control.

Public API; everything else in this package is an implementation detail.
"""

# Importing a backend's module registers it; this order is the order ``auto`` dispatch tries them in.
# isort: off
from kernels import triton_backend, aten, reference, control, stacks  # noqa: F401

# isort: on
from kernels.arithmetic import ArithmeticBound, bias_allowance, reduction_bound
from kernels.backend import (
    BACKENDS,
    OP_NODES,
    LogprobBackend,
    ShardPartials,
    register_backend,
    registered_backends,
    stores_logits,
    unregister_backend,
)
from kernels.bitwise import bit_pattern, bit_view, first_bit_difference
from kernels.capability import DispatchPolicy, ImplementationKind, LogprobBackendCapability
from kernels.contract import (
    EXECUTION_DTYPE_NAMES,
    PLATFORMS,
    TP_MODES,
    DeterminismScope,
    LogprobContract,
    LogprobContractError,
    LogprobOutputSpec,
    MaskMode,
    MaskSpec,
    MergeOrder,
    ReductionSpec,
)
from kernels.dispatch import (
    LogprobDispatchError,
    LogprobOp,
    RankAgreement,
    get_logprob_op,
    resolve_logprob_backend,
)
from kernels.distributed import RankGroup, distributed_ranks
from kernels.errors import (
    BackendUnavailableError,
    DtypeMismatchError,
    InputChangedError,
    KernelInputError,
    NonFiniteInputError,
    NonFiniteOutputError,
    RankGroupError,
    ShapeMismatchError,
    TargetOutOfRangeError,
    TPConfigError,
)
from kernels.grad import has_tiled_backward
from kernels.launches import KernelLaunch, launch_triton, observed_provenance
from kernels.lm_head import DEFAULT_VOCAB_TILE, NONFINITE_OUTPUTS, lm_head_logprob, logprob, matmul
from kernels.provenance import (
    NodeProvenance,
    Provenance,
    ProvenanceMismatchError,
    observe,
    provenance_mismatches,
    require_provenance,
)
from kernels.ranks import LogprobResult
from kernels.rounding import GradientBound, RoundingBound, gradient_bound, logit_errors, rounding_bound
from kernels.sharding import MIN_VOCAB_TILE, ShardingSpec, padded_vocab_size
from kernels.validation import EXECUTION_DTYPES, IGNORE_INDEX, ValueChecks, dtype_name

__all__ = [
    "BACKENDS",
    "DEFAULT_VOCAB_TILE",
    "EXECUTION_DTYPES",
    "EXECUTION_DTYPE_NAMES",
    "IGNORE_INDEX",
    "MIN_VOCAB_TILE",
    "NONFINITE_OUTPUTS",
    "OP_NODES",
    "PLATFORMS",
    "TP_MODES",
    "ArithmeticBound",
    "BackendUnavailableError",
    "DeterminismScope",
    "DispatchPolicy",
    "DtypeMismatchError",
    "GradientBound",
    "ImplementationKind",
    "InputChangedError",
    "KernelInputError",
    "KernelLaunch",
    "LogprobBackend",
    "LogprobBackendCapability",
    "LogprobContract",
    "LogprobContractError",
    "LogprobDispatchError",
    "LogprobOp",
    "LogprobOutputSpec",
    "LogprobResult",
    "MaskMode",
    "MaskSpec",
    "MergeOrder",
    "NodeProvenance",
    "NonFiniteInputError",
    "NonFiniteOutputError",
    "Provenance",
    "ProvenanceMismatchError",
    "RankAgreement",
    "RankGroup",
    "RankGroupError",
    "ReductionSpec",
    "RoundingBound",
    "ShapeMismatchError",
    "ShardPartials",
    "ShardingSpec",
    "TPConfigError",
    "TargetOutOfRangeError",
    "ValueChecks",
    "bias_allowance",
    "bit_pattern",
    "bit_view",
    "distributed_ranks",
    "dtype_name",
    "first_bit_difference",
    "get_logprob_op",
    "gradient_bound",
    "has_tiled_backward",
    "launch_triton",
    "lm_head_logprob",
    "logit_errors",
    "logprob",
    "matmul",
    "observe",
    "observed_provenance",
    "padded_vocab_size",
    "provenance_mismatches",
    "reduction_bound",
    "register_backend",
    "registered_backends",
    "require_provenance",
    "resolve_logprob_backend",
    "rounding_bound",
    "stores_logits",
    "unregister_backend",
]
