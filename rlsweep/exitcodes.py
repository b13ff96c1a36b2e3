"""How every command line ends: exit codes, one meaning each, shared by the run, the sweep gate, ``rlsweep.check``
and ``rlsweep.report``, and the one line on stderr that any error, usage error or signal ends it with.

docs/sweeps.md states them for users. Only judged verdicts may give GREEN or RED; everything else that
stops a command is ERROR, and missing or unverifiable results are INCOMPLETE. This module imports nothing heavy:
a command installs its start-up signal handlers from here before it imports torch, pandas or Hydra.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any, NoReturn

from rlsweep.errors import RlsweepError, UsageError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
    message where it does not already say it (Hydra's composition errors keep the reason in their cause).
    A ``SystemExit`` is said as the call that raised it (``describe_exit``), never as its bare code."""
    if isinstance(err, SystemExit):
        return f"the process was ended early through {describe_exit(err)}"
    text = " ".join(str(err).split()) or type(err).__name__
    cause = " ".join(str(err.__cause__ or "").split())
    if cause and cause not in text:
        text += f" ({cause})"
    return text


def exit_site(stop: SystemExit) -> str | None:
    """The module whose code raised ``stop`` (called ``sys.exit()``): the innermost frame of its traceback."""
    frame = stop.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return None if frame is None else frame.tb_frame.f_globals.get("__name__")


def describe_exit(stop: SystemExit) -> str:
    """``sys.exit(0) in module 'x'``: the code as it was passed, and where, for an error line."""
    site = exit_site(stop)
    return f"sys.exit({stop.code!r})" + (f" in module {site!r}" if site else "")


def expected(err: BaseException) -> bool:
    """Bad input rlsweep or the kernels refused on purpose: said plainly; anything else also names its type.

    A kernels error exists only once ``kernels.errors`` is imported, so it is looked up there: this module must not
    import torch (see the module docstring)."""
    kernel_errors = sys.modules.get("kernels.errors")
    return isinstance(err, RlsweepError) or (
        kernel_errors is not None and isinstance(err, kernel_errors.KernelInputError)
    )


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's time limit, a cancelled CI job), raised where the process is (``run_command``): it
    stops as on Ctrl-C, its cleanups run, and it ends with one line and exit 1, not the signal's silent 143."""


def stopped_by(signum: int) -> str:
    return "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"


class ErrorLine:
    """The one line on stderr a failed command ends with; once said, a later signal adds no second one."""

    said = False

    @classmethod
    def say(cls, prog: str, text: str) -> None:
        print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
        cls.said = True


def stop_at_once(prog: str) -> None:
    """SIGINT or SIGTERM ends the process at once, with one line and exit 1.

    A command installs this first, before its heavy imports: Python's own SIGINT prints a traceback from inside
    whatever import it lands in, and SIGTERM's default ends silently with 143. Nothing has started that needs a
    cleanup then; while the command's body runs, ``run_command`` turns the signals into exceptions instead.
    """

    def stop(signum: int, frame: Any) -> None:
        if not ErrorLine.said:
            os.write(2, f"{prog}: error: {stopped_by(signum)}\n".encode())
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a flush interrupted mid-write: what it held is lost with the process
                pass
        os._exit(ExitCode.ERROR)

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)


def raise_on_signals(prog: str) -> None:
    """Ctrl-C raises KeyboardInterrupt and SIGTERM ``Terminated`` where the process is, so its cleanups run; after the
    first, a second signal (cleanups that hang) ends the process at once (``stop_at_once``), still with one line."""

    def interrupted(signum: int, frame: Any) -> None:
        stop_at_once(prog)
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    for signum in STOP_SIGNALS:
        signal.signal(signum, interrupted)


def exit_without_teardown(status: int) -> NoReturn:
    """End the process as the interpreter ends it, up to tearing its modules down: non-daemon threads joined, atexit
    handlers run (weakref finalizers, multiprocessing's children, logging's files), the standard streams flushed;
    then exit with ``status`` without that teardown, which frees torch's, transformers' and pandas' objects one by one
    (0.6 - 0.7 s of a command on a 2-core CPU) for nothing the command does. A stream that cannot be flushed ends it
    with 120, as the interpreter's own exit does. Only a command line's ``__main__`` calls it, never a caller in the
    same process. Under a profiler or tracer (``python -m cProfile``, a debugger), which writes its results after the
    command returns, it exits as usual."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(status)
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            status = 120
    os._exit(status)


def run_command(prog: str, command: Callable[[], ExitCode]) -> int:
    """A command line's ``main``: its body under ``guarded``, with signals raised as exceptions while it runs.

    The handlers it found (``stop_at_once``, where the command was started from the shell) are back once it ends,
    so the process ends as it started; a caller in the same process (a test) gets its own back.
    """
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

    def body() -> ExitCode:
        raise_on_signals(prog)
        return command()

    try:
        return int(guarded(prog, body))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def one_line_usage(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with its usage errors raised as a ``UsageError`` of one line (the usage folded in), exit 1 through
    ``guarded``: argparse would print its usage and the error over several lines and exit 2, which reads as RED."""

    def error(message: str) -> None:
        usage = " ".join(parser.format_usage().split()[1:])  # without its "usage:" word
        raise UsageError(f"{message} (usage: {usage})")

    parser.error = error  # type: ignore[method-assign]
    return parser


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
        ErrorLine.say(prog, stopped_by(signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT))
        return ExitCode.ERROR
    except Exception as err:
        ErrorLine.say(prog, ("" if expected(err) else f"{type(err).__name__}: ") + one_line(err))
        return ExitCode.ERROR
