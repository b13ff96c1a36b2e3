"""Triton's CPU interpreter without its per-call re-patching: the same arithmetic, a fifth less time.

Under ``TRITON_INTERPRET=1`` a launch patches ``triton.language`` for the interpreter once (``GridExecutor``), runs
every program, and restores it. But each call of a ``@triton.jit`` device function from inside a program (a helper
of ours, or ``tl.sum``, ``tl.cdiv``, which are such functions) patches the language modules its module sees again,
every call, and leaves those patches in place: 0.5 ms of ``inspect.getmembers`` per call, tens of thousands of
calls per run (a fifth of an interpreted run's time, docs/benchmarks.md#the-triton-interpreter).
``patch_device_calls_once`` makes a device function's call patch only modules its launch has not patched yet (told
apart by the module globals that name them); what it patches stays in place, as the interpreter leaves it.

The function calls, the programs and every tensor operation are the interpreter's own: only how often the same
attributes are set changes. Where this Triton's interpreter does not have the structure the patch expects, it is
left as it is (slower, the same bits).
"""

from __future__ import annotations

import functools
from contextvars import ContextVar
from typing import Any

# The module globals (by id) whose language modules the launch in progress has patched; None outside a launch.
_PATCHED: ContextVar[set[int] | None] = ContextVar("interpreter_patched", default=None)


@functools.cache
def patch_device_calls_once() -> bool:
    """Install the once-per-launch patching in this process; whether this Triton's interpreter allowed it."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid_executor = getattr(interpreter, "GridExecutor", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    error = getattr(interpreter, "InterpreterError", None)
    if not (grid_executor and function and hasattr(function, "rewrite") and error):
        return False
    if not callable(getattr(interpreter, "_patch_lang", None)):
        return False
    launch = grid_executor.__call__

    @functools.wraps(launch)
    def launch_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _PATCHED.set({id(self.fn.__globals__)})
        try:
            return launch(self, *args, **kwargs)
        finally:
            _PATCHED.reset(token)

    def device_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched = _PATCHED.get()
        if patched is None or id(self.fn.__globals__) not in patched:  # outside a launch: every call, as before
            interpreter._patch_lang(self.fn)
            if patched is not None:
                patched.add(id(self.fn.__globals__))
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            raise error(repr(err)) from err

    grid_executor.__call__ = launch_once
    function.__call__ = device_call
    return True
