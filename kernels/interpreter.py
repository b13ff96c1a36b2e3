"""Triton's CPU interpreter without its re-patching: the same arithmetic, in less time.

Under ``TRITON_INTERPRET=1`` every launch patches ``triton.language`` for the interpreter (``GridExecutor`` calls
``_patch_lang``: 2 - 3 ms of ``inspect.getmembers``), runs every program, and restores it; and each call of a
``@triton.jit`` device function from inside a program (a helper of ours, or ``tl.sum``, ``tl.cdiv``, which are such
functions) patches the language modules its module sees again, every call, and leaves those patches in place. The
patches are the same every time: the interpreter's one builder and semantic layer, set on the same members of the
same modules. ``patch_language_once`` makes ``_patch_lang`` patch the language modules a module's functions see the
first time a function of that module asks, and leave them patched: in a process that interprets, every kernel is
interpreted, so ``triton.language`` stays in the interpreter's form for the process's life. Launches of small kernels
(the invariant body's: ``kernels.body``) spent about half their time there (docs/benchmarks.md#the-triton-interpreter).

The function calls, the programs and every tensor operation are the interpreter's own: only how often the same
attributes are set changes. Where this Triton's interpreter does not have the structure the patch expects, it is
left as it is (slower, the same bits).

``skip_dead_overflow_checks`` drops work whose result nothing reads. Triton's ``+``, ``-`` and ``*`` on 32-bit integers
ask the semantic layer for an overflow check (``sanitize_overflow``): the operands again in int64, the operation, two
comparisons, and a ``device_assert`` of the result. Without ``debug`` that assert is dropped (a compiled kernel's
optimiser removes the whole check as dead code), but the interpreter computes the check eagerly, on every index
operation of every program: about a third of the invariant body's time. With ``debug`` off the check is off too, so
nothing a kernel computes, stores or raises changes.

``exact_float_casts`` gives the interpreter's bf16 <-> fp32 conversion (``_convert_float``: a cast, and the ``other``
value of every masked load, broadcast to the block) its own bits in one shift where no input is subnormal. The general
conversion walks every mantissa bit of the block once any element's exponent field is zero, which every 0.0 has: a
bf16 load's ``other=0.0`` took about a fifth of a small matmul launch. Where an element is a nonzero subnormal the
interpreter's own conversion runs, so every value is the one it gives (tests/test_interpreter.py checks all 65,536
bf16 patterns and fp32 ones of every exponent).

``remembered_numpy_dtypes``: the interpreter looks up the numpy dtype of a Triton type on nearly every operation, and
each lookup built a table of 17 numpy dtypes first (about 5 % of an invariant-body run). The answer depends on the
element type alone, so it is looked up once per element type.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


@functools.cache
def patch_language_once() -> bool:
    """Install the once-per-process patching of ``triton.language``; whether this Triton's interpreter allowed it."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if not callable(patch_lang) or scope is None or not callable(getattr(scope, "restore", None)):
        return False
    patched: set[int] = set()  # the module globals (by id) whose language modules are patched

    @functools.wraps(patch_lang)
    def patch_once(fn: Any) -> Any:
        key = id(fn.__globals__)
        if key not in patched:
            patch_lang(fn)  # its scope is dropped: the patches stay in place
            patched.add(key)
        return scope()  # a launch's restore() then has nothing to undo

    interpreter._patch_lang = patch_once
    skip_dead_overflow_checks(interpreter)
    exact_float_casts(interpreter)
    remembered_numpy_dtypes(interpreter)
    return True


def skip_dead_overflow_checks(interpreter: Any) -> None:
    """Turn the interpreter's integer-overflow checks off where their asserts are dropped (``debug`` off)."""
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "debug", True) is False:
        if getattr(options, "sanitize_overflow", False) is True:
            builder.options = dataclasses.replace(options, sanitize_overflow=False)


def exact_float_casts(interpreter: Any) -> None:
    """bf16 -> fp32 and fp32 -> bf16 without rounding (a cast's mode: None) as one shift of the bits, which is what
    the interpreter's ``_convert_float`` gives for every input but a nonzero subnormal: widening appends 16 zero
    bits, narrowing keeps the upper 16 (it truncates; NaN payloads and the sign included). Inputs holding a nonzero
    subnormal go to the interpreter's own conversion, whatever it makes of them."""
    convert = getattr(interpreter, "_convert_float", None)
    language = getattr(interpreter, "tl", None)
    if not callable(convert) or getattr(convert, "exact_shift", False) or language is None:
        return
    import numpy as np

    widths = {(language.bfloat16, language.float32): (np.uint16, np.uint32, 16),
              (language.float32, language.bfloat16): (np.uint32, np.uint16, -16)}  # fmt: skip

    @functools.wraps(convert)
    def convert_float(input: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
        shifted = widths.get((input_dtype, output_dtype)) if rounding_mode is None else None
        if shifted is None or not isinstance(input, np.ndarray) or input.itemsize != np.dtype(shifted[0]).itemsize:
            return convert(input, input_dtype, output_dtype, rounding_mode)
        source, target, shift = shifted
        bits = np.ascontiguousarray(input).view(source)
        exponent_mask, mantissa_mask = (0x7F80, 0x007F) if source is np.uint16 else (0x7F800000, 0x007FFFFF)
        if np.any(((bits & exponent_mask) == 0) & ((bits & mantissa_mask) != 0)):
            return convert(input, input_dtype, output_dtype, rounding_mode)
        out = bits.astype(target) << shift if shift > 0 else (bits >> -shift).astype(target)
        return out.reshape(input.shape)

    convert_float.exact_shift = True
    interpreter._convert_float = convert_float


def remembered_numpy_dtypes(interpreter: Any) -> None:
    """``_get_np_dtype`` once per element type: a block's answer is its element type's (a pointer's: uint64)."""
    lookup = getattr(interpreter, "_get_np_dtype", None)
    language = getattr(interpreter, "tl", None)
    block_type = getattr(language, "block_type", None)
    if not callable(lookup) or getattr(lookup, "remembered", False) or not isinstance(block_type, type):
        return
    known: dict[Any, Any] = {}

    @functools.wraps(lookup)
    def numpy_dtype(tt_dtype: Any) -> Any:
        key = tt_dtype.element_ty if isinstance(tt_dtype, block_type) else tt_dtype
        try:
            return known[key]
        except KeyError:
            known[key] = found = lookup(key)
            return found
        except TypeError:  # a type that cannot be a key is looked up as the interpreter would
            return lookup(tt_dtype)

    numpy_dtype.remembered = True
    interpreter._get_np_dtype = numpy_dtype
