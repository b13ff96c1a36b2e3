"""grad=true: a run differentiates every kernel call and judges the gradients (docs/index.md, "Gradients")."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from rlsweep_fixtures import build_inputs, check_run, compose_run, execute_run

import kernels.grad
from rlsweep.config import run_spec
from rlsweep.errors import ConfigError

SMALL = ("profile=triton_cpu_bf16", "layout=smoke", "model.vocab_size=1000")  # few vocab tiles: a quick backward
GRADIENT_ROWS = {  # (judgment, tensor) -> rows in a layout=smoke run (3 cells)
    ("gradient_accuracy", "grad_hidden"): 3,
    ("gradient_accuracy", "grad_weight"): 1,
    ("gradient_invariance", "grad_hidden"): 2,
}


@pytest.mark.xdist_group("grad")
def test_grad_true_judges_every_cells_gradients_and_summarizes_each_token(tmp_path):
    outcome = execute_run(compose_run("grad=true", *SMALL), tmp_path)
    rows = [v for v in outcome.verdicts if v.judgment.startswith("gradient")]
    counts = {}
    for v in rows:
        counts[(v.judgment, v.tensor)] = counts.get((v.judgment, v.tensor), 0) + 1
    assert counts == GRADIENT_ROWS
    assert all(v.passed and v.expected_pass for v in rows), [v.detail for v in rows if not v.passed]
    tokens = pd.read_parquet(tmp_path / "tokens")
    active = tokens[tokens.active]
    assert (active.grad_norm > 0).all() and active.grad_used.between(0, 1).all()
    assert (tokens[~tokens.active].grad_norm == 0).all()


def test_without_grad_the_gradient_columns_are_empty_and_nothing_is_judged(tmp_path):
    outcome = execute_run(compose_run("layout=smoke"), tmp_path)
    assert not [v for v in outcome.verdicts if v.judgment.startswith("gradient")]
    tokens = pd.read_parquet(tmp_path / "tokens")
    assert tokens.grad_norm.map(math.isnan).all() and tokens.grad_used.map(math.isnan).all()


@pytest.mark.xdist_group("grad")
def test_a_wrong_backward_is_red(tmp_path, monkeypatch):
    """d hidden 10 % too large everywhere: gradient_accuracy must see it (the negative control of gradients)."""
    tiled = kernels.grad.tiled_gradients

    def skewed(*args, **kwargs):
        d_hidden, d_weight = tiled(*args, **kwargs)
        return d_hidden * 1.1, d_weight

    monkeypatch.setattr(kernels.grad, "tiled_gradients", skewed)
    outcome = execute_run(compose_run("grad=true", *SMALL), tmp_path)
    red = [v for v in outcome.verdicts if not v.passed]
    assert red and {(v.judgment, v.tensor) for v in red} == {("gradient_accuracy", "grad_hidden")}


def test_grad_with_distributed_ranks_is_refused_before_anything_runs():
    with pytest.raises(ConfigError, match="grad=true needs tp_mode=emulated"):
        check_run(compose_run("grad=true", "tp=2", "tp_mode=distributed"))


def test_upstream_gradient_is_per_token_and_zero_on_prompt_tokens():
    workload = build_inputs(run_spec(compose_run("layout=smoke")))[1]
    g = workload.upstream()
    assert g.dtype == torch.float32 and bool((g[~workload.active] == 0).all()) and bool((g[workload.active] != 0).all())
    assert torch.equal(g, workload.upstream())  # counter-based: the same every time


@pytest.mark.xdist_group("grad")
def test_the_gate_compares_each_tokens_d_hidden_bits_across_tp(tmp_path):
    from dataclasses import replace

    from rlsweep_fixtures import multirun

    from rlsweep.gate import gradient_tp_invariance, load_run, run_gate

    done = multirun(tmp_path, "grad=true", *SMALL, "tp=1,2")
    assert done.returncode == 0, done.stdout + done.stderr
    sweep = pd.read_parquet(tmp_path / "sweep_checks.parquet")
    rows = sweep[sweep.judgment == "gradient_invariance"]
    assert len(rows) == 3 and rows.passed.all() and (rows.tensor == "grad_hidden").all()
    result = run_gate(tmp_path)
    baseline, other = sorted(result.runs, key=lambda run: run.run["tp"])
    tokens = other.tokens.copy()
    flipped = tokens.index[tokens.active & (tokens.cell == "B1/full")][3]
    tokens.loc[flipped, "grad_bits"] = "0" * 16
    verdict = gradient_tp_invariance(replace(other, tokens=tokens), baseline, "B1/full")
    assert not verdict.passed and verdict.value == 1.0
    assert (verdict.first_sample_id, verdict.first_position) == tuple(tokens.loc[flipped, ["sample_id", "position"]])
    assert load_run(other.directory).tokens.grad_bits.notna().all()
