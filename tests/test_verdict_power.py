"""Verdict power (docs/contract.md#verdict-power): each class of realistic kernel bug, a few lines changed in the
correct toy backend (tests/bug_backends.py), is red by a margin on the default model and workload, while the toy
backend it was cut from is green in the same runs."""

from __future__ import annotations

import importlib
import os
import re
import sys

import pandas as pd
import pytest
from hydra import compose, initialize_config_module
from rlsweep_fixtures import compose_run, execute_run
from test_extending import TESTS, TOY_CONF, rlsweep

import kernels
from rlsweep.exitcodes import ExitCode
from rlsweep.verdicts import Judgment, Verdict

COUNTED = re.compile(r"(\d+) of \d+ active tokens (?:exceed|differ)")
DEFAULT_WORKLOAD = "workload=hunt"  # the default's: the suite's helpers otherwise pin varlen4
MARGIN = 3.0  # red by at least this many times its threshold ...
TOKENS = 5  # ... or on at least this many tokens


@pytest.fixture(scope="module")
def bug_registry():
    """The toy backend and its bugs registered for this module's tests, the registry restored after them."""
    saved = dict(kernels.BACKENDS)
    sys.path.insert(0, str(TESTS))
    import bug_backends
    import toy_backend

    if "toy" not in kernels.BACKENDS:
        importlib.reload(toy_backend)
    importlib.reload(bug_backends)  # its classes over the registered toy backend, each id registered afresh
    yield bug_backends
    kernels.BACKENDS.clear()
    kernels.BACKENDS.update(saved)


def run_backend(backend: str, directory, *overrides: str) -> list[Verdict]:
    """One run of ``backend`` on the defaults (model tiny, workload hunt, layout full), claiming bitwise tp."""
    cfg = compose_run(
        DEFAULT_WORKLOAD,
        "profile=cpu_bf16",
        f"profile.backend_family={backend}",
        f"profile.required_nodes={{matmul: {backend}, logprob: {backend}, tp_merge: {backend}}}",
        "profile.merge_order=global_tile",
        "profile.determinism_scope=cross_tp_bitwise",
        *overrides,
    )
    return execute_run(cfg, directory).verdicts


def tokens_named(verdict: Verdict) -> int:
    found = COUNTED.search(verdict.detail)
    return int(found.group(1)) if found else 0


def by_margin(verdict: Verdict) -> bool:
    """Red by MARGIN times its threshold (a ratio of a bound, threshold 1) or on TOKENS tokens (a count of tokens or
    values, threshold 0)."""
    if verdict.threshold == 0:
        return not verdict.passed and verdict.value >= TOKENS
    return not verdict.passed and (verdict.value / verdict.threshold >= MARGIN or tokens_named(verdict) >= TOKENS)


# (bug, tp, the judgment that must catch it by a margin): the bug's class in docs/contract.md#verdict-power.
BUGS = [
    ("temperature", 1, Judgment.KERNEL_ACCURACY),  # (a)
    ("scaled_matmul", 1, Judgment.KERNEL_BIAS),  # (a), in the matmul's epilogue
    ("bf16_allreduce", 2, Judgment.KERNEL_ACCURACY),  # (b)
    ("bf16_allreduce", 4, Judgment.KERNEL_ACCURACY),  # (b)
    ("padding_zero", 1, Judgment.KERNEL_ACCURACY),  # (c)
    ("padding_zero", 4, Judgment.KERNEL_ACCURACY),  # (c)
    ("no_max", 1, Judgment.SMOKE),  # (d): an overflow from finite inputs is a verdict, the tables written
    ("boundary_target", 2, Judgment.KERNEL_ACCURACY),  # (e)
    ("last_row", 1, Judgment.KERNEL_ACCURACY),  # (e)
    ("tf32", 1, Judgment.KERNEL_ACCURACY),  # (g)
    ("partial_tile", 1, Judgment.KERNEL_ACCURACY),  # (g)
]


