"""Bad sizes, seeds, files and geometries are refused by the RunSpec parse or ``preflight`` with a typed error,
before any allocation."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from rlsweep_fixtures import check_run, compose_run, execute_run, run_rlsweep, tables_left, write_replay
from safetensors.torch import save_file

from rlsweep import environment
from rlsweep.config import run_spec
from rlsweep.errors import ConfigError, ReplayInputError
from rlsweep.execute import check_fits, peak_bytes
from rlsweep.exitcodes import ExitCode
from rlsweep.layouts import filler_rows_needed, largest_calls, plan_cells
from rlsweep.manifest import identify
from rlsweep.model import build_lm_head
from rlsweep.run import preflight
from rlsweep.spec import (
    MAX_HIDDEN_SCALE,
    MAX_HIDDEN_SIZE,
    MAX_LOGIT_STD,
    MAX_NEEDLE_ROWS,
    MAX_SEQ_LEN,
    MAX_VOCAB_SIZE,
    MAX_VOCAB_TILE,
    MIN_HIDDEN_SCALE,
    MIN_LOGIT_STD,
)
from rlsweep.synthetic import SEED_LIMIT, counter_bits
from rlsweep.workload import Workload, WorkloadShape, workload_shape

HIDDEN, VOCAB, SEQ_LENS = 16, 700, [5, 7, 4]


def footprint(cfg):
    """``peak_bytes`` of a composed run, from the RunSpec the run parses."""
    spec = run_spec(cfg)
    return peak_bytes(spec, workload_shape(spec.workload, spec.model))


# --- workload: no token, no active token, positions that do not fit the counter key -----------------------

SYNTHETIC_WORKLOADS = {
    "no sample (T = 0)": (["workload.seq_lens=[]", "workload.prompt_lens=[]"], "has no token (T = 0)"),
    "no sample, prompts left": (["workload.seq_lens=[]"], "has no token (T = 0)"),
    "no active token": (["workload.seq_lens=[4]", "workload.prompt_lens=[4]"], "seq_len=4, prompt_len=4"),
    "sample longer than its keys": (
        [f"workload.seq_lens=[{MAX_SEQ_LEN + 1}]", "workload.prompt_lens=[1]"],
        f"1 <= seq_len <= {MAX_SEQ_LEN}",
    ),
}


@pytest.mark.parametrize("case", sorted(SYNTHETIC_WORKLOADS))
def test_synthetic_workload_without_tokens_is_refused(case):
    overrides, message = SYNTHETIC_WORKLOADS[case]
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_run(compose_run(*overrides))


def replay_tensors(rows: int = sum(SEQ_LENS)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    lens = SEQ_LENS if rows else []
    return {
        "weight": (torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5).to(torch.bfloat16),
        "hidden_states": torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16),
        "target_ids": torch.randint(0, VOCAB, (rows,), generator=gen),
        "seq_lens": torch.tensor(lens, dtype=torch.int64),
    }


def replay_overrides(directory, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Write the head and the capture; the overrides of a smoke replay run reading them."""
    return [*write_replay(directory, tensors, HIDDEN, VOCAB), "layout=smoke"]


def test_replay_without_tokens_is_refused(tmp_path):
    cfg = compose_run(*replay_overrides(tmp_path, replay_tensors(rows=0)))
    with pytest.raises(ReplayInputError, match=re.escape("hidden_states has no row (T = 0)")):
        check_run(cfg)


def test_replay_without_active_token_is_refused(tmp_path):
    tensors = replay_tensors() | {"active_mask": torch.zeros(sum(SEQ_LENS), dtype=torch.bool)}
    cfg = compose_run(*replay_overrides(tmp_path, tensors))
    with pytest.raises(ReplayInputError, match=f"marks none of the {sum(SEQ_LENS)} tokens active"):
        check_run(cfg)


def test_replay_seq_lens_whose_int64_sum_wraps_to_t_are_refused(tmp_path):
    rows = sum(SEQ_LENS)
    wrapping = [2**62, 2**62, 2**62, 2**62 + rows]  # sums to 2**64 + T: T in int64 arithmetic
    tensors = replay_tensors() | {"seq_lens": torch.tensor(wrapping, dtype=torch.int64)}
    cfg = compose_run(*replay_overrides(tmp_path, tensors))
    message = f"seq_lens[0] = {wrapping[0]} is outside [1, {MAX_SEQ_LEN}]"
    with pytest.raises(ReplayInputError, match=re.escape(message)):
        check_run(cfg)


# --- model=replay without its sizes -----------------------------------------------------------------------


