"""Tensors as bytes: local safetensors inputs (the weight file, replay captures), whose headers are read before any
tensor is loaded, and the digest of a tensor's bits (``bits_sha256``).

Every failure to read an input is a ``ReplayInputError`` naming the file, the config key that points at it and
what is wrong: missing, not a regular file, unreadable, truncated or not safetensors at all.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

import kernels
from rlsweep.errors import ReplayInputError

# safetensors' dtype names; a name missing here is a dtype no rlsweep input may have.
SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


@dataclass(frozen=True)
class TensorHeader:
    """A tensor's dtype and shape as the file's header declares them; ``dtype`` is None outside SAFETENSORS_DTYPES."""

    stored: str
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype | None:
        return SAFETENSORS_DTYPES.get(self.stored)

    @property
    def is_floating(self) -> bool:
        return self.dtype is not None and self.dtype.is_floating_point

    def describe(self) -> str:
        return f"{self.stored} {list(self.shape)}"


@dataclass(frozen=True)
class TensorFile:
    """A safetensors file named by a config key: ``what`` and ``key`` name it in every error."""

    path: str
    what: str  # "weight file", "replay file"
    key: str  # the config key that holds the path

    def describe(self) -> str:
        return f"{self.what} {self.path!r} ({self.key})"

    def headers(self) -> dict[str, TensorHeader]:
        """Each tensor's header; nothing is loaded."""
        with self.opened() as handle:
            return {name: header(handle.get_slice(name)) for name in handle.keys()}

    def load(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, read as stored (dtype and shape as their headers say)."""
        with self.opened() as handle:
            return {name: handle.get_tensor(name) for name in names}

    def cast_finite(self, name: str, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``stored`` (this file's tensor ``name``) cast to ``dtype``, every value finite there; the first that is not
        is named with its index: not finite as stored, or finite but past ``dtype``'s range (float32 3.4e38 is inf in
        bfloat16)."""
        cast = stored.to(dtype)
        finite = finite_elements(cast)
        if not bool(finite.all()):
            index = tuple(int(i) for i in (~finite).nonzero()[0])
            value = stored[index].item()
            why = (
                f"overflows the execution dtype {kernels.dtype_name(dtype)} (largest finite {torch.finfo(dtype).max:g})"
                if math.isfinite(value)
                else "is not finite"
            )
            raise ReplayInputError(f"{self.describe()}: {name}[{', '.join(map(str, index))}] = {value} {why}")
        return cast

    @contextmanager
    def opened(self) -> Iterator[Any]:
        """``safe_open`` of a regular file (``check_regular_file``) whose errors, at open or at a read, are a
        ReplayInputError naming the file."""
        check_regular_file(self.path, self.describe())
        try:
            # safetensors words every failed open as "No such file or directory"; the OS says which it was.
            os.close(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK))
        except OSError as err:
            raise ReplayInputError(f"{self.describe()} cannot be read: {err.strerror or err}") from err
        try:
            with safe_open(self.path, framework="pt") as handle:
                yield handle
        except (SafetensorError, OSError) as err:
            reason = " ".join(str(err).split()) or type(err).__name__
            raise ReplayInputError(f"{self.describe()} is not a readable safetensors file: {reason}") from err


def file_kind(mode: int) -> str:
    """What a path whose ``st_mode`` is ``mode`` is, in words: "a regular file", "a FIFO", "a character device", ..."""
    kinds = [(stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket")]  # fmt: skip
    return next((kind for test, kind in kinds if test(mode)), f"not a regular file (mode {stat.filemode(mode)})")


def refuse_irregular(mode: int, path: str | Path, where: str) -> None:
    """A ReplayInputError naming ``where``, unless ``mode`` (of ``path``, symlinks followed) is a regular file's."""
    if not stat.S_ISREG(mode):
        link = os.path.realpath(path)
        through = f" (through a link to {link!r})" if os.path.islink(path) else ""
        raise ReplayInputError(f"{where} is {file_kind(mode)}{through}, not a regular file")


def check_regular_file(path: str | Path, where: str) -> None:
    """``path`` is a regular file, symlinks followed to their final target, before anything opens, reads or hashes it:
    a FIFO would block the open until some writer came and /dev/zero would be read for ever; ``where`` names the file
    and the config key that holds it in the error."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ReplayInputError(f"{where} does not exist") from None
    except OSError as err:
        raise ReplayInputError(f"{where} cannot be read: {err.strerror or err}") from err
    refuse_irregular(mode, path, where)


def finite_elements(tensor: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite`` for every floating dtype: torch has none for the one-byte float8 dtypes a safetensors file
    may hold, which are checked in float32 (exactly: every float8 value is a float32 one)."""
    return torch.isfinite(tensor.float() if tensor.is_floating_point() and tensor.element_size() == 1 else tensor)


def header(tensor_slice: Any) -> TensorHeader:
    return TensorHeader(str(tensor_slice.get_dtype()), tuple(int(n) for n in tensor_slice.get_shape()))


def tensor_header(tensor: torch.Tensor) -> TensorHeader:
    """The header of a tensor as loaded: what its file declared for it, read back from the tensor itself."""
    stored = next((name for name, dtype in SAFETENSORS_DTYPES.items() if dtype == tensor.dtype), str(tensor.dtype))
    return TensorHeader(stored, tuple(tensor.shape))


def bits_sha256(tensor: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's bytes as held: its dtype's bit patterns in row-major order, so equal bits give
    equal digests (-0.0 and 0.0, or two NaN payloads, do not). The weight's hash and the gradients' fingerprints."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data).hexdigest()
