"""Logprob head on one GPU: Triton invariant kernels vs stock PyTorch vs the memory-bandwidth floor.

Usage: python benchmarks/bench_logprob.py [--tokens 16384] [--vocab 151936] [--hidden 4096] [--out DIR]
Prints a Markdown table and writes bench_logprob.json to --out. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
import triton

import kernels

WARMUP, REPEATS = 3, 10


def time_ms(fn) -> float:
    """Median CUDA-event time of ``fn`` over REPEATS runs after WARMUP runs."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab-tile", type=int, default=kernels.DEFAULT_VOCAB_TILE)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_logprob needs CUDA", file=sys.stderr)
        return 1
    T, V, H, tile = args.tokens, args.vocab, args.hidden, args.vocab_tile
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=gen) * (4.0 / H**0.5)).bfloat16()
    logits = hidden @ weight.T
    targets = torch.randint(0, V, (T,), device="cuda", generator=gen)
    rows = []

    # Floor: the logprob head must read T*V bf16 logits once; a device copy measures the bandwidth.
    scratch = torch.empty_like(logits)
    copy_ms = time_ms(lambda: scratch.copy_(logits))
    copy_tbps = 2 * logits.numel() * logits.element_size() / copy_ms / 1e9
    floor_ms = logits.numel() * logits.element_size() / copy_tbps / 1e9
    rows.append(("copy (read+write) bandwidth", copy_ms, f"{copy_tbps:.2f} TB/s"))
    rows.append(("logprob floor T*V*2 B / copy bw", floor_ms, "1.00x floor"))

    triton_impl = kernels.BACKENDS["triton"]
    sharding = kernels.ShardingSpec.even(V, tile, 1)
    owned = torch.ones(T, dtype=torch.bool, device="cuda")

    def triton_logprob():
        partials, _ = triton_impl.shard_partials(logits, targets, owned, sharding)
        lse, _ = triton_impl.merge([partials])
        return partials.target_logit - lse

    def aten_logprob():
        return torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None])

    for name, fn in (
        ("triton tile partials + ordered merge", triton_logprob),
        ("aten fp32 log_softmax + gather", aten_logprob),
    ):
        ms = time_ms(fn)
        rows.append((f"logprob: {name}", ms, f"{floor_ms / ms:.2f}x floor"))

    flops = 2 * T * V * H
    cublas_ms = time_ms(lambda: hidden @ weight.T)
    triton_mm_ms = time_ms(lambda: kernels.matmul(hidden, weight, backend="triton"))
    rows.append(("matmul: cuBLAS bf16", cublas_ms, f"{flops / cublas_ms / 1e9:.0f} TFLOP/s"))
    rows.append(("matmul: triton invariant", triton_mm_ms, f"{cublas_ms / triton_mm_ms:.2f}x cuBLAS"))

    for backend in ("triton", "aten"):
        ms = time_ms(lambda b=backend: kernels.lm_head_logprob(hidden, weight, targets, backend=b, vocab_tile=tile))
        rows.append((f"lm_head_logprob end to end: {backend}", ms, "incl. input checks"))

    # Invariance at the real shape: 7 rows alone vs the same rows inside the T-row call.
    full = {b: kernels.lm_head_logprob(hidden, weight, targets, backend=b, vocab_tile=tile) for b in ("triton", "aten")}
    pick = torch.tensor([0, 1, 2, 100, 5000, T // 2, T - 1], device="cuda")
    invariance = {}
    for backend, result in full.items():
        alone = kernels.lm_head_logprob(hidden[pick], weight, targets[pick], backend=backend, vocab_tile=tile)
        invariance[backend] = {
            name: kernels.first_bit_difference(getattr(alone, name), getattr(result, name)[pick]) is None
            for name in ("logp", "lse")
        }

    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "shape": {"tokens": T, "vocab": V, "hidden": H, "vocab_tile": tile},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_logprob.json").write_text(
        json.dumps({"env": env, "rows": rows, "bitwise_7_rows_vs_full_call": invariance}, indent=2)
    )
    print(json.dumps(env))
    print("| measurement | ms | |\n|---|---:|---|")
    for name, ms, note in rows:
        print(f"| {name} | {ms:.3f} | {note} |")
    print(f"bitwise, 7 rows alone vs inside the {T}-row call: {invariance}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
