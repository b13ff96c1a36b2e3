"""Kernel launches observed where they happen: each launch helper runs a kernel and records what it ran.

Every Triton kernel a backend launches goes through ``launch_triton``, and every torch matmul or reduction
through ``launch_torch`` (their summation order is what decides the bits; elementwise ops, copies and
selections are not recorded). Each records the launch under a name taken from the object it launched, never
from a string the caller passes, into the recorder of the node call in progress (``recording_launches``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from math import prod
from typing import Any


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel as launched: its name, derived from the launched object, and its launch configuration.

    ``config`` is for information only (block sizes, warps); only ``kernel`` is compared with a declaration.
    """

    kernel: str
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "config": dict(self.config)}


# The launches of the node call in progress; a ContextVar, so threads and tasks never see each other's.
_IN_PROGRESS: ContextVar[list[KernelLaunch] | None] = ContextVar("kernel_launches", default=None)


@contextmanager
def recording_launches() -> Iterator[list[KernelLaunch]]:
    """Collect every launch made through the helpers below until the block ends (an inner block takes over)."""
    launches: list[KernelLaunch] = []
    token = _IN_PROGRESS.set(launches)
    try:
        yield launches
    finally:
        _IN_PROGRESS.reset(token)


def record(launch: KernelLaunch) -> None:
    """Add ``launch`` to the node call in progress; outside any node call there is nothing to record into."""
    launches = _IN_PROGRESS.get()
    if launches is not None:
        launches.append(launch)


def triton_kernel_name(kernel: Any) -> str:
    """``kernels.triton_kernels.invariant_matmul_kernel``: the Python function a @triton.jit object wraps."""
    return f"{kernel.fn.__module__}.{kernel.fn.__qualname__}"


def launch_triton(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``, recorded with ``meta`` (constexprs, num_warps, num_stages) as its config."""
    # An empty grid has no program to run (Triton's CUDA launcher skips it too); the kernel chosen is still recorded.
    if prod(grid):
        kernel[grid](*args, **meta)
    record(KernelLaunch(triton_kernel_name(kernel), dict(meta)))


def launch_torch(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)`` for one aten overload (``torch.ops.aten.mm.default``), recorded as ``op.name()``."""
    out = op(*args, **kwargs)
    record(KernelLaunch(op.name()))
    return out


def distinct_launches(launches: Iterable[KernelLaunch]) -> tuple[KernelLaunch, ...]:
    """Each distinct launch once, in first-launch order, so a record does not grow with rows or splits."""
    seen: list[KernelLaunch] = []
    for launch in launches:
        if launch not in seen:  # configs are dicts, so launches compare but do not hash
            seen.append(launch)
    return tuple(seen)