@pytest.mark.parametrize("bug, tp, judgment", BUGS, ids=[f"{bug}-tp{tp}" for bug, tp, _ in BUGS])
def test_a_realistic_bug_is_red_by_a_margin(bug_registry, tmp_path, bug, tp, judgment):
    # layout=smoke keeps a call of every row count kind (one batch, one sample per call, a needle) at a third the cost
    verdicts = run_backend(f"bug_{bug}", tmp_path, f"tp={tp}", "layout=smoke")
    caught = [v for v in verdicts if v.judgment == judgment and by_margin(v)]
    red = sorted({(v.judgment, v.tensor) for v in verdicts if not v.passed})
    assert caught, f"bug_{bug} at tp={tp}: no {judgment} row red by a margin; red rows: {red}"
    assert (tmp_path / "checks").is_dir() and (tmp_path / "tokens").is_dir()


def test_the_default_workload_is_the_one_that_hunts():
    with initialize_config_module("conf", version_base="1.3"):
        assert compose("config").workload.name == DEFAULT_WORKLOAD.split("=")[1]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_correct_backend_the_bugs_were_cut_from_is_green(bug_registry, tmp_path, tp):
    verdicts = run_backend("toy", tmp_path, f"tp={tp}", *([] if tp == 1 else ["layout=smoke"]))
    red = [(v.judgment, v.tensor, v.lhs_cell, v.detail) for v in verdicts if not v.as_expected]
    assert not red, red
    assert {Judgment.KERNEL_ACCURACY, Judgment.KERNEL_BIAS} <= {v.judgment for v in verdicts}


@pytest.mark.slow
@pytest.mark.xdist_group("extending")
def test_a_per_rank_fold_claimed_bitwise_across_tp_is_red_in_a_tp_sweep(tmp_path):
    """(f): each rank folds its tiles before the ranks are merged; the sum moves by less than an ulp of lse, which
    the run's own bounds allow, but the tp sweep compares bits on every judged token."""
    conf = tmp_path / "conf" / "profile"
    conf.mkdir(parents=True)
    profile = (TOY_CONF / "profile" / "toy_cpu.yaml").read_text()
    conf.joinpath("toy_cpu.yaml").write_text(profile)
    conf.joinpath("rank_fold_cpu.yaml").write_text(
        profile.replace("name: toy_cpu", "name: rank_fold_cpu")
        .replace("backend_family: toy", "backend_family: bug_rank_fold")
        .replace("backend_module: toy_backend", "backend_module: bug_backends")
        .replace(
            "{matmul: toy, logprob: toy, tp_merge: toy}",
            "{matmul: bug_rank_fold, logprob: bug_rank_fold, tp_merge: bug_rank_fold}",
        )
    )
    done = rlsweep(tmp_path / "sweep", DEFAULT_WORKLOAD, "profile=toy_cpu,rank_fold_cpu", "layout=smoke", "tp=1,2,4",
                   config_dir=tmp_path / "conf")  # fmt: skip
    assert done.returncode == ExitCode.RED, done.stdout + done.stderr
    sweep = pd.read_parquet(tmp_path / "sweep" / "sweep_checks.parquet")
    tp_rows = sweep[sweep["judgment"] == Judgment.TP_INVARIANCE]
    fold, toy = (tp_rows[tp_rows["profile"] == name] for name in ("rank_fold_cpu", "toy_cpu"))
    assert len(toy) and toy["passed"].all()  # the correct backend keeps its bits across tp
    assert (fold["value"] >= TOKENS).any(), fold[["tp", "lhs_cell", "tensor", "value"]]
    within = pd.read_parquet(tmp_path / "sweep" / "checks")
    assert within[within["profile"] == "rank_fold_cpu"]["passed"].all()  # only the tp sweep can see it
    assert os.path.isdir(tmp_path / "sweep" / "tokens")
