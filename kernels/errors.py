"""Typed errors raised by the kernels: bad input before any work is done, overflow after."""

from __future__ import annotations


class KernelInputError(ValueError):
    """Bad input to a kernel entry point; the message names the offending value."""


class ShapeMismatchError(KernelInputError):
    """Tensor shapes that cannot be combined (for example hidden[T, H] with weight[V, H'])."""


class DtypeMismatchError(KernelInputError):
    """A dtype outside what the op supports, or operands of different dtypes."""


class TargetOutOfRangeError(KernelInputError):
    """A target id outside [0, vocab) that is not the ignore_index."""

    def __init__(self, message: str, *, position: int, value: int):
        super().__init__(message)
        self.position = position
        self.value = value


class NonFiniteInputError(KernelInputError):
    """NaN or Inf in hidden states or weights."""


class InputChangedError(KernelInputError):
    """An input changed between the call that queued its check and the read of that check (``checks=``): the
    call's outputs were computed from values no longer there, and are not to be used."""


class TPConfigError(KernelInputError):
    """A tensor-parallel request or vocab tile the geometry or the machine cannot serve."""


class NonFiniteOutputError(KernelInputError):
    """Finite inputs gave a NaN or ±Inf logp or lse: the row's logits overflowed the execution dtype."""

    def __init__(self, message: str, *, row: int):
        super().__init__(message)
        self.row = row


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here (missing device, module or interpreter)."""


class RankGroupError(RuntimeError):
    """The distributed ranks (``tp_mode="distributed"``) could not serve a call: a rank could not start, raised or
    died, or an earlier call closed the group. The message names the rank and its error (or why the group closed),
    and the rank's traceback is a note."""


class NoBackwardError(RuntimeError):
    """A gradient asked of a kernel that has no backward (the invariant body's: ``kernels.body``)."""
