"""Tensors as bytes: local safetensors inputs (the weight file, replay captures), whose headers are read before any
tensor is loaded, and the digest of a tensor's bits (``bits_sha256``).

Every failure to read an input is a ``ReplayInputError`` naming the file, the config key that points at it and
what is wrong: missing, unreadable, truncated or not safetensors at all.
"""

from __future__ import annotations

import hashlib
import math
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
        path = Path(self.path)
        if not path.is_file():  # a directory, say, exists: "does not exist" would send the user looking elsewhere
            raise ReplayInputError(f"{self.describe()} " + ("is not a file" if path.exists() else "does not exist"))
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
        finite = torch.isfinite(cast)
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
        """``safe_open`` whose errors, at open or at a read, are a ReplayInputError naming the file."""
        try:
            with safe_open(self.path, framework="pt") as handle:
                yield handle
        except (SafetensorError, OSError) as err:
            reason = " ".join(str(err).split()) or type(err).__name__
            raise ReplayInputError(f"{self.describe()} is not a readable safetensors file: {reason}") from err


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
