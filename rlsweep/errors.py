"""Typed errors for bad input (to a run, the gate, the analysis); each names the offending value and what is valid.

All of them end a run with exit code 1 and one paragraph on stderr (``rlsweep.__main__``).
"""

from __future__ import annotations


class RlsweepError(ValueError):
    """Bad input to a run: configuration, data file, contract or output location."""


class ConfigError(RlsweepError):
    """A configuration value outside what the run can serve (tp, chunk_size, needle position, ...)."""


class ContractError(RlsweepError):
    """A tolerance contract that is malformed or would weaken a verdict."""


class ReplayInputError(RlsweepError):
    """A replay or weight file that is missing a tensor or holds wrong shapes, dtypes or values."""


class OutputDirError(RlsweepError):
    """The run's output directory cannot be written."""


class TablesNotFoundError(RlsweepError):
    """A path that holds no rlsweep tables (or is not a readable directory)."""


class UnreadablePathError(RlsweepError):
    """A file or directory that exists but cannot be read (its permissions, an I/O error): named, never passed over."""


class SelectionError(RlsweepError):
    """An analysis selector that matches no token, or not exactly one token per logical key."""


class UsageError(RlsweepError):
    """A command line that its parser cannot read: an unknown flag, a missing or empty argument."""
