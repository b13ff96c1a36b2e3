"""Shared fixtures: the devices to test on and fresh random lm_head inputs at a realistic logit scale."""

from __future__ import annotations

import copy
import functools
import gc
import importlib.util
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter; the switch is read when the
# kernels are decorated, so it must be set before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One torch thread per test process and per command it starts: the suite runs one xdist worker per core, and a second
# thread per worker only contends for the other worker's core (a whole-model run: 8.8 s of CPU with two, 6.6 s with
# one). The variable reaches the commands through the environment; it is read when torch first runs a parallel op.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# A test process holds torch, Triton, transformers and pandas (~450k objects) and its in-process tests allocate
# millions of short-lived ones: at CPython's default thresholds (700, 10, 10) it collected 6,500 times, 23 of them
# over every object. Collecting less often (each collection still runs in full) took three modules' in-process tests
# from 84 s to 73 s (gc 8.5 s -> 2.4 s). Commands the tests start keep the interpreter's defaults.
gc.set_threshold(50_000, 20, 100)

CONTRACT = Path(__file__).parent.parent / "conf" / "contract" / "v2.yaml"  # the shipped default contract


def triton_version() -> tuple[int, ...]:
    spec = importlib.util.find_spec("triton")
    if spec is None:
        return (0,)
    from importlib.metadata import version

    return tuple(int(part) for part in version("triton").split(".")[:2] if part.isdigit())


# Liger-Kernel 0.8.5's cross-entropy kernel runs under triton 3.9's interpreter; under 3.6's (the GPU image's) it
# stops with "TypeError: only 0-dimensional arrays can be converted to Python scalars", patched launches or not.
liger_interpreted = pytest.mark.skipif(
    triton_version() < (3, 9),
    reason="Liger-Kernel's kernel does not run under this Triton's interpreter (3.6: a TypeError); it does under 3.9",
)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
LOGIT_STD = 4.0  # realistic lm_head logits have std 3-5 and a peaked softmax


def triton_runs_on(device: str) -> bool:
    """Triton runs on CUDA compiled, and on the CPU only in its interpreter."""
    return device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def needs_interpreter(item: pytest.Item) -> bool:
    """Runs Triton on CPU tensors in this process: marked ``interpreter``, or a triton test on device "cpu"."""
    if item.get_closest_marker("interpreter"):
        return True
    params = getattr(item, "callspec", None).params if hasattr(item, "callspec") else {}
    on_cpu = params.get("device", "cpu") == "cpu"
    triton_backend = str(params.get("backend", "")).startswith("triton")
    triton = triton_backend or "triton_device" in item.fixturenames or "triton" in item.originalname
    return on_cpu and triton and ("device" in params or triton_backend)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The interpreter is a per-process setting: on a CUDA machine the interpreter tests are deselected here
    and run by tests/test_interpreter_subprocess.py in a child process with CUDA hidden, so nothing skips."""
    for item in items:
        if needs_interpreter(item):
            item.add_marker(pytest.mark.interpreter)
    items.sort(key=schedule_key)  # stable: collection order within each key
    if torch.cuda.is_available():
        kept = [item for item in items if not item.get_closest_marker("interpreter")]
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("interpreter")])
        items[:] = kept


def xdist_group(item: pytest.Item) -> str | None:
    """The item's ``xdist_group`` name as pytest-xdist spells it (several marks: their names sorted, joined by _)."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) or None


# The order in which a worker is handed work (pyproject: --dist loadgroup --no-loadscope-reorder hands out the
# groups and tests in collection order): the groups, then the modules of end-to-end runs and sweeps, then the
# in-process ones, and within each the tests marked slow first. The longest work starts first, so no worker is
# left idle at the end while the other finishes a long test it took last.
MODULE_ORDER = (
    "test_sweep", "test_verdict_power", "test_extending", "test_distributed_ranks", "test_input_bounds",
    "test_replay_and_bad_input", "test_run", "test_kernel_invariance", "test_kernel_gradients",
    "test_workload_hunt", "test_kernel_arithmetic", "test_kernel_provenance", "test_rounding_model",
    "test_kernel_accuracy",
)  # fmt: skip
GROUP_ORDER = ("fail_closed", "small_sweep", "grad", "extending", "planned_verdicts")


def schedule_key(item: pytest.Item) -> tuple:
    group, module = xdist_group(item), item.path.stem
    if group is not None:
        return (0, GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER), group)
    rank = MODULE_ORDER.index(module) if module in MODULE_ORDER else len(MODULE_ORDER)
    return (1, rank, module, item.get_closest_marker("slow") is None)


