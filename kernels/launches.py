"""Kernel launches observed where they happen, never named by the backend that launched them.

Two observers, one record (docs/dispatch.md#observed-provenance):
- ``observing_dispatcher`` runs a node call under torch's profiler and keeps what the dispatcher saw: each torch
  op whose summation order decides the bits (a matmul, a reduction, a softmax; ``reducing_op``), each custom op
  (any operator namespace but torch's own) and each compiled graph that ran (``torch.compile``: the FX graph's
  cache key), outermost first: what such an op or graph ran inside it is part of it. Elementwise ops, copies,
  views and allocations are not kept.
- ``launch_triton`` runs a Triton kernel and records the ``@triton.jit`` function it launched: under the Triton
  interpreter no dispatcher sees it. A Triton kernel that a library launches itself (Liger-Kernel's) is recorded
  the same way while the dispatcher is observed: ``watch_triton_launches`` wraps Triton's own launcher.
Both record into the recorder of the node call in progress (``recording_launches``). The dispatcher is observed
only inside ``observed_provenance()`` (a dispatched ``LogprobOp`` call, every rlsweep run): the profiler costs
milliseconds a node, which a training step calling ``kernels.lm_head_logprob`` should not pay.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.autograd.profiler import profile

from kernels.interpreter import patch_language_once


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


# Whether node calls in this context observe the dispatcher (``observed_provenance``).
_OBSERVED: ContextVar[bool] = ContextVar("observed_provenance", default=False)


@contextmanager
def observed_provenance() -> Iterator[None]:
    """Node calls inside the block observe what the dispatcher ran (``observing_dispatcher``); outside it their
    records hold Triton launches only and say so (``NodeProvenance.observed``), and no provenance check passes them."""
    token = _OBSERVED.set(True)
    try:
        yield
    finally:
        _OBSERVED.reset(token)


def observing() -> bool:
    """Whether node calls here observe the dispatcher."""
    return _OBSERVED.get()


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


# True while ``launch_triton`` launches: the launch is recorded there, with its configuration, not again by the watch.
_LAUNCHING: ContextVar[bool] = ContextVar("launching_triton", default=False)


def launch_triton(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``, recorded with ``meta`` (constexprs, num_warps, num_stages) as its config."""
    # An empty grid has no program to run (Triton's CUDA launcher skips it too); the kernel chosen is still recorded.
    if prod(grid):
        token = _LAUNCHING.set(True)
        try:
            kernel[grid](*args, **meta)
        finally:
            _LAUNCHING.reset(token)
    record(KernelLaunch(triton_kernel_name(kernel), dict(meta)))


@functools.cache
def watch_triton_launches() -> None:
    """Wrap the ``run`` of Triton's kernel classes, compiled and interpreted, once per process: while a node call
    observes (``observing``), every kernel launched other than through ``launch_triton`` is recorded under the
    ``@triton.jit`` function's name. Neither the dispatcher nor, under the interpreter, the profiler sees a Triton
    launch; Triton's launch hooks are not called by its interpreter, so its launchers are wrapped instead."""
    from triton.runtime import interpreter, jit

    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        cls.run = watched_run(cls.run)


class TritonImportWatch(importlib.abc.MetaPathFinder):
    """Installs ``watch_triton_launches`` as soon as ``import triton`` has run, whoever imports it and when: a
    library that imports triton inside its first node call has its launches in that call recorded too."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "triton":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_watch(module: Any) -> None:
            exec_module(module)
            triton_imported()

        spec.loader.exec_module = exec_then_watch
        return spec


def watch_triton_when_imported() -> None:
    """Watch Triton's launchers now if triton is imported, else from the moment it is (``TritonImportWatch``)."""
    if "triton" in sys.modules:
        triton_imported()
    elif not any(isinstance(finder, TritonImportWatch) for finder in sys.meta_path):
        sys.meta_path.insert(0, TritonImportWatch())


def triton_imported() -> None:
    """What this package installs into Triton once it is imported: the launch watch, and the interpreter's
    once-per-process patching of triton.language (kernels/interpreter.py), which changes no bit."""
    watch_triton_launches()
    patch_language_once()


def watched_run(run: Any) -> Any:
    @functools.wraps(run)
    def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
        if observing() and not _LAUNCHING.get() and not kwargs.get("warmup"):
            record(KernelLaunch(triton_kernel_name(self)))
        return run(self, *args, **kwargs)

    return watched


