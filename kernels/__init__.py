"""Logprob kernels for the lm_head: reference, stock PyTorch, Triton invariant and a negative control.

Public API; everything else in this package is an implementation detail.
"""

from kernels import aten, control, reference, triton_backend  # noqa: F401  (register the backends)
from kernels.backend import BACKENDS, LogprobBackend, ShardPartials, register_backend
from kernels.bitwise import bit_pattern, first_bit_difference
from kernels.errors import (
    BackendUnavailableError,
    DtypeMismatchError,
    KernelInputError,
    NonFiniteInputError,
    ShapeMismatchError,
    TargetOutOfRangeError,
    TPConfigError,
)
from kernels.lm_head import DEFAULT_VOCAB_TILE, TP_MODES, LogprobResult, lm_head_logprob, logprob, matmul
from kernels.provenance import OP_NODES, NodeProvenance, Provenance, dtype_name, provenance_mismatches
from kernels.sharding import ShardingSpec, padded_vocab_size
from kernels.validation import IGNORE_INDEX

__all__ = [
    "BACKENDS",
    "DEFAULT_VOCAB_TILE",
    "IGNORE_INDEX",
    "OP_NODES",
    "TP_MODES",
    "BackendUnavailableError",
    "DtypeMismatchError",
    "KernelInputError",
    "LogprobBackend",
    "LogprobResult",
    "NodeProvenance",
    "NonFiniteInputError",
    "Provenance",
    "ShapeMismatchError",
    "ShardPartials",
    "ShardingSpec",
    "TPConfigError",
    "TargetOutOfRangeError",
    "bit_pattern",
    "dtype_name",
    "first_bit_difference",
    "lm_head_logprob",
    "logprob",
    "matmul",
    "padded_vocab_size",
    "provenance_mismatches",
    "register_backend",
]
