"""pandas over rlsweep tables (docs/analysis.md): load runs, sweeps or whole trees, and ask the usual questions.

Loaders take a run dir, a sweep dir or an ``outputs/`` tree and find the tables recursively. dtypes are
derived from the table schemas: string columns become categoricals (``detail`` stays text), ``tp`` and
the logical key stay int64, ``logp``/``lse`` float32 and ``ref_logp`` float64 as written, and
``first_sample_id``/``first_position`` are nullable Int64. Every frame gets a ``run_dir`` column.

Selectors are dicts of column filters, e.g. ``{"profile": "cpu_bf16", "tp": 1, "cell": "BN/packed"}``;
a list value means "any of". ``dlogp`` compares two selections over the same logical
``(sample_id, position)`` tokens (active ones only); ``first_divergence`` and ``worst_tokens`` read its result.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

import kernels
from rlsweep.discovery import discover, enclosing_sweep, lexical, part_of_a_sweep
from rlsweep.errors import SelectionError, TablesNotFoundError
from rlsweep.gate import (
    COMPARABLE_COLUMNS,
    SWEEP_CHECKS_TABLE,
    baseline_order,
    count_verdicts,
    read_sweep_checks,
    sweep_of,
)
from rlsweep.listing import list_tree
from rlsweep.manifest import MANIFEST_FILE, verify_run
from rlsweep.spec import CANONICAL_CELL
from rlsweep.tables import CHECKS_SCHEMA, CHECKS_TABLE, TOKENS_SCHEMA, TOKENS_TABLE, TableError, read_table
from rlsweep.verdicts import FORWARD_TENSORS, Judgment, Outcome, outcome

RUN_DIR = "run_dir"  # added column: the directory the row's run tables were read from
LEVEL = "level"  # added checks column: RUN_LEVEL (checks.parquet) or SWEEP_LEVEL (sweep_checks.parquet)
RUN_LEVEL, SWEEP_LEVEL = "run", "sweep"
TEXT_COLUMNS = ("detail", "grad_bits", "grad_weight_bits")  # string columns that stay text: free, or digests
NULLABLE_COLUMNS = ("first_sample_id", "first_position")  # null when nothing diverged
KEY = ("sample_id", "position")  # the logical identity of a token (docs/index.md)
REFERENCE = "reference"  # rhs of dlogp meaning: the float64 reference logp of the lhs tokens themselves
SUMMARY_GROUPS = ("profile", "model", "tp", "judgment")
RUN_GROUP = ("profile", *COMPARABLE_COLUMNS)  # runs whose tokens are comparable across tp (the gate's rule)
DIFF_COLUMNS = (RUN_DIR, "profile", "model", "workload", "tp", "tp_mode", "cell", *KEY, "target_id")
LEADING_CATEGORIES = {"judgment": tuple(Judgment), LEVEL: (RUN_LEVEL, SWEEP_LEVEL)}
# The verdicts on a run's cell against another cell (its own run's canonical one, the same cell of its tp baseline):
# the outcome of a heatmap cell (``cell_outcomes``).
INVARIANCE_JUDGMENTS = (Judgment.FORWARD_INVARIANCE, Judgment.TP_INVARIANCE)

Selector = Mapping[str, Any]
# What a load_tokens frame has beyond the table's own columns, and the ones the comparisons read.
TOKEN_COLUMNS = (RUN_DIR, *RUN_GROUP, "tp", "tp_mode", "cell", *KEY, "target_id", "active")


def pandas_dtype(field: pa.Field) -> str:
    """The analysis dtype of one schema column."""
    if pa.types.is_string(field.type):
        return "str" if field.name in TEXT_COLUMNS else "category"
    if field.name in NULLABLE_COLUMNS:
        return "Int64"
    return np.dtype(field.type.to_pandas_dtype()).name


def natural_key(path: Path) -> tuple:
    """Sort job dirs 0, 1, ..., 10 rather than 0, 1, 10, 2."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.parts)


