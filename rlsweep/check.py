"""``python -m rlsweep.check DIR``: the sweep gate over any directory of rlsweep tables.

Writes ``sweep_checks.parquet`` and ``summary.md`` into DIR and prints a short table of verdicts.
Exit codes: 0 every verdict as expected, 2 some verdict not as expected, 1 a job left no complete
tables (it crashed) or DIR cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlsweep.errors import RlsweepError
from rlsweep.gate import GateResult, run_gate, verdict_counts, write_sweep_outputs

MAX_LISTED = 10


def console_summary(result: GateResult) -> str:
    """Verdicts per profile x tp, then the first verdicts that are not as expected."""
    counts = verdict_counts(result)
    per_run = counts.groupby(["profile", "tp"], observed=True)[["passed", "failed", "unexpected"]].sum().reset_index()
    lines = [f"{'profile':<24} {'tp':>3} {'verdicts':>8} {'failed':>7} {'not as expected':>16}"]
    for row in per_run.itertuples():
        lines.append(f"{row.profile:<24} {row.tp:>3} {row.passed + row.failed:>8} {row.failed:>7} {row.unexpected:>16}")
    unexpected = result.unexpected
    for row in unexpected.head(MAX_LISTED).itertuples():
        expectation = "expected pass" if row.expected_pass else "expected red, passed"
        lines.append(
            f"  RED {row.profile} tp={row.tp} {row.judgment} {row.tensor} {row.lhs_cell} ({expectation}): {row.detail}"
        )
    if len(unexpected) > MAX_LISTED:
        lines.append(f"  ... {len(unexpected) - MAX_LISTED} more in summary.md")
    lines += [f"  {note}" for note in result.notes]
    verdict = {0: "GREEN", 1: "CRASHED JOB", 2: "RED"}[result.exit_code]
    lines.append(f"sweep gate: {len(result.runs)} runs, {len(unexpected)} verdicts not as expected -> {verdict}")
    return "\n".join(lines)


def gate_directory(root: str | Path) -> int:
    """Run the gate over ``root``, write its tables there, print the summary; return the exit code."""
    result = run_gate(root)
    write_sweep_outputs(Path(root), result)
    print(console_summary(result))
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlsweep.check", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="a run dir, a sweep dir or a whole outputs/ tree")
    args = parser.parse_args(argv)
    try:
        return gate_directory(args.directory)
    except (RlsweepError, OSError) as err:
        print(f"rlsweep.check: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
