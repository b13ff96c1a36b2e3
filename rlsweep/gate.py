"""The sweep gate: cross-run judgments from the tables on disk (SPEC §4.9, §4.11).

``tp_invariance`` compares every run with the smallest-tp run of the same profile, model, weights,
workload and seed, cell by cell; ``backend_parity`` compares the canonical cell of profiles that ran
the same model, weights, workload, seed and tp. Reading from disk makes the gate work with any launcher.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import combinations
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import torch

import kernels
from rlsweep.config import ExpectedVerdictConfig
from rlsweep.contract import Contract, contract_from_mapping
from rlsweep.errors import RlsweepError
from rlsweep.judgments import FORWARD_TENSORS, Verdict, apply_expected, compare_tokens, expectations_for
from rlsweep.layouts import CANONICAL_CELL
from rlsweep.tables import (
    CHECKS_SCHEMA,
    CHECKS_TABLE,
    RUN_COLUMNS,
    TOKENS_TABLE,
    read_metadata,
    run_is_complete,
    write_tables,
)

SWEEP_CHECKS_TABLE = "sweep_checks.parquet"
SUMMARY_FILE = "summary.md"
TP_MODE_ORDER = ("emulated", "distributed")  # the baseline of a tp group is emulated when both ran
VERDICT_GROUPS = ("profile", "tp", "judgment")
VERDICT_COUNTS = ("passed", "failed", "unexpected")  # unexpected: passed != expected_pass


@dataclass(frozen=True)
class RunTables:
    """One complete run read back from disk."""

    directory: Path
    run: dict[str, Any]  # the run columns (run_id, profile, tp, ...)
    config: dict[str, Any]  # the resolved config from the tables' metadata
    contract: Contract
    tokens: pd.DataFrame
    checks: pd.DataFrame

    @property
    def label(self) -> str:
        return f"{self.run['profile']} tp={self.run['tp']} ({self.run['tp_mode']})"

    @property
    def expected_red(self) -> list[ExpectedVerdictConfig]:
        return expectations_for(self.config)


@dataclass
class GateResult:
    """Everything the gate found under one directory."""

    runs: list[RunTables]
    incomplete: list[Path]
    sweep_checks: pd.DataFrame
    run_checks: pd.DataFrame
    notes: list[str] = field(default_factory=list)

    @property
    def unexpected(self) -> pd.DataFrame:
        both = pd.concat([self.run_checks, self.sweep_checks], ignore_index=True)
        return both[both["passed"] != both["expected_pass"]] if len(both) else both

    @property
    def exit_code(self) -> int:
        """1 when a job left no complete tables (it crashed), else 2 on any unexpected verdict, else 0."""
        if self.incomplete:
            return 1
        return 2 if len(self.unexpected) else 0


def find_run_dirs(root: Path) -> tuple[list[Path], list[Path]]:
    """(complete run dirs, Hydra job dirs without complete tables) under ``root``."""
    candidates = {path.parent for path in root.rglob(CHECKS_TABLE)} | {path.parent for path in root.rglob(TOKENS_TABLE)}
    candidates |= {path.parent for path in root.rglob(".hydra") if path.is_dir()}
    complete = sorted(path for path in candidates if run_is_complete(path))
    incomplete = sorted(path for path in candidates if not run_is_complete(path))
    return complete, incomplete


def load_run(directory: Path) -> RunTables:
    metadata = read_metadata(directory / CHECKS_TABLE)
    tokens = pd.read_parquet(directory / TOKENS_TABLE)
    checks = pd.read_parquet(directory / CHECKS_TABLE)
    run = checks.iloc[0][RUN_COLUMNS.names].to_dict() if len(checks) else {}
    contract = contract_from_mapping(metadata["contract"], source=f"{directory / CHECKS_TABLE} metadata")
    return RunTables(directory, run, metadata["config"], contract, tokens, checks)


def run_gate(root: str | Path) -> GateResult:
    """Load every run under ``root`` and compute the cross-run verdicts."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{str(root)!r} is not a directory of rlsweep tables")
    complete, incomplete = find_run_dirs(root)
    if not complete and not incomplete:
        raise RlsweepError(f"no rlsweep tables ({CHECKS_TABLE}, {TOKENS_TABLE}) under {str(root)!r}")
    runs = [load_run(directory) for directory in complete]
    rows: list[dict[str, Any]] = []
    for lhs, rhs in tp_pairs(runs):
        rows += verdict_rows(lhs, tp_invariance(lhs, rhs))
    for lhs, rhs in parity_pairs(runs):
        rows += verdict_rows(lhs, backend_parity(lhs, rhs))
    sweep_checks = pd.DataFrame(rows, columns=CHECKS_SCHEMA.names)
    run_checks = pd.concat([run.checks for run in runs], ignore_index=True) if runs else sweep_checks.iloc[:0]
    notes = [f"{path}: no complete tables (the job crashed or is still running)" for path in incomplete]
    return GateResult(runs, incomplete, sweep_checks, run_checks, notes)