def categorical(values: pd.Series, leading: Sequence[str] = ()) -> pd.Categorical:
    """Categories: ``leading`` first, then the other values in order of first appearance (cells in layout order)."""
    seen = [value for value in pd.unique(values.astype(str)) if value not in leading]
    return pd.Categorical(values.astype(str), categories=[*leading, *seen])


def normalize(frame: pd.DataFrame, schema: pa.Schema) -> pd.DataFrame:
    """Cast the schema's columns (plus run_dir/level) to the analysis dtypes; column order as in the schema."""
    missing = [name for name in schema.names if name not in frame.columns]
    if missing:
        raise TablesNotFoundError(f"table lacks columns {missing}; expected the schema of rlsweep.tables")
    extra = [name for name in (LEVEL, RUN_DIR) if name in frame.columns]
    out = pd.DataFrame(index=pd.RangeIndex(len(frame)))
    for field in schema:
        dtype, column = pandas_dtype(field), frame[field.name].reset_index(drop=True)
        leading = LEADING_CATEGORIES.get(field.name, ())
        out[field.name] = categorical(column, leading) if dtype == "category" else column.astype(dtype)
    for name in extra:
        out[name] = categorical(frame[name].reset_index(drop=True), LEADING_CATEGORIES.get(name, ()))
    return out


class IncompleteRunsWarning(UserWarning):
    """Runs or jobs under a loaded path that are missing or incomplete: the frame leaves them out."""


def found_runs(root: Path) -> tuple[list[Path], list[str]]:
    """(every complete run dir under ``root``, in natural order; what the gate would call missing or incomplete there:
    ``discover``'s lines, a directory that cannot be read first, and where ``root`` is part of a sweep, that the
    sweep's verdict is not under it)."""
    if not root.is_dir():
        raise TablesNotFoundError(f"{str(root)!r} is not a directory (expected a run dir, a sweep dir or outputs/)")
    complete, incomplete, scope = discover(root)
    incomplete += [part_of_a_sweep(root, scope)] if scope else []
    if not complete:
        found = f"; {len(incomplete)} thing(s) missing or incomplete, first: {incomplete[0]}" if incomplete else ""
        raise TablesNotFoundError(
            f"no complete rlsweep run ({MANIFEST_FILE} naming its tables) under {str(root)!r}{found}"
        )
    return sorted(complete, key=natural_key), incomplete


def warn_left_out(root: Path, incomplete: Sequence[str], stacklevel: int) -> None:
    """Say what a frame leaves out, as the gate leaves it out: a frame that says nothing of it would read as the
    whole (``stacklevel``: of the ``warnings.warn`` call, so that it points at the loader's caller)."""
    if incomplete:
        warnings.warn(
            f"{len(incomplete)} thing(s) under {str(root)!r} missing or incomplete, left out of the frame (first: "
            f"{incomplete[0]}); python -m rlsweep.check {root} lists them",
            IncompleteRunsWarning,
            stacklevel=stacklevel,
        )


def run_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """Every complete run dir under ``path`` (itself included), in natural order; warns of what is left out."""
    root = Path(path)
    complete, incomplete = found_runs(root)
    warn_left_out(root, incomplete, stacklevel=4)  # its caller's caller: the user of load_tokens
    return complete


def read_run_table(run_dir: Path, table: str, schema: pa.Schema) -> pd.DataFrame:
    """One complete run's table, found through its manifest (docs/tables.md)."""
    return read_table(verify_run(run_dir).files[table], schema).to_pandas()


