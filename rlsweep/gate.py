"""The sweep gate: cross-run judgments from the tables on disk (docs/sweeps.md).

A sweep is judged against its own job list (Hydra's ``multirun.yaml``): every job must have a complete
run (``rlsweep.manifest``), or the gate says INCOMPLETE, naming the job. ``tp_invariance`` compares every
run with the smallest-tp run of the same profile, model, weights, workload and seed, cell by cell;
``backend_parity`` compares the canonical cell of profiles that ran the same model, weights, workload,
seed and tp. Reading from disk makes the gate work with any launcher.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import combinations
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import torch
import yaml

import kernels
from rlsweep.contract import Contract, contract_from_mapping, op_class
from rlsweep.errors import ConfigError, OutputDirError, TablesNotFoundError
from rlsweep.exitcodes import ExitCode, combine
from rlsweep.judgments import apply_expected, compare_tokens, declaration_verdict
from rlsweep.manifest import (
    HYDRA_CONFIG,
    MANIFEST_FILE,
    canonical_sha256,
    read_manifest,
    table_files,
    verify_run,
)
from rlsweep.spec import CANONICAL_CELL, ExpectedRed, declarations_of
from rlsweep.tables import (
    CHECKS_SCHEMA,
    CHECKS_TABLE,
    RUN_COLUMNS,
    RUN_TABLES,
    TOKENS_SCHEMA,
    TOKENS_TABLE,
    TableError,
    dataset_entries,
    hidden,
    is_partition,
    read_metadata,
    read_table,
    write_tables,
)
from rlsweep.verdicts import FORWARD_TENSORS, REPORTED_ONLY, SWEEP_JUDGMENTS, Judgment, Tensor, Verdict, as_expected

MULTIRUN_FILE = "multirun.yaml"  # Hydra's record of a sweep: its sweeper, parameters and overrides
JOBS_FILE = "jobs.json"  # every job's overrides, written at the sweep's start (rlsweep.callbacks)
JOBS_FORMAT = "rlsweep-sweep-jobs/2"
JOB_OVERRIDES = Path(".hydra") / "overrides.yaml"
SWEEP_CHECKS_TABLE = "sweep_checks.parquet"
SUMMARY_FILE = "summary.md"
TP_MODE_ORDER = ("emulated", "distributed")  # the baseline of a tp group is emulated when both ran
# Runs whose tokens can be compared token by token: the same inputs. A tp group adds the profile.
COMPARABLE_COLUMNS = ("model", "weight_hash", "workload", "seed")
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
    def declarations(self) -> tuple[ExpectedRed, ...]:
        return declarations_of(self.config)

    @property
    def expected_red(self) -> list[ExpectedRed]:
        """The declarations that select this run."""
        return [d for d in self.declarations if d.applies(self.run["profile"], self.run["tp"])]


@dataclass
class GateResult:
    """Everything the gate found under one directory."""

    runs: list[RunTables]
    incomplete: list[str]  # one line per job or run dir that is missing or not complete
    sweep_checks: pd.DataFrame
    run_checks: pd.DataFrame
    scope: str = ""  # where only part of a sweep was judged: which jobs of which sweep (``discover``)

    @property
    def unexpected(self) -> pd.DataFrame:
        both = pd.concat([self.run_checks, self.sweep_checks], ignore_index=True)
        return both[~as_expected(both["passed"], both["expected_pass"])] if len(both) else both

    @property
    def exit_code(self) -> ExitCode:
        """INCOMPLETE when a job or table is missing, else RED on any unexpected verdict, else GREEN."""
        found = [ExitCode.INCOMPLETE] if self.incomplete else []
        return combine(found + ([ExitCode.RED] if len(self.unexpected) else []))


def job_key(overrides: Sequence[str]) -> tuple[str, ...]:
    """What tells a sweep's jobs apart: the set of their overrides, as Hydra records them in each job's dir."""
    return tuple(sorted(overrides))


def check_distinct_jobs(jobs: Sequence[Sequence[str]], where: str) -> None:
    """No two jobs of a sweep with the same overrides: the gate finds a job's run dir by them."""
    first: dict[tuple[str, ...], int] = {}
    for number, job in enumerate(jobs):
        earlier = first.setdefault(job_key(job), number)
        if earlier != number:
            raise ConfigError(
                f"{where}: job #{number} ({' '.join(job)}) repeats job #{earlier}: a job's run is found by its "
                "overrides, so each job of a sweep must have its own; drop the repeated value"
            )


