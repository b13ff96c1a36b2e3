"""Synthetic workloads that hunt kernel bugs: per-sample hidden scales and probe targets on vocab boundaries."""

from __future__ import annotations

import re

import pytest
import torch
from rlsweep_fixtures import build_inputs, compose_run, write_replay

import kernels
from rlsweep.config import run_spec
from rlsweep.errors import ConfigError
from rlsweep.spec import MAX_HIDDEN_SCALE, MIN_HIDDEN_SCALE
from rlsweep.workload import Workload, probe_columns

VOCABS = [3001, 151936]  # model=tiny's and Qwen3's: neither a multiple of a tile


def boundary_sides(vocab_size: int, width: int) -> set[int]:
    """The vocab's two ends and both sides of every multiple of ``width`` below it: probe_columns' definition."""
    return {0, vocab_size - 1} | {c for b in range(width, vocab_size, width) for c in (b - 1, b)}


def widths(vocab_size: int) -> list[int]:
    """The boundary widths probe_columns walks, coarsest first: powers of two below the vocab, down to the tile."""
    return [
        w for w in (1 << k for k in range(vocab_size.bit_length(), -1, -1)) if kernels.MIN_VOCAB_TILE <= w < vocab_size
    ]


@pytest.mark.parametrize("vocab_size", VOCABS)
def test_probe_columns_walk_the_boundaries_coarsest_first(vocab_size):
    every = boundary_sides(vocab_size, kernels.MIN_VOCAB_TILE)
    columns = probe_columns(vocab_size, len(every)).tolist()
    assert columns[:2] == [0, vocab_size - 1]
    assert set(columns) == every  # each boundary side once: len(columns) == len(every)
    assert all(0 <= c < vocab_size for c in columns)
    for width in widths(vocab_size):  # after a width's level, every coarser-or-equal boundary is in, nothing finer
        level = boundary_sides(vocab_size, width)
        assert set(columns[: len(level)]) == level, width
    for b in range(kernels.MIN_VOCAB_TILE, vocab_size - 1, kernels.MIN_VOCAB_TILE):  # b - 1 comes just before b
        assert columns.index(b) == columns.index(b - 1) + 1, b


@pytest.mark.parametrize("vocab_size", VOCABS)
def test_probe_columns_cycle_past_the_last_boundary(vocab_size):
    distinct = len(boundary_sides(vocab_size, kernels.MIN_VOCAB_TILE))
    columns = probe_columns(vocab_size, 2 * distinct + 3)
    assert columns.dtype == torch.int64 and columns.shape == (2 * distinct + 3,)
    assert torch.equal(columns[distinct : 2 * distinct], columns[:distinct])
    assert torch.equal(columns[2 * distinct :], columns[:3])
    assert probe_columns(vocab_size, 0).shape == (0,)


@pytest.mark.parametrize("vocab_size", VOCABS)
@pytest.mark.parametrize("tile", [kernels.MIN_VOCAB_TILE, 256, 1024])
@pytest.mark.parametrize("tp", [2, 3, 8])
def test_every_shard_edge_comes_before_any_boundary_finer_than_its_tile(vocab_size, tile, tp):
    sharding = kernels.ShardingSpec.even(vocab_size, tile, tp)
    edges = {c for lo, _ in sharding.bounds if 0 < lo < vocab_size for c in (lo - 1, lo)}
    assert edges  # tp > 1 over a vocab wider than the tile: at least one shard edge among real columns
    level = boundary_sides(vocab_size, tile)
    assert edges <= set(probe_columns(vocab_size, len(level)).tolist())


def test_the_finest_probe_boundary_is_the_narrowest_tile_the_kernels_take():
    kernels.ShardingSpec.even(VOCABS[0], kernels.MIN_VOCAB_TILE, 2)
    with pytest.raises(kernels.TPConfigError, match="vocab_tile must be a power of two"):
        kernels.ShardingSpec.even(VOCABS[0], kernels.MIN_VOCAB_TILE // 2, 2)


def probes(workload: Workload, probe_samples) -> torch.Tensor:
    return workload.active & torch.isin(workload.sample_ids, torch.tensor(list(probe_samples), dtype=torch.int64))


def test_probe_tokens_target_boundary_columns_and_are_not_sampled():
    spec = run_spec(compose_run("workload=hunt"))
    workload = build_inputs(spec)[1]
    probe = probes(workload, spec.workload.probe_samples)
    assert spec.workload.probe_samples and bool(probe.any())
    assert torch.equal(workload.sampled, workload.active & ~probe)
    assert torch.equal(workload.targets[probe], probe_columns(spec.model.vocab_size, int(probe.sum())))
    active_targets = workload.targets[workload.active]
    assert bool(((active_targets >= 0) & (active_targets < spec.model.vocab_size)).all())
    assert bool((workload.targets[~workload.active] == kernels.IGNORE_INDEX).all())
    # A token's sampled target depends on its key alone: making other samples probes leaves it as it was.
    unprobed = build_inputs(run_spec(compose_run("workload=hunt", "workload.probe_samples=[]")))[1]
    assert torch.equal(unprobed.sampled, unprobed.active)
    assert torch.equal(workload.targets[workload.sampled], unprobed.targets[workload.sampled])
    assert not torch.equal(workload.targets[probe], unprobed.targets[probe])


def test_the_hunt_workload_is_the_same_at_every_tp_and_tile():
    hashes = {
        build_inputs(run_spec(compose_run("workload=hunt", *overrides)))[1].sha256
        for overrides in [(), ("tp=2",), ("profile=cuda_bf16", "tp=2")]  # tiles 256 and 1024
    }
    assert len(hashes) == 1


def test_a_replay_samples_every_active_token(tmp_path):
    gen = torch.Generator().manual_seed(0)
    hidden, vocab, seq_lens = 16, 100, [5, 7]
    tensors = {
        "weight": torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16),
        "hidden_states": torch.randn(sum(seq_lens), hidden, generator=gen).to(torch.bfloat16),
        "target_ids": torch.randint(0, vocab, (sum(seq_lens),), generator=gen),
        "seq_lens": torch.tensor(seq_lens),
        "active_mask": torch.arange(sum(seq_lens)) % 3 != 0,
    }
    workload = build_inputs(run_spec(compose_run(*write_replay(tmp_path, tensors, hidden, vocab))))[1]
    assert torch.equal(workload.sampled, tensors["active_mask"])


