"""Bitwise comparison of float tensors: bit patterns, never ``==`` on floats."""

from __future__ import annotations

import torch

from kernels.errors import DtypeMismatchError, ShapeMismatchError

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor as same-width integers, on its own device (NaN-safe; -0.0 != 0.0)."""
    return tensor.detach().contiguous().view(_INT_OF_WIDTH[tensor.element_size()])


def bit_pattern(tensor: torch.Tensor) -> torch.Tensor:
    """``bit_view`` on the CPU, for comparing and storing."""
    return bit_view(tensor).cpu()


def first_bit_difference(lhs: torch.Tensor, rhs: torch.Tensor) -> int | None:
    """Flat index of the first element whose bits differ, or None when lhs and rhs are bitwise equal."""
    if lhs.shape != rhs.shape or lhs.dtype != rhs.dtype:
        error = ShapeMismatchError if lhs.shape != rhs.shape else DtypeMismatchError
        raise error(f"cannot compare bits of {lhs.dtype}{tuple(lhs.shape)} and {rhs.dtype}{tuple(rhs.shape)}")
    differ = (bit_pattern(lhs) != bit_pattern(rhs)).flatten()
    return int(differ.nonzero()[0, 0]) if bool(differ.any()) else None