# Packet names (``aten::<name>``) of the torch ops whose summation order decides their bits: matmuls, reductions,
# softmaxes, norms, losses, attention. An op every overload of which torch tags pointwise (``maximum``, ``clamp_min``)
# is elementwise whatever its name says.
REDUCING_NAMES = re.compile(
    r"mm|matmul|linear|dot|mv|addr|einsum|conv|sum|mean|amax|amin|max|min|prod|norm|var|std|softmax|logsumexp|"
    r"loss|cum|attention|median|reduce|embedding_bag|trapz|trapezoid"
)
# Operator namespaces that are torch's own: their ops are kept only where ``reducing_op`` says so. Any other
# namespace is a custom op (``torch.library``), kept whatever it does.
TORCH_NAMESPACES = frozenset({"aten", "prim", "prims", "profiler", "autograd", "c10d", "inductor", "cuda"})
# What torch.compile does while it compiles (tracing runs ops on fake tensors): none of it is a launch. Such a range
# hides what it encloses only where dynamo converted at least as many frames during the block as the profile holds
# ranges of that name (``dynamo_frames``): a node that names a range of its own "dynamo" hides nothing.
COMPILING = frozenset({"dynamo"})
COMPILED_GRAPH = re.compile(r"## Call CompiledFxGraph (\S+) ##")
# The kernel name a compiled graph is recorded under; its FX graph's cache key goes in the launch's config.
COMPILED_GRAPH_KERNEL = "torch.compile::graph"


@functools.cache
def reducing_op(name: str) -> bool:
    """Whether the aten op ``name`` (``sum``, ``log_softmax``) is a matmul or reduction (``REDUCING_NAMES``)."""
    if not REDUCING_NAMES.search(name):
        return False
    overloads = aten_overloads(name)
    return bool(overloads) and not all(torch.Tag.pointwise in overload.tags for overload in overloads)


def aten_overloads(name: str) -> list[Any]:
    """Every overload of the aten op ``name``; none where torch has no such op."""
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return []
    return [getattr(packet, overload) for overload in packet.overloads()]


def observed_launch(name: str) -> KernelLaunch | None:
    """What a profiler event named ``name`` records, or None: a reducing aten op, a custom op, a compiled graph."""
    compiled = COMPILED_GRAPH.fullmatch(name)
    if compiled:
        return KernelLaunch(COMPILED_GRAPH_KERNEL, {"graph": compiled.group(1)})
    namespace, colons, op = name.partition("::")
    if not colons or not op or " " in name:
        return None
    if namespace == "aten":
        return KernelLaunch(name) if reducing_op(op) else None
    if namespace in TORCH_NAMESPACES or not touches_tensors(namespace, op):
        return None
    return KernelLaunch(name)


@functools.cache
def touches_tensors(namespace: str, name: str) -> bool:
    """Whether the custom op ``namespace::name`` takes or returns a tensor in any overload. One that does neither
    computes nothing on the node's tensors: a version query a library makes while it imports (seen on CUDA:
    ``torchvision::_cuda_version``, inside Liger-Kernel's first call). An op whose schema cannot be read counts as
    touching them."""
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        schemas = [getattr(packet, overload)._schema for overload in packet.overloads()]
    except (AttributeError, RuntimeError):
        return True
    types = [str(value.type) for schema in schemas for value in (*schema.arguments, *schema.returns)]
    return not schemas or any("Tensor" in kind for kind in types)


@functools.cache
def profiler_config() -> _ExperimentalConfig:
    """Every thread's ops, where this torch can (``profile_all_threads``); else the calling thread's only."""
    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # a torch without the option
        return _ExperimentalConfig()