class XdistGroups:
    """``--dist loadgroup`` for pytest 9: pytest-xdist (3.8) names a grouped test's work unit by appending
    ``@group`` to ``item._nodeid``, which pytest 9 no longer reads (a node's id lives in ``item._id``): every test
    became a unit of its own, and a group's module fixture (a sweep) was built on every worker. This appends it
    where xdist's own hook left the id without it, after that hook."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not getattr(config.option, "loadgroup", False):
            return
        for item in items:
            group = xdist_group(item)
            if group is None or item.nodeid.endswith(f"@{group}") or not hasattr(item, "_id"):
                continue
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{group}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(XdistGroups(), "rlsweep-xdist-groups")


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@dataclass
class LmHeadInputs:
    hidden: torch.Tensor  # [T, H]
    weight: torch.Tensor  # [V, H]
    targets: torch.Tensor  # [T]
    seed: int


@pytest.fixture
def isolated_registries():
    """kernels.BACKENDS (each backend with its kernel and capability declarations) restored after the test, in
    its registration order, so no registration, replacement or removal leaks."""
    import kernels  # imported late: TRITON_INTERPRET above must be set first

    saved = dict(kernels.BACKENDS)
    yield
    kernels.BACKENDS.clear()
    kernels.BACKENDS.update(saved)


@pytest.fixture
def make_inputs():
    """Factory of random inputs: a fresh seed every call (reported on failure) unless one is given."""

    def make(
        rows: int, hidden_size: int, vocab: int, dtype: torch.dtype, device: str, seed: int | None = None
    ) -> LmHeadInputs:
        seed = secrets.randbits(31) if seed is None else seed
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(rows, hidden_size, generator=gen)
        weight = torch.randn(vocab, hidden_size, generator=gen) * (LOGIT_STD / hidden_size**0.5)
        logits = hidden.double() @ weight.double().T
        # Half the targets sampled from the model's own distribution (as a rollout would), half uniform.
        sampled = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(1)
        uniform = torch.randint(0, vocab, (rows,), generator=gen)
        targets = torch.where(torch.arange(rows) % 2 == 0, sampled, uniform)
        return LmHeadInputs(hidden.to(dtype).to(device), weight.to(dtype).to(device), targets.to(device), seed)

    return make


# Two profiles (one the negative control, undeclared here so its invariance reds are RED) x tp 1,2, smoke cells.
SMALL_SWEEP = ("profile=cpu_bf16,negative_control_cpu", "tp=1,2", "layout=smoke")


@pytest.fixture(scope="session")
def small_sweep(tmp_path_factory) -> Path:
    """A real multirun (exit 2: the control's reds are not declared) shared by the analysis and report tests."""
    from rlsweep_fixtures import multirun  # imported late: TRITON_INTERPRET above must be set first

    sweep_dir = tmp_path_factory.mktemp("small_sweep")
    done = multirun(sweep_dir, *SMALL_SWEEP)
    assert done.returncode == 2, done.stdout + done.stderr
    return sweep_dir


@pytest.fixture(scope="session")
def report_dir(small_sweep, tmp_path_factory) -> Path:
    """The shared sweep's report (``python -m rlsweep.report``), written elsewhere so the sweep dir stays as the
    multirun left it; read by the report tests and opened by the browser test."""
    import forkserver

    from rlsweep.gate import run_gate

    out = tmp_path_factory.mktemp("report")
    done = forkserver.run("-m", "rlsweep.report", [str(small_sweep), "--out", str(out)], timeout=120)
    assert done.returncode == run_gate(small_sweep).exit_code == 2, done.stdout + done.stderr  # the control's reds
    assert "-> RED" in done.stdout
    return out


def contract_row(judgment: str, tensor: str, dtype: torch.dtype, op_class: str | None = None) -> dict:
    """The shipped contract's row for ``judgment`` (docs/contract.md), read as plain YAML: the kernel tests take
    their thresholds from the contract without importing rlsweep. ``op_class``: for rows keyed by one."""
    rows = contract_judgments(CONTRACT.read_text())[judgment]["rows"]
    row = rows[tensor][str(dtype).removeprefix("torch.")]
    return copy.deepcopy(row if op_class is None else row[op_class])


@functools.lru_cache(maxsize=4)
def contract_judgments(text: str) -> dict:
    """The judgments of a contract file's text, parsed once per text (pure-Python YAML: ~0.1 s a parse)."""
    import yaml

    return yaml.safe_load(text)["judgments"]


@pytest.fixture(autouse=True)
def observed():
    """Every test's kernel calls observe the dispatcher, as a dispatched op and every rlsweep run do; a test of the
    unobserved default leaves it with ``observed_provenance``'s token reset."""
    import kernels  # imported late: TRITON_INTERPRET above must be set first

    with kernels.observed_provenance():
        yield