def sweep_group(run: RunTables) -> tuple:
    """What must be equal for two runs' tokens to be comparable."""
    return (run.run["model"], run.run["weight_hash"], run.run["workload"], run.config.get("seed"))


def tp_pairs(runs: Sequence[RunTables]) -> Iterable[tuple[RunTables, RunTables]]:
    """(run, baseline) for every run that is not its group's smallest tp (emulated first)."""
    groups: dict[tuple, list[RunTables]] = {}
    for run in runs:
        groups.setdefault((run.run["profile"], *sweep_group(run)), []).append(run)
    for members in groups.values():
        members.sort(key=lambda r: (r.run["tp"], TP_MODE_ORDER.index(r.run["tp_mode"]), str(r.directory)))
        yield from ((member, members[0]) for member in members[1:])


def parity_pairs(runs: Sequence[RunTables]) -> Iterable[tuple[RunTables, RunTables]]:
    """Every pair of distinct profiles that ran the same tokens at the same tp and tp_mode."""
    groups: dict[tuple, dict[str, RunTables]] = {}
    for run in runs:
        groups.setdefault((*sweep_group(run), run.run["tp"], run.run["tp_mode"]), {}).setdefault(
            run.run["profile"], run
        )
    for by_profile in groups.values():
        for lhs_name, rhs_name in combinations(sorted(by_profile), 2):
            yield by_profile[lhs_name], by_profile[rhs_name]


def aligned(lhs: RunTables, rhs: RunTables, cell: str) -> pd.DataFrame:
    """Active tokens of ``cell`` in both runs, joined on the logical key, in logical order."""
    keys = ["sample_id", "position"]
    columns = [*keys, "active", *FORWARD_TENSORS]
    left = lhs.tokens.loc[lhs.tokens["cell"] == cell, columns]
    right = rhs.tokens.loc[rhs.tokens["cell"] == cell, columns]
    joined = left.merge(right, on=keys, suffixes=("_lhs", "_rhs"), validate="one_to_one")
    return joined[joined["active_lhs"] & joined["active_rhs"]].sort_values(keys, ignore_index=True)


def compare_cell(judgment: str, lhs: RunTables, rhs: RunTables, cell: str, scope: str | None) -> list[Verdict]:
    """One verdict per tensor: ``lhs`` run vs ``rhs`` run on the active tokens of ``cell``."""
    joined = aligned(lhs, rhs, cell)
    dtype = lhs.config["profile"]["execution_dtype"]
    roles = lhs.contract.roles_for(judgment)
    keys = tuple(torch.from_numpy(joined[key].to_numpy(copy=True)) for key in ("sample_id", "position"))
    verdicts = []
    for tensor in FORWARD_TENSORS:
        left = torch.from_numpy(joined[f"{tensor}_lhs"].to_numpy(copy=True))
        right = torch.from_numpy(joined[f"{tensor}_rhs"].to_numpy(copy=True))
        tolerance = lhs.contract.tolerance(judgment, tensor, dtype, scope=scope)
        verdict = compare_tokens(judgment, tensor, roles, (cell, cell), left, right, tolerance, keys)
        bitwise = len(joined) > 0 and kernels.first_bit_difference(left, right) is None
        detail = f"{lhs.label} vs {rhs.label} ({rhs.run['run_id']}); {verdict.detail}; also bitwise: {bitwise}"
        verdicts.append(replace(verdict, detail=detail))
    return verdicts