def job_list_sha256(sweep: Any, jobs: Sequence[Sequence[str]]) -> str:
    return canonical_sha256({"sweep": sweep, "jobs": [list(job) for job in jobs]})


def write_job_list(sweep_dir: Path, sweep: dict[str, Any], jobs: Sequence[Sequence[str]]) -> None:
    """Record at the sweep's start what Hydra expands its jobs from (``rlsweep.config.sweep_record``), every job's
    overrides, and the sha256 of both, for the gate to judge the sweep against."""
    record = {"format": JOBS_FORMAT, "sweep": sweep, "jobs": [list(job) for job in jobs]}
    text = json.dumps({**record, "sha256": job_list_sha256(sweep, jobs)}, indent=2) + "\n"
    write_tables(sweep_dir, {}, files={JOBS_FILE: text})


def hydra_sweep_record(sweep_dir: Path) -> dict[str, Any]:
    """What Hydra's ``multirun.yaml`` says the sweep's jobs are expanded from: the sweeper's params, the overrides."""
    path = sweep_dir / MULTIRUN_FILE
    try:
        hydra = yaml.safe_load(path.read_text())["hydra"]
        return {"params": hydra["sweeper"]["params"], "task": hydra["overrides"]["task"]}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError) as err:
        raise TableError(
            f"{str(path)!r} cannot be read as Hydra's record of the sweep: {type(err).__name__}: "
            f"{' '.join(str(err).split())}"
        ) from err


def sweep_jobs(sweep_dir: Path) -> list[tuple[str, ...]]:
    """Every job's overrides, in job order, as the sweep recorded them at its start (``write_job_list``).

    The list must be the one rlsweep wrote (its sha256), for the sweep Hydra recorded beside it (``multirun.yaml``),
    each job once: a list edited by hand, or copied from another sweep, would judge a sweep against other jobs.
    """
    path = sweep_dir / JOBS_FILE
    try:
        record = json.loads(path.read_text())
        if record.get("format") != JOBS_FORMAT or not all(
            isinstance(job, list) and all(isinstance(o, str) for o in job) for job in record["jobs"]
        ):
            raise ValueError(f"not an rlsweep job list ({JOBS_FORMAT})")
        jobs = [tuple(job) for job in record["jobs"]]
        if record.get("sha256") != job_list_sha256(record.get("sweep"), jobs):
            raise ValueError(
                "it was changed after the sweep wrote it: its sha256 does not match its jobs; rerun the sweep into "
                "this dir (the same overrides and --multirun) to write it again"
            )
        recorded = hydra_sweep_record(sweep_dir)
        if canonical_sha256(recorded) != canonical_sha256(record["sweep"]):
            raise ValueError(
                f"it lists the jobs of {json.dumps(record['sweep'], sort_keys=True)}, but {MULTIRUN_FILE} records "
                f"the sweep {json.dumps(recorded, sort_keys=True)}"
            )
        check_distinct_jobs(jobs, "its jobs")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise TableError(
            f"{str(path)!r} cannot be read as the sweep's job list ({' '.join(str(err).split())}); rlsweep writes "
            "it when a sweep starts, so this sweep was not started by rlsweep or its record is damaged"
        ) from err
    return jobs


def job_overrides(run_dir: Path) -> tuple[str, ...] | None:
    path = run_dir / JOB_OVERRIDES
    if not path.is_file():
        return None
    try:
        overrides = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        return None
    return tuple(overrides)


def sweep_marks(directory: Path) -> list[Path]:
    """What shows that ``directory`` holds a sweep: Hydra's multirun.yaml, the job list, ``job=<n>`` partitions."""
    marks = [directory / name for name in (MULTIRUN_FILE, JOBS_FILE) if (directory / name).exists()]
    return marks + [entry for entry in dataset_entries(directory) if is_partition(entry)]


def single_run_marks(directory: Path) -> list[Path]:
    """What shows that ``directory`` holds a single run: its manifest, Hydra's record of a run, tables outside a
    partition."""
    marks = [directory / name for name in (MANIFEST_FILE, HYDRA_CONFIG) if (directory / name).exists()]
    return marks + [entry for entry in dataset_entries(directory) if not is_partition(entry)]