def tokens_frame(tables: Sequence[tuple[Path, pd.DataFrame]]) -> pd.DataFrame:
    """(run dir, tokens table) pairs -> one tokens frame with analysis dtypes and a run_dir column."""
    parts = [table.assign(**{RUN_DIR: str(directory)}) for directory, table in tables if len(table)]
    if not parts:  # provenance stopped every kernel: runs without tokens still have verdicts
        return normalize(pd.DataFrame({name: [] for name in [*TOKENS_SCHEMA.names, RUN_DIR]}), TOKENS_SCHEMA)
    return normalize(pd.concat(parts, ignore_index=True), TOKENS_SCHEMA)


def checks_frame(
    run_tables: Sequence[tuple[Path, pd.DataFrame]],
    sweep_tables: Sequence[tuple[Path, pd.DataFrame, Sequence[Path]]] = (),
) -> pd.DataFrame:
    """Run and sweep checks -> one frame; a sweep row's run_dir is its lhs run's dir, as the gate recorded it with
    the row (``rlsweep.gate.read_sweep_checks``): (sweep dir, table, each row's run dir).

    A gate over a dir of several sweeps judges each sweep's runs again: a verdict that its table and the sweep's own
    both hold, the same in every column, is one row, not two.
    """
    parts = [table.assign(**{LEVEL: RUN_LEVEL, RUN_DIR: str(directory)}) for directory, table in run_tables]
    runs = {lexical(directory): (str(directory), set(run["run_id"])) for directory, run in run_tables}
    for sweep_dir, table, row_dirs in sweep_tables:
        owners = [runs.get(lexical(directory), (None, set())) for directory in row_dirs]
        run_dir = pd.Series([d if i in ids else None for (d, ids), i in zip(owners, table["run_id"], strict=True)],
                            index=table.index, dtype=object)  # fmt: skip
        if run_dir.isna().any():  # an earlier sweep's verdicts, of runs this sweep no longer holds complete
            strangers = sorted(table.loc[run_dir.isna(), "run_id"].astype(str).unique())
            raise TableError(
                f"{str(sweep_dir / SWEEP_CHECKS_TABLE)!r} holds verdicts of {len(strangers)} run ids "
                f"({', '.join(strangers[:4])}) that no complete run under {str(sweep_dir)!r} has: the table is stale; "
                f"python -m rlsweep.check {sweep_dir} writes this sweep's"
            )
        parts.append(table.assign(**{LEVEL: SWEEP_LEVEL, RUN_DIR: run_dir}))
    if len(sweep_tables) > 1:
        sweep_rows = pd.concat(parts[len(run_tables) :], ignore_index=True)
        parts[len(run_tables) :] = [sweep_rows[~sweep_rows.astype(str).duplicated()]]
    parts = [part for part in parts if len(part)]  # concat of empty frames would blur the dtypes
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=[*CHECKS_SCHEMA.names])
    return normalize(frame, CHECKS_SCHEMA)


