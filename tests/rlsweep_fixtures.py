"""Helpers shared by the rlsweep tests: composing configs and running ``python -m rlsweep``."""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import forkserver
import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import DictConfig
from safetensors.torch import save_file

from rlsweep import plots
from rlsweep.config import register_configs, run_spec
from rlsweep.locks import LOCK_FILE
from rlsweep.manifest import MANIFEST_FILE, identify, read_manifest, table_files
from rlsweep.model import LmHead, build_lm_head
from rlsweep.run import RunOutcome, execute, preflight
from rlsweep.spec import RunSpec
from rlsweep.tables import RUN_TABLES, RunLocation
from rlsweep.verdicts import Outcome
from rlsweep.workload import Workload, build_workload

register_configs()

# The suite's runs and sweeps use the four-sample workload their expectations were written for, unless a test names a
# workload or a sweep: the default (hunt: 397 active tokens, docs/contract.md#verdict-power) costs several times more
# under the Triton interpreter and with grad=true. A sweep's job lines show it among the overrides (``job_line``).
# tests/test_verdict_power.py runs the default itself.
SUITE_WORKLOAD = "workload=varlen4"


def job_line(*overrides: str) -> str:
    """The overrides of a sweep's job as its progress and error lines print them: SUITE_WORKLOAD first."""
    return " ".join(suite_overrides(overrides))


def suite_overrides(overrides: tuple[str, ...] | list[str]) -> list[str]:
    """``overrides`` with SUITE_WORKLOAD first, unless they name a workload or a sweep (which names its own)."""
    named = any(o.split("=")[0].lstrip("+~") in ("workload", "sweep") for o in overrides if not o.startswith("-"))
    return list(overrides) if named else [SUITE_WORKLOAD, *overrides]


def compose_run(*overrides: str) -> DictConfig:
    """The run config exactly as ``python -m rlsweep <overrides>`` composes it, with the ``hydra`` node that names
    the files composed (``run_spec`` reads the contract file's name there). Each call gets a copy of its own."""
    return copy.deepcopy(composed(tuple(suite_overrides(overrides)), os.getcwd()))


