"""Bitwise invariance of the Triton kernels to the call's rows and the TP degree; the control must vary."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch
from conftest import triton_runs_on

import kernels

VOCAB, HIDDEN, TILE = 1000, 64, 128


@pytest.fixture
def triton_device(device):
    if not triton_runs_on(device):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    return device


def needle_call(inp, filler, needle_rows: torch.Tensor, rows: int, position: int, backend: str):
    """The needle rows placed at ``position`` inside a call of ``rows`` rows of unrelated filler."""
    count = needle_rows.numel()
    hidden = torch.cat([filler.hidden[:position], inp.hidden[needle_rows], filler.hidden[position : rows - count]])
    targets = torch.cat([filler.targets[:position], inp.targets[needle_rows], filler.targets[position : rows - count]])
    logits, _ = kernels.matmul(hidden, inp.weight, backend=backend)
    result = kernels.lm_head_logprob(hidden, inp.weight, targets, backend=backend, vocab_tile=TILE)
    window = slice(position, position + count)
    return logits[window], result.logp[window], result.lse[window]


INVARIANT = ["triton", "triton_fused"]  # the backends that declare cross_tp_bitwise


@pytest.mark.parametrize("backend", INVARIANT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_row_alone_equals_row_among_filler(backend, dtype, triton_device, make_inputs):
    inp = make_inputs(1, HIDDEN, VOCAB, dtype, triton_device)
    filler = make_inputs(257, HIDDEN, VOCAB, dtype, triton_device)
    alone = needle_call(inp, filler, torch.tensor([0]), 1, 0, backend)
    rng = secrets.SystemRandom()
    for rows in (2, rng.randint(3, 256), 257):
        position = rng.randrange(rows)
        among = needle_call(inp, filler, torch.tensor([0]), rows, position, backend)
        for name, a, b in zip(("logits", "logp", "lse"), alone, among, strict=True):
            assert kernels.first_bit_difference(a, b) is None, (
                f"{name} bits changed when the row sat at {position} of {rows} (seeds {inp.seed}, {filler.seed})"
            )


def test_control_varies_with_the_number_of_rows(make_inputs):
    inp = make_inputs(64, HIDDEN, VOCAB, torch.float32, "cpu")
    many = kernels.lm_head_logprob(inp.hidden, inp.weight, inp.targets, backend="control", vocab_tile=TILE)
    alone = [
        kernels.lm_head_logprob(inp.hidden[i : i + 1], inp.weight, inp.targets[i : i + 1], backend="control")
        for i in range(64)
    ]
    differ = [kernels.first_bit_difference(a.lse, many.lse[i : i + 1]) is not None for i, a in enumerate(alone)]
    assert any(differ), f"the negative control gave the same bits in a 1-row and a 64-row call (seed {inp.seed})"


@pytest.mark.parametrize("backend", INVARIANT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_is_bitwise_tp_invariant(backend, dtype, triton_device, make_inputs):
    inp = make_inputs(19, HIDDEN, VOCAB, dtype, triton_device)
    base = kernels.lm_head_logprob(inp.hidden, inp.weight, inp.targets, backend=backend, vocab_tile=TILE)
    for tp in (2, 4, 8):
        padded = kernels.padded_vocab_size(VOCAB, TILE, tp)
        sharded = kernels.lm_head_logprob(inp.hidden, inp.weight, inp.targets, backend=backend, tp=tp, vocab_tile=TILE)
        for name in ("logp", "lse"):
            index = kernels.first_bit_difference(getattr(base, name), getattr(sharded, name))
            assert index is None, f"{name} row {index} differs at tp={tp} (padded vocab {padded}, seed {inp.seed})"
        assert sharded.provenance.nodes["tp_merge"].config["tiles"] == padded // TILE


def test_the_tile_merge_gives_one_answer_in_any_order_and_grouping(triton_device, monkeypatch):
    """The merge is exact (docs/kernels.md): tiles in another order, split over ranks, or loaded in other blocks
    give the same lse bits, and the lse is float64's to within 2 ulp."""
    from kernels import triton_backend
    from kernels.backend import ShardPartials, get_backend

    seed = secrets.randbits(31)
    gen = torch.Generator().manual_seed(seed)
    rows, n_tiles = 37, 150
    maxes = torch.randn(rows, n_tiles, generator=gen, dtype=torch.float64) * 12
    sums = 1 + torch.rand(rows, n_tiles, generator=gen, dtype=torch.float64) * 1023
    maxes[:, -3:], sums[:, -3:] = float("-inf"), 0.0  # all-padding tiles
    want = torch.logsumexp(maxes.float().double() + sums.float().double().log(), dim=1)  # of the fp32 partials
    merge = get_backend("triton").merge

    def lse(order: torch.Tensor, ranks: int = 1) -> torch.Tensor:
        m, s = maxes[:, order].float().to(triton_device), sums[:, order].float().to(triton_device)
        zeros = torch.zeros(rows, device=triton_device)
        shards = zip(m.chunk(ranks, dim=1), s.chunk(ranks, dim=1), strict=True)
        return merge([ShardPartials(a, b, zeros, zeros.bool()) for a, b in shards])[0].cpu()

    base = lse(torch.arange(n_tiles))
    ulps = ((base.double() - want).abs() / (want.abs() * torch.finfo(torch.float32).eps)).max()
    assert ulps <= 2, f"lse is {ulps:.2f} ulp from float64's (seed {seed})"
    variants = {"reversed": lse(torch.arange(n_tiles).flip(0)), "3 ranks": lse(torch.arange(n_tiles), ranks=3)}
    variants["shuffled"] = lse(torch.randperm(n_tiles, generator=gen))
    monkeypatch.setattr(triton_backend, "MERGE_CHUNK", 4)
    monkeypatch.setattr(triton_backend, "MERGE_ROWS", 1)
    monkeypatch.setattr(triton_backend, "INTERPRETER_MERGE_ROWS", 8)
    variants["other blocks"] = lse(torch.arange(n_tiles))
    for name, got in variants.items():
        index = kernels.first_bit_difference(base, got)
        assert index is None, f"{name}: lse row {index} differs (seed {seed})"


