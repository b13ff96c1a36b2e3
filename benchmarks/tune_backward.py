"""Time the backward's three kernels on one vocab chunk (H200), for candidate tilings.

Usage: python benchmarks/tune_backward.py [--repeats 10] [--tokens 16384]. Prints one Markdown row per (kernel,
tiling): ms per chunk of GRADIENT_CHUNK_COLUMNS columns, and the cuBLAS time of the same product for scale. Needs
CUDA.
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_logprob import Bench  # this folder: run as python benchmarks/tune_backward.py

from kernels import triton_backend as tb
from kernels.triton_backend import MatmulTiling

H, C = 4096, tb.GRADIENT_CHUNK_COLUMNS


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    T = args.tokens
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    bench = Bench(args.repeats)
    km, _ = tb.load_kernels(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(C, H, device="cuda", generator=gen) * 0.06).bfloat16()
    d_logits = (torch.randn(T, C, device="cuda", generator=gen) * 1e-3).bfloat16()
    d_logits_t = d_logits.t().contiguous()
    d_hidden = torch.zeros(T, H, device="cuda")
    d_weight = torch.empty(C, H, device="cuda", dtype=torch.bfloat16)
    lse = torch.full((T,), 12.0, device="cuda")
    scale = torch.randn(T, device="cuda")
    g = torch.randn(T, device="cuda")
    target = torch.randint(-1, C, (T,), device="cuda")
    rows = []
    rows.append(("cuBLAS logits chunk", "", bench.time_ms(lambda: hidden @ w.T)))
    rows.append(("cuBLAS d hidden chunk", "", bench.time_ms(lambda: d_logits @ w)))
    rows.append(("cuBLAS d weight chunk", "", bench.time_ms(lambda: d_logits.T @ hidden)))
    from triton.tools.tensor_descriptor import TensorDescriptor

    for tiling in [MatmulTiling(128, 256, 64, 8, 8, 3), MatmulTiling(128, 128, 64, 8, 8, 4),
                   MatmulTiling(128, 256, 64, 8, 8, 4)]:  # fmt: skip

        def logits(t=tiling):
            tiles = tb.triton_cdiv(T, t.block_m) * tb.triton_cdiv(C, t.block_n)
            programs = tb.persistent_programs(tiles, hidden.device)
            km.gradient_logits_tma_kernel[(programs,)](
                TensorDescriptor.from_tensor(hidden, [t.block_m, t.block_k]),
                TensorDescriptor.from_tensor(w, [t.block_n, t.block_k]),
                lse, scale, g, target, d_logits, T, C, d_logits.stride(0), H,
                BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                PROGRAMS=programs, ROUND_LOGITS=False, num_warps=t.num_warps, num_stages=t.num_stages,
            )  # fmt: skip

        try:
            rows.append(("d logits (tma)", tiling, bench.time_ms(logits)))
        except Exception as err:
            rows.append(("d logits (tma)", tiling, f"{type(err).__name__}"))
    candidates = [MatmulTiling(128, 256, 64, 8, 8, 3), MatmulTiling(128, 256, 64, 8, 8, 4)]
    for tiling in candidates:

        def dh(t=tiling):
            tb.tma_matmul(km, d_logits, w, d_hidden, t, t.block_k, a_by_k=False, b_by_k=True, accumulate=True)

        name = "d hidden += (tma, one program per tile)"
        try:
            rows.append((name, tiling, bench.time_ms(dh)))
        except Exception as err:
            rows.append((name, tiling, f"{type(err).__name__}"))
    for tiling in [MatmulTiling(128, 256, 64, 8, 8, 3), MatmulTiling(128, 128, 64, 8, 8, 4),
                   MatmulTiling(128, 256, 64, 8, 8, 4)]:  # fmt: skip

        def dw(t=tiling):
            tb.tma_matmul(km, d_logits, hidden, d_weight, t, t.block_k, a_by_k=True, b_by_k=True, accumulate=False)

        def dw_t(t=tiling):
            tb.tma_matmul(km, d_logits_t, hidden, d_weight, t, t.block_k, a_by_k=False, b_by_k=True, accumulate=False)

        for name, fn in (("d weight, A by K (tma)", dw), ("d weight, A transposed in memory (tma)", dw_t)):
            for by_tma in (True, False):
                tb.STORE_BY_TMA = by_tma
                label = f"{name}, stored by {'TMA' if by_tma else 'masked stores'}"
                try:
                    rows.append((label, tiling, bench.time_ms(fn)))
                except Exception as err:
                    rows.append((label, tiling, f"{type(err).__name__}"))
            tb.STORE_BY_TMA = True
    print(f"T={T} H={H} chunk={C} device={torch.cuda.get_device_name()}")
    print("| kernel | tiling (M, N, K, group, warps, stages) | ms per chunk |\n|---|---|---:|")
    for name, tiling, ms in rows:
        t = tiling
        cfg = "" if t == "" else f"{t.block_m}x{t.block_n}x{t.block_k} g{t.group_m} w{t.num_warps} s{t.num_stages}"
        print(f"| {name} | {cfg} | {ms if isinstance(ms, str) else f'{ms:.3f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