@functools.lru_cache(maxsize=512)
def composed(overrides: tuple[str, ...], cwd: str) -> DictConfig:
    """Hydra's composition of ``overrides`` (from ``cwd``, which the hydra node records), once per test process:
    a composition parses every config file again in pure-Python YAML (~0.3 s); a copy takes a tenth of that."""
    with initialize_config_module("conf", version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def build_inputs(spec: RunSpec) -> tuple[LmHead, Workload]:
    """The head and the workload a run of ``spec`` computes, on the CPU."""
    head = build_lm_head(spec.model, dtype=spec.profile.dtype, device=torch.device("cpu"))
    return head, build_workload(spec.workload, spec.model, head.weight, seed=spec.seed, dtype=spec.profile.dtype)


def write_replay(directory: Path, tensors: dict, hidden_size: int, vocab_size: int) -> list[str]:
    """Write the head (``tensors["weight"]``) and the capture (the rest); the overrides of a replay run reading them."""
    save_file({"lm_head.weight": tensors["weight"]}, directory / "head.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "weight"}, directory / "capture.safetensors")
    return [
        "model=replay",
        "workload=replay",
        f"model.hidden_size={hidden_size}",
        f"model.vocab_size={vocab_size}",
        f"model.weights.path={directory / 'head.safetensors'}",
        f"workload.path={directory / 'capture.safetensors'}",
    ]


def check_run(cfg: DictConfig) -> None:
    """Everything a run checks before its first kernel: the RunSpec parse, then ``preflight``."""
    preflight(run_spec(cfg))


def execute_run(cfg: DictConfig, directory: Path) -> RunOutcome:
    """``execute`` of a single run (no lock, no manifest): the kernels, judgments and tables only."""
    spec = run_spec(cfg)
    return execute(spec, RunLocation.single(directory), identify(spec.config), standalone=True)


def table_file(run_dir: Path, table: str) -> Path:
    """The file of ``table`` that the manifest in ``run_dir`` names (complete or not)."""
    manifest, reason = read_manifest(run_dir)
    assert manifest is not None, reason
    return table_files(run_dir, manifest)[table]


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str
    directory: Path


# The environment of a machine without CUDA, on any machine: what a CUDA profile meets on a CPU-only host.
WITHOUT_CUDA = {"CUDA_VISIBLE_DEVICES": ""}


def import_path(*directories: Path | str) -> str:
    """A PYTHONPATH of ``directories`` ahead of the caller's own (where Hydra itself may come from one, as on the GPU
    machine): replacing it would leave the run unable to import what this process imports."""
    return os.pathsep.join([*(str(d) for d in directories), *filter(None, [os.environ.get("PYTHONPATH")])])


def run_rlsweep(
    directory: Path, *overrides: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Completed:
    """A real ``python -m rlsweep`` subprocess writing into ``directory`` (``env``: added variables)."""
    args = [f"hydra.run.dir={directory}", *suite_overrides(overrides)]
    done = forkserver.run("-m", "rlsweep", args, env=env, cwd=cwd, timeout=300)
    return Completed(done.returncode, done.stdout, done.stderr, directory)


# A sweep whose control's forward_invariance reds are declared, as conf/sweep/ci.yaml declares them.
CONTROL_DECLARED = "expected_red=[{profiles:[negative_control_cpu],judgment:forward_invariance,reason:control}]"


def copy_outputs(source: Path, target: Path) -> Path:
    """A copy of a run or sweep dir (or a tree of them) at ``target``, without the lock file a writer leaves."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(LOCK_FILE))
    return target


def tables_left(directory: Path) -> list[str]:
    """Run tables (or their temporaries) present in ``directory``."""
    if not directory.exists():
        return []
    return sorted(p.name for p in directory.iterdir() if any(name in p.name for name in (*RUN_TABLES, MANIFEST_FILE)))


def needs_launcher(name: str) -> pytest.MarkDecorator:
    """Skip where Hydra's ``name`` launcher plugin is missing (the test extras install it; a GPU image may not)."""
    try:  # find_spec of a submodule imports its parent: with no Hydra plugin at all, hydra_plugins is missing too
        missing = importlib.util.find_spec(f"hydra_plugins.hydra_{name}_launcher") is None
    except ModuleNotFoundError:
        missing = True
    return pytest.mark.skipif(missing, reason=f"hydra-{name}-launcher is not installed (pip install -e '.[test]')")


def permissions_enforced() -> bool:
    """Whether this process is held to file permissions: root with its usual capabilities lists a mode-000 dir."""
    if os.geteuid() != 0:
        return True
    with tempfile.TemporaryDirectory() as scratch:
        probe = Path(scratch) / "probe"
        probe.mkdir(mode=0)
        try:
            os.listdir(probe)
        except PermissionError:
            return True
        finally:
            probe.chmod(0o700)
    return False


# Tests that take a permission away (chmod) to see what a reader or writer does without it.
needs_permissions = pytest.mark.skipif(
    not permissions_enforced(), reason="running as root, which ignores file permissions: a chmod takes nothing away"
)


@contextmanager
def chmodded(path: Path, mode: int, recursive: bool = False) -> Iterator[Path]:
    """``path`` (with ``recursive``, everything under it too) with permission bits ``mode``, restored afterwards."""
    paths = [path, *(path.rglob("*") if recursive else [])]
    before = {p: p.lstat().st_mode & 0o7777 for p in paths if not p.is_symlink()}
    for p in sorted(before, key=lambda p: len(p.parts), reverse=True):  # deepest first: a dir's own bits last
        p.chmod(mode)
    try:
        yield path
    finally:
        for p in sorted(before, key=lambda p: len(p.parts)):
            p.chmod(before[p])


def multirun(sweep_dir: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m rlsweep <overrides> --multirun`` into ``sweep_dir``."""
    args = [f"hydra.sweep.dir={sweep_dir}", *suite_overrides(overrides), "--multirun"]
    return forkserver.run("-m", "rlsweep", args, timeout=timeout)


def with_fault(fault: str, module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m <module> <args>`` after the Python statements ``fault`` ran in the same process.

    Fault injection for the fail-closed tests: ``fault`` patches a function (make it raise, exit the
    process midway, ...) before the command line starts.
    """
    start = f"sys.argv = [{module!r}, *sys.argv[1:]]\nrunpy.run_module({module!r}, run_name='__main__')"
    script = f"import sys, runpy\n{fault}\n{start}"
    args = suite_overrides(args) if module == "rlsweep" else list(args)
    return forkserver.run("-c", script, args, timeout=timeout)


def heatmap_verdict(checks: pd.DataFrame, column: pd.Series, cell: str) -> Outcome | None:
    """What a heatmap cell (a run's ``cell``; ``column``: its profile, model, tp, tp_mode) must show, read off the
    checks: red where a forward_invariance or tp_invariance verdict of it is not as expected, else amber where one
    failed as declared, else green; None where none judged it (the baseline's canonical cell)."""
    rows = checks[
        checks["judgment"].isin(["forward_invariance", "tp_invariance"])
        & checks["tensor"].isin(["logp", "lse"])
        & (checks["lhs_cell"] == cell)
        & np.logical_and.reduce([checks[key] == column[key] for key in ("profile", "model", "tp", "tp_mode")])
    ]
    if not len(rows):
        return None
    if (rows["passed"] != rows["expected_pass"]).any():
        return Outcome.NOT_AS_EXPECTED
    return Outcome.PASSED if rows["passed"].all() else Outcome.FAILED_AS_DECLARED


def seen_verdict(rgb) -> Outcome | None:
    """The verdict a heatmap colour shows: the hue whose shades (``plots.OUTCOME_SHADES``) lie nearest, or None for
    the no-verdict grey. ``rgb``: 0..1 or 0..255 channels."""
    rgb = np.asarray(rgb, dtype=float)[:3]
    rgb = rgb / 255 if rgb.max() > 1 else rgb

    def distance(scale) -> float:  # from rgb to the segment of the scale's shades
        light, dark = plots.blend(scale, 0)[:3], plots.blend(scale, 1)[:3]
        along = np.clip(np.dot(rgb - light, dark - light) / np.dot(dark - light, dark - light), 0, 1)
        return float(np.linalg.norm(rgb - (light + along * (dark - light))))

    found = {verdict: distance(scale) for verdict, scale in plots.OUTCOME_SHADES.items()}
    found[None] = float(np.linalg.norm(rgb - plots.blend((plots.NO_VERDICT_COLOR,) * 2, 0)[:3]))
    return min(found, key=found.get)