def test_replay_model_without_sizes_names_every_missing_key(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("not set: model.hidden_size, model.vocab_size")):
        check_run(compose_run("model=replay"))


# --- corrupt, truncated or wrong weight and replay files ----------------------------------------------------


def corrupt(path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes({"garbage": b"this is not a safetensors file", "truncated": data[: len(data) // 2]}[how])


def replace_by_dir(path) -> None:
    path.unlink()
    path.mkdir()


BAD_WEIGHT_FILES = {
    "a directory": (lambda d: replace_by_dir(d / "head.safetensors"), "(model.weights.path) is a directory"),
    "not safetensors": (lambda d: corrupt(d / "head.safetensors", "garbage"), "is not a readable safetensors file"),
    "truncated": (lambda d: corrupt(d / "head.safetensors", "truncated"), "is not a readable safetensors file"),
    "no head tensor": (
        lambda d: save_file({"embed.weight": torch.zeros(VOCAB, HIDDEN)}, d / "head.safetensors"),
        "has no tensor 'lm_head.weight'",
    ),
    "wrong shape": (
        lambda d: save_file({"lm_head.weight": torch.zeros(VOCAB, HIDDEN + 1)}, d / "head.safetensors"),
        f"has shape [{VOCAB}, {HIDDEN + 1}]",
    ),
    "integer dtype": (
        lambda d: save_file({"lm_head.weight": torch.zeros(VOCAB, HIDDEN, dtype=torch.int32)}, d / "head.safetensors"),
        "has dtype I32; a floating dtype is needed",
    ),
}
BAD_REPLAY_FILES = {
    "a directory": (lambda d: replace_by_dir(d / "capture.safetensors"), "(workload.path) is a directory"),
    "not safetensors": (lambda d: corrupt(d / "capture.safetensors", "garbage"), "is not a readable safetensors file"),
    "truncated": (lambda d: corrupt(d / "capture.safetensors", "truncated"), "is not a readable safetensors file"),
    "integer hidden states": (
        lambda d: save_file(
            replay_tensors() | {"hidden_states": torch.zeros(sum(SEQ_LENS), HIDDEN, dtype=torch.int64)},
            d / "capture.safetensors",
        ),
        "hidden_states must be a floating",
    ),
    "active_mask not bool": (
        lambda d: save_file(
            {k: v for k, v in replay_tensors().items() if k != "weight"}
            | {"active_mask": torch.ones(sum(SEQ_LENS), dtype=torch.uint8)},
            d / "capture.safetensors",
        ),
        "active_mask must be bool",
    ),
}


# What an input path may be besides a regular file: each was opened (a FIFO: until some writer came) or read without end
# (/dev/zero) when the run hashed its inputs, before any check. Each makes the path in place of the input file.
NOT_REGULAR = {
    "a FIFO": (lambda path: (path.unlink(), os.mkfifo(path)), "is a FIFO (named pipe), not a regular file"),
    "a link to /dev/zero": (lambda path: (path.unlink(), path.symlink_to("/dev/zero")),
                            "is a character device (through a link to '/dev/zero'), not a regular file"),
    "a directory": (replace_by_dir, "is a directory, not a regular file"),
}  # fmt: skip
INPUT_FILES = {
    "model.weights.path": ("weight file", "head.safetensors"),
    "workload.path": ("replay file", "capture.safetensors"),
}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("key", sorted(INPUT_FILES))
@pytest.mark.parametrize("case", sorted(NOT_REGULAR))
def test_an_input_path_that_is_no_regular_file_is_refused_before_it_is_read_or_hashed(tmp_path, key, case):
    overrides = replay_overrides(tmp_path, replay_tensors())
    what, name = INPUT_FILES[key]
    make, kind = NOT_REGULAR[case]
    make(tmp_path / name)
    spec = run_spec(compose_run(*overrides))
    # A sweep checks every job's files first (preflight); a single run hashes them first (its identity).
    for step in (lambda: preflight(spec), lambda: identify(spec.config)):
        with pytest.raises(ReplayInputError) as caught:
            step()
        assert str(caught.value) == f"{what} {str(tmp_path / name)!r} ({key}) {kind}"


@pytest.mark.parametrize(
    ("files", "case"),
    [*(("weight", c) for c in sorted(BAD_WEIGHT_FILES)), *(("replay", c) for c in sorted(BAD_REPLAY_FILES))],
)
def test_bad_file_names_its_path_and_what_is_wrong(tmp_path, files, case):
    overrides = replay_overrides(tmp_path, replay_tensors())
    spoil, message = (BAD_WEIGHT_FILES if files == "weight" else BAD_REPLAY_FILES)[case]
    spoil(tmp_path)
    path = tmp_path / ("head.safetensors" if files == "weight" else "capture.safetensors")
    with pytest.raises(ReplayInputError, match=re.escape(message)) as caught:
        check_run(compose_run(*overrides))
    assert str(path) in str(caught.value)


# --- seeds ------------------------------------------------------------------------------------------------


def test_seeds_outside_the_range_alias_seeds_inside_it():
    """Why the bound is what it is: the stream key wraps modulo 2**64 after the seed is shifted."""
    rows, cols = torch.arange(4)[:, None], torch.arange(3)[None, :]
    bits = lambda seed: counter_bits(seed, "hidden", rows, cols)  # noqa: E731
    assert torch.equal(bits(5 + SEED_LIMIT), bits(5))
    assert torch.equal(bits(-1), bits(SEED_LIMIT - 1))
    assert not torch.equal(bits(SEED_LIMIT - 1), bits(0))


@pytest.mark.parametrize("key", ["seed", "model.weights.seed"])
@pytest.mark.parametrize("value", [-1, SEED_LIMIT, 2**64])
def test_seed_that_would_alias_is_refused(key, value):
    with pytest.raises(ConfigError, match=re.escape(f"{key}={value} is outside") + ".*" + re.escape("[0, 2**56 - 1]")):
        check_run(compose_run("layout=smoke", f"{key}={value}"))


def test_largest_distinct_seed_is_accepted():
    check_run(compose_run("layout=smoke", f"seed={SEED_LIMIT - 1}", f"model.weights.seed={SEED_LIMIT - 1}"))


# --- sizes: typo bounds, then the memory estimate -----------------------------------------------------------

ABSURD_SIZES = {
    "hidden_size 0": (["model.hidden_size=0"], f"model.hidden_size=0 is outside [1, {MAX_HIDDEN_SIZE}]"),
    "hidden_size too large": (
        [f"model.hidden_size={MAX_HIDDEN_SIZE + 1}"],
        f"model.hidden_size={MAX_HIDDEN_SIZE + 1} is outside [1, {MAX_HIDDEN_SIZE}]",
    ),
    "vocab_size 1e8": (["model.vocab_size=100000000"], f"model.vocab_size=100000000 is outside [2, {MAX_VOCAB_SIZE}]"),
    "vocab_size 1": (["model.vocab_size=1"], f"model.vocab_size=1 is outside [2, {MAX_VOCAB_SIZE}]"),
    "padded vocab below vocab": (["model.padded_vocab_size=3000"], "model.padded_vocab_size=3000 is outside"),
    "vocab_tile too large": (
        [f"profile.vocab_tile={MAX_VOCAB_TILE * 2}"],
        f"profile.vocab_tile={MAX_VOCAB_TILE * 2} is above {MAX_VOCAB_TILE}",
    ),
    "chunk_size too large": ([f"layout.chunk_size={MAX_SEQ_LEN + 1}"], f"at most {MAX_SEQ_LEN}"),
    "needle m too large": (
        [f"layout.needles=[{{m: {MAX_NEEDLE_ROWS + 1}, pos: 0}}]"],
        f"need 1 <= m <= {MAX_NEEDLE_ROWS}",
    ),
}


@pytest.mark.parametrize("case", sorted(ABSURD_SIZES))
def test_absurd_size_is_refused_with_its_bound(case):
    overrides, message = ABSURD_SIZES[case]
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_run(compose_run(*overrides))


# Scales of the synthetic inputs: 0 (or 1e-300, 0 in bf16) makes an all-zero tensor, a negative one flips it, a tiny
# one makes every logp -log(V) whatever the kernel did; both bounded alike.
SCALES = {
    "model.weights.logit_std": (MIN_LOGIT_STD, MAX_LOGIT_STD),
    "workload.hidden_scale": (MIN_HIDDEN_SCALE, MAX_HIDDEN_SCALE),
}


@pytest.mark.parametrize("key", sorted(SCALES))
@pytest.mark.parametrize("value", [0.0, 1e-300, 1e-6, -4.0, math.nan, math.inf, 128.0])
def test_a_scale_outside_its_bound_is_refused(key, value):
    low, high = SCALES[key]
    with pytest.raises(ConfigError, match=re.escape(f"{key}={value!r} must be in [{low:g}, {high:g}]")):
        check_run(compose_run("layout=smoke", f"{key}={value}"))


@pytest.mark.parametrize("key", sorted(SCALES))
@pytest.mark.parametrize("end", [0, 1])
def test_a_scale_at_its_bound_is_accepted(key, end):
    check_run(compose_run("layout=smoke", "workload=varlen4", f"{key}={SCALES[key][end]}"))


# Inside every bound, but far above any machine: 2 TiB of bf16 weight alone.
TOO_LARGE = [f"model.hidden_size={MAX_HIDDEN_SIZE}", f"model.vocab_size={MAX_VOCAB_SIZE}"]


def test_geometry_that_cannot_fit_is_refused_before_allocating(monkeypatch, tmp_path):
    import rlsweep.run

    def must_not_run(*args, **kwargs):
        raise AssertionError("the head was built for a run that cannot fit")

    monkeypatch.setattr(rlsweep.run, "build_lm_head", must_not_run)
    with pytest.raises(ConfigError, match=r"needs about [\d.,]+ GiB on cpu .* is available") as caught:
        execute_run(compose_run(*TOO_LARGE, "layout=smoke"), tmp_path)
    for size in (f"hidden_size={MAX_HIDDEN_SIZE}", f"vocab_size={MAX_VOCAB_SIZE}", "largest_call_rows="):
        assert size in str(caught.value)
    assert tables_left(tmp_path) == []


def test_guard_compares_with_the_memory_of_the_runs_device(monkeypatch):
    cfg = compose_run("model=qwen3_8b", "layout=smoke")
    estimate = footprint(cfg)
    check_fits(estimate, "cuda", (estimate.peak, "exactly enough"))
    with pytest.raises(ConfigError, match=re.escape("but only 1.0 GiB is available (one GiB left)")):
        check_fits(estimate, "cuda", (1 << 30, "one GiB left"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (3 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert environment.available_memory("cuda") == (3 << 30, "free memory of cuda:0 (torch.cuda.mem_get_info)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert environment.available_memory("cuda") is None  # the run stops on provenance before any tensor


def test_ordinary_runs_are_far_below_the_limit():
    available, _source = environment.available_memory("cpu")
    default = footprint(compose_run())
    assert default.peak < min(1 << 30, available // 8), default.describe()
    # Qwen3-8B's head on one GPU of 16 GiB or more.
    qwen = footprint(compose_run("model=qwen3_8b", "profile=cuda_bf16", "tp=4"))
    assert qwen.peak < 16 << 30, qwen.describe()


def fake_workload(seq_lens: list[int], active: torch.Tensor) -> Workload:
    """Just enough of a workload for ``plan_cells``: token keys and the active mask, no hidden state."""
    sample_ids = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    hidden = torch.zeros(len(sample_ids), 1)
    return Workload("fake", 0, sample_ids, positions, hidden, sample_ids, active, active, tuple(seq_lens))


def synthetic_active(seq_lens, prompt_lens) -> torch.Tensor:
    return torch.cat([torch.arange(n) >= p for n, p in zip(seq_lens, prompt_lens, strict=True)])


@pytest.mark.parametrize("layout", ["full", "smoke"])
@pytest.mark.parametrize("active", ["synthetic", "replay mask"])
def test_largest_calls_match_the_planned_cells(layout, active):
    chunks = ["layout.chunk_size=3"] if layout == "full" else []  # smoke has no chunked cell to read it
    spec = run_spec(compose_run(f"layout={layout}", *chunks))
    seq_lens = list(spec.workload.seq_lens)
    if active == "synthetic":
        mask = synthetic_active(seq_lens, spec.workload.prompt_lens)
    else:  # a replay mask: gaps anywhere, and one sample with no active token
        mask = torch.arange(sum(seq_lens)) % 3 == 1
        mask[: seq_lens[0]] = False
    workload = fake_workload(seq_lens, mask)
    counts = [int(mask[workload.sample_rows(s)].sum()) for s in range(len(seq_lens))]
    cells = plan_cells(spec.layout, workload)
    assert largest_calls(spec.layout, WorkloadShape(tuple(seq_lens), tuple(counts))) == {
        cell.name: max(cell.call_rows) for cell in cells
    }
    assert spec.layout.filler_rows == filler_rows_needed(cells)


MEASURE = textwrap.dedent(
    """
    import resource, sys, tempfile
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from rlsweep_fixtures import compose_run, execute_run
    from test_input_bounds import footprint
    cfg = compose_run(*{overrides!r})
    estimate = footprint(cfg).peak
    def rss():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
    start = rss()
    execute_run(cfg, Path(tempfile.mkdtemp()))
    print(estimate, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_estimate_covers_the_measured_peak_of_a_cpu_run():
    """The estimate is an upper bound of what a real run's peak RSS grows by (a head where float64 dominates)."""
    from pathlib import Path

    overrides = ["model.vocab_size=8192", "model.hidden_size=512", "layout=smoke"]
    script = MEASURE.format(tests=str(Path(__file__).parent), overrides=overrides)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    estimate, measured = map(int, done.stdout.split()[-2:])
    assert measured <= estimate, (measured, estimate)


# --- the real command line: one line, exit 1, no table -------------------------------------------------------

CLI_REFUSALS = {
    "no token": (["workload.seq_lens=[]", "workload.prompt_lens=[]"], "has no token (T = 0)"),
    "replay model without sizes": (["model=replay"], "model.hidden_size, model.vocab_size"),
    "negative seed": (["seed=-1"], "seed=-1 is outside"),
    "vocab 1e8": (["model.vocab_size=100000000"], "model.vocab_size=100000000 is outside"),
    "cannot fit": (TOO_LARGE, "is available ("),
    # A single run hashes its input files first: /dev/zero was read for ever.
    "weights /dev/zero": (["model.weights.kind=file", "model.weights.path=/dev/zero"],
                          "weight file '/dev/zero' (model.weights.path) is a character device, not a regular file"),
    "replay /dev/zero": (["workload=replay", "workload.path=/dev/zero"],
                         "replay file '/dev/zero' (workload.path) is a character device, not a regular file"),
    "empty tables_dir": (["tables_dir=''"], "tables_dir=''"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CLI_REFUSALS))
def test_cli_refuses_with_one_message_and_no_table(tmp_path, case):
    overrides, message = CLI_REFUSALS[case]
    done = run_rlsweep(tmp_path, "layout=smoke", *overrides)
    assert done.returncode == 1, done.stderr
    assert message in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert tables_left(tmp_path) == []


def test_cli_refuses_a_truncated_weight_file(tmp_path):
    overrides = replay_overrides(tmp_path, replay_tensors())
    corrupt(tmp_path / "head.safetensors", "truncated")
    done = run_rlsweep(tmp_path / "run", *overrides)
    assert done.returncode == 1, done.stderr
    assert f"weight file '{tmp_path / 'head.safetensors'}'" in done.stderr
    assert "Traceback" not in done.stderr
    assert tables_left(tmp_path / "run") == []


@pytest.mark.parametrize("backend", ["atn", "triton", "reference"])
def test_a_node_required_on_another_backend_than_the_profiles_is_refused(backend):
    """The run binds every op node to backend_family: a node required elsewhere could only end red, after the run."""
    message = f"required_nodes {{'matmul': '{backend}'}} name a backend other than backend_family='aten'"
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_spec(compose_run("layout=smoke", f"profile.required_nodes.matmul={backend}"))


@pytest.mark.parametrize("overrides", [["model.vocab_size=200"], ["profile.vocab_tile=4096"], ["model.vocab_size=10"]])
def test_tp_above_1_where_one_tile_holds_the_whole_vocab_is_refused(overrides):
    """Shards are whole tiles: a tile of the whole vocab sits on rank 0, and the other ranks split nothing."""
    with pytest.raises(ConfigError, match=r"tp=2 with profile\.vocab_tile=\d+ >= model\.vocab_size=\d+: rank 0 holds"):
        run_spec(compose_run("layout=smoke", "tp=2", *overrides))
    run_spec(compose_run("layout=smoke", "tp=1", *overrides))


@pytest.mark.parametrize(("scale", "code"), [(1e-30, ExitCode.ERROR), (1e-8, ExitCode.ERROR), (1e-7, ExitCode.RED)])
def test_inputs_no_verdict_could_fail_on_are_refused_by_one_rule_and_the_rest_are_judged(tmp_path, scale, code):
    # A head file scaled down: at 1e-8 every logit spread is below one fp32 ulp of logp and the negative control's
    # layout variance vanishes (GREEN if run); at 1e-7 it still shows, so the inputs are judged and the control is red.
    spec = run_spec(compose_run())
    head = build_lm_head(spec.model, dtype=torch.float32, device=torch.device("cpu"))
    path = tmp_path / "head.safetensors"
    save_file({"lm_head.weight": (head.weight * scale).to(torch.bfloat16).contiguous()}, path)
    done = run_rlsweep(
        tmp_path / "run", "profile=negative_control_cpu", "model=replay", f"model.weights.path={path}",
        f"model.hidden_size={spec.model.hidden_size}", f"model.vocab_size={spec.model.vocab_size}",
    )  # fmt: skip
    assert done.returncode == code, done.stdout + done.stderr
    if code == ExitCode.ERROR:
        assert "no verdict could fail on these inputs" in done.stderr and len(done.stderr.splitlines()) == 1
        assert tables_left(tmp_path / "run") == []