def load_tokens(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Every complete run's tokens under ``path``: one row per (run, cell, sample_id, position)."""
    frame = tokens_frame([(d, read_run_table(d, TOKENS_TABLE, TOKENS_SCHEMA)) for d in run_dirs(path)])
    if not len(frame):
        raise TablesNotFoundError(f"the {TOKENS_TABLE} tables under {str(path)!r} hold no rows")
    return frame


def load_checks(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Every complete run's checks (level "run") and sweep_checks.parquet (level "sweep") under ``path``.

    A sweep_checks.parquet in a dir inside a sweep (a job dir checked alone) is not loaded: that gate saw only part
    of the sweep, so its rows are no verdict of the sweep (a declaration there selects no run of it, say). A run of a
    sweep that no loaded sweep_checks.parquet judged lacks its sweep's verdicts: warned of, as a missing run is.
    """
    root = Path(path)
    complete, incomplete = found_runs(root)
    runs = [(d, read_run_table(d, CHECKS_TABLE, CHECKS_SCHEMA)) for d in complete]
    found = list_tree(root).named(SWEEP_CHECKS_TABLE)
    sweep_tables = sorted((p for p in found if enclosing_sweep(p.parent) is None), key=natural_key)
    try:
        read = [(p.parent, *read_sweep_checks(p)) for p in sweep_tables]
        frame = checks_frame(runs, [(sweep_dir, table, row_dirs) for sweep_dir, table, row_dirs, _ in read])
    except TableError as err:  # a sweep table whose runs are not all complete now: say why they are not
        if not incomplete:
            raise
        first = f"first of what is missing or incomplete under {str(root)!r}: {incomplete[0]}"
        raise TableError(f"{err} ({first})") from err
    judged = {lexical(run_dir) for *_, runs_judged in read for run_dir in runs_judged}
    warn_left_out(root, incomplete + without_sweep_verdicts(root, complete, judged), stacklevel=3)
    if not len(frame):
        raise TablesNotFoundError(f"the {CHECKS_TABLE} tables under {str(path)!r} hold no rows")
    return frame


def without_sweep_verdicts(root: Path, complete: Sequence[Path], judged: set[Path]) -> list[str]:
    """The line for the runs of a sweep that no loaded sweep_checks.parquet judged (``judged``: the run dirs those
    tables judged): their sweep's cross-run verdicts are missing (its gate has not run since the sweep started again,
    or its table is gone), as ``python -m rlsweep.check`` on the sweep would find."""
    missing = [run_dir for run_dir in complete if lexical(run_dir) not in judged and enclosing_sweep(run_dir)]
    if not missing:
        return []
    return [
        f"{missing[0]}: its sweep's cross-run verdicts are missing (no {SWEEP_CHECKS_TABLE} under {str(root)!r} judged "
        f"this run{f' or {len(missing) - 1} more' if len(missing) > 1 else ''}): python -m rlsweep.check "
        f"{enclosing_sweep(missing[0])} judges the sweep and writes them"
    ]


def summary(checks: pd.DataFrame, by: Sequence[str] = SUMMARY_GROUPS) -> pd.DataFrame:
    """Counts of passed, failed and unexpected (passed != expected_pass) verdicts per ``by`` group."""
    if isinstance(by, str) or not isinstance(by, Sequence) or not all(isinstance(column, str) for column in by):
        raise SelectionError(f"by must be a list of column names, e.g. ['profile', 'tp']; got {by!r}")
    require_frame(checks, [*by, "passed", "expected_pass"], "a load_checks frame")
    return count_verdicts(checks, by)


def require_frame(frame: Any, columns: Sequence[str], what: str) -> None:
    """``frame`` must be a DataFrame with ``columns``, as ``what`` (the function that makes it) returns one."""
    if not isinstance(frame, pd.DataFrame):
        raise SelectionError(f"expected {what}, got {type(frame).__name__}")
    missing = [column for column in columns if column not in frame.columns]
    if missing:
        raise SelectionError(f"expected {what}: it has no column {', '.join(map(repr, missing))}")


def select(tokens: pd.DataFrame, selector: Selector) -> pd.DataFrame:
    """Rows whose columns equal the selector's values (a list value: any of them)."""
    if not isinstance(selector, Mapping):
        raise SelectionError(
            f"a selector maps columns to values, e.g. {{'profile': 'cpu_bf16', 'tp': 2}}; got {selector!r}"
        )
    require_frame(tokens, [], "a load_tokens frame")
    mask = pd.Series(True, index=tokens.index)
    for column, wanted in selector.items():
        if column not in tokens.columns:
            raise SelectionError(f"selector column {column!r} is not a column; columns: {', '.join(tokens.columns)}")
        values = wanted if isinstance(wanted, list | tuple | set) else [wanted]
        mask &= tokens[column].isin([str(v) if isinstance(v, os.PathLike) else v for v in values])
    return tokens[mask]


def active_selection(tokens: pd.DataFrame, selector: Selector, side: str) -> pd.DataFrame:
    chosen = select(tokens, selector)
    chosen = chosen[chosen["active"]]
    if not len(chosen):
        raise SelectionError(f"{side} selector {dict(selector)!r} matches no active token")
    return chosen


def bits_equal(lhs: pd.Series, rhs: pd.Series) -> pd.Series:
    """Elementwise bit equality through kernels.bit_pattern (NaN-safe; -0.0 differs from 0.0).

    Both Series must have one length, one index (same labels, same order) and one dtype: bits of different
    dtypes never compare equal, and pairing by position across different indexes would compare other tokens.
    """
    if len(lhs) != len(rhs):
        raise SelectionError(f"bits_equal: lhs has {len(lhs)} values, rhs {len(rhs)}; compare Series of one length")
    if not lhs.index.equals(rhs.index):
        raise SelectionError(
            f"bits_equal: lhs and rhs have different index labels or order (lhs starts {list(lhs.index[:3])}, rhs "
            f"{list(rhs.index[:3])}); align them first, e.g. rhs.reindex(lhs.index)"
        )
    if lhs.dtype != rhs.dtype:
        raise SelectionError(
            f"bits_equal: lhs is {lhs.dtype}, rhs {rhs.dtype}; cast one to the other's dtype (their bits differ)"
        )
    left = kernels.bit_pattern(torch.from_numpy(lhs.to_numpy(copy=True)))
    right = kernels.bit_pattern(torch.from_numpy(rhs.to_numpy(copy=True)))
    return pd.Series((left == right).numpy(), index=lhs.index)


def dlogp(tokens: pd.DataFrame, lhs: Selector, rhs: Selector | str = REFERENCE, tensor: str = "logp") -> pd.DataFrame:
    """``dlogp = lhs - rhs`` (float64) of ``tensor`` over the active tokens the lhs selector picks.

    ``lhs`` may span several runs and cells; ``rhs`` must pick one token per (sample_id, position) (one run,
    one cell), and every lhs token is compared with the rhs token of the same logical key. ``rhs=REFERENCE``
    compares logp with the float64 ``ref_logp`` of the same rows. Returns DIFF_COLUMNS + lhs, rhs, dlogp,
    bits_equal (for REFERENCE: the float32 logp, widened exactly, has the reference's bits) and allowed: the
    rounding model's bound on |dlogp| (the lhs token's bound vs REFERENCE, the sum of both tokens' otherwise).
    """
    if tensor not in FORWARD_TENSORS:
        raise SelectionError(f"tensor {tensor!r} is not one of {', '.join(FORWARD_TENSORS)}")
    require_frame(tokens, TOKEN_COLUMNS, "a load_tokens frame")
    left = active_selection(tokens, lhs, "lhs")
    if isinstance(rhs, str):
        if rhs != REFERENCE or tensor != "logp":
            raise SelectionError(f"rhs {rhs!r} with tensor {tensor!r}: only logp has a reference (rhs={REFERENCE!r})")
        joined = left.assign(lhs=left[tensor].astype("float64"), rhs=left["ref_logp"], allowed=left["logp_bound"])
    else:
        right = active_selection(tokens, rhs, "rhs")
        repeated = right.duplicated(list(KEY))
        if repeated.any():
            runs, cells = right[RUN_DIR].nunique(), right["cell"].nunique()
            raise SelectionError(
                f"rhs selector {dict(rhs)!r} picks {runs} runs and {cells} cells, not one token per (sample_id, "
                f"position); narrow it with run_dir, tp_mode or cell"
            )
        bound = f"{tensor}_bound"
        partner = right[[*KEY, "target_id", tensor, bound]].rename(
            columns={"target_id": "rhs_target", tensor: "rhs", bound: "rhs_bound"}
        )
        joined = left.merge(partner, on=list(KEY), how="left", validate="many_to_one")
        unmatched = joined["rhs_target"].isna()
        if unmatched.any():
            first = joined.loc[unmatched, list(KEY)].iloc[0].tolist()
            raise SelectionError(
                f"{int(unmatched.sum())} lhs tokens have no active rhs token with the same (sample_id, position), "
                f"first {tuple(first)}; lhs {dict(lhs)!r}, rhs {dict(rhs)!r}"
            )
        differs = joined["target_id"] != joined["rhs_target"]
        if differs.any():
            raise SelectionError(
                f"lhs {dict(lhs)!r} and rhs {dict(rhs)!r} are not the same logical tokens: target_id differs at "
                f"{int(differs.sum())} keys (another workload or seed?)"
            )
        allowed = joined[bound] + joined["rhs_bound"]
        joined = joined.assign(lhs=joined[tensor], rhs=joined["rhs"].astype(joined[tensor].dtype), allowed=allowed)
    equal = bits_equal(joined["lhs"], joined["rhs"].astype(joined["lhs"].dtype))
    out = joined[list(DIFF_COLUMNS)].assign(
        lhs=joined["lhs"],
        rhs=joined["rhs"],
        dlogp=joined["lhs"].astype("float64") - joined["rhs"].astype("float64"),
        bits_equal=equal,
        allowed=joined["allowed"].astype("float64"),
    )
    return out.sort_values([RUN_DIR, "cell", *KEY], ignore_index=True)


def first_divergence(diffs: pd.DataFrame) -> pd.DataFrame:
    """Per (run, cell, sample_id) of a ``dlogp`` frame: the first position whose bits differ (<NA> if none).

    Columns: run_dir, profile, tp, tp_mode, cell, sample_id, first_position (Int64), lhs, rhs, dlogp at
    that position, and diverging_tokens (how many of the sample's active tokens differ).
    """
    groups = [RUN_DIR, "profile", "tp", "tp_mode", "cell", "sample_id"]
    require_frame(diffs, [*groups, "position", "lhs", "rhs", "dlogp", "bits_equal"], "a dlogp frame")
    ordered = diffs.sort_values([*groups, "position"])
    differ = ordered[~ordered["bits_equal"]]
    first = differ.groupby(groups, observed=True, sort=False).head(1)[[*groups, "position", "lhs", "rhs", "dlogp"]]
    counts = differ.groupby(groups, observed=True).size().rename("diverging_tokens").reset_index()
    samples = ordered[groups].drop_duplicates()
    out = samples.merge(first, on=groups, how="left").merge(counts, on=groups, how="left")
    out = out.rename(columns={"position": "first_position"})
    out["first_position"] = out["first_position"].astype("Int64")
    out["diverging_tokens"] = out["diverging_tokens"].fillna(0).astype("int64")
    return out.reset_index(drop=True)


def worst_tokens(diffs: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    """The ``n`` rows of a ``dlogp`` frame with the largest |dlogp|; NaN/Inf rank first."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise SelectionError(f"n={n!r} must be an integer >= 0")
    require_frame(diffs, ["dlogp"], "a dlogp frame")
    magnitude = diffs["dlogp"].abs().fillna(math.inf)
    return diffs.loc[magnitude.sort_values(ascending=False, kind="stable").index[:n]]


def baseline_runs(tokens: pd.DataFrame) -> pd.DataFrame:
    """One row per run: RUN_GROUP columns, tp, tp_mode, run_dir and ``baseline`` (the group's smallest tp run).

    The baseline is chosen as the gate chooses the tp_invariance baseline: within the run's sweep
    (``rlsweep.gate.sweep_of``), smallest tp, emulated first.
    """
    require_frame(tokens, TOKEN_COLUMNS, "a load_tokens frame")
    if not len(tokens):
        raise SelectionError("the tokens frame holds no rows: no run to compare")
    runs = tokens[[*RUN_GROUP, "tp", "tp_mode", RUN_DIR]].drop_duplicates().astype({RUN_DIR: str, "tp_mode": str})
    order = [baseline_order(*key) for key in zip(runs["tp"], runs["tp_mode"], runs[RUN_DIR], strict=True)]
    runs = runs.iloc[sorted(range(len(runs)), key=order.__getitem__)]
    sweeps = runs[RUN_DIR].map(lambda directory: str(sweep_of(Path(directory))))  # the gate's groups are per sweep
    runs["baseline"] = runs.groupby([sweeps, *RUN_GROUP], observed=True)[RUN_DIR].transform("first")
    return runs.reset_index(drop=True)


def dlogp_vs_canonical(tokens: pd.DataFrame, tensor: str = "logp") -> pd.DataFrame:
    """Every run's cells vs the canonical cell of its group's smallest-tp run: one row per (run, cell).

    Columns: RUN_GROUP, tp, tp_mode, run_dir, cell, max_abs_dlogp, mismatched_tokens, active_tokens.
    """
    rows = []
    for baseline, runs in baseline_runs(tokens).groupby("baseline", sort=False):
        diffs = dlogp(tokens, {RUN_DIR: list(runs[RUN_DIR])}, {RUN_DIR: baseline, "cell": CANONICAL_CELL}, tensor)
        rows.append(
            diffs.assign(abs_dlogp=diffs["dlogp"].abs(), mismatched=~diffs["bits_equal"])
            .groupby([RUN_DIR, "cell"], observed=True)
            .agg(
                max_abs_dlogp=("abs_dlogp", "max"),
                mismatched_tokens=("mismatched", "sum"),
                active_tokens=("dlogp", "size"),
            )
            .reset_index()
            .merge(runs.drop(columns="baseline").astype({RUN_DIR: diffs[RUN_DIR].dtype}), on=RUN_DIR)
        )
    grid = pd.concat(rows, ignore_index=True)
    return grid[[*RUN_GROUP, "tp", "tp_mode", RUN_DIR, "cell", "max_abs_dlogp", "mismatched_tokens", "active_tokens"]]


def cell_outcomes(checks: pd.DataFrame) -> pd.DataFrame:
    """The verdict of each run's cell that ``dlogp_vs_canonical`` compares: one row per (run_dir, cell) with an
    ``outcome`` (``rlsweep.verdicts.Outcome``), the worst of its INVARIANCE_JUDGMENTS verdicts on logp and lse, and
    of a whole model's forward_invariance rows of its body (``row_local``, a bitwise body's ``modules``).

    A cell without such a verdict (the canonical cell of a group's baseline run, compared with itself) has no row.
    """
    require_frame(checks, [RUN_DIR, "judgment", "tensor", "lhs_cell", "passed", "expected_pass"], "a load_checks frame")
    forward = checks["judgment"] == Judgment.FORWARD_INVARIANCE  # logp, lse, and a whole model's body rows
    rows = checks[forward | (checks["judgment"].isin(INVARIANCE_JUDGMENTS) & checks["tensor"].isin(FORWARD_TENSORS))]
    worst = list(Outcome)  # worst first
    rank = [worst.index(outcome(*row)) for row in zip(rows["passed"], rows["expected_pass"], strict=True)]
    ranked = pd.DataFrame({RUN_DIR: rows[RUN_DIR].astype(str), "cell": rows["lhs_cell"].astype(str), "rank": rank})
    cells = ranked.groupby([RUN_DIR, "cell"], sort=False)["rank"].min().reset_index()
    return cells.assign(outcome=[worst[rank] for rank in cells["rank"]]).drop(columns="rank")


def dlogp_vs_reference(tokens: pd.DataFrame) -> pd.DataFrame:
    """Accuracy: the canonical cell of every group's smallest-tp run vs its float64 reference (a dlogp frame)."""
    baselines = list(baseline_runs(tokens)["baseline"].unique())
    return dlogp(tokens, {RUN_DIR: baselines, "cell": CANONICAL_CELL}, REFERENCE)
