"""The lm_head logprob on one GPU, through the public calls a user makes, beside cuBLAS, aten and Liger-Kernel.

Usage: python benchmarks/bench_logprob.py [--tokens 64 16384] [--repeats 20] [--tune [matmul fused logprob]] [--out DIR]

For each token count T (V = 151936, H = 4096, bf16 inputs, logits of std 4): the bandwidth floor of reading the
[T, V] bf16 logits, ``kernels.logprob`` on materialized logits, ``kernels.matmul`` against cuBLAS, and
``kernels.lm_head_logprob`` (triton, triton_fused, aten) beside Liger-Kernel's fused linear cross-entropy forward;
each with its median time over ``--repeats`` calls (before every call the L2 is flushed and, at decode sizes, the GPU
held busy until the host has queued the call: ``Bench.time_ms``), its peak memory beyond the inputs, its max
|logp - float64| on 64 rows, and whether 7 rows alone give the bits they have inside the T-row call.
``kernels.logprob`` and ``kernels.matmul`` are timed a second way too: given ``checks=`` and read after the call,
and back to back (50 calls on inputs rotated past L2, the checks read once after them) beside a copy and cuBLAS
timed the same way; for ``kernels.logprob`` also its kernels alone and the host time of one call. Then forward +
backward of triton_fused and of Liger: time, peak memory with the gradients it makes, max |d hidden - float64| on 64
rows, 7 rows bitwise. ``--tune`` times candidate tilings first, of the kinds named or all (docs/benchmarks.md says
how the shipped ones were chosen). Prints Markdown tables; writes bench_logprob.json to --out. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch
import triton

import kernels
from kernels import triton_backend
from kernels.backend import get_backend
from kernels.triton_backend import MatmulTiling

V, H, LOGIT_STD = 151936, 4096, 4.0
PROBE = [0, 1, 2, 5, 31, 48, 63]  # rows checked alone against the full call (all < 64, so every T has them)
ACCURACY_ROWS = 64
FLUSH_BYTES = 512 << 20  # more than the H200's 50 MB L2, written before every timed call
HOLD_CYCLES = 500_000  # GPU clock cycles (about 0.25 ms) the device spins after the flush, before the timed call
HOLD_UP_TO_TOKENS = 1024  # calls this small hold the GPU (their host time outlasts the flush); larger ones do not


class Bench:
    def __init__(self, repeats: int):
        self.repeats = repeats
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        self.hold_cycles = HOLD_CYCLES

    def time_ms(self, fn: Callable[[], object]) -> float:
        """Median CUDA-event time of ``fn`` over ``repeats`` calls, each after an L2 flush and a hold (neither timed):
        the device spins for ``hold_cycles`` (``torch.cuda._sleep``), which with the flush outlasts the host's time
        to queue one call here, so the span times the work the call queues and any wait it makes for the device,
        not the host's pace before its first launch; that pace is the host-time row (``host_ms``). A call that waits
        still pays its return after the wait; what it returns is freed after the span, as a caller keeps it. Calls
        of more than HOLD_UP_TO_TOKENS rows are not held: their work outlasts the host's, and after a hold the H200
        ran T = 16384's kernels 20 µs slower and a waiting call took 94 µs longer (docs/benchmarks.md)."""
        fn()
        fn()
        times = []
        for _ in range(self.repeats):
            self.flush.zero_()
            if self.hold_cycles:
                torch.cuda._sleep(self.hold_cycles)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            stop.record()
            torch.cuda.synchronize()
            del out  # what the call returned is freed when its caller lets go of it, after the span
            times.append(start.elapsed_time(stop))
        return statistics.median(times)

    def hold_for(self, tokens: int) -> None:
        """Hold the GPU before each timed call of ``tokens`` rows (``time_ms``) at decode sizes only."""
        self.hold_cycles = HOLD_CYCLES if tokens <= HOLD_UP_TO_TOKENS else 0

    def stream_ms(self, fn: Callable[[int], object], calls: int = 50) -> float:
        """Median over ``repeats // 4`` batches of the CUDA-event time per call of ``calls`` back-to-back calls
        ``fn(i)``: the steady state of a loop that does not wait for the device between calls. ``fn`` rotates its
        inputs through more bytes than L2 holds, so no call reads what the one before left there."""
        fn(0)
        fn(1)
        times = []
        for _ in range(max(3, self.repeats // 4)):
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(calls):
                fn(i)
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / calls)
        return statistics.median(times)

    def host_ms(self, fn: Callable[[], object]) -> float:
        """Host time per call of ``fn`` over ``repeats`` calls that queue work without waiting for it
        (``time.perf_counter``; the device is idle when they start): what a call costs before its kernels run."""
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(self.repeats):
            fn()
        host = (time.perf_counter() - start) / self.repeats * 1e3
        torch.cuda.synchronize()
        return host

    @staticmethod
    def peak_gib(fn: Callable[[], object]) -> float:
        """Peak memory ``fn`` allocates beyond what is allocated when it starts, in GiB."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        del out
        return (torch.cuda.max_memory_allocated() - base) / 2**30


def inputs(tokens: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, H, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=gen) * (LOGIT_STD / H**0.5)).bfloat16()
    targets = torch.randint(0, V, (tokens,), device="cuda", generator=gen)
    return hidden, weight, targets


def liger():
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return liger_fused_linear_cross_entropy


def logp_paths(tile: int, fused_tile: int) -> dict[str, Callable]:
    """name -> (hidden, weight, targets) -> logp [T] fp32, each through its public call."""

    def head(backend: str, vocab_tile: int):
        return lambda h, w, t: kernels.lm_head_logprob(h, w, t, backend=backend, vocab_tile=vocab_tile).logp

    paths = {
        "lm_head_logprob triton": head("triton", tile),
        "lm_head_logprob triton_fused": head("triton_fused", fused_tile),
        "lm_head_logprob aten": head("aten", tile),
    }
    flce = liger()
    if flce is not None:
        paths["Liger FLCE forward"] = lambda h, w, t: -flce(h, w, t, reduction="none").float()
    return paths


def invariant(path: Callable, hidden, weight, targets, full: torch.Tensor) -> bool:
    pick = torch.tensor(PROBE, device="cuda")
    alone = path(hidden[pick], weight, targets[pick])
    return kernels.first_bit_difference(alone, full[pick]) is None


def materialized(bench: Bench, hidden, weight, targets, tile: int) -> list[dict]:
    """The floor of reading the [T, V] bf16 logits, and ``kernels.logprob`` on them."""
    tokens = hidden.shape[0]
    logits = hidden @ weight.T
    scratch = torch.empty_like(logits)
    copy_ms = bench.time_ms(lambda: scratch.copy_(logits))
    tbps = 2 * logits.numel() * logits.element_size() / (copy_ms * 1e-3) / 1e12  # read + write
    floor_ms = copy_ms / 2  # reading the logits once, at the copy's bandwidth
    rows = [
        {
            "T": tokens,
            "measurement": "copy of the bf16 logits (read + write)",
            "ms": copy_ms,
            "note": f"{tbps:.2f} TB/s",
        },
        {"T": tokens, "measurement": "floor: read T*V bf16 logits once", "ms": floor_ms, "note": "1.00x floor"},
    ]
    for backend in ("triton", "aten"):
        ms = bench.time_ms(lambda b=backend: kernels.logprob(logits, targets, backend=b, vocab_tile=tile))
        rows.append({"T": tokens, "measurement": f"kernels.logprob {backend} (materialized logits)", "ms": ms,
                     "note": f"{floor_ms / ms:.2f}x floor"})  # fmt: skip
    ms = deferred_ms(bench, lambda checks: kernels.logprob(logits, targets, backend="triton", checks=checks))
    rows.append({"T": tokens, "measurement": "kernels.logprob triton, checks=ValueChecks() read after the call",
                 "ms": ms, "note": f"{floor_ms / ms:.2f}x floor"})  # fmt: skip
    # The GPU side alone: the kernels the call launches at TP = 1 (one or two), without its Python and checks.
    sharding = kernels.ShardingSpec.even(logits.shape[1], tile, 1)
    ms = bench.time_ms(lambda: get_backend("triton").whole_vocab(logits, targets, sharding))
    rows.append({"T": tokens, "measurement": "kernels.logprob triton's kernels alone (whole_vocab)", "ms": ms,
                 "note": f"{floor_ms / ms:.2f}x floor"})  # fmt: skip
    ms = bench.host_ms(lambda: kernels.logprob(logits, targets, backend="triton", checks=kernels.ValueChecks()))
    rows.append({"T": tokens, "measurement": "host time of one kernels.logprob triton call, not waited for", "ms": ms,
                 "note": ""})  # fmt: skip
    # Back to back: logits rotated through at least 2 copies and 100 MB, past the 50 MB L2.
    rotation = [logits] + [logits.clone() for _ in range(max(1, -(-(100 << 20) // logits.nbytes) - 1))]
    scratches = [torch.empty_like(logits) for _ in rotation]
    stream_copy = bench.stream_ms(lambda i: scratches[i % len(rotation)].copy_(rotation[i % len(rotation)]))
    stream_floor = stream_copy / 2
    checks = kernels.ValueChecks()
    ms = bench.stream_ms(lambda i: kernels.logprob(rotation[i % len(rotation)], targets, backend="triton",
                                                    checks=checks))  # fmt: skip
    checks.raise_first()
    rows.append({"T": tokens, "measurement": "back to back: floor, half a copy of rotated logits", "ms": stream_floor,
                 "note": "1.00x floor"})  # fmt: skip
    rows.append({"T": tokens, "measurement": "back to back: kernels.logprob triton, checks read once after them",
                 "ms": ms, "note": f"{stream_floor / ms:.2f}x floor"})  # fmt: skip
    return rows


def deferred_ms(bench: Bench, call: Callable[[kernels.ValueChecks], object]) -> float:
    """``bench.time_ms`` of a call given its own ``checks``, each read (``raise_first``) after the timed span, as a
    caller does that reads the checks of many calls at once."""
    pending: list[kernels.ValueChecks] = []

    def one() -> None:
        pending.append(kernels.ValueChecks())
        call(pending[-1])

    ms = bench.time_ms(one)
    for checks in pending:
        checks.raise_first()
    return ms


def measure(bench: Bench, tokens: int, tile: int, fused_tile: int, reference: torch.Tensor) -> list[dict]:
    hidden, weight, targets = inputs(tokens)
    rows: list[dict] = []

    def row(name: str, ms: float, note: str = "", **extra) -> None:
        rows.append({"T": tokens, "measurement": name, "ms": round(ms, 4), "note": note, **extra})

    rows += materialized(bench, hidden, weight, targets, tile)
    flops = 2 * tokens * V * H
    cublas_ms = bench.time_ms(lambda: hidden @ weight.T)
    triton_ms = bench.time_ms(lambda: kernels.matmul(hidden, weight, backend="triton"))
    row("matmul cuBLAS bf16", cublas_ms, f"{flops / cublas_ms / 1e9:.0f} TFLOP/s")
    row("kernels.matmul triton (invariant)", triton_ms, f"{cublas_ms / triton_ms:.2f}x cuBLAS")
    ms = deferred_ms(bench, lambda checks: kernels.matmul(hidden, weight, backend="triton", checks=checks))
    row("kernels.matmul triton, checks=ValueChecks() read after the call", ms, f"{cublas_ms / ms:.2f}x cuBLAS")
    # Back to back on 4 rotated hidden states (the 1.2 GB weight is past L2 whatever the order).
    rotation = [hidden] + [torch.randn_like(hidden) for _ in range(3)]
    stream_cublas = bench.stream_ms(lambda i: rotation[i % 4] @ weight.T)
    checks = kernels.ValueChecks()
    ms = bench.stream_ms(lambda i: kernels.matmul(rotation[i % 4], weight, backend="triton", checks=checks))
    checks.raise_first()
    row("back to back: matmul cuBLAS bf16", stream_cublas, "")
    row("back to back: kernels.matmul triton, checks read once after them", ms, f"{stream_cublas / ms:.2f}x cuBLAS")

    probe = slice(0, ACCURACY_ROWS)
    for name, path in logp_paths(tile, fused_tile).items():
        with torch.no_grad():
            ms = bench.time_ms(lambda p=path: p(hidden, weight, targets))
            peak = bench.peak_gib(lambda p=path: p(hidden, weight, targets))
            full = path(hidden, weight, targets)
            error = float((full[probe].double() - reference).abs().max())
            bitwise = invariant(path, hidden, weight, targets, full)
        row(name, ms, f"{ms / cublas_ms:.2f}x cuBLAS matmul", peak_gib=round(peak, 3), max_err=error, bitwise=bitwise)

    rows += forward_backward(bench, hidden, weight, targets, fused_tile, cublas_ms)
    return rows


def loss_paths(fused_tile: int) -> dict[str, Callable]:
    """name -> (hidden, weight, targets) -> the summed negative logp, whose backward sends g_logp = -1 to each row."""
    paths = {
        "lm_head_logprob triton_fused": lambda h, w, t: (
            -kernels.lm_head_logprob(h, w, t, backend="triton_fused", vocab_tile=fused_tile).logp.sum()
        )
    }
    flce = liger()
    if flce is not None:
        paths["Liger FLCE"] = lambda h, w, t: flce(h, w, t, reduction="none").sum()
    return paths


def forward_backward(bench: Bench, hidden, weight, targets, fused_tile: int, cublas_ms: float) -> list[dict]:
    """Forward + backward of each loss path: time, peak memory with the gradients it makes (none held before), the
    max |d hidden - float64| on the first rows, and whether 7 rows' d hidden alone equal theirs in the call."""
    tokens = hidden.shape[0]
    probe = slice(0, ACCURACY_ROWS)
    h64, w64 = hidden[probe].double(), weight.double()
    p = torch.softmax(h64 @ w64.T, dim=1)
    gold = p @ w64 - w64[targets[probe]]  # d hidden of -logp: softmax @ W - W[target]
    del w64, p
    rows = []
    for name, loss in loss_paths(fused_tile).items():
        leaf = hidden.detach().requires_grad_(True)
        head = weight.detach().requires_grad_(True)

        def step(loss=loss, leaf=leaf, head=head, pick=slice(None)):
            leaf.grad = head.grad = None
            loss(leaf[pick], head, targets[pick]).backward()
            return leaf.grad

        ms = bench.time_ms(step)
        leaf.grad = head.grad = None
        peak = bench.peak_gib(step)
        d_hidden = step().clone()
        error = float((d_hidden[probe].double() - gold).abs().max())
        pick = torch.tensor(PROBE, device="cuda")
        alone = step(pick=pick)[pick]
        bitwise = kernels.first_bit_difference(alone, d_hidden[pick]) is None
        leaf.grad = head.grad = None
        rows.append({"T": tokens, "measurement": f"{name} forward + backward", "ms": round(ms, 4),
                     "note": f"{ms / cublas_ms:.2f}x cuBLAS matmul", "peak_gib": round(peak, 3),
                     "max_err": error, "bitwise": bitwise})  # fmt: skip
    return rows


TUNABLE = ("matmul", "fused", "logprob")


def tune(bench: Bench, kinds: list[str], out: list[dict]) -> None:
    """Candidate tilings of ``kinds`` at both ends of T: the numbers the shipped choices in kernels/triton_backend.py
    rest on."""
    matmul_candidates = [
        MatmulTiling(128, 128, 64, 8, 8, 3),
        MatmulTiling(128, 256, 64, 8, 8, 3),
        MatmulTiling(64, 256, 64, 8, 4, 4),
    ]
    fused_candidates = [  # (tiling: block_n unused, vocab tile, TMA, persistent programs per SM)
        (MatmulTiling(128, 0, 64, 8, 8, 3), 256, False, 1),
        (MatmulTiling(128, 0, 64, 8, 8, 3), 256, True, 1),
        (MatmulTiling(128, 0, 64, 8, 8, 4), 256, True, 1),
        (MatmulTiling(128, 0, 128, 8, 8, 2), 256, True, 1),
        (MatmulTiling(128, 0, 64, 8, 8, 3), 128, True, 1),
        (MatmulTiling(128, 0, 64, 8, 4, 4), 128, True, 2),
        (MatmulTiling(128, 0, 64, 8, 8, 3), 256, True, 2),
    ]
    partial_candidates = [(1, 4, 1), (1, 8, 1), (1, 16, 1), (1, 32, 1), (2, 8, 1), (2, 4, 1)]
    matmul_candidates = matmul_candidates if "matmul" in kinds else []
    fused_candidates = fused_candidates if "fused" in kinds else []
    partial_candidates = partial_candidates if "logprob" in kinds else []
    knobs = ("PARTIAL_ROWS", "PARTIAL_TILES", "ONE_LAUNCH_TILES", "PARTIAL_WARPS", "FUSED_TMA", "FUSED_PROGRAMS_PER_SM")
    saved = (dict(triton_backend.CUDA_TILING), dict(triton_backend.FUSED_TILING))
    saved_knobs = {knob: getattr(triton_backend, knob) for knob in knobs}
    try:
        for tokens in (64, 16384):
            tune_at(bench, tokens, matmul_candidates, fused_candidates, partial_candidates, out)
            torch.cuda.empty_cache()
    finally:
        triton_backend.CUDA_TILING.update(saved[0])
        triton_backend.FUSED_TILING.update(saved[1])
        for knob, value in saved_knobs.items():
            setattr(triton_backend, knob, value)


def tune_at(bench: Bench, tokens: int, matmul_candidates, fused_candidates, partial_candidates, out) -> None:
    hidden, weight, targets = inputs(tokens)
    bench.hold_for(tokens)
    cublas_ms = bench.time_ms(lambda: hidden @ weight.T)
    for tiling in matmul_candidates:
        triton_backend.CUDA_TILING[torch.bfloat16] = tiling
        ms = bench.time_ms(lambda: kernels.matmul(hidden, weight, backend="triton"))
        out.append({"T": tokens, "kind": "matmul", "config": str(tiling), "ms": ms, "x_cublas": cublas_ms / ms})
    for tiling, tile, tma, per_sm in fused_candidates:
        triton_backend.FUSED_TILING[torch.bfloat16] = tiling
        triton_backend.FUSED_TMA, triton_backend.FUSED_PROGRAMS_PER_SM = tma, per_sm
        path = logp_paths(1024, tile)["lm_head_logprob triton_fused"]
        ms = bench.time_ms(lambda p=path: p(hidden, weight, targets))
        bitwise = invariant(path, hidden, weight, targets, path(hidden, weight, targets))
        config = f"{tiling} tile={tile} tma={tma} per_sm={per_sm}"
        out.append({"T": tokens, "kind": "fused", "config": config, "ms": ms, "x_cublas": cublas_ms / ms,
                    "bitwise": bitwise})  # fmt: skip
    logits = hidden @ weight.T if partial_candidates else None
    for rows, tiles, warps in partial_candidates:
        triton_backend.PARTIAL_ROWS, triton_backend.PARTIAL_TILES, triton_backend.PARTIAL_WARPS = rows, tiles, warps
        triton_backend.ONE_LAUNCH_TILES = tiles  # up to ONE_LAUNCH_ROWS rows the one launch takes its own count
        ms = bench.time_ms(lambda: kernels.logprob(logits, targets, backend="triton", vocab_tile=1024))
        out.append({"T": tokens, "kind": "logprob", "config": f"rows={rows} tiles={tiles} warps={warps}", "ms": ms})


def host_profile(tokens: int = 64, calls: int = 30) -> str:
    """Where a decode-size call spends its time on the host: cProfile of synchronized fused calls."""
    import cProfile
    import io
    import pstats

    hidden, weight, targets = inputs(tokens)
    for _ in range(3):
        kernels.lm_head_logprob(hidden, weight, targets, backend="triton_fused", vocab_tile=256)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        kernels.lm_head_logprob(hidden, weight, targets, backend="triton_fused", vocab_tile=256)
        torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
    return text.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 16384])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--vocab-tile", type=int, default=1024, help="the unfused triton profile's tile")
    parser.add_argument("--fused-tile", type=int, default=256, help="the fused profile's tile")
    parser.add_argument("--tune", nargs="*", choices=TUNABLE, help="time candidate tilings first (none named: all)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_logprob needs CUDA", file=sys.stderr)
        return 1
    bench = Bench(args.repeats)
    tuning: list[dict] = []
    if args.tune is not None:
        print(host_profile())
        tune(bench, args.tune or list(TUNABLE), tuning)
        print("| T | kind | config | ms | x cuBLAS | bitwise |\n|---:|---|---|---:|---:|---|")
        for r in tuning:
            print(f"| {r['T']} | {r['kind']} | {r['config']} | {r['ms']:.3f} | {r.get('x_cublas', float('nan')):.2f} "
                  f"| {r.get('bitwise', '')} |")  # fmt: skip
    rows: list[dict] = []
    for tokens in args.tokens:
        h, w, t = inputs(tokens)
        reference = kernels.lm_head_logprob(h[:ACCURACY_ROWS], w, t[:ACCURACY_ROWS], backend="reference").logp
        del h, w, t
        torch.cuda.empty_cache()
        bench.hold_for(tokens)
        rows += measure(bench, tokens, args.vocab_tile, args.fused_tile, reference)
        torch.cuda.empty_cache()
    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "liger_kernel": version("liger-kernel") if liger() else None,
        "shape": {"vocab": V, "hidden": H, "vocab_tile": args.vocab_tile, "fused_tile": args.fused_tile},
        "repeats": args.repeats,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_logprob.json").write_text(json.dumps({"env": env, "rows": rows, "tuning": tuning}, indent=2))
    print(json.dumps(env))
    print("| T | measurement | ms | | peak GiB | max abs err vs fp64 | 7 rows bitwise |")
    print("|---:|---|---:|---|---:|---:|---|")
    for r in rows:
        err = f"{r['max_err']:.3g}" if "max_err" in r else ""
        print(f"| {r['T']} | {r['measurement']} | {r['ms']:.3f} | {r['note']} | {r.get('peak_gib', '')} | {err} "
              f"| {r.get('bitwise', '')} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