def listed(paths: Sequence[Path], directory: Path, limit: int = 4) -> str:
    names = [str(path.relative_to(directory)) for path in paths]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def named_dir(directory: Path, key: str | None) -> str:
    return f"output directory {str(directory)!r}" + (f" ({key})" if key else "")


def refuse_sweep_over_run(sweep_dir: Path) -> None:
    """A sweep never starts in a dir that holds a single run: the gate would take that run for one of its jobs."""
    marks = single_run_marks(sweep_dir)
    if marks:
        raise OutputDirError(
            f"{named_dir(sweep_dir, 'hydra.sweep.dir')} holds a single run ({listed(marks, sweep_dir)}); a sweep "
            "there would mix its jobs' tables with that run's: choose another hydra.sweep.dir (a new one, or a "
            "sweep's to resume it), or move the run away"
        )


def refuse_run_over_sweep(run_dir: Path, key: str | None = None) -> None:
    """A single run never writes into a sweep's dir: it would replace the datasets that hold the sweep's partitions."""
    marks = sweep_marks(run_dir)
    if marks:
        raise OutputDirError(
            f"{named_dir(run_dir, key)} holds a sweep ({listed(marks, run_dir)}); a single run there would delete the "
            "sweep's tables: write the run elsewhere (hydra.run.dir=..., tables_dir=...), or run the sweep again with "
            "--multirun to redo its jobs"
        )


def candidate_dirs(root: Path) -> set[Path]:
    """Directories that hold, or were meant to hold, a run: a manifest or Hydra's job record."""
    found = {path.parent for path in root.rglob(MANIFEST_FILE)}
    return found | {path.parent.parent for path in root.rglob(str(HYDRA_CONFIG))}


def visible_tables(root: Path) -> set[Path]:
    """Every file (or link) a dataset reader would load from the tokens/ and checks/ folders under ``root``, whatever
    its name, hidden names aside; as absolute paths, ``..`` resolved by name (links stay links)."""
    found = set()
    for name in RUN_TABLES:
        for folder in root.rglob(name):
            for path in folder.rglob("*") if folder.is_dir() and not folder.is_symlink() else [folder]:
                if (path.is_file() or path.is_symlink()) and not any(hidden(p) for p in path.relative_to(root).parts):
                    found.add(lexical(path))
    return found


def lexical(path: Path) -> Path:
    return Path(os.path.normpath(path.absolute()))


def orphan_tables(root: Path, candidates: set[Path]) -> list[str]:
    """Table files that no run's manifest names: left by a crash, an older sweep or a copy, never data to trust.

    A file in the folder of a table that a manifest names is that run's to report (``verify_run``).
    """
    named = set()
    for directory in candidates:
        manifest, _ = read_manifest(directory)
        if manifest is not None:
            named |= {lexical(path) for path in table_files(directory, manifest).values()}
    folders = {path.parent for path in named}
    stray = [path for path in visible_tables(root) - named if path.parent not in folders]
    return [f"{path}: no run's {MANIFEST_FILE} names this table file (stale, partial or copied)" for path in
            sorted(stray)]  # fmt: skip


def enclosing_sweep(root: Path) -> Path | None:
    """The sweep dir that ``root`` lies inside (a job dir checked on its own, say), or None."""
    if (root / MULTIRUN_FILE).is_file():
        return None
    return next((parent for parent in root.absolute().parents if (parent / MULTIRUN_FILE).is_file()), None)


