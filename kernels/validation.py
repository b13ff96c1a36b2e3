"""Input checks at the kernels' boundary.

Shapes, dtypes and devices are checked before anything is launched. Checks of values (finiteness, the targets'
range) need the values, which on a GPU means waiting for the device; each call queues them in a ``ValueChecks``
and reads every verdict at once, after its kernels are queued and before it returns (docs/kernels.md#errors).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable

import torch

from kernels.errors import (
    DtypeMismatchError,
    InputChangedError,
    KernelInputError,
    NonFiniteInputError,
    ShapeMismatchError,
    TargetOutOfRangeError,
)

EXECUTION_DTYPES = (torch.bfloat16, torch.float32)
IGNORE_INDEX = -100


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; the one dtype-name normalizer of the project."""
    return str(dtype).removeprefix("torch.")


class ValueChecks:
    """Checks of input and output values queued on the device, read in one device-to-host copy.

    ``add(failed, explain)`` queues a tensor of any shape (bools, or a kernel's integer status words) with a nonzero
    element when something may be wrong, and ``add_sum(total, explain)`` a 0-dim floating sum that is NaN or ±Inf
    then (``screen_sum``); ``explain`` looks closer: it raises the typed error naming the value, or returns when
    the screen was a false alarm (a sum of finite values can overflow). ``raise_first()`` waits for the device once
    and runs the explanation of the first failed check, in the order they were added, so a call raises what
    up-front checks would have raised. ``send()`` starts copying the verdicts queued so far to the host:
    ``raise_first()`` then waits for that copy, not for the kernels queued after it (a call whose checks are all of
    its inputs can return while its kernel runs).
    """

    def __init__(self) -> None:
        self._pending: list[tuple[torch.Tensor, Callable[[], None], bool]] = []
        # The verdicts of the first checks pending, on the host or on their way there (with the event that marks
        # their arrival), and how many checks they hold.
        self._sent: tuple[torch.Tensor, torch.cuda.Event | None, int] | None = None

    def add(self, failed: torch.Tensor, explain: Callable[[], None]) -> None:
        self._pending.append((failed, explain, False))

    def add_sum(self, total: torch.Tensor, explain: Callable[[], None]) -> None:
        self._pending.append((total, explain, True))

    def take(self, other: ValueChecks) -> None:
        """Queue ``other``'s pending checks after these, in their order, and empty ``other``."""
        pending, other._pending, other._sent = other._pending, [], None
        self._pending.extend(pending)

    def send(self) -> None:
        """Copy the verdicts queued so far to pinned host memory, on a side stream (``verdict_stream``) that waits
        for the current stream's work so far; once only."""
        values = [value for value, _, _ in self._pending]
        if self._sent is not None or not values:
            return
        verdicts, copied = flattened(values), None
        if verdicts.device.type == "cuda":
            # Copied on a side stream once computed, so the copy runs beside the kernels queued after it rather than
            # ahead of them (H200, kernels.matmul at T = 64: 314 µs, against 325 with the kernel queued behind it).
            host = torch.empty(verdicts.shape, dtype=verdicts.dtype, pin_memory=True)
            side = verdict_stream(verdicts.device)
            side.wait_stream(torch.cuda.current_stream(verdicts.device))
            with torch.cuda.stream(side):
                host.copy_(verdicts, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(side)
            verdicts.record_stream(side)  # its memory is not reused before the copy has read it
            verdicts = host
        self._sent = (verdicts, copied, len(values))

    def raise_first(self) -> None:
        pending, self._pending = self._pending, []
        sent, self._sent = self._sent, None
        if not pending:
            return
        on_host: list[torch.Tensor] = []
        checks_sent = 0
        if sent is not None:
            host, copied, checks_sent = sent
            if copied is not None:
                copied.synchronize()
            on_host.append(host)
        rest = [value for value, _, _ in pending[checks_sent:]]
        if rest:  # the call's one wait for the device
            on_host.append(verdicts_to_host(flattened(rest)))
        read = on_host[0] if len(on_host) == 1 else torch.cat(on_host)
        sizes = [value.numel() for value, _, _ in pending]
        if read.numel() != sum(sizes):  # never expected: a verdict read short would pass unseen
            raise RuntimeError(f"read {read.numel()} verdict values for {len(pending)} checks of {sum(sizes)} values")
        at = 0
        for (_, explain, is_sum), size in zip(pending, sizes, strict=True):
            words, at = (read if size == read.numel() else read[at : at + size]), at + size
            if verdict_failed(words, is_sum):
                explain()


def verdicts_to_host(verdicts: torch.Tensor) -> torch.Tensor:
    """``verdicts`` on the host, read by a call's one wait for the device: from CUDA, a copy into pinned memory on
    the current stream, then a wait for an event recorded after it (on an H200, 5 - 9 µs less than ``.cpu()``'s
    copy into pageable memory at T = 64 in two runs, the same within the noise at 16384: docs/benchmarks.md).
    ``benchmarks/bench_wait.py`` times this read beside ``.cpu()``."""
    if verdicts.device.type != "cuda":
        return verdicts.cpu()
    host = torch.empty(verdicts.shape, dtype=verdicts.dtype, pin_memory=True)
    host.copy_(verdicts, non_blocking=True)
    landed = torch.cuda.Event()
    landed.record(torch.cuda.current_stream(verdicts.device))
    landed.synchronize()
    return host


SMALL_VERDICT = 64  # up to this many values a verdict is read as a Python list, past it by a torch op on the host


def verdict_failed(words: torch.Tensor, is_sum: bool) -> bool:
    """Whether one check's verdict values, on the host, say it failed: a sum that is not finite, else any nonzero
    value. Many values (1024 status words of a 16384-row call) take one op, 3 µs against 12 for a list."""
    if words.numel() > SMALL_VERDICT:
        return (not bool(words.isfinite().all())) if is_sum else bool(words.any())
    values = words.tolist()
    return (not all(map(math.isfinite, values))) if is_sum else any(values)


@functools.cache
def verdict_stream(device: torch.device) -> torch.cuda.Stream:
    """The CUDA stream ``ValueChecks.send`` copies verdicts on, one per device."""
    return torch.cuda.Stream(device)


def flattened(values: list[torch.Tensor]) -> torch.Tensor:
    """Every element of the verdicts, in order, as one 1-dim tensor; a lone verdict is reshaped, without a cat to
    launch. The cat promotes bools, status words and sums to one floating dtype, which keeps each verdict (a status
    word is a few bits)."""
    return values[0].reshape(-1) if len(values) == 1 else torch.cat([value.reshape(-1) for value in values])


def check_matmul_values(hidden: torch.Tensor, weight: torch.Tensor, checks: ValueChecks) -> None:
    """hidden's finiteness queued in ``checks``; weight's checked at its first sight (``check_finite_once``)."""
    check_finite("hidden", hidden, checks)
    check_finite_once("weight", weight)


def check_tensor(name: str, value: object) -> None:
    """A dense tensor with its values in memory: the kernels read memory, so no list, sparse or meta tensor."""
    if not isinstance(value, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided or value.is_meta:
        where = "on the meta device" if value.is_meta else f"of layout {value.layout}"
        raise KernelInputError(f"{name} is a tensor {where}; the kernels take dense (strided) tensors with values")


def resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with the values it reads as: a view PyTorch marks negated or conjugated (``x.conj().imag``) keeps
    the other values in memory, which is what the kernels read, so it is materialized; any other tensor is
    returned as it is. Differentiable."""
    return tensor.resolve_neg().resolve_conj()


def check_matmul_shapes(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """Shapes, dtypes and device of hidden[T, H] and weight[V, H]: everything but their values."""
    check_tensor("hidden", hidden)
    check_tensor("weight", weight)
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


def check_lm_head_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, checks: ValueChecks
) -> None:
    """``check_matmul_shapes`` and ``check_matmul_values`` plus targets[T] on the same device."""
    check_matmul_shapes(hidden, weight)
    check_matmul_values(hidden, weight, checks)
    check_targets(targets, rows=hidden.shape[0])
    if targets.device != hidden.device:
        raise ShapeMismatchError(f"inputs on different devices: hidden {hidden.device}, targets {targets.device}")


def check_logits_inputs(logits: torch.Tensor, targets: torch.Tensor, checks: ValueChecks, *, values: bool) -> None:
    """logits[T, V] with targets[T] on the same device; ``values``: also queue a scan of the logits for NaN and
    ±Inf (a backend whose kernel detects them itself skips this second pass over T*V values)."""
    check_tensor("logits", logits)
    if logits.dim() != 2:
        raise ShapeMismatchError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in (*EXECUTION_DTYPES, torch.float64):
        raise DtypeMismatchError(f"logits have dtype {logits.dtype}; supported: bfloat16, float32, float64")
    check_targets(targets, rows=logits.shape[0])
    if targets.device != logits.device:
        raise ShapeMismatchError(f"inputs on different devices: logits {logits.device}, targets {targets.device}")
    if values:
        check_finite("logits", logits, checks)


def check_targets(targets: torch.Tensor, *, rows: int) -> None:
    check_tensor("targets", targets)
    if targets.dim() != 1 or targets.shape[0] != rows:
        raise ShapeMismatchError(f"targets must be [T] with T={rows}, got shape {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise DtypeMismatchError(f"targets have dtype {targets.dtype}; supported: int64, int32")


def check_target_range(targets: torch.Tensor, vocab_size: int, checks: ValueChecks) -> torch.Tensor:
    """Queue the check that every target is in [0, vocab_size) or equal to IGNORE_INDEX.

    Returns the targets with any other value replaced by IGNORE_INDEX: the kernels launched before the verdict is
    read then never index with it, and the call raises ``TargetOutOfRangeError`` before returning anything."""
    bad = out_of_range(targets, vocab_size)
    checks.add(bad.any(), functools.partial(explain_target_range, targets, bad, vocab_size))
    return torch.where(bad, IGNORE_INDEX, targets)


def out_of_range(targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[T] bool: the target is outside [0, vocab_size) and is not IGNORE_INDEX."""
    return ((targets < 0) | (targets >= vocab_size)) & (targets != IGNORE_INDEX)


def explain_target_range(targets: torch.Tensor, bad: torch.Tensor, vocab_size: int) -> None:
    position = int(bad.nonzero()[0, 0])
    value = int(targets[position])
    if not bool(out_of_range(targets[position : position + 1], vocab_size)[0]):
        raise InputChangedError(changed_since_checked("targets", f"target {value} at row {position}"))
    raise TargetOutOfRangeError(
        f"target id {value} at row {position} is outside [0, {vocab_size}) and is not ignore_index={IGNORE_INDEX}",
        position=position,
        value=value,
    )


def screen_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The 0-dim sum of ``tensor``, accumulated in fp32 (float64 for float64): not finite when ``tensor`` may hold a
    NaN or ±Inf. One kernel that reads the tensor once without a temporary (``torch.isfinite`` of a bf16 [T, H]
    allocates 2.5x its size); finite values can also give a non-finite sum, by overflow, so a non-finite screen is
    only a reason to look closer."""
    return tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32)


def check_finite(name: str, tensor: torch.Tensor, checks: ValueChecks | None = None) -> None:
    """NonFiniteInputError naming the first NaN or ±Inf of ``tensor``: at once, or queued in ``checks``."""
    explain = functools.partial(explain_nonfinite, name, tensor)
    if checks is not None:
        checks.add_sum(screen_sum(tensor), explain)
    elif not math.isfinite(screen_sum(tensor).item()):
        explain()


def explain_nonfinite(name: str, tensor: torch.Tensor) -> None:
    """Look at ``tensor`` element by element after a failed screen; raise for a NaN or ±Inf, return if none."""
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        index = tuple(int(i) for i in (~finite).nonzero()[0])
        raise NonFiniteInputError(f"{name} holds a non-finite value {tensor[index].item()} at index {index}")
    # Finite values whose sum overflows fail the screen again; a screen that passes now saw other values.
    if math.isfinite(screen_sum(tensor).item()):
        raise InputChangedError(changed_since_checked(name, "every value is finite now"))


def explain_narrowing(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """NonFiniteInputError naming the first finite value of ``tensor`` past the range of ``dtype``, the narrower
    dtype a backend reads it in (float64 logits reduced in float32): it reads as ±Inf there."""
    if not tensor.dtype.is_floating_point or torch.finfo(tensor.dtype).max <= torch.finfo(dtype).max:
        return
    past = torch.isfinite(tensor) & ~torch.isfinite(tensor.to(dtype))
    if bool(past.any()):
        index = tuple(int(i) for i in past.nonzero()[0])
        raise NonFiniteInputError(
            f"{name} holds {tensor[index].item()} at index {index}, past the largest finite {dtype_name(dtype)} "
            f"({torch.finfo(dtype).max:.4g}), the dtype they are reduced in: it reads as ±inf there"
        )


def changed_since_checked(name: str, now: str) -> str:
    return (
        f"{name} changed after the call that queued its check: the check found a bad value, but {now}; the call's "
        "outputs were computed from the old values and are not to be used (do not write to a call's inputs before "
        "its checks are read)"
    )


def version_stamp(tensor: torch.Tensor) -> tuple | None:
    """What says a tensor object still holds the values it held, without reading them: its in-place version counter
    (bumped by every in-place op on it or a view of it), storage, shape, strides, dtype and device; compared for the
    same object only (``id``, kept while the object lives). None for an inference tensor, which counts no versions:
    it is never taken as unchanged. Writes that bypass the counter (through ``.data`` or a NumPy array sharing the
    memory) are not seen (docs/kernels.md#errors)."""
    if tensor.is_inference():
        return None
    return (tensor._version, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


# id(tensor) -> its version_stamp when found finite. A weight is checked once, not on every call: reading a
# 151936 x 4096 head costs as much as a decode-size matmul.
_FINITE: dict[int, tuple] = {}


def check_finite_once(name: str, tensor: torch.Tensor) -> None:
    """``check_finite``, skipped for a tensor already found finite and unchanged since (``version_stamp``). The first
    sight of a tensor is checked at once (it is remembered only once found finite); later calls queue nothing."""
    key, stamp = id(tensor), version_stamp(tensor)
    if stamp is not None and _FINITE.get(key) == stamp:
        return
    check_finite(name, tensor)
    if stamp is None:
        return
    if key not in _FINITE:
        weakref.finalize(tensor, _FINITE.pop, key, None)
    _FINITE[key] = stamp
