"""Bitwise comparison of float tensors: bit patterns, never ``==`` on floats."""

from __future__ import annotations

import torch

from kernels.errors import DtypeMismatchError, ShapeMismatchError
from kernels.validation import check_tensor, resolved

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_view(tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """The raw bits of a tensor as same-width integers, on its own device (NaN-safe; -0.0 != 0.0): the bits of the
    values it reads as, a view PyTorch marks negated or conjugated included (``resolved``)."""
    check_tensor(name, tensor)
    if tensor.is_quantized:  # viewing its memory as another dtype crashes the process (torch 2.13)
        raise DtypeMismatchError(f"{name} is a quantized tensor ({tensor.dtype}); compare tensor.int_repr() instead")
    if tensor.element_size() not in _INT_OF_WIDTH:
        widths = ", ".join(str(width) for width in _INT_OF_WIDTH)
        raise DtypeMismatchError(
            f"{name} has dtype {tensor.dtype} of {tensor.element_size()} bytes, which no integer type views; the bits "
            f"of elements of {widths} bytes are read"
        )
    return resolved(tensor.detach()).contiguous().view(_INT_OF_WIDTH[tensor.element_size()])


def bit_pattern(tensor: torch.Tensor) -> torch.Tensor:
    """``bit_view`` on the CPU, for comparing and storing."""
    return bit_view(tensor).cpu()


def first_bit_difference(lhs: torch.Tensor, rhs: torch.Tensor) -> int | None:
    """Flat index of the first element whose bits differ, or None when lhs and rhs are bitwise equal."""
    check_tensor("lhs", lhs)
    check_tensor("rhs", rhs)
    if lhs.shape != rhs.shape or lhs.dtype != rhs.dtype:
        error = ShapeMismatchError if lhs.shape != rhs.shape else DtypeMismatchError
        raise error(f"cannot compare bits of {lhs.dtype}{tuple(lhs.shape)} and {rhs.dtype}{tuple(rhs.shape)}")
    differ = (bit_view(lhs, "lhs").cpu() != bit_view(rhs, "rhs").cpu()).flatten()
    return int(differ.nonzero()[0, 0]) if bool(differ.any()) else None