def discover(root: Path) -> tuple[list[Path], list[str], str]:
    """(complete run dirs to judge, what is missing or incomplete, the scope when ``root`` is part of a sweep).

    Runs inside a sweep dir are judged against that sweep's job list; runs outside any sweep stand alone. Under a
    dir inside a sweep (a job dir), its runs are judged as that sweep's jobs, and the sweep's verdict is not there
    to give: its other jobs and its cross-run verdicts are not under ``root``, so that is INCOMPLETE.
    """
    sweeps = sorted({path.parent for path in root.rglob(MULTIRUN_FILE)}, key=lambda p: len(p.parts), reverse=True)
    candidates = candidate_dirs(root)
    complete: list[Path] = []
    incomplete: list[str] = []
    claimed: set[Path] = set()
    for sweep_dir in sweeps:
        members = sorted(d for d in candidates - claimed if d.is_relative_to(sweep_dir) and d != sweep_dir)
        claimed.update(members)
        if marks := single_run_marks(sweep_dir):  # never one of the sweep's runs, nor a run beside it
            claimed.add(sweep_dir)
            incomplete.append(f"{sweep_dir}: a single run ({listed(marks, sweep_dir)}) in this sweep dir, whose "
                              "datasets it shares with the sweep's jobs; not judged")  # fmt: skip
        found, missing, _ = sweep_runs(sweep_dir, members)
        complete += found
        incomplete += missing
    scope = ""
    outer = enclosing_sweep(root)
    if outer is not None and (members := sorted(candidates - claimed)):
        claimed.update(members)
        found, missing, jobs = sweep_runs(outer, members, whole=False)
        complete += found
        scope = f"{', '.join(jobs) or 'no job'} of the sweep {outer} only"
        incomplete += [*missing, f"{root}: {scope}; its other jobs and its cross-run verdicts are not under this dir, "
                       f"so this is not the sweep's verdict: python -m rlsweep.check {outer} gives it"]  # fmt: skip
    for run_dir in sorted(candidates - claimed):
        state = verify_run(run_dir)
        if state.complete:
            complete.append(run_dir)
        else:
            incomplete.append(f"{run_dir}: {state.reason}")
    return complete, incomplete + orphan_tables(root, candidates), scope


def sweep_runs(sweep_dir: Path, members: Sequence[Path], whole: bool = True) -> tuple[list[Path], list[str], list[str]]:
    """The complete runs of a sweep's jobs among ``members`` (the run dirs under it), what is missing or incomplete
    (a job without exactly one complete run, a run dir that is no job of the sweep's list), and the jobs found.

    ``whole``: ``members`` are all of the sweep's run dirs, so a job without one is missing; else only some are.
    """
    by_job: dict[tuple[str, ...], list[Path]] = {}
    for member in members:
        by_job.setdefault(job_key(job_overrides(member) or ()), []).append(member)
    complete: list[Path] = []
    incomplete: list[str] = []
    found: list[str] = []
    for number, job in enumerate(sweep_jobs(sweep_dir)):
        dirs = by_job.pop(job_key(job), [])
        name = f"job #{number} ({' '.join(job)})"
        found += [name] if dirs else []
        label = f"{sweep_dir}: {name}"
        if not dirs:
            incomplete += [f"{label}: no run dir"] if whole else []
        elif len(dirs) > 1:
            incomplete.append(f"{label}: {len(dirs)} run dirs claim it ({', '.join(map(str, dirs))})")
        elif (state := verify_run(dirs[0])).complete:
            complete.append(dirs[0])
        else:
            incomplete.append(f"{label} in {dirs[0]}: {state.reason}")
    for key, dirs in by_job.items():  # left by an earlier sweep into the same dir, or dropped from the list
        incomplete += [
            f"{d}: not a job of {sweep_dir / JOBS_FILE} ({' '.join(key) or 'no overrides recorded'}), yet its "
            "tables may be in the sweep's datasets; remove the dir and its job=<n> partitions, or sweep into a new dir"
            for d in dirs
        ]
    return complete, incomplete, found


def load_run(directory: Path) -> RunTables:
    """A complete run's tables, each checked against its schema; a run always holds at least one verdict."""
    files = verify_run(directory).files
    tokens = read_table(files[TOKENS_TABLE], TOKENS_SCHEMA).to_pandas()
    checks = read_table(files[CHECKS_TABLE], CHECKS_SCHEMA).to_pandas()
    if not len(checks):
        raise TableError(f"{str(files[CHECKS_TABLE])!r} holds no verdict (every run judges its contract)")
    metadata = read_metadata(files[CHECKS_TABLE])
    run = checks.iloc[0][RUN_COLUMNS.names].to_dict()
    contract = contract_from_mapping(metadata["contract"], source=f"{files[CHECKS_TABLE]} metadata")
    return RunTables(directory, run, metadata["config"], contract, tokens, checks)