def test_sample_scales_change_only_their_samples_hidden_rows():
    spec = run_spec(compose_run("workload=hunt"))
    scales = spec.workload.sample_scales
    assert set(scales) - {1.0} and 1.0 in scales
    ones = f"workload.sample_scales=[{','.join(['1.0'] * len(scales))}]"
    scaled, plain = build_inputs(spec)[1], build_inputs(run_spec(compose_run("workload=hunt", ones)))[1]
    for sample, scale in enumerate(scales):
        rows = scaled.sample_rows(sample)
        if scale == 1.0:
            assert torch.equal(scaled.hidden[rows], plain.hidden[rows]), sample
        else:  # a power of two commutes with the one rounding to the execution dtype
            assert torch.equal(scaled.hidden[rows], plain.hidden[rows] * scale), (sample, scale)
    # An empty list is 1.0 for every sample, bit for bit.
    default = build_inputs(run_spec(compose_run("workload=hunt", "workload.sample_scales=[]")))[1]
    assert default.sha256 == plain.sha256
    # hidden_scale multiplies every sample's own scale.
    doubled = build_inputs(run_spec(compose_run("workload=hunt", "workload.hidden_scale=2")))[1]
    assert torch.equal(doubled.hidden, scaled.hidden * 2)


SAMPLES = len(run_spec(compose_run()).workload.seq_lens)  # the default workload's
SCALES_BUT_LAST = ",".join(["1.0"] * (SAMPLES - 1))
BAD_WORKLOADS = {
    "too few scales": ([f"workload.sample_scales=[{SCALES_BUT_LAST}]"], "workload.sample_scales=[1.0"),
    "too many scales": ([f"workload.sample_scales=[{SCALES_BUT_LAST},1.0,1.0]"], "entries for the"),
    "scale past the bound": (
        [f"workload.sample_scales=[{SCALES_BUT_LAST},{MAX_HIDDEN_SCALE * 2}]"],
        f"workload.sample_scales[{SAMPLES - 1}] (1.0 * {MAX_HIDDEN_SCALE * 2!r})={MAX_HIDDEN_SCALE * 2!r} must be in",
    ),
    "product past the bound": (  # each factor in range, their product not
        ["workload.hidden_scale=2", f"workload.sample_scales=[{SCALES_BUT_LAST},{MAX_HIDDEN_SCALE}]"],
        f"(2.0 * {MAX_HIDDEN_SCALE!r})={2 * MAX_HIDDEN_SCALE!r} must be in",
    ),
    "product below the bound": (
        [f"workload.hidden_scale={MIN_HIDDEN_SCALE}", f"workload.sample_scales=[0.5,{SCALES_BUT_LAST}]"],
        f"workload.sample_scales[0] ({MIN_HIDDEN_SCALE!r} * 0.5)={MIN_HIDDEN_SCALE / 2!r} must be in",
    ),
    "NaN scale": ([f"workload.sample_scales=[nan,{SCALES_BUT_LAST}]"], "(1.0 * nan)=nan must be in"),
    "probe past the last sample": ([f"workload.probe_samples=[{SAMPLES}]"], f"[{SAMPLES}] are no sample index"),
    "negative probe": (["workload.probe_samples=[-1]"], "[-1] are no sample index"),
    "repeated probe": (["workload.probe_samples=[0,0]"], "workload.probe_samples=[0, 0] lists samples [0] more than"),
    "every sample a probe": (
        [f"workload.probe_samples=[{','.join(map(str, range(SAMPLES)))}]"],
        "a probe: leave at least one",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_WORKLOADS))
def test_a_bad_hunt_key_is_refused_naming_the_value(case):
    overrides, message = BAD_WORKLOADS[case]
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_spec(compose_run(*overrides))


# A replay's file gives its hidden states and targets: a synthetic key set beside it would change nothing.
# run_spec reads neither file named here.
REPLAY = ["model=replay", "workload=replay", "model.hidden_size=8", "model.vocab_size=64", "model.weights.path=h.st"]
REPLAY += ["workload.path=capture.st"]


@pytest.mark.parametrize("override", ["workload.sample_scales=[1.0]", "workload.probe_samples=[0]"])
def test_a_hunt_key_of_a_replay_is_refused(override):
    with pytest.raises(ConfigError, match=re.escape(f"{override} applies to synthetic workloads only")):
        run_spec(compose_run(*REPLAY, override))
    run_spec(compose_run(*REPLAY))