@pytest.mark.parametrize(("rows", "vocab", "tile"), [(1, 1000, 128), (37, 3001, 64), (130, 500, 16)])
def test_tp1_in_one_launch_and_in_two_gives_the_same_bits_and_verdicts(rows, vocab, tile, triton_device, monkeypatch):
    """Small calls run TP = 1 as one kernel whose last program per row block merges; larger ones as two kernels.
    Which one runs depends on the row count only, so both must give every output bit and check verdict alike."""
    from kernels import triton_backend

    seed = secrets.randbits(31)
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).bfloat16().to(triton_device)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[::3] = kernels.IGNORE_INDEX
    bad = targets.clone()
    bad[-1] = vocab  # in the last row block
    nan_logits = logits.clone()
    nan_logits[rows // 2, 3] = float("nan")  # in a middle one
    results = []
    for limit in (rows, rows - 1):  # one launch, then two
        monkeypatch.setattr(triton_backend, "ONE_LAUNCH_ROWS", limit)
        results.append(kernels.logprob(logits, targets.to(triton_device), backend="triton", vocab_tile=tile))
        with pytest.raises(kernels.TargetOutOfRangeError, match=f"target id {vocab} at row {rows - 1}"):
            kernels.logprob(logits, bad.to(triton_device), backend="triton", vocab_tile=tile)
        with pytest.raises(kernels.NonFiniteInputError, match=rf"nan at index \({rows // 2}, 3\)"):
            kernels.logprob(nan_logits, targets.to(triton_device), backend="triton", vocab_tile=tile)
    one, two = results
    assert one.provenance.nodes["tp_merge"].kernels == ("kernels.triton_kernels.whole_vocab_kernel",)
    assert two.provenance.nodes["tp_merge"].kernels == ("kernels.triton_kernels.whole_vocab_finish_kernel",)
    for name in ("logp", "lse", "owner_rank", "active"):
        index = kernels.first_bit_difference(getattr(one, name).double(), getattr(two, name).double())
        assert index is None, f"{name} row {index} differs between one launch and two (seed {seed})"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: only the GPU reuses a stream's arrival counts")
def test_the_one_launch_leaves_every_streams_arrival_counts_at_zero(monkeypatch):
    """On a GPU the one launch reuses its stream's arrival counts, zeroed once, not per call: every call, of any row
    count and on any stream, must leave them at zero for the next, and give the bits of the two-launch path."""
    from kernels import triton_backend

    seed = secrets.randbits(31)
    gen = torch.Generator().manual_seed(seed)
    side = torch.cuda.Stream()
    for stream, rows in [(torch.cuda.current_stream(), 37), (side, 1024), (side, 3), (torch.cuda.current_stream(), 1)]:
        logits = (torch.randn(rows, 3001, generator=gen) * 4).bfloat16().cuda()
        targets = torch.randint(0, 3001, (rows,), generator=gen).cuda()
        with torch.cuda.stream(stream):
            results = []
            for limit in (rows, rows - 1):  # one launch, then two
                monkeypatch.setattr(triton_backend, "ONE_LAUNCH_ROWS", limit)
                results.append(kernels.logprob(logits, targets, backend="triton", vocab_tile=64))
        torch.cuda.synchronize()
        for name in ("logp", "lse"):
            index = kernels.first_bit_difference(getattr(results[0], name), getattr(results[1], name))
            assert index is None, f"{rows} rows on {stream}: {name} row {index} differs (seed {seed})"
        left = {key: int(counts.count_nonzero()) for key, counts in triton_backend._ARRIVAL_COUNTS.items()}
        assert len(left) >= 1 and not any(left.values()), f"arrival counts left nonzero: {left}"


@pytest.mark.interpreter
@pytest.mark.parametrize(("backend", "tp"), [("triton", 2), ("triton", 4), ("triton_fused", 2)])
def test_triton_distributed_gloo_equals_emulated(backend, tp, make_inputs):
    if not triton_runs_on("cpu"):
        pytest.skip("gloo ranks run the Triton interpreter on the CPU")
    inp = make_inputs(13, HIDDEN, VOCAB, torch.bfloat16, "cpu")
    emulated = kernels.lm_head_logprob(inp.hidden, inp.weight, inp.targets, backend=backend, tp=tp, vocab_tile=TILE)
    distributed = kernels.lm_head_logprob(
        inp.hidden, inp.weight, inp.targets, backend=backend, tp=tp, tp_mode="distributed", vocab_tile=TILE
    )
    assert distributed.provenance.tp_mode == "distributed"
    assert distributed.provenance.nodes["matmul"].backend == backend
    for name in ("logp", "lse", "owner_rank"):
        a, b = getattr(emulated, name), getattr(distributed, name)
        assert kernels.first_bit_difference(a.double(), b.double()) is None, f"{name} differs (seed {inp.seed})"


def strided_targets(targets: torch.Tensor, layout: str) -> torch.Tensor:
    """The same target values in another memory layout."""
    if layout == "every other element":
        spread = torch.full((2 * targets.numel(),), -7, dtype=targets.dtype, device=targets.device)
        spread[::2] = targets
        return spread[::2]
    if layout == "a column of [T, 2]":
        return torch.stack([targets, torch.full_like(targets, -7)], dim=1)[:, 0]
    return targets[:1].expand(targets.numel())  # "one element expanded": stride 0


@pytest.mark.parametrize("layout", ["every other element", "a column of [T, 2]", "one element expanded"])
@pytest.mark.parametrize("call", ["logprob", "lm_head_logprob"])
@pytest.mark.parametrize("backend", ["triton", "triton_fused", "aten"])
def test_targets_in_any_memory_layout_give_the_bits_of_a_contiguous_copy(backend, call, layout, device, make_inputs):
    if backend.startswith("triton") and not triton_runs_on(device):
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    inp = make_inputs(37, HIDDEN, VOCAB, torch.bfloat16, device)
    targets = inp.targets.clone()
    targets[5] = kernels.IGNORE_INDEX
    strided = strided_targets(targets, layout)
    assert not strided.is_contiguous()

    def run(t):
        if call == "logprob":
            logits, _ = kernels.matmul(inp.hidden, inp.weight, backend="aten")
            return kernels.logprob(logits, t, backend=backend, vocab_tile=TILE)
        return kernels.lm_head_logprob(inp.hidden, inp.weight, t, backend=backend, vocab_tile=TILE)

    want, got = run(strided.contiguous()), run(strided)
    for name in ("logp", "lse"):
        index = kernels.first_bit_difference(getattr(want, name), getattr(got, name))
        assert index is None, f"{name} row {index} differs with the targets laid out as {layout} (seed {inp.seed})"
    assert torch.equal(want.active, got.active) and torch.equal(want.owner_rank, got.owner_rank), layout


@pytest.mark.interpreter
def test_one_rank_group_serves_many_calls_and_follows_a_new_weight(make_inputs):
    if not triton_runs_on("cpu"):
        pytest.skip("gloo ranks run the Triton interpreter on the CPU")
    first = make_inputs(9, HIDDEN, VOCAB, torch.bfloat16, "cpu")
    second = make_inputs(4, HIDDEN, VOCAB, torch.bfloat16, "cpu")
    calls = [(first.hidden, first.weight, first.targets), (first.hidden[:3], first.weight, first.targets[:3])]
    calls.append((second.hidden, second.weight, second.targets))  # a new weight must reach the ranks
    with kernels.distributed_ranks("triton", kernels.ShardingSpec.even(VOCAB, TILE, 2), device_type="cpu"):
        served = [
            kernels.lm_head_logprob(h, w, t, backend="triton", tp=2, tp_mode="distributed", vocab_tile=TILE)
            for h, w, t in calls
        ]
    for (h, w, t), got in zip(calls, served, strict=True):
        want = kernels.lm_head_logprob(h, w, t, backend="triton", tp=2, vocab_tile=TILE)
        for name in ("logp", "lse"):
            index = kernels.first_bit_difference(getattr(want, name), getattr(got, name))
            assert index is None, f"{name} row {index} differs (seeds {first.seed}, {second.seed})"


def test_one_rank_group_follows_a_new_weight_in_a_freed_ones_memory(make_inputs):
    """The ranks keep the weight they were sent; a new tensor is sent again, even at the same address, version,
    shape and dtype as the one before it (a loader that refills one buffer each step and wraps it anew), and so is
    an inference tensor, which counts no versions."""
    vocab, hidden, tile = 64, 16, 16
    inp = make_inputs(6, hidden, vocab, torch.float32, "cpu")
    rng = np.random.default_rng(secrets.randbits(31))
    memory = np.empty((vocab, hidden), dtype=np.float32)
    with kernels.distributed_ranks("aten", kernels.ShardingSpec.even(vocab, tile, 2), device_type="cpu"):
        for step in range(4):
            memory[:] = rng.normal(0, (1 + step) / hidden**0.5, size=memory.shape)
            weight = torch.from_numpy(memory)  # each step a new tensor, at the same address, at version 0
            if step == 3:
                with torch.inference_mode():
                    weight = weight.clone()
            for call in range(2):
                got = kernels.lm_head_logprob(inp.hidden, weight, inp.targets, backend="aten", tp=2,
                                              tp_mode="distributed", vocab_tile=tile)  # fmt: skip
                want = kernels.lm_head_logprob(inp.hidden, weight, inp.targets, backend="aten", tp=2, vocab_tile=tile)
                index = kernels.first_bit_difference(want.logp, got.logp)
                assert index is None, f"step {step} call {call}: logp row {index} is a stale weight's (seed {inp.seed})"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: the decode tiling is the compiled TMA path's")
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_the_decode_tiling_gives_the_bits_of_the_shipped_tiling(rows, monkeypatch):
    """Calls of at most DECODE_ROWS rows take other blocks; every output must keep its bits (docs/kernels.md)."""
    from kernels import triton_backend
    from kernels.backend import get_backend

    triton = get_backend("triton")
    assert rows <= triton_backend.DECODE_ROWS
    seed = secrets.randbits(31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn(3 * 4096 + 77, 4096, device="cuda", generator=gen) / 64).bfloat16()
    for scale in (1e-3, 1.0, 300.0):
        hidden = (torch.randn(rows, 4096, device="cuda", generator=gen) * scale).bfloat16()
        decode, _ = triton.invariant_matmul(hidden, weight, torch.bfloat16)
        monkeypatch.setattr(triton_backend, "DECODE_ROWS", 0)
        shipped, _ = triton.invariant_matmul(hidden, weight, torch.bfloat16)
        monkeypatch.undo()
        index = kernels.first_bit_difference(decode, shipped)
        assert index is None, f"logit {index} differs between the tilings (rows {rows}, scale {scale}, seed {seed})"
