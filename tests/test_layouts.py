"""Layout cells: every logical token exactly once, restored to logical order, row counts as configured."""

from __future__ import annotations

import re

import pytest
import torch
from rlsweep_fixtures import build_inputs, compose_run

import kernels
from rlsweep.config import run_spec
from rlsweep.errors import ConfigError
from rlsweep.layouts import plan_cells, restore_logical_order
from rlsweep.spec import CANONICAL_CELL, CELL_KINDS, DECODE_CELL


@pytest.fixture(scope="module")
def cfg():
    return run_spec(compose_run("layout=full", "workload=varlen4"))


@pytest.fixture(scope="module")
def workload(cfg):
    return build_inputs(cfg)[1]


@pytest.fixture(scope="module")
def cells(cfg, workload):
    return {cell.name: cell for cell in plan_cells(cfg.layout, workload)}


def test_full_layout_covers_every_cell_kind(cfg, cells):
    assert set(cfg.layout.cells) == set(CELL_KINDS)
    expected = {kind for kind in CELL_KINDS if kind != "needle"}
    expected |= {n.cell_name for n in cfg.layout.needles}
    assert set(cells) == expected
    assert next(iter(cells)) == CANONICAL_CELL


def test_every_cell_restores_logical_order(cells, workload):
    keys = (workload.sample_ids * 1000 + workload.positions).double()
    for cell in cells.values():
        per_call = []
        for call in cell.calls:
            rows = torch.where(call.logical >= 0, call.logical, 0)
            per_call.append(torch.where(call.logical >= 0, keys[rows], -1.0))
        assert torch.equal(restore_logical_order(cell, per_call, workload.num_tokens), keys), cell.name


def test_chunked_cells_use_the_configured_chunk_size(cfg, cells, workload):
    size = cfg.layout.chunk_size
    b1 = cells["B1/chunked"].call_rows
    assert max(b1) == size
    assert len(b1) == sum(-(-n // size) for n in workload.seq_lens)
    bn = cells["BN/chunked"].call_rows
    assert len(bn) == -(-max(workload.seq_lens) // size) and sum(bn) == workload.num_tokens


def test_decode_calls_shrink_as_samples_finish(cells, workload):
    prefill, *steps = cells[DECODE_CELL].call_rows
    assert prefill == int((~workload.active).sum())
    assert steps[0] == len(workload.seq_lens) and steps == sorted(steps, reverse=True)
    assert sum(steps) == int(workload.active.sum())


def test_padded_and_needle_cells_have_the_configured_row_counts(cfg, cells, workload):
    assert cells["BN/pad_right"].call_rows == (len(workload.seq_lens) * max(workload.seq_lens),)
    for needle in cfg.layout.needles:
        assert cells[needle.cell_name].call_rows == (needle.m + workload.num_tokens,)


def test_hidden_states_depend_only_on_seed_sample_and_position(cfg, workload):
    overrides = ("workload=varlen4", "workload.seq_lens=[9,16]", "workload.prompt_lens=[8,8]")
    other = build_inputs(run_spec(compose_run(*overrides)))[1]
    for row in range(other.num_tokens):
        sample, position = int(other.sample_ids[row]), int(other.positions[row])
        logical = int(workload.sample_rows(sample)[position])
        assert torch.equal(other.hidden[row], workload.hidden[logical])
    assert bool((workload.targets[~workload.active] == kernels.IGNORE_INDEX).all())


# Workloads on which some cells of layout=full make the very calls of BN/packed: a verdict on them could show
# nondeterminism only, so the run refuses them by name and says which cells to keep.
@pytest.mark.parametrize(
    ("overrides", "same"),
    [
        (["workload.seq_lens=[12]", "workload.prompt_lens=[4]"], "BN/pad_right, BN/pad_left, BN/permuted, B1/full"),
        (["workload.seq_lens=[9,9]", "workload.prompt_lens=[3,3]"], "BN/pad_right, BN/pad_left"),
        (["layout.chunk_size=19"], "BN/chunked"),
    ],
    ids=["one sample", "equal lengths", "one chunk per sample"],
)
def test_cells_that_make_the_canonical_calls_again_are_refused_by_name(overrides, same):
    spec = run_spec(compose_run("layout=full", "workload=varlen4", *overrides))
    with pytest.raises(ConfigError, match=re.escape(f"layout cell(s) {same} make the very calls of {CANONICAL_CELL}")):
        plan_cells(spec.layout, build_inputs(spec)[1])
