"""Shared fixtures: the devices to test on and fresh random lm_head inputs at a realistic logit scale."""

from __future__ import annotations

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

CONTRACT = Path(__file__).parent.parent / "conf" / "contract" / "v2.yaml"  # the shipped default contract

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
    if torch.cuda.is_available():
        kept = [item for item in items if not item.get_closest_marker("interpreter")]
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("interpreter")])
        items[:] = kept


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


def contract_row(judgment: str, tensor: str, dtype: torch.dtype, op_class: str | None = None) -> dict:
    """The shipped contract's row for ``judgment`` (docs/contract.md), read as plain YAML: the kernel tests take
    their thresholds from the contract without importing rlsweep. ``op_class``: for rows keyed by one."""
    import yaml

    rows = yaml.safe_load(CONTRACT.read_text())["judgments"][judgment]["rows"]
    row = rows[tensor][str(dtype).removeprefix("torch.")]
    return row if op_class is None else row[op_class]


@pytest.fixture(autouse=True)
def observed():
    """Every test's kernel calls observe the dispatcher, as a dispatched op and every rlsweep run do; a test of the
    unobserved default leaves it with ``observed_provenance``'s token reset."""
    import kernels  # imported late: TRITON_INTERPRET above must be set first

    with kernels.observed_provenance():
        yield