def tp_invariance(lhs: RunTables, baseline: RunTables) -> list[Verdict]:
    """Bitwise for cross_tp_bitwise profiles, else the contract's fixed_topology tolerance row."""
    scope = lhs.config["profile"]["determinism_scope"]
    cells = [cell for cell in lhs.tokens["cell"].unique() if cell in set(baseline.tokens["cell"])]
    verdicts = [v for cell in cells for v in compare_cell("tp_invariance", lhs, baseline, cell, scope)]
    return apply_expected(verdicts, lhs.expected_red)


def backend_parity(lhs: RunTables, rhs: RunTables) -> list[Verdict]:
    verdicts = compare_cell("backend_parity", lhs, rhs, CANONICAL_CELL, None)
    return apply_expected(verdicts, lhs.expected_red)


def verdict_rows(run: RunTables, verdicts: Sequence[Verdict]) -> list[dict[str, Any]]:
    return [{**run.run, **asdict(verdict)} for verdict in verdicts]


def write_sweep_outputs(root: Path, result: GateResult) -> None:
    """sweep_checks.parquet (same schema as checks.parquet) and summary.md, both written atomically."""
    table = pa.Table.from_pandas(result.sweep_checks, schema=CHECKS_SCHEMA, preserve_index=False)
    write_tables(root, {SWEEP_CHECKS_TABLE: table}, files={SUMMARY_FILE: summary_markdown(result)})


def count_verdicts(checks: pd.DataFrame, by: Sequence[str] = VERDICT_GROUPS) -> pd.DataFrame:
    """Pass/fail/unexpected counts of a checks frame, one row per group of ``by`` columns."""
    if not len(checks):
        return pd.DataFrame(columns=[*by, *VERDICT_COUNTS])
    checks = checks.assign(failed=~checks["passed"], unexpected=checks["passed"] != checks["expected_pass"])
    return checks.groupby(list(by), observed=True)[list(VERDICT_COUNTS)].sum().astype(int).reset_index()


def verdict_counts(result: GateResult) -> pd.DataFrame:
    """Pass/fail/unexpected counts by profile x tp x judgment, over run and sweep verdicts."""
    return count_verdicts(pd.concat([result.run_checks, result.sweep_checks], ignore_index=True))


def summary_markdown(result: GateResult) -> str:
    counts = verdict_counts(result)
    lines = ["# Sweep summary", "", f"Runs with complete tables: {len(result.runs)}.", ""]
    lines += [f"- {note}" for note in result.notes]
    lines += ["| profile | tp | judgment | passed | failed | not as expected |", "|---|---:|---|---:|---:|---:|"]
    lines += [
        f"| {r.profile} | {r.tp} | {r.judgment} | {r.passed} | {r.failed} | {r.unexpected} |"
        for r in counts.itertuples()
    ]
    tolerance_tp = result.sweep_checks[
        (result.sweep_checks["judgment"] == "tp_invariance") & (result.sweep_checks["metric"] == "max_abs_diff")
    ]
    if len(tolerance_tp):
        bitwise = tolerance_tp["detail"].str.contains("also bitwise: True")
        lines += [
            "",
            f"TP rows judged by tolerance (fixed_topology): {len(tolerance_tp)}, of which also bitwise: "
            f"{int(bitwise.sum())}.",
        ]
    unexpected = result.unexpected
    lines += ["", f"Verdicts not as expected: {len(unexpected)}."]
    for row in unexpected.head(20).itertuples():
        lines.append(f"- {row.profile} tp={row.tp} {row.judgment} {row.tensor} {row.lhs_cell}: {row.detail}")
    lines += ["", f"Exit code: {result.exit_code}."]
    return "\n".join(lines) + "\n"