@functools.cache
def quiet_profiler() -> None:
    """The profiler logs two lines on stderr per use unless told otherwise; a user's own setting is kept."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


# Whether this thread is inside ``observing_dispatcher``'s profile, and inside a ``bookkeeping`` block there.
_PROFILING: ContextVar[bool] = ContextVar("profiling", default=False)
_BOOKKEEPING: ContextVar[bool] = ContextVar("bookkeeping", default=False)


@contextmanager
def bookkeeping() -> Iterator[None]:
    """The block is rlsweep's own work inside an observed block (hooks copying each module's tensors for the
    first-divergence table, rlsweep/divergence.py): it runs with this thread's record functions off, so the profiler
    records none of its ops. They are not the node's, and costing nothing to record or to read back they keep a body's
    observation cheap (the profiler's stop takes about 11 us an event). Record functions are per thread: ops that any
    other thread runs meanwhile are recorded as the node's, as always, and no range a node names hides anything."""
    if not _PROFILING.get() or _BOOKKEEPING.get():
        yield
        return
    token = _BOOKKEEPING.set(True)
    torch._C._autograd._enable_record_function(False)
    try:
        yield
    finally:
        torch._C._autograd._enable_record_function(True)  # on, as the profiler needs it around the block
        _BOOKKEEPING.reset(token)


# The profiler is one per process and sees every thread: node calls made at once on two threads take turns, and ops
# another thread runs meanwhile are seen as the node's (a backend cannot hide a reduction in a thread of its own).
_PROFILER = threading.Lock()


@contextmanager
def observing_dispatcher() -> Iterator[None]:
    """Record (``record``) what the dispatcher ran inside the block: each event ``observed_launch``
    keeps, outermost first (one inside another kept event is part of it), in the order they started. Outside
    ``observed_provenance`` it observes nothing."""
    if not observing():
        yield
        return
    quiet_profiler()
    if torch.autograd.profiler._is_profiler_enabled:
        raise RuntimeError(
            "a node call was made while torch's profiler was already running (a node call inside another, or the "
            "caller's own profiler): provenance observes each node call with a profiler of its own"
        )
    token = _PROFILING.set(True)
    try:
        # autograd's profiler, not torch.profiler's, whose start imports torch._inductor (a second) to look for it.
        with _PROFILER, profile(use_device=None, experimental_config=profiler_config()) as profiler:
            frames = dynamo_frames()
            yield
            frames = dynamo_frames() - frames
    finally:
        _PROFILING.reset(token)
    events = profiler.kineto_results.events()
    for launch in outermost_launches(events, compiled_frames=frames):
        record(launch)


def dynamo_frames() -> int:
    """The frames torch.compile's dynamo has been asked to convert in this process (each compile's "dynamo" range is
    one of them); 0 while it is not imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["frames"]["total"])


def outermost_launches(events: Iterable[Any], compiled_frames: int = 0) -> list[KernelLaunch]:
    """The launches (``observed_launch``) among a profile's raw events that no other kept launch or compiling event
    encloses on its thread, in the order they started; ``compiled_frames``: how many frames dynamo converted
    meanwhile (``COMPILING`` ranges hide only if there are no more of them than that). Nesting is read from each CPU
    event's thread and interval, as torch's own event tree reads it, without building that tree: it costs seconds for
    a body's tens of thousands of ops (``torch.autograd.profiler.profile.function_events``)."""
    cpu = torch.autograd.DeviceType.CPU
    compiling = 0  # the compiling ranges among the events
    launches: dict[str, KernelLaunch | None] = {}
    by_thread: dict[int, list[tuple[int, int, str]]] = {}
    for event in events:  # one pass, each event's name read once: a body's profile holds tens of thousands
        name = event.name()
        if name not in launches:
            launches[name] = observed_launch(name)
        if launches[name] is None and name not in COMPILING:
            continue  # neither kept nor hiding what it encloses: it changes nothing below
        if event.device_type() != cpu:
            continue
        if name in COMPILING:
            compiling += 1
        if event.is_async():
            continue
        if event.start_thread_id() != event.end_thread_id() or getattr(event, "is_hidden_event", bool)():
            continue  # an event on two threads is async, as torch's tree reads it; hidden ones it leaves out
        by_thread.setdefault(event.start_thread_id(), []).append((event.start_ns(), event.end_ns(), name))
    hiding = COMPILING if compiling <= compiled_frames else frozenset()
    kept: list[tuple[int, KernelLaunch]] = []
    for spans in by_thread.values():
        enclosing: list[int] = []  # the ends of the open kept or hiding events around the current one
        for start, end, name in sorted(spans, key=lambda span: (span[0], -span[1])):
            launch = launches[name]
            if launch is None and name not in hiding:
                continue  # a compiling range whose count says dynamo did not open them all: it hides nothing
            while enclosing and enclosing[-1] <= start:
                enclosing.pop()
            if enclosing:
                continue
            if launch is not None:
                kept.append((start, launch))
            enclosing.append(end)
    return [launch for _, launch in sorted(kept, key=lambda item: item[0])]


def distinct_launches(launches: Iterable[KernelLaunch]) -> tuple[KernelLaunch, ...]:
    """Each distinct launch once, in first-launch order, so a record does not grow with rows or splits."""
    seen: list[KernelLaunch] = []
    for launch in launches:
        if launch not in seen:  # configs are dicts, so launches compare but do not hash
            seen.append(launch)
    return tuple(seen)


watch_triton_when_imported()
