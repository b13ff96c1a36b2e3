"""The invariant body (rlsweep/invariant_body.py) against stock transformers sdpa on the same model and weights:
a packed prefill (sequences packed in one row, attention confined to each, as a trainer runs it) and one decode step
of a batch against a KV cache of equal lengths (as an inference engine runs it). Bodies only (no head), bf16, no
grad; CUDA events, median of the repeats after warm-up.

Usage: python benchmarks/invariant_body.py [--model qwen3_1_7b] [--packed 8x2048] [--decode 64x2048]
       [--repeats 10] [--out DIR]

Prints one table (ms per call, invariant / sdpa) and writes invariant_body.json to DIR. On the CPU (the Triton
interpreter) use small sizes, e.g. --model qwen3_tiny --packed 2x64 --decode 4x64 --repeats 2: a check that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sizes(text: str) -> tuple[int, int]:
    count, length = text.lower().split("x")
    return int(count), int(length)


def clock(device):
    """A function that times a callable in ms (CUDA events on a GPU)."""
    import torch

    def timed(call) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        begin = time.perf_counter()
        call()
        return (time.perf_counter() - begin) * 1e3

    return timed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_1_7b")
    parser.add_argument("--packed", type=sizes, default=(8, 2048))
    parser.add_argument("--decode", type=sizes, default=(64, 2048))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="print each case's top kernels (torch.profiler)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import transformers
    import triton
    from omegaconf import OmegaConf
    from transformers import DynamicCache

    from rlsweep.hf_model import WholeModelSpec, build_model
    from rlsweep.model_cells import cache_keyword, confinement_mask

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    raw = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml")["body"])
    spec = WholeModelSpec.parse({"name": args.model, **raw})
    bodies = {name: build_model(spec, dtype=torch.bfloat16, attention=name, device=device)
              for name in ("sdpa", "invariant")}  # fmt: skip
    assert bodies["sdpa"].weights_hash == bodies["invariant"].weights_hash
    vocab = bodies["sdpa"].head_weight.shape[0]
    timed = clock(device)
    generator = torch.Generator().manual_seed(0)

    def median(call, label: str = "") -> float:
        call()  # warm-up: compiles the kernels
        call()
        ms = statistics.median(timed(call) for _ in range(args.repeats))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
                call()
            print(f"--- {label}")
            averages = profiler.key_averages()
            print(averages.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
        return ms

    results = []
    count, length = args.packed
    ids = torch.randint(0, vocab, (1, count * length), generator=generator).to(device)
    positions = torch.arange(length).repeat(count)[None].to(device)
    for name, built in bodies.items():
        mask = confinement_mask([length] * count, built.attention, torch.bfloat16).to(device)
        with torch.no_grad():
            ms = median(lambda b=built, m=mask: b.body(input_ids=ids, position_ids=positions, attention_mask=m,
                                                       use_cache=False), f"packed {name}")  # fmt: skip
        results.append({"case": f"packed prefill {count}x{length}", "body": name, "ms": ms})
        del mask
    batch, cached = args.decode
    prompt = torch.randint(0, vocab, (batch, cached), generator=generator).to(device)
    token = torch.randint(0, vocab, (batch, 1), generator=generator).to(device)
    for name, built in bodies.items():
        cache = DynamicCache(config=built.model.config)
        keyword = cache_keyword(built.body)
        with torch.no_grad():
            built.body(input_ids=prompt, use_cache=True, **{keyword: cache})
            mask = torch.ones((batch, cached + 1), dtype=torch.int64, device=device)
            where = torch.full((batch, 1), cached, device=device)

            def step(b=built, c=cache, m=mask, p=where, k=keyword):
                b.body(input_ids=token, attention_mask=m, position_ids=p, use_cache=True, **{k: c})
                c.crop(-1)  # the next step decodes against the same cached tokens

            ms = median(step, f"decode {name}")
        results.append({"case": f"decode step {batch}x{cached}", "body": name, "ms": ms})
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    table = {}
    for row in results:
        table.setdefault(row["case"], {})[row["body"]] = row["ms"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    versions = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                "transformers": transformers.__version__, "device": name}  # fmt: skip
    print(f"model={args.model} bf16, {versions}")
    print(f"{'case':<28}{'sdpa ms':>10}{'invariant ms':>14}{'ratio':>8}")
    for case, row in table.items():
        print(f"{case:<28}{row['sdpa']:>10.2f}{row['invariant']:>14.2f}{row['invariant'] / row['sdpa']:>8.2f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "invariant_body.json").write_text(json.dumps({"versions": versions, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
