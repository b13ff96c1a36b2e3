"""``python -m rlsweep.check DIR``: the sweep gate over any directory of rlsweep tables.

Writes ``sweep_checks.parquet`` and ``summary.md`` into DIR (holding DIR's lock while it does) and prints a
short table of verdicts; a DIR it cannot write (an archived, read-only run or sweep) is judged all the same, its
outputs not written, which one line says. Exit codes: ``rlsweep.exitcodes.ExitCode`` (docs/sweeps.md).
"""

# ruff: noqa: E402 -- the signal handlers go in before the imports below, which take seconds (pandas, torch)
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlsweep.exitcodes import ExitCode, exit_without_teardown, one_line_usage, run_command, stop_at_once

PROG = "python -m rlsweep.check"
if __name__ == "__main__":
    stop_at_once(PROG)

from rlsweep.causes import MAX_CAUSES, cause_lines
from rlsweep.discovery import holder
from rlsweep.errors import TablesNotFoundError
from rlsweep.gate import SUMMARY_FILE, SWEEP_CHECKS_TABLE, GateResult, run_gate, verdict_counts, write_sweep_outputs
from rlsweep.locks import locked
from rlsweep.tables import table_folder, unwritable_reason

MAX_LISTED = 10  # incomplete lines a console prints; summary.md has them all


def console_summary(result: GateResult) -> str:
    """Verdicts per profile x tp, then the verdicts not as expected, one line per cause, then what is missing."""
    counts = verdict_counts(result)
    per_run = counts.groupby(["profile", "tp"], observed=True)[["passed", "failed", "unexpected"]].sum().reset_index()
    lines = [f"{'profile':<24} {'tp':>3} {'verdicts':>8} {'failed':>7} {'not as expected':>16}"]
    for row in per_run.itertuples():
        lines.append(f"{row.profile:<24} {row.tp:>3} {row.passed + row.failed:>8} {row.failed:>7} {row.unexpected:>16}")
    unexpected = result.unexpected
    causes = cause_lines(unexpected.to_dict("records"), limit=MAX_CAUSES, rest=SUMMARY_FILE)
    lines += [f"  RED {line}" for line in causes]
    lines += [f"  INCOMPLETE {line}" for line in result.incomplete[:MAX_LISTED]]
    if len(result.incomplete) > MAX_LISTED:
        lines.append(f"  ... {len(result.incomplete) - MAX_LISTED} more in {SUMMARY_FILE}")
    lines.append(
        f"sweep gate: {result.runs_judged}, {len(unexpected)} "
        f"verdicts not as expected, {len(result.incomplete)} missing or incomplete -> {result.exit_code.word}"
    )
    return "\n".join(lines)


def directory_argument(text: str) -> Path:
    """DIR of ``rlsweep.check`` and ``rlsweep.report``: an empty one (an unset shell variable, quoted) is a usage
    error, never the current directory judged in its place."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is empty: name a run dir, a sweep dir or an outputs/ tree ('.' for the current directory)"
        )
    return Path(text)


def add_directory_argument(parser: argparse.ArgumentParser) -> None:
    """The DIR argument both commands take (``directory_argument``)."""
    parser.add_argument("directory", type=directory_argument, help="a run dir, a sweep dir or a whole outputs/ tree")


def gate_directory(root: str | Path) -> ExitCode:
    """Run the gate over ``root``, write its tables there, print the summary; return the exit code.

    A ``root`` that cannot be written is judged without its lock (no writer can write there either) and without
    writing: a read-only dir never hides its verdict, and a line on stderr says its outputs were not written.
    """
    root = Path(root)
    if not root.is_dir():
        raise TablesNotFoundError(f"{str(root)!r} is not a directory of rlsweep tables")
    owner = holder(root)
    if owner is not None and table_folder(root, owner) is not None:  # its lock file would go into a dataset
        raise TablesNotFoundError(
            f"{str(root)!r} is a tables folder of {str(owner)!r}, not a run or sweep dir: python -m rlsweep.check "
            f"{owner} judges it"
        )
    read_only = unwritable_reason(root)
    if read_only is not None:
        result = run_gate(root)
        print(console_summary(result))
        print(f"{PROG}: {read_only} (read-only), so {SWEEP_CHECKS_TABLE} and {SUMMARY_FILE} were not written there "
              "(any it holds are an earlier gate's); the verdict is the one above", file=sys.stderr)  # fmt: skip
        return result.exit_code
    with locked(root):
        result = run_gate(root)
        write_sweep_outputs(root, result)
    print(console_summary(result))
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    def command() -> ExitCode:
        parser = one_line_usage(argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0]))
        add_directory_argument(parser)
        args = parser.parse_args(argv)
        return gate_directory(args.directory)

    return run_command(PROG, command)


if __name__ == "__main__":
    exit_without_teardown(main())
