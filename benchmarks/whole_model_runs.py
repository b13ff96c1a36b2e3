"""Whole-model runs on one machine: ``python -m rlsweep model=<model> profile=<p>`` for each profile, timed, then
what each found from its tables: per cell, the logprobs whose bits differ from the canonical cell's, and the first
module that diverged (docs/whole_model.md).

Usage: python benchmarks/whole_model_runs.py --out DIR [--model qwen3_1_7b] [--profiles p1 p2 ...] [--traceback]
       [-- overrides]

``--traceback``: a run that fails prints its exception's traceback too (rlsweep itself prints one line).

Each run writes its tables under DIR/<profile>; prints a table per profile and writes whole_model_runs.json
to DIR. Exit 1 when a run ended in an error (exit code 1 or 3), else 0: a red run (2) is a finding, recorded.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

DEFAULT_PROFILES = ("hf_sdpa_cuda_bf16", "hf_eager_cuda_bf16", "hf_packing_control_cuda_bf16")
# rlsweep with one change: an unexpected exception's traceback goes to stderr before its one line.
WITH_TRACEBACK = (
    "import runpy, sys, traceback; import rlsweep.exitcodes as codes; line = codes.one_line; "
    "codes.one_line = lambda err: (traceback.print_exception(err), line(err))[1]; "
    "sys.argv = ['rlsweep', *sys.argv[1:]]; runpy.run_module('rlsweep', run_name='__main__')"
)
ROW_LOCAL_FIRST = re.compile(r"first \S+ \(\w+\): \d+ of \d+ tokens")  # a red row_local row's first module
MOVED = re.compile(r"(\d+) of (\d+) active tokens differ.*?max \|diff\| ([0-9.e+-]+|inf|nan)")


def findings(run_dir: Path) -> list[dict]:
    """Per cell: its logp forward_invariance verdict, the tokens that moved and by how much, the first module, and
    its row_local verdict (row-local modules that gave equal input rows other bits, the first of them)."""
    checks = pd.read_parquet(run_dir / "checks")
    divergence = pd.read_parquet(run_dir / "divergence")
    first = divergence[divergence.first_diverging].set_index("cell") if len(divergence) else divergence
    rows = []
    invariance = checks[(checks.judgment == "forward_invariance") & (checks.tensor == "logp")]
    row_local = checks[(checks.judgment == "forward_invariance") & (checks.tensor == "row_local")]
    for verdict in invariance.itertuples():
        moved = MOVED.search(verdict.detail)
        row = {"cell": verdict.lhs_cell, "passed": bool(verdict.passed),
               "tokens_moved": int(moved.group(1)) if moved else 0, "judged": int(moved.group(2)) if moved else None,
               "max_abs_dlogp": float(moved.group(3)) if moved else 0.0, "first_module": "", "module_tokens": 0,
               "module_max_abs_diff": 0.0}  # fmt: skip
        local = row_local[row_local.lhs_cell == verdict.lhs_cell]
        if len(local):
            named = ROW_LOCAL_FIRST.search(local.detail.iloc[0])
            row["row_local_modules_differing"] = int(local.value.iloc[0])
            row["row_local_first"] = "" if local.passed.iloc[0] else named.group(0) if named else local.detail.iloc[0]
        if len(first) and verdict.lhs_cell in first.index:
            module = first.loc[verdict.lhs_cell]
            row.update(first_module=module.module, module_tokens=int(module.tokens_differing),
                       module_max_abs_diff=float(module.max_abs_diff))  # fmt: skip
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--model", default="qwen3_1_7b")
    parser.add_argument("--profiles", nargs="+", default=list(DEFAULT_PROFILES))
    parser.add_argument("--traceback", action="store_true", help="a failed run prints its traceback")
    parser.add_argument("overrides", nargs="*", help="more overrides for every run (after --)")
    args = parser.parse_args()
    results, failed = [], False
    for profile in args.profiles:
        run_dir = args.out / profile
        entry = ["-c", WITH_TRACEBACK] if args.traceback else ["-m", "rlsweep"]
        command = [sys.executable, *entry, f"model={args.model}", f"profile={profile}",
                   f"hydra.run.dir={run_dir}", *args.overrides]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        (args.out / f"{profile}.log").parent.mkdir(parents=True, exist_ok=True)
        (args.out / f"{profile}.log").write_text(done.stdout + done.stderr)
        result = {"profile": profile, "model": args.model, "exit_code": done.returncode, "seconds": round(seconds, 1)}
        if done.returncode in (0, 2):
            result["cells"] = findings(run_dir)
        else:
            failed = True
            result["error"] = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            if args.traceback:
                print(done.stderr[-4000:])
        results.append(result)
        print(f"\n### {profile}: exit {done.returncode}, {seconds:.1f} s")
        if "cells" in result:
            print(pd.DataFrame(result["cells"]).to_string(index=False))
        else:
            print(result["error"])
        (args.out / "whole_model_runs.json").write_text(json.dumps(results, indent=2))  # after each: a cut run keeps it
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
