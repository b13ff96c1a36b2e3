"""What a waiting ``kernels.logprob`` call pays after its kernels, on one GPU, piece by piece.

Usage: python benchmarks/bench_wait.py [--tokens 64 16384] [--rounds 4] [--repeats 30]
                                       [--device-flags spin|yield|blocking] [--out DIR]

A call given no ``checks=`` copies its verdicts to the host after its kernels and returns once they have landed, so
its time is its kernels' plus that tail (docs/kernels.md#errors). For each T (V = 151936, bf16 logits of std 4, as in
bench_logprob.py) this times, in ``--rounds`` interleaved rounds of ``Bench.time_ms`` (L2 flushed before every call
and, up to 1024 rows, the GPU held until the call is queued): the floor (half a copy of the logits); a copy alone and
a copy followed by ``torch.cuda.synchronize()``; the call's kernels alone (``TritonBackend.whole_vocab``); the
kernels followed by a wait for the stream and by each way of reading their status words in ``READS``; and
``kernels.logprob`` with ``checks=`` read after the timed span, then waiting, once for each read in ``READS``
(swapped in for ``kernels.validation.verdicts_to_host``). ``--device-flags`` sets how the CUDA runtime waits
(``cudaSetDeviceFlags`` before CUDA starts; left to the runtime by default). Prints one Markdown table per T (the
median of each round, in µs) and writes bench_wait.json to --out. Needs CUDA.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from bench_logprob import LOGIT_STD, Bench, V

import kernels
from kernels import validation
from kernels.backend import get_backend

DEVICE_FLAGS = {"spin": 1, "yield": 2, "blocking": 4}  # cudaDeviceScheduleSpin, ...Yield, ...BlockingSync


READS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "pageable copy (.cpu())": lambda verdicts: verdicts.cpu(),
    "pinned copy, then its event (shipped)": validation.verdicts_to_host,
}


def set_device_flags(name: str) -> None:
    """cudaSetDeviceFlags(DEVICE_FLAGS[name]) through the CUDA runtime torch loaded, before CUDA starts."""
    with open("/proc/self/maps") as maps:
        runtime = next((line.split()[-1] for line in maps if "libcudart" in line), None)
    if runtime is None:
        raise SystemExit("bench_wait: no CUDA runtime (libcudart) is loaded, so --device-flags cannot be set")
    if torch.cuda.is_initialized() or ctypes.CDLL(runtime).cudaSetDeviceFlags(DEVICE_FLAGS[name]) != 0:
        raise SystemExit(f"bench_wait: cudaSetDeviceFlags({name}) failed")


def spans(tokens: int) -> tuple[dict[str, Callable[[], object]], list[kernels.ValueChecks]]:
    """name -> a call to time, and the checks the ``checks=`` call leaves to be read after its span."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(tokens, V, device="cuda", generator=gen) * LOGIT_STD).bfloat16()
    targets = torch.randint(0, V, (tokens,), device="cuda", generator=gen)
    scratch = torch.empty_like(logits)
    sharding = kernels.ShardingSpec.even(V, kernels.DEFAULT_VOCAB_TILE, 1)
    triton = get_backend("triton")

    def kernels_alone():
        return triton.whole_vocab(logits, targets, sharding)[0]

    def kernels_then(wait: Callable[[torch.Tensor], object]) -> Callable[[], object]:
        return lambda: wait(kernels_alone().status)

    def waiting_call(read: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        def call():
            shipped, validation.verdicts_to_host = validation.verdicts_to_host, read
            try:
                return kernels.logprob(logits, targets, backend="triton")
            finally:
                validation.verdicts_to_host = shipped

        return call

    read_after: list[kernels.ValueChecks] = []

    def checks_after():
        read_after.append(kernels.ValueChecks())
        return kernels.logprob(logits, targets, backend="triton", checks=read_after[-1])

    return {
        "floor: half a copy of the logits": lambda: scratch.copy_(logits),
        "a copy of the logits": lambda: scratch.copy_(logits),
        "a copy, then torch.cuda.synchronize()": lambda: (scratch.copy_(logits), torch.cuda.synchronize()),
        "kernels alone (whole_vocab)": kernels_alone,
        "kernels, then a wait for the stream": kernels_then(lambda _: torch.cuda.current_stream().synchronize()),
        **{f"kernels, then a {name}": kernels_then(read) for name, read in READS.items()},
        "kernels.logprob, checks= read after the span": checks_after,
        **{f"kernels.logprob waiting: {name}": waiting_call(read) for name, read in READS.items()},
    }, read_after


def measure(bench: Bench, tokens: int, rounds: int) -> dict[str, list[float]]:
    """Per span, the median µs of each of ``rounds`` rounds, the spans interleaved within a round."""
    bench.hold_for(tokens)
    calls, read_after = spans(tokens)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            us = bench.time_ms(call) * 1e3
            times[name].append(us / 2 if name.startswith("floor") else us)
        for checks in read_after:
            checks.raise_first()
        read_after.clear()
    return times


def table(tokens: int, times: dict[str, list[float]]) -> str:
    floor = statistics.median(times["floor: half a copy of the logits"])
    lines = [f"T = {tokens}", "", "| span | µs, each round | median | floor / median |", "|---|---|---:|---:|"]
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | {median:.1f} | {floor / median:.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 16384])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device-flags", choices=sorted(DEVICE_FLAGS))
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if args.device_flags:
        set_device_flags(args.device_flags)
    if not torch.cuda.is_available():
        raise SystemExit("bench_wait: needs a CUDA GPU")
    bench = Bench(args.repeats)
    results = {}
    for tokens in args.tokens:
        results[tokens] = measure(bench, tokens, args.rounds)
        print(table(tokens, results[tokens]), end="\n\n", flush=True)
    record = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "device_flags": args.device_flags, "us": results}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_wait.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
