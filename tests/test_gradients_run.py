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
from rlsweep.layouts import plan_cells

# In-process runs of triton_cpu_bf16: on a CUDA machine they run in the interpreter's child process
# (tests/test_interpreter_subprocess.py), as every test that runs Triton on CPU tensors.
pytestmark = pytest.mark.interpreter
SMALL = ("profile=triton_cpu_bf16", "layout=smoke", "model.vocab_size=1000")  # few vocab tiles: a quick backward
# One cell, for a bug that no layout hides (it is in every call): the packed cell holds prompt and response tokens in
# one call, and its grad=true run takes a seventh of layout=smoke's (whose 64-row needle batches most of it).
PACKED_ONLY = ("layout.cells=[BN/packed]", "layout.needles=[]")


def gradient_rows(cells: tuple[str, ...]) -> dict[tuple[str, str, str], int]:
    """(judgment, tensor, lhs cell) -> rows a grad=true run over ``cells`` (canonical first) writes."""
    rows = {("gradient_accuracy", tensor, cell): 1 for cell in cells for tensor in ("grad_hidden", "grad_weight")}
    return rows | {("gradient_invariance", "grad_hidden", cell): 1 for cell in cells[1:]}


@pytest.mark.xdist_group("grad")
def test_grad_true_judges_every_cells_gradients_and_summarizes_each_token(tmp_path, monkeypatch):
    cfg = compose_run("grad=true", *SMALL)
    partitions = []  # the calls= of every kernels.gradient_bound the run asks for
    bound = kernels.gradient_bound
    monkeypatch.setattr(kernels, "gradient_bound", lambda *a, **k: partitions.append(k.get("calls")) or bound(*a, **k))
    outcome = execute_run(cfg, tmp_path)
    # The run's bound, then one per cell of several calls: its d weight is rounded call by call.
    cells = plan_cells(run_spec(cfg).layout, build_inputs(run_spec(cfg))[1])
    several = [[c.tolist() for c in cell.call_tokens] for cell in cells if len(cell.calls) > 1]
    assert partitions[0] is None and [[c.tolist() for c in calls] for calls in partitions[1:]] == several != []
    rows = [v for v in outcome.verdicts if v.judgment.startswith("gradient")]
    counts = {}
    for v in rows:
        counts[(v.judgment, v.tensor, v.lhs_cell)] = counts.get((v.judgment, v.tensor, v.lhs_cell), 0) + 1
    assert counts == gradient_rows(run_spec(cfg).layout.cell_names)
    assert all(v.passed and v.expected_pass for v in rows), [v.detail for v in rows if not v.passed]
    tokens = pd.read_parquet(tmp_path / "tokens")
    active = tokens[tokens.active]
    assert (active.grad_norm > 0).all() and active.grad_used.between(0, 1).all()
    assert (tokens[~tokens.active].grad_norm == 0).all()
    digests = tokens.groupby("cell", observed=True).grad_weight_bits.agg(["nunique", "count"])
    assert (digests["nunique"] == 1).all() and (digests["count"] == len(tokens) // len(digests)).all()


def test_without_grad_the_gradient_columns_are_empty_and_nothing_is_judged(tmp_path):
    outcome = execute_run(compose_run("layout=smoke"), tmp_path)
    assert not [v for v in outcome.verdicts if v.judgment.startswith("gradient")]
    tokens = pd.read_parquet(tmp_path / "tokens")
    assert tokens.grad_norm.map(math.isnan).all() and tokens.grad_used.map(math.isnan).all()
    assert tokens.grad_bits.isna().all() and tokens.grad_weight_bits.isna().all()


def red_with_d_hidden(tmp_path, monkeypatch, edit, *overrides: str) -> list:
    """The red verdicts of a grad=true run (``SMALL``, then ``overrides``) whose backward's d hidden goes through
    ``edit(d_hidden, targets, g_logp)`` (``g_logp``: the call's upstream, 0 on prompt, pad and filler rows)."""
    tiled = kernels.grad.tiled_gradients

    def edited(impl, hidden, weight, targets, lse, g_logp, *args, **kwargs):
        d_hidden, d_weight = tiled(impl, hidden, weight, targets, lse, g_logp, *args, **kwargs)
        return edit(d_hidden.clone(), targets, g_logp).to(d_hidden.dtype), d_weight

    monkeypatch.setattr(kernels.grad, "tiled_gradients", edited)
    return [v for v in execute_run(compose_run("grad=true", *SMALL, *overrides), tmp_path).verdicts if not v.passed]


@pytest.mark.xdist_group("grad")
def test_a_wrong_backward_is_red(tmp_path, monkeypatch):
    """d hidden 10 % too large everywhere: gradient_accuracy must see it (the negative control of gradients)."""
    red = red_with_d_hidden(tmp_path, monkeypatch, lambda d_hidden, targets, g_logp: d_hidden * 1.1, *PACKED_ONLY)
    assert red and {(v.judgment, v.tensor) for v in red} == {("gradient_accuracy", "grad_hidden")}


@pytest.mark.xdist_group("grad")
def test_a_backward_that_writes_d_hidden_on_prompt_tokens_is_red(tmp_path, monkeypatch):
    """A prompt token's logp is the constant 0, so its d hidden must be 0: one that is not is a wrong gradient."""
    red = red_with_d_hidden(tmp_path, monkeypatch, lambda d_hidden, targets, g_logp: torch.where(
        (targets == kernels.IGNORE_INDEX)[:, None], 0.5, d_hidden), *PACKED_ONLY)  # fmt: skip
    assert red and {(v.judgment, v.tensor) for v in red} == {("gradient_accuracy", "grad_hidden")}


@pytest.mark.xdist_group("grad")
def test_a_backward_that_lets_a_prompt_tokens_upstream_through_is_red(tmp_path, monkeypatch):
    """Prompt tokens get an upstream too: a backward that does not stop it at their IGNORE_INDEX target gives them a
    d hidden other than 0."""
    of = kernels.grad.Upstream.of.__func__
    unmasked = classmethod(lambda cls, targets, g_logp, g_lse: of(cls, torch.zeros_like(targets), g_logp, g_lse))
    monkeypatch.setattr(kernels.grad.Upstream, "of", unmasked)
    outcome = execute_run(compose_run("grad=true", *SMALL, *PACKED_ONLY), tmp_path)
    red = {(v.judgment, v.tensor) for v in outcome.verdicts if not v.passed}
    assert ("gradient_accuracy", "grad_hidden") in red


@pytest.mark.xdist_group("grad")
def test_a_backward_that_writes_into_a_filler_row_of_the_batch_is_red(tmp_path, monkeypatch):
    """A needle call's filler rows (another sample in the batch) get an upstream of 0: their d hidden must be 0."""

    def into_filler(d_hidden, targets, g_logp):
        filler = (targets != kernels.IGNORE_INDEX) & (g_logp == 0)  # filler rows: a target, no upstream
        return torch.where(filler[:, None], math.nan, d_hidden)

    red = red_with_d_hidden(tmp_path, monkeypatch, into_filler)
    assert {(v.judgment, v.tensor, v.lhs_cell) for v in red} == {
        ("gradient_accuracy", "grad_hidden", cell)
        for cell in run_spec(compose_run(*SMALL)).layout.cell_names
        if cell.startswith("needle")
    }, [v.detail for v in red]
    assert all("pad or filler row(s) of its calls got a d hidden other than 0" in v.detail for v in red)


@pytest.mark.xdist_group("grad")
def test_a_nan_in_a_tokens_d_hidden_is_red_and_uses_all_of_its_bound_in_the_tokens_table(tmp_path, monkeypatch):
    def nan_in_first_active_row(d_hidden, targets, g_logp):
        d_hidden[(targets != kernels.IGNORE_INDEX).nonzero()[0, 0], 3] = math.nan
        return d_hidden

    red = {
        (v.judgment, v.tensor, v.lhs_cell)
        for v in red_with_d_hidden(tmp_path, monkeypatch, nan_in_first_active_row, *PACKED_ONLY)
    }
    assert ("gradient_accuracy", "grad_hidden", "BN/packed") in red
    tokens = pd.read_parquet(tmp_path / "tokens")
    assert tokens.grad_norm.isna().any() and (tokens.grad_used[tokens.grad_norm.isna()] == math.inf).all()


@pytest.mark.xdist_group("grad")
def test_a_wrong_d_weight_in_one_non_canonical_cell_is_red(tmp_path, monkeypatch):
    """d weight 10 % too large in one cell's calls only: that cell's own gradient_accuracy row must see it."""
    import rlsweep.run

    cfg = compose_run("grad=true", *SMALL)
    wrong = run_spec(cfg).layout.cell_names[1]
    tiled, run_cell = kernels.grad.tiled_gradients, rlsweep.run.run_cell

    def skewed(*args, **kwargs):
        d_hidden, d_weight = tiled(*args, **kwargs)
        return d_hidden, d_weight * 1.1

    def run_cell_with_skew(cell, *args, **kwargs):
        with monkeypatch.context() as patch:
            if cell.name == wrong:
                patch.setattr(kernels.grad, "tiled_gradients", skewed)
            return run_cell(cell, *args, **kwargs)

    monkeypatch.setattr(rlsweep.run, "run_cell", run_cell_with_skew)
    outcome = execute_run(cfg, tmp_path)
    red = [v for v in outcome.verdicts if not v.passed]
    assert [(v.judgment, v.tensor, v.lhs_cell) for v in red] == [("gradient_accuracy", "grad_weight", wrong)]
    assert "vocab row=" in red[0].detail and red[0].value > 1


def test_grad_with_distributed_ranks_of_a_torch_backend_is_refused_before_anything_runs():
    with pytest.raises(ConfigError, match="grad=true with tp_mode=distributed: profile 'cpu_bf16' runs backend 'aten'"):
        check_run(compose_run("grad=true", "tp=2", "tp_mode=distributed", "profile=cpu_bf16"))


@pytest.mark.xdist_group("grad")
def test_grad_with_distributed_gloo_ranks_gives_the_emulated_gradients(tmp_path):
    """tp=2 on real gloo ranks: GREEN, and every token's d hidden bits and every cell's d weight digest are the
    emulated ranks' (kernels/distributed.py continues the one d hidden sum across the rank processes)."""
    runs = {}
    for mode in ("emulated", "distributed"):
        outcome = execute_run(compose_run("grad=true", *SMALL, "tp=2", f"tp_mode={mode}"), tmp_path / mode)
        assert all(v.passed for v in outcome.verdicts), [v for v in outcome.verdicts if not v.passed]
        runs[mode] = pd.read_parquet(tmp_path / mode / "tokens").sort_values(["cell", "sample_id", "position"])
    for column in ("grad_bits", "grad_weight_bits"):
        a, b = (runs[mode][column].reset_index(drop=True) for mode in runs)
        assert a.notna().any() and a.equals(b), column


def test_upstream_gradient_is_per_token_and_reaches_prompt_tokens_too():
    workload = build_inputs(run_spec(compose_run("layout=smoke")))[1]
    g = workload.upstream()
    assert g.dtype == torch.float32 and bool((g != 0).all()) and bool((~workload.active).any())
    assert torch.equal(g, workload.upstream())  # counter-based: the same every time


@pytest.mark.xdist_group("grad")
def test_the_gate_compares_each_tokens_d_hidden_and_each_cells_d_weight_bits_across_tp(tmp_path):
    from dataclasses import replace

    from rlsweep_fixtures import multirun

    from rlsweep.gate import gradient_tp_invariance, load_run, run_gate, tp_invariance

    done = multirun(tmp_path, "grad=true", *SMALL, "tp=1,2")
    assert done.returncode == 0, done.stdout + done.stderr
    sweep = pd.read_parquet(tmp_path / "sweep_checks.parquet")
    rows = sweep[sweep.judgment == "gradient_invariance"]
    cells = run_spec(compose_run(*SMALL)).layout.cell_names
    assert rows.passed.all() and sorted(zip(rows.tensor, rows.lhs_cell, strict=True)) == sorted(
        (tensor, cell) for tensor in ("grad_hidden", "grad_weight") for cell in cells
    )
    result = run_gate(tmp_path)
    baseline, other = sorted(result.runs, key=lambda run: run.run["tp"])
    tokens = other.tokens.copy()
    flipped = tokens.index[tokens.active & (tokens.cell == "B1/full")][3]
    tokens.loc[flipped, "grad_bits"] = "0" * 16
    verdict = gradient_tp_invariance(replace(other, tokens=tokens), baseline, "B1/full")
    assert not verdict.passed and verdict.value == 1.0
    assert (verdict.first_sample_id, verdict.first_position) == tuple(tokens.loc[flipped, ["sample_id", "position"]])
    assert load_run(other.directory).tokens.grad_bits.notna().all()
    # A prompt token's d hidden (0, its logp being constant) is compared too.
    tokens = other.tokens.copy()
    tokens.loc[tokens.index[~tokens.active & (tokens.cell == "B1/full")][0], "grad_bits"] = "0" * 16
    assert not gradient_tp_invariance(replace(other, tokens=tokens), baseline, "B1/full").passed
    # One cell's d weight digest differs at tp=2: the gate's tp rows are red for that cell's d weight, and only there.
    tokens = other.tokens.copy()
    tokens.loc[tokens.cell == cells[-1], "grad_weight_bits"] = "0" * 64
    red = [v for v in tp_invariance(replace(other, tokens=tokens), [baseline]) if not v.passed]
    assert [(v.judgment, v.tensor, v.lhs_cell) for v in red] == [("gradient_invariance", "grad_weight", cells[-1])]


@pytest.mark.xdist_group("grad")
def test_a_controls_gradient_reds_are_declared_like_any_other_and_a_gradient_declaration_matching_none_is_red(
    tmp_path,
):
    from dataclasses import replace

    from rlsweep_fixtures import multirun

    from rlsweep.gate import declaration_check, run_gate

    declared = [{"judgment": j, "reason": "control"} for j in ("forward_invariance", "gradient_accuracy")]
    everywhere = {"judgment": "gradient_invariance", "reason": "control"}
    listed = ",".join("{" + ",".join(f"{k}:{v}" for k, v in d.items()) + "}" for d in [*declared, everywhere])
    done = multirun(tmp_path, "profile=negative_control_cpu", "layout=smoke", "grad=true", "model.vocab_size=1000",
                    "tp=1,2", f"expected_red=[{listed}]")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # A run compares each cell's d hidden with the canonical cell's, so no row of it has the canonical cell; the
    # control is not cross_tp_bitwise, so the gate has no gradient rows for it either: declared there, it is red.
    result = run_gate(tmp_path)
    canonical = {**everywhere, "cells": ["BN/packed"]}
    blind = [replace(run, config={**run.config, "expected_red": [*declared, canonical]}) for run in result.runs]
    (row,) = declaration_check(blind, result.sweep_checks.to_dict("records"))
    assert not row["passed"] and row["tensor"] == "gradient_invariance" and "cells: ['BN/packed']" in row["detail"]