def run_gate(root: str | Path) -> GateResult:
    """Load every complete run under ``root`` and compute the cross-run verdicts."""
    root = Path(root)
    if not root.is_dir():
        raise TablesNotFoundError(f"{str(root)!r} is not a directory of rlsweep tables")
    complete, incomplete, scope = discover(root)
    if not complete and not incomplete:
        raise TablesNotFoundError(
            f"no rlsweep run ({MANIFEST_FILE}, {CHECKS_TABLE}/, {TOKENS_TABLE}/) in {str(root)!r}"
        )
    runs = [load_run(directory) for directory in complete]
    rows: list[dict[str, Any]] = []
    for lhs, rhs in tp_pairs(runs):
        rows += verdict_rows(lhs, tp_invariance(lhs, rhs))
    for lhs, rhs in parity_pairs(runs):
        rows += verdict_rows(lhs, backend_parity(lhs, rhs))
    rows += declaration_check(runs, rows)
    sweep_checks = pd.DataFrame(rows, columns=CHECKS_SCHEMA.names).astype({"passed": bool, "expected_pass": bool})
    run_checks = pd.concat([run.checks for run in runs], ignore_index=True) if runs else sweep_checks.iloc[:0]
    return GateResult(runs, incomplete, sweep_checks, run_checks, scope)


