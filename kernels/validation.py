"""Input checks at the kernels' boundary: every check runs before any kernel is launched."""

from __future__ import annotations

import weakref

import torch

from kernels.errors import (
    DtypeMismatchError,
    NonFiniteInputError,
    ShapeMismatchError,
    TargetOutOfRangeError,
)

EXECUTION_DTYPES = (torch.bfloat16, torch.float32)
IGNORE_INDEX = -100


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; the one dtype-name normalizer of the project."""
    return str(dtype).removeprefix("torch.")


def check_matmul_inputs(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """Shapes, dtypes, device and finiteness of hidden[T, H] and weight[V, H]."""
    if hidden.dim() != 2:
        raise ShapeMismatchError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ShapeMismatchError(f"weight must be [V, H], got shape {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ShapeMismatchError(f"hidden size differs: hidden {tuple(hidden.shape)} vs weight {tuple(weight.shape)}")
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if tensor.dtype not in EXECUTION_DTYPES:
            raise DtypeMismatchError(f"{name} has dtype {tensor.dtype}; supported: bfloat16, float32")
    if hidden.dtype != weight.dtype:
        raise DtypeMismatchError(f"hidden is {hidden.dtype} but weight is {weight.dtype}")
    if hidden.device != weight.device:
        raise ShapeMismatchError(f"inputs on different devices: hidden {hidden.device}, weight {weight.device}")
    check_finite("hidden", hidden)
    check_finite_once("weight", weight)


def check_lm_head_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    """``check_matmul_inputs`` plus targets[T] on the same device."""
    check_matmul_inputs(hidden, weight)
    check_targets(targets, rows=hidden.shape[0])
    if targets.device != hidden.device:
        raise ShapeMismatchError(f"inputs on different devices: hidden {hidden.device}, targets {targets.device}")


def check_logits_inputs(logits: torch.Tensor, targets: torch.Tensor, *, values: bool = True) -> None:
    """logits[T, V] with targets[T]; ``values``: also scan the logits for NaN and ±Inf (a backend whose kernel
    detects them itself skips this second pass over T*V values)."""
    if logits.dim() != 2:
        raise ShapeMismatchError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in (*EXECUTION_DTYPES, torch.float64):
        raise DtypeMismatchError(f"logits have dtype {logits.dtype}; supported: bfloat16, float32, float64")
    check_targets(targets, rows=logits.shape[0])
    if values:
        check_finite("logits", logits)


def check_targets(targets: torch.Tensor, *, rows: int) -> None:
    if targets.dim() != 1 or targets.shape[0] != rows:
        raise ShapeMismatchError(f"targets must be [T] with T={rows}, got shape {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise DtypeMismatchError(f"targets have dtype {targets.dtype}; supported: int64, int32")


def check_target_range(targets: torch.Tensor, vocab_size: int) -> None:
    """Every target is in [0, vocab_size) or equal to IGNORE_INDEX."""
    bad = ((targets < 0) | (targets >= vocab_size)) & (targets != IGNORE_INDEX)
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        value = int(targets[position])
        raise TargetOutOfRangeError(
            f"target id {value} at row {position} is outside [0, {vocab_size}) and is not ignore_index={IGNORE_INDEX}",
            position=position,
            value=value,
        )


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """NonFiniteInputError naming the first NaN or ±Inf of ``tensor``.

    A sum accumulated in fp32 (float64 for float64) screens first: any NaN or ±Inf makes it non-finite, and it
    reads the tensor once without a temporary (``torch.isfinite`` of a bf16 [T, H] allocates 2.5x its size).
    Only a non-finite sum, which finite values can also give by overflow, is looked at element by element.
    """
    screen = tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32)
    if bool(torch.isfinite(screen)):
        return
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        index = tuple(int(i) for i in (~finite).nonzero()[0])
        raise NonFiniteInputError(f"{name} holds a non-finite value {tensor[index].item()} at index {index}")


# id(tensor) -> the stamp it had when found finite. A weight is checked once, not on every call: reading a
# 151936 x 4096 head costs as much as a decode-size matmul. Any in-place change bumps the tensor's version
# counter (shared by its views), and a new storage changes data_ptr, so either is checked again.
_FINITE: dict[int, tuple] = {}


def check_finite_once(name: str, tensor: torch.Tensor) -> None:
    """``check_finite``, skipped for a tensor already found finite and not modified since."""
    key = id(tensor)
    stamp = (tensor._version, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)
    if _FINITE.get(key) == stamp:
        return
    check_finite(name, tensor)
    if key not in _FINITE:
        weakref.finalize(tensor, _FINITE.pop, key, None)
    _FINITE[key] = stamp
