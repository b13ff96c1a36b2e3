"""Exit codes, one meaning each, shared by the run, the sweep gate, ``rlsweep.check`` and ``rlsweep.report``.

docs/sweeps.md states them for users. Only judged verdicts may give GREEN or RED; everything else that
stops a command is ERROR, and missing or unverifiable results are INCOMPLETE.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any

import kernels
from rlsweep.errors import RlsweepError

EXPECTED_ERRORS = (RlsweepError, kernels.KernelInputError)  # said plainly; anything else also names its type


class ExitCode(IntEnum):
    GREEN = 0  # every expected verdict present and as expected
    ERROR = 1  # bad input, bad config, usage error, crash
    RED = 2  # judged verdicts exist and some are not as expected
    INCOMPLETE = 3  # jobs, tables or verdicts missing, or not from the config beside them

    @property
    def word(self) -> str:
        return self.name


# When several apply, the first of these wins: an error hides everything, then missing results, then RED.
PRECEDENCE = (ExitCode.ERROR, ExitCode.INCOMPLETE, ExitCode.RED, ExitCode.GREEN)


def combine(codes: Iterable[ExitCode]) -> ExitCode:
    """The code of several findings: ERROR before INCOMPLETE before RED before GREEN."""
    found = set(codes)
    return next((code for code in PRECEDENCE if code in found), ExitCode.GREEN)


def one_line(err: BaseException) -> str:
    """An exception as one line: its message, or its type where the message is empty, then its cause's
    message where it does not already say it (Hydra's composition errors keep the reason in their cause)."""
    text = " ".join(str(err).split()) or type(err).__name__
    cause = " ".join(str(err.__cause__ or "").split())
    if cause and cause not in text:
        text += f" ({cause})"
    return text


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's time limit, a cancelled CI job), raised where the process is (``stop_on_sigterm``): it
    stops as on Ctrl-C, its cleanups run, and it ends with one line and exit 1, not the signal's silent 143."""


def stop_on_sigterm() -> None:
    def terminated(signum: int, frame: Any) -> None:
        raise Terminated

    signal.signal(signal.SIGTERM, terminated)


def guarded(prog: str, command: Callable[[], ExitCode]) -> ExitCode:
    """Run a command line's body: any exception is one line on stderr and ERROR, never a traceback.

    argparse's own usage exit (2) would read as RED, so it is mapped to ERROR.
    """
    try:
        return ExitCode(command())
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        return ExitCode.GREEN if code == 0 else ExitCode.ERROR
    except KeyboardInterrupt as stop:
        print(f"{prog}: error: {'terminated (SIGTERM)' if isinstance(stop, Terminated) else 'interrupted'}",
              file=sys.stderr)  # fmt: skip
        return ExitCode.ERROR
    except Exception as err:
        kind = "" if isinstance(err, EXPECTED_ERRORS) else f"{type(err).__name__}: "
        print(f"{prog}: error: {kind}{one_line(err)}", file=sys.stderr)
        return ExitCode.ERROR