def declaration_check(runs: Sequence[RunTables], sweep_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Red rows for declarations that select no run, and for sweep-judgment declarations that match no row.

    Each run already judged its own run-judgment declarations (a red ``expected_red`` row where one matched nothing).
    """
    seen: dict[str, ExpectedRed] = {}
    for run in runs:
        for declaration in run.declarations:
            seen.setdefault(declaration.describe(), declaration)
    rows = []
    for declaration in seen.values():
        selected = [run for run in runs if declaration.applies(run.run["profile"], run.run["tp"])]
        if not selected:
            verdict = replace(declaration_verdict(declaration, 0, "this sweep"),
                              detail=f"{declaration.describe()} selects no run of this sweep")  # fmt: skip
            rows += verdict_rows(runs[0], [verdict])
        elif declaration.judgment in SWEEP_JUDGMENTS:
            ids = {run.run["run_id"] for run in selected}
            matched = sum(
                declaration.declares(row["judgment"], row["lhs_cell"], row["tensor"])
                for row in sweep_rows
                if row["run_id"] in ids
            )
            if not matched:
                rows += verdict_rows(selected[0], [declaration_verdict(declaration, 0, "this sweep")])
    return rows


def sweep_group(run: RunTables) -> tuple:
    """What must be equal for two runs' tokens to be comparable (COMPARABLE_COLUMNS)."""
    return tuple(run.run[column] for column in COMPARABLE_COLUMNS)


def baseline_order(tp: int, tp_mode: str, directory: str) -> tuple:
    """Runs of one group sort by this; the first is the tp baseline: smallest tp, emulated first, then job order."""
    return (tp, TP_MODE_ORDER.index(tp_mode), re.sub(r"\d+", lambda m: m.group().zfill(12), directory))


def tp_pairs(runs: Sequence[RunTables]) -> Iterable[tuple[RunTables, RunTables]]:
    """(run, baseline) for every run that is not its group's smallest tp (emulated first)."""
    groups: dict[tuple, list[RunTables]] = {}
    for run in runs:
        groups.setdefault((run.run["profile"], *sweep_group(run)), []).append(run)
    for members in groups.values():
        members.sort(key=lambda r: baseline_order(r.run["tp"], r.run["tp_mode"], str(r.directory)))
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
    columns = [*keys, "active", *FORWARD_TENSORS, *(f"{tensor}_bound" for tensor in FORWARD_TENSORS)]
    left = lhs.tokens.loc[lhs.tokens["cell"] == cell, columns]
    right = rhs.tokens.loc[rhs.tokens["cell"] == cell, columns]
    joined = left.merge(right, on=keys, suffixes=("_lhs", "_rhs"), validate="one_to_one")
    return joined[joined["active_lhs"] & joined["active_rhs"]].sort_values(keys, ignore_index=True)


def compare_cell(judgment: str, lhs: RunTables, rhs: RunTables, cell: str, scope: str | None) -> list[Verdict]:
    """One verdict per tensor: ``lhs`` run vs ``rhs`` run on the active tokens of ``cell``."""
    joined = aligned(lhs, rhs, cell)
    profile = lhs.config["profile"]
    dtype = profile["execution_dtype"]
    op = op_class(dtype, profile.get("logits_dtype"))
    roles = lhs.contract.roles_for(judgment)

    def column(name: str) -> torch.Tensor:
        return torch.from_numpy(joined[name].to_numpy(copy=True))

    keys = (column("sample_id"), column("position"))
    verdicts = []
    for tensor in FORWARD_TENSORS:
        left, right = column(f"{tensor}_lhs"), column(f"{tensor}_rhs")
        # Each side is within its own bound of the same reference, so they are within the sum of both.
        bound = column(f"{tensor}_bound_lhs") + column(f"{tensor}_bound_rhs")
        tolerance = lhs.contract.tolerance(judgment, tensor, dtype, op=op, scope=scope)
        verdict = compare_tokens(judgment, tensor, roles, (cell, cell), left, right, tolerance, keys, bound)
        bitwise = len(joined) > 0 and kernels.first_bit_difference(left, right) is None
        detail = f"{lhs.label} vs {rhs.label} ({rhs.run['run_id']}); {verdict.detail}; also bitwise: {bitwise}"
        verdicts.append(replace(verdict, detail=detail))
    return verdicts


def tp_invariance(lhs: RunTables, baseline: RunTables) -> list[Verdict]:
    """Bitwise for cross_tp_bitwise profiles, else the contract's fixed_topology tolerance row."""
    scope = lhs.config["profile"]["determinism_scope"]
    cells = [cell for cell in lhs.tokens["cell"].unique() if cell in set(baseline.tokens["cell"])]
    verdicts = [v for cell in cells for v in compare_cell(Judgment.TP_INVARIANCE, lhs, baseline, cell, scope)]
    if scope == kernels.DeterminismScope.CROSS_TP_BITWISE:
        for judge in (gradient_tp_invariance, weight_gradient_tp_invariance):
            verdicts += [v for cell in cells if (v := judge(lhs, baseline, cell)) is not None]
    return apply_expected(verdicts, lhs.expected_red)


def gradient_tp_invariance(lhs: RunTables, baseline: RunTables, cell: str) -> Verdict | None:
    """grad=true runs: every active token's d hidden bits (by the tokens table's grad_bits) the same as the
    baseline's; None where either run did not differentiate. A missing fingerprint counts as a difference."""
    keys = ["sample_id", "position"]
    sides = [run.tokens.loc[(run.tokens["cell"] == cell) & run.tokens["active"], [*keys, "grad_bits"]]
             for run in (lhs, baseline)]  # fmt: skip
    if any(side["grad_bits"].isna().all() for side in sides):
        return None
    joined = sides[0].merge(sides[1], on=keys, suffixes=("_lhs", "_rhs"), validate="one_to_one").sort_values(keys)
    differ = (joined["grad_bits_lhs"] != joined["grad_bits_rhs"]) | joined["grad_bits_lhs"].isna()
    first = joined[differ].iloc[0] if differ.any() else None
    count = int(differ.sum())
    return Verdict(
        Judgment.GRADIENT_INVARIANCE,
        Tensor.GRAD_HIDDEN,
        *lhs.contract.roles_for(Judgment.GRADIENT_INVARIANCE),
        cell,
        cell,
        metric="mismatched_tokens",
        value=float(count),
        threshold=0.0,
        passed=count == 0 and len(joined) > 0,
        first_sample_id=None if first is None else int(first["sample_id"]),
        first_position=None if first is None else int(first["position"]),
        detail=f"{lhs.label} vs {baseline.label} ({baseline.run['run_id']}); bitwise d hidden by each token's "
        f"grad_bits: {count} of {len(joined)} active tokens differ",
    )


def weight_gradient_tp_invariance(lhs: RunTables, baseline: RunTables, cell: str) -> Verdict | None:
    """grad=true runs: the cell's d weight bits (by the tokens table's grad_weight_bits, one digest per cell) the
    same as the baseline's; None where either run did not differentiate at all. Each rank computes its own vocab
    rows of d weight, so for one layout cell they do not change with tp. A missing or second digest differs."""
    if any(run.tokens["grad_weight_bits"].isna().all() for run in (lhs, baseline)):
        return None
    digests = [run.tokens.loc[run.tokens["cell"] == cell, "grad_weight_bits"] for run in (lhs, baseline)]
    left, right = (set(digest.fillna("null")) for digest in digests)
    passed = len(left) == 1 and left == right
    shown = [", ".join(sorted(value[:16] for value in side)) for side in (left, right)]
    return Verdict(
        Judgment.GRADIENT_INVARIANCE,
        Tensor.GRAD_WEIGHT,
        *lhs.contract.roles_for(Judgment.GRADIENT_INVARIANCE),
        cell,
        cell,
        metric="mismatched_digests",
        value=0.0 if passed else 1.0,
        threshold=0.0,
        passed=passed,
        detail=f"{lhs.label} vs {baseline.label} ({baseline.run['run_id']}); bitwise d weight of the cell by its "
        f"grad_weight_bits: {'equal' if passed else 'differ'} ({shown[0]} vs {shown[1]})",
    )


def backend_parity(lhs: RunTables, rhs: RunTables) -> list[Verdict]:
    verdicts = compare_cell(Judgment.BACKEND_PARITY, lhs, rhs, CANONICAL_CELL, None)
    return apply_expected(verdicts, lhs.expected_red)


def verdict_rows(run: RunTables, verdicts: Sequence[Verdict]) -> list[dict[str, Any]]:
    return [{**run.run, **asdict(verdict)} for verdict in verdicts]


def write_sweep_outputs(root: Path, result: GateResult) -> None:
    """sweep_checks.parquet (same schema as checks.parquet) and summary.md, both written atomically."""
    table = pa.Table.from_pandas(result.sweep_checks, schema=CHECKS_SCHEMA, preserve_index=False)
    write_tables(root, {SWEEP_CHECKS_TABLE: table}, files={SUMMARY_FILE: summary_markdown(result)})


def reported_only(checks: pd.DataFrame) -> pd.Series:
    """Rows that report a value the contract has no row for: never a verdict, never counted as one."""
    return checks["passed"] & checks["threshold"].isna() & checks["detail"].astype(str).str.startswith(REPORTED_ONLY)


def count_verdicts(checks: pd.DataFrame, by: Sequence[str] = VERDICT_GROUPS) -> pd.DataFrame:
    """Pass/fail/unexpected counts of a checks frame's verdicts (reported-only rows aside), per ``by`` group."""
    checks = checks[~reported_only(checks)] if len(checks) else checks
    if not len(checks):
        return pd.DataFrame(columns=[*by, *VERDICT_COUNTS])
    checks = checks.assign(failed=~checks["passed"], unexpected=~as_expected(checks["passed"], checks["expected_pass"]))
    return checks.groupby(list(by), observed=True)[list(VERDICT_COUNTS)].sum().astype(int).reset_index()


def verdict_counts(result: GateResult) -> pd.DataFrame:
    """Pass/fail/unexpected counts by profile x tp x judgment, over run and sweep verdicts."""
    return count_verdicts(pd.concat([result.run_checks, result.sweep_checks], ignore_index=True))


def summary_markdown(result: GateResult) -> str:
    counts = verdict_counts(result)
    judged = f"Complete runs judged: {len(result.runs)}" + (f" ({result.scope})" if result.scope else "")
    lines = ["# Sweep summary", "", f"{judged}.", ""]
    if result.incomplete:
        lines += [f"Missing or incomplete ({len(result.incomplete)}), so the sweep cannot be GREEN:", ""]
        lines += [f"- {line}" for line in result.incomplete] + [""]
    lines += ["| profile | tp | judgment | passed | failed | not as expected |", "|---|---:|---|---:|---:|---:|"]
    lines += [
        f"| {r.profile} | {r.tp} | {r.judgment} | {r.passed} | {r.failed} | {r.unexpected} |"
        for r in counts.itertuples()
    ]
    tolerance_tp = result.sweep_checks[
        (result.sweep_checks["judgment"] == Judgment.TP_INVARIANCE)
        & (result.sweep_checks["metric"] != "mismatched_tokens")
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
    for row in unexpected.itertuples():
        lines.append(f"- {row.profile} tp={row.tp} {row.judgment} {row.tensor} {row.lhs_cell}: {row.detail}")
    lines += ["", f"Exit code: {int(result.exit_code)} ({result.exit_code.word})."]
    return "\n".join(lines) + "\n"
