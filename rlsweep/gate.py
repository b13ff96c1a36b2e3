"""The sweep gate: cross-run judgments from the tables on disk (docs/sweeps.md).

A sweep is judged against its own job list (Hydra's ``multirun.yaml``): every job must have a complete
run (``rlsweep.manifest``), or the gate says INCOMPLETE, naming the job. ``tp_invariance`` compares every
run, cell by cell, with the smallest-tp run of the same profile, model, weights, workload and seed that computed
the cell; ``backend_parity`` compares the canonical cell of profiles that ran the same model, weights, workload,
seed and tp (and, for a whole model, the same body). Reading from disk makes the gate work with any launcher.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from itertools import combinations
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import torch

import kernels
from rlsweep.causes import cause_lines
from rlsweep.contract import Contract, contract_from_mapping, op_class
from rlsweep.discovery import discover, enclosing_sweep, lexical, part_of_a_sweep
from rlsweep.errors import ContractError, OutputDirError, TablesNotFoundError
from rlsweep.exitcodes import ExitCode, combine, one_line
from rlsweep.hf_model import body_attention
from rlsweep.judgments import apply_expected, compare_tokens, declaration_verdict
from rlsweep.manifest import MANIFEST_FILE, canonical_sha256, input_paths, read_manifest, verify_run
from rlsweep.planned import plan_problems
from rlsweep.spec import CANONICAL_CELL, ExpectedRed, declarations_of, tensors_of
from rlsweep.tables import (
    CHECKS_SCHEMA,
    CHECKS_TABLE,
    DIVERGENCE_SCHEMA,
    DIVERGENCE_TABLE,
    RUN_COLUMNS,
    TOKENS_SCHEMA,
    TOKENS_TABLE,
    TableError,
    read_metadata,
    read_table,
    with_metadata,
    write_tables,
)
from rlsweep.verdicts import (
    FORWARD_TENSORS,
    GRAD_ONLY,
    REPORTED_ONLY,
    RUN_JUDGMENTS,
    Judgment,
    Tensor,
    Verdict,
    as_expected,
)
from rlsweep.verdicts import judged as verdict_judged

SWEEP_CHECKS_TABLE = "sweep_checks.parquet"
SUMMARY_FILE = "summary.md"
# What rlsweep.report writes into a dir (DIR or --out): a sweep or run into that dir removes them with the gate's.
REPORT_MARKDOWN = "report.md"
REPORT_HTML = "report.html"
HEATMAP_PNG = "dlogp_heatmap.png"
HISTOGRAM_PNG = "dlogp_histogram.png"
DIVERGENCE_PNG = "divergence_by_module.png"  # a whole model's modules in each moved cell
REPORT_FILES = (REPORT_MARKDOWN, REPORT_HTML, HEATMAP_PNG, HISTOGRAM_PNG, DIVERGENCE_PNG)
TP_MODE_ORDER = ("emulated", "distributed")  # the baseline of a tp group is emulated when both ran
# Runs whose tokens can be compared token by token: the same inputs, by their bits (weight_hash, workload_hash:
# a workload's name does not say its lengths, scale or replay file). A tp group adds the profile.
COMPARABLE_COLUMNS = ("model", "weight_hash", "workload", "workload_hash", "seed")
DECLARED_BY = ("judgment", "lhs_cell", "tensor")  # the columns an expected_red declaration selects rows by
VERDICT_GROUPS = ("profile", "tp", "judgment")
VERDICT_COUNTS = ("passed", "failed", "unexpected")  # unexpected: passed != expected_pass
# A sweep row's run (its lhs run's dir): run_ids repeat across sweeps of one config (two commits' under outputs/),
# so sweep_checks.parquet records each row's run dir, relative to its own dir, in its metadata under this key.
ROW_RUN_DIR = "run_dir"
JUDGED_RUNS = "judged_runs"  # and the manifest digest of every run it judged, by run dir: a rerun makes it stale


@dataclass(frozen=True)
class RunTables:
    """One complete run read back from disk."""

    directory: Path
    run: dict[str, Any]  # the run columns (run_id, profile, tp, ...)
    config: dict[str, Any]  # the resolved config from the tables' metadata
    contract: Contract
    tokens: pd.DataFrame
    checks: pd.DataFrame
    inputs: dict[str, str]  # sha256 of each input file the run read, by input name (its manifest's ``inputs``)
    manifest_sha256: str = ""  # of its manifest as read (as ``manifest_digest``): a rerun's differs, run_id or not
    divergence: pd.DataFrame | None = None  # a whole model's modules in its moved cells (empty for a head's run)

    @property
    def label(self) -> str:
        return f"{self.run['profile']} tp={self.run['tp']} ({self.run['tp_mode']})"

    @cached_property
    def cells(self) -> frozenset[str]:
        """The layout cells this run computed tokens of."""
        return frozenset(self.tokens["cell"].unique())

    @cached_property
    def sweep(self) -> Path:
        """The sweep dir this run is a job of, or its own dir: a run outside any sweep is its whole sweep."""
        return sweep_of(self.directory)

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
    sweep_run_dirs: list[Path] = field(default_factory=list)  # each sweep_checks row's run: its lhs run's dir

    @property
    def runs_judged(self) -> str:
        """How many complete runs were judged, after the scope when only part of a sweep was: ``jobs ...: 3 runs``."""
        return f"{self.scope + ': ' if self.scope else ''}{len(self.runs)} runs"

    @property
    def unexpected(self) -> pd.DataFrame:
        both = pd.concat([self.run_checks, self.sweep_checks], ignore_index=True)
        return both[~as_expected(both["passed"], both["expected_pass"])] if len(both) else both

    @property
    def exit_code(self) -> ExitCode:
        """INCOMPLETE when a job or table is missing, else RED on any unexpected verdict, else GREEN."""
        found = [ExitCode.INCOMPLETE] if self.incomplete else []
        return combine(found + ([ExitCode.RED] if len(self.unexpected) else []))


def load_run(directory: Path) -> RunTables:
    """A complete run's tables, each checked against its schema; a run always holds at least one verdict."""
    state = verify_run(directory)
    files = state.files
    tokens = read_table(files[TOKENS_TABLE], TOKENS_SCHEMA).to_pandas()
    checks = read_table(files[CHECKS_TABLE], CHECKS_SCHEMA).to_pandas()
    if not len(checks):
        raise TableError(f"{str(files[CHECKS_TABLE])!r} holds no verdict (every run judges its contract)")
    config, contract = run_metadata(
        files[CHECKS_TABLE], state.manifest["config_sha256"], set(checks["contract_sha256"])
    )
    run = checks.iloc[0][RUN_COLUMNS.names].to_dict()
    inputs = dict(state.manifest["inputs"])
    divergence = read_table(files[DIVERGENCE_TABLE], DIVERGENCE_SCHEMA).to_pandas()
    return RunTables(directory, run, config, contract, tokens, checks, inputs, canonical_sha256(state.manifest),
                     divergence)  # fmt: skip


def run_metadata(path: Path, config_sha256: str, judged_by: set[str]) -> tuple[dict[str, Any], Contract]:
    """The config and contract a checks table's metadata holds, once they are the run's own: the config its manifest
    hashed and the contract its rows name. The gate takes declarations, inputs and thresholds from them."""
    metadata = read_metadata(path)
    config = metadata.get("config")
    if not isinstance(config, dict) or canonical_sha256(config) != config_sha256:
        raise TableError(
            f"{str(path)!r}: its metadata's config is not the one its run's manifest names (sha256 differs)"
        )
    try:
        contract = contract_from_mapping(metadata.get("contract"), source=f"{path} metadata")
    except (ContractError, KeyError, TypeError) as err:
        raise TableError(f"{str(path)!r}: its metadata holds no readable contract: {one_line(err)}") from err
    if judged_by != {contract.sha256}:
        raise TableError(
            f"{str(path)!r}: its metadata's contract (sha256 {contract.sha256[:12]}) is not the one its rows were "
            f"judged by ({', '.join(sorted(digest[:12] for digest in judged_by))})"
        )
    return config, contract


def manifest_digest(directory: Path) -> str | None:
    """The sha256 of the manifest in ``directory`` (None without one): a rerun writes another, whatever its run_id."""
    manifest, _ = read_manifest(directory)
    return None if manifest is None else canonical_sha256(manifest)


def changed_inputs(runs: Sequence[RunTables]) -> list[str]:
    """One line per input file that runs of one sweep read at one path and found with different contents.

    The file changed during the sweep (or between a sweep and its resumption), so those runs computed on different
    inputs: judged apart by their weight hash, a tp degree would silently go without its tp verdicts; compared, they
    would blame the change on tp. Neither is the sweep's verdict, so the gate calls it incomplete.
    """
    contents: dict[tuple[Path, str, str], dict[str, list[RunTables]]] = {}
    for run in runs:
        for name, path in input_paths(run.config).items():
            contents.setdefault((run.sweep, name, path), {}).setdefault(run.inputs.get(name, "none"), []).append(run)
    lines = []
    for (sweep, name, path), by_hash in contents.items():
        if len(by_hash) > 1:
            seen = "; ".join(
                f"{digest[:12]} in {', '.join(os.path.relpath(run.directory, sweep) for run in members)}"
                for digest, members in by_hash.items()
            )
            lines.append(
                f"{sweep}: its runs read the {name} file {path!r} with {len(by_hash)} different contents ({seen}), "
                "so they computed on different inputs and cannot be judged as one sweep: keep the file unchanged "
                "and run the sweep again"
            )
    return lines


def without_baseline(runs: Sequence[RunTables]) -> list[str]:
    """One line per run of a sweep that no run of its profile at the profile's smallest tp in the sweep computed the
    same inputs as (``sweep_group``): it would go without its tp verdicts, so the sweep is incomplete. Inputs do not
    depend on tp, so this means they changed during the sweep (``changed_inputs`` names a file that did)."""
    by_profile: dict[tuple[Path, str], list[RunTables]] = {}
    for run in runs:  # a run outside any sweep is its own sweep (``sweep_of``): its own baseline
        by_profile.setdefault((run.sweep, run.run["profile"]), []).append(run)
    lines = []
    for (sweep, profile), members in by_profile.items():
        smallest = min(run.run["tp"] for run in members)
        baselines = {sweep_group(run) for run in members if run.run["tp"] == smallest}
        lines += [
            f"{run.directory}: {run.label} computed other inputs ({', '.join(COMPARABLE_COLUMNS)}) than every run of "
            f"{profile} at tp={smallest} in the sweep {sweep}, so it has no tp baseline and no tp verdicts"
            for run in members
            if sweep_group(run) not in baselines
        ]
    return lines


def run_gate(root: str | Path) -> GateResult:
    """Load every complete run under ``root`` and compute the cross-run verdicts."""
    root = Path(root)
    if not root.is_dir():
        raise TablesNotFoundError(f"{str(root)!r} is not a directory of rlsweep tables")
    complete, incomplete, scope = discover(root)
    if scope:
        incomplete.append(part_of_a_sweep(root, scope))
    if not complete and not incomplete:
        raise TablesNotFoundError(
            f"no rlsweep run ({MANIFEST_FILE}, {CHECKS_TABLE}/, {TOKENS_TABLE}/) in {str(root)!r}"
        )
    runs = []
    for run in (load_run(directory) for directory in complete):
        problems = plan_problems(run.config, run.contract, run.checks, standalone=run.sweep == lexical(run.directory))
        incomplete += [f"{run.directory}: its checks table is not the verdicts its config implies: {problem}"
                       for problem in problems]  # fmt: skip
        runs += [] if problems else [run]
    incomplete += changed_inputs(runs) + without_baseline(runs)
    rows: list[dict[str, Any]] = []
    compared: list[set[str]] = []  # the runs each row is of: its lhs run, and a parity row's rhs run too
    for lhs, earlier in tp_pairs(runs):
        rows += (judged := verdict_rows(lhs, tp_invariance(lhs, earlier)))
        compared += [{lhs.run["run_id"]}] * len(judged)
    for lhs, rhs in parity_pairs(runs):
        rows += (judged := verdict_rows(lhs, backend_parity(lhs, rhs)))
        compared += [{lhs.run["run_id"], rhs.run["run_id"]}] * len(judged)
    rows += declaration_check(runs, rows, compared)
    sweep_checks = pd.DataFrame(rows, columns=CHECKS_SCHEMA.names).astype({"passed": bool, "expected_pass": bool})
    run_checks = pd.concat([run.checks for run in runs], ignore_index=True) if runs else sweep_checks.iloc[:0]
    return GateResult(runs, incomplete, sweep_checks, run_checks, scope, [row[ROW_RUN_DIR] for row in rows])


def declaration_check(
    runs: Sequence[RunTables], sweep_rows: Sequence[dict[str, Any]], compared: Sequence[set[str]] | None = None
) -> list[dict[str, Any]]:
    """Red rows for declarations that select no run, and for the other declarations that match no row of the runs
    they select: sweep rows, and for a judgment of both levels (``BOTH_LEVELS``) the runs' own rows too. A sweep row
    is of the runs ``compared`` names for it (a parity row: both sides, as ``backend_parity`` applies them), else
    of its run_id's.

    A declaration selects among the runs of the sweep that declared it (``RunTables.sweep``): under a dir that holds
    several sweeps, another sweep's runs never stand in for a declaration that selects none of its own.
    Each run already judged its own run-judgment declarations (a red ``expected_red`` row where one matched nothing),
    but a grad=false run not those of ``GRAD_ONLY`` judgments: one that no selected run judged is red here.
    """
    seen: dict[tuple[Path, str], tuple[ExpectedRed, list[RunTables]]] = {}
    sweeps: dict[Path, list[RunTables]] = {}
    for run in runs:
        sweeps.setdefault(run.sweep, []).append(run)
    for sweep, members in sweeps.items():
        for declaration in (declaration for run in members for declaration in run.declarations):
            seen.setdefault((sweep, declaration.describe()), (declaration, members))
    rows = []
    for declaration, members in seen.values():
        selected = [run for run in members if declaration.applies(run.run["profile"], run.run["tp"])]
        if not selected:
            verdict = replace(declaration_verdict(declaration, 0, "this sweep"),
                              detail=f"{declaration.describe()} selects no run of this sweep")  # fmt: skip
            rows += verdict_rows(members[0], [verdict])
        elif declaration.judgment in RUN_JUDGMENTS:
            # Each selected run judged it, except a run with no row of a GRAD_ONLY judgment (grad=false); where
            # every selected run is such a run, none did, so the gate does.
            if declaration.judgment in GRAD_ONLY and not any(
                (run.checks["judgment"] == declaration.judgment).any() for run in selected
            ):
                rows += verdict_rows(selected[0], [declaration_verdict(declaration, 0, "this sweep")])
        else:
            ids = {run.run["run_id"] for run in selected}
            of = compared if compared is not None else [{row["run_id"]} for row in sweep_rows]
            judged = [row for row, runs_of in zip(sweep_rows, of, strict=True) if runs_of & ids]
            judged += [row for run in selected for row in run.checks[[*DECLARED_BY, "detail"]].to_dict("records")]
            matched = sum(
                verdict_judged(row["detail"]) and declaration.declares(*(row[key] for key in DECLARED_BY))
                for row in judged
            )
            if not matched:
                rows += verdict_rows(selected[0], [declaration_verdict(declaration, 0, "this sweep")])
    return rows


def sweep_of(directory: Path) -> Path:
    """The sweep dir a run dir is a job of, or the run dir itself (absolute, ``..`` resolved by name): runs are
    compared only within one sweep, so a run outside any sweep is compared with no other, and under a dir of several
    sweeps each is judged on its own (not one commit's or machine's runs against another's, as if tp differed)."""
    return lexical(enclosing_sweep(directory) or directory)


def sweep_group(run: RunTables) -> tuple:
    """What must be equal for two runs' tokens to be comparable: their sweep, and their inputs (COMPARABLE_COLUMNS)."""
    return (run.sweep, *(run.run[column] for column in COMPARABLE_COLUMNS))


def baseline_order(tp: int, tp_mode: str, directory: str) -> tuple:
    """Runs of one group sort by this; the first is the tp baseline: smallest tp, emulated first, then job order."""
    return (tp, TP_MODE_ORDER.index(tp_mode), re.sub(r"\d+", lambda m: m.group().zfill(12), directory))


def tp_pairs(runs: Sequence[RunTables]) -> Iterable[tuple[RunTables, list[RunTables]]]:
    """(run, the runs before it in its group by ``baseline_order``) for every run but its group's first.

    A group is one profile as the runs resolved it (a sweep over ``profile.vocab_tile`` makes a group per tile: the
    promise of tp invariance is for one tile structure, and two tiles sum the vocab in other groupings)."""
    groups: dict[tuple, list[RunTables]] = {}
    for run in runs:
        profile = json.dumps(run.config.get("profile", {}), sort_keys=True, default=str)
        groups.setdefault((run.run["profile"], profile, *sweep_group(run)), []).append(run)
    for members in groups.values():
        members.sort(key=lambda r: baseline_order(r.run["tp"], r.run["tp_mode"], str(r.directory)))
        yield from ((member, members[:index]) for index, member in enumerate(members) if index)


def parity_pairs(runs: Sequence[RunTables]) -> Iterable[tuple[RunTables, RunTables]]:
    """Every pair of runs of distinct profiles that ran the same tokens at the same tp and tp_mode: a profile may have
    several such runs (a sweep over ``profile.vocab_tile`` or ``layout.cells``), and each is paired.

    Parity judges the head's backends on the same hidden states, so a whole model's runs pair only where their bodies
    ran alike (``body_of``): two attention implementations give other hidden states, whose difference no head bound
    covers (docs/whole_model.md).

    The pair's first run is the one its rows are charged to: the one at fault (``at_fault_first``), else the first by
    profile name."""
    groups: dict[tuple, list[RunTables]] = {}
    for run in runs:
        groups.setdefault((*sweep_group(run), run.run["tp"], run.run["tp_mode"], *body_of(run)), []).append(run)
    for members in groups.values():
        members.sort(key=lambda r: (r.run["profile"], baseline_order(r.run["tp"], r.run["tp_mode"], str(r.directory))))
        pairs = ((lhs, rhs) for lhs, rhs in combinations(members, 2) if lhs.run["profile"] != rhs.run["profile"])
        yield from (at_fault_first(lhs, rhs, CANONICAL_CELL) for lhs, rhs in pairs)


def body_of(run: RunTables) -> tuple[Any, Any]:
    """How a whole model's body ran: its profile's body_attention as the run resolved it (``hf_model.body_attention``:
    a head profile's null ran DEFAULT_ATTENTION) and body_packing, as the run's resolved config holds them (a head's
    runs hold the schema's defaults, which nothing reads, so they group alike)."""
    profile = run.config.get("profile") or {}
    return body_attention(profile.get("body_attention")), profile.get("body_packing")


def computed_active(run: RunTables, cell: str) -> bool:
    """Whether ``run`` computed an active token of ``cell`` (provenance may have stopped it before that cell)."""
    return bool(run.tokens.loc[run.tokens["cell"] == cell, "active"].any())


def at_fault_first(lhs: RunTables, rhs: RunTables, cell: str) -> tuple[RunTables, RunTables]:
    """The pair with the run their disagreement is of first, so their rows are its (run columns, run dir): where only
    one computed active tokens of ``cell``, the other (a comparison fails for want of its tokens); where both did,
    the one farther from the float64 reference both ran on the same inputs (``reference_used``: a profile's bug is
    its own red, not its partner's); where neither is farther, the pair as given."""
    computed = computed_active(lhs, cell), computed_active(rhs, cell)
    if computed != (True, True):
        return (rhs, lhs) if computed == (True, False) else (lhs, rhs)
    tensors = [tensor for tensor in tensors_of(lhs.config) if tensor in tensors_of(rhs.config)]
    return (rhs, lhs) if reference_used(rhs, cell, tensors) > reference_used(lhs, cell, tensors) else (lhs, rhs)


def reference_used(run: RunTables, cell: str, tensors: Sequence[str]) -> float:
    """The largest share of its accuracy bound that any active token of ``cell`` uses, ``|value - float64 reference|
    / bound`` over ``tensors``: no error uses none of a bound, even of 0; a NaN uses all of it and more."""
    tokens = run.tokens.loc[(run.tokens["cell"] == cell) & run.tokens["active"]]
    used = 0.0
    for tensor in tensors:
        error = torch.from_numpy((tokens[tensor].astype("float64") - tokens[f"ref_{tensor}"]).abs().to_numpy(copy=True))
        bound = torch.from_numpy(tokens[f"{tensor}_bound"].to_numpy(dtype="float64", copy=True))
        share = torch.where(error == 0, 0.0, error.nan_to_num(nan=math.inf, posinf=math.inf) / bound)
        used = max(used, float(share.nan_to_num(nan=math.inf).max()) if share.numel() else 0.0)
    return used


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
    # Whose active tokens are missing, where none are shared: such a row is charged to that run (``at_fault_first``).
    missing = [run.label for run in (lhs, rhs) if not (len(joined) or computed_active(run, cell))]
    verdicts = []
    for tensor in [t for t in tensors_of(lhs.config) if t in tensors_of(rhs.config)]:  # what both computed
        left, right = column(f"{tensor}_lhs"), column(f"{tensor}_rhs")
        # Each side is within its own bound of the same reference, so they are within the sum of both.
        bound = column(f"{tensor}_bound_lhs") + column(f"{tensor}_bound_rhs")
        tolerance = lhs.contract.tolerance(judgment, tensor, dtype, op=op, scope=scope)
        verdict = compare_tokens(judgment, tensor, roles, (cell, cell), left, right, tolerance, keys, bound)
        bitwise = len(joined) > 0 and kernels.first_bit_difference(left, right) is None
        if missing:
            verdict = replace(verdict, detail=f"{verdict.detail}: {' and '.join(missing)} computed none of {cell}")
        detail = f"{lhs.label} vs {rhs.label} ({rhs.run['run_id']}); {verdict.detail}; also bitwise: {bitwise}"
        verdicts.append(replace(verdict, detail=detail))
    return verdicts


def tp_invariance(lhs: RunTables, earlier: Sequence[RunTables]) -> list[Verdict]:
    """Bitwise for cross_tp_bitwise profiles, else the contract's fixed_topology tolerance row.

    Each cell of ``lhs`` is compared with the first of ``earlier`` (its group's runs before it) that computed the
    cell, and its gradients with the first that also differentiated: a group's runs may differ in their layout or
    in ``grad``, and the first run alone would leave the cells and gradients it lacks unjudged.
    """
    scope = lhs.config["profile"]["determinism_scope"]
    verdicts = []
    for cell in lhs.tokens["cell"].unique():
        computed = [run for run in earlier if cell in run.cells]  # cells read once per run: a group may hold many
        if not computed:
            continue
        verdicts += compare_cell(Judgment.TP_INVARIANCE, lhs, computed[0], cell, scope)
        differentiated = [run for run in computed if run.config.get("grad")]
        if scope == kernels.DeterminismScope.CROSS_TP_BITWISE and lhs.config.get("grad") and differentiated:
            for judge in (gradient_tp_invariance, weight_gradient_tp_invariance):
                verdicts += [v for v in [judge(lhs, differentiated[0], cell)] if v is not None]
    return apply_expected(verdicts, lhs.expected_red)


def gradient_tp_invariance(lhs: RunTables, baseline: RunTables, cell: str) -> Verdict | None:
    """grad=true runs: every token's d hidden bits (by the tokens table's grad_bits; a prompt token's too, as the run
    judges it) the same as the baseline's; None where either run did not differentiate. A missing fingerprint counts
    as a difference."""
    keys = ["sample_id", "position"]
    sides = [run.tokens.loc[run.tokens["cell"] == cell, [*keys, "grad_bits"]] for run in (lhs, baseline)]
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
        f"grad_bits: {count} of {len(joined)} tokens differ",
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
    """The canonical cell of two profiles' runs; a row is of both runs, so the declarations that select either apply:
    which profile is ``lhs`` is only their order by name."""
    verdicts = compare_cell(Judgment.BACKEND_PARITY, lhs, rhs, CANONICAL_CELL, None)
    return apply_expected(verdicts, [*lhs.expected_red, *rhs.expected_red])


def verdict_rows(run: RunTables, verdicts: Sequence[Verdict]) -> list[dict[str, Any]]:
    return [{**run.run, **asdict(verdict), ROW_RUN_DIR: run.directory} for verdict in verdicts]


def write_sweep_outputs(root: Path, result: GateResult) -> None:
    """sweep_checks.parquet (same schema as checks.parquet, each row's run dir in its metadata) and summary.md, both
    written atomically."""
    table = pa.Table.from_pandas(result.sweep_checks, schema=CHECKS_SCHEMA, preserve_index=False)
    judged = {os.path.relpath(run.directory, root): run.manifest_sha256 for run in result.runs}
    run_dirs = [os.path.relpath(path, root) for path in result.sweep_run_dirs]
    table = with_metadata(table, {ROW_RUN_DIR: run_dirs, JUDGED_RUNS: judged})
    write_tables(root, {SWEEP_CHECKS_TABLE: table}, files={SUMMARY_FILE: summary_markdown(result)})


def read_sweep_checks(path: Path) -> tuple[pd.DataFrame, list[Path], list[Path]]:
    """A sweep_checks.parquet, each row's run dir and every run dir it judged (``write_sweep_outputs``); one that does
    not record them is not the gate's: it cannot say whose verdicts its rows are. One whose judged runs were run again
    since is stale."""
    table = read_table(path, CHECKS_SCHEMA)
    try:
        metadata = read_metadata(path)
    except TableError:
        metadata = {}
    run_dirs, judged = metadata.get(ROW_RUN_DIR), metadata.get(JUDGED_RUNS)
    if not (isinstance(run_dirs, list) and len(run_dirs) == len(table) and all(isinstance(d, str) for d in run_dirs)
            and isinstance(judged, dict)):  # fmt: skip
        raise TableError(
            f"{str(path)!r} does not record the run dir of each of its {len(table)} rows, so whose verdicts they are "
            f"is unknown (an older rlsweep wrote it, or not the gate): python -m rlsweep.check {path.parent} writes it"
        )
    changed = sorted(
        directory for directory, digest in judged.items() if manifest_digest(path.parent / directory) != digest
    )
    if changed:
        raise TableError(
            f"{str(path)!r} holds the verdicts of runs that were run again or removed since ({', '.join(changed[:4])}"
            f"{' and more' if len(changed) > 4 else ''}): the table is stale; python -m rlsweep.check {path.parent} "
            "writes it again"
        )
    return table.to_pandas(), [path.parent / d for d in run_dirs], [path.parent / d for d in sorted(judged)]


def remove_sweep_outputs(root: Path) -> None:
    """A sweep's (or a single run's) first step once it holds its dir: the last gate's outputs and the last report
    go, so no earlier verdict or report reads as its own."""
    for path in (root / SWEEP_CHECKS_TABLE, root / SUMMARY_FILE, *(root / name for name in REPORT_FILES)):
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            raise OutputDirError(
                f"{str(path)!r} (an earlier gate's or report's output) cannot be removed before this sweep or run: "
                f"{err.strerror or err}"
            ) from err


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
    lines = ["# Sweep summary", "", f"Complete runs judged: {result.runs_judged}.", ""]
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
    if len(unexpected):  # one line per cause (rlsweep.causes); the tables hold every row
        where = f"every row: {CHECKS_TABLE}/, {SWEEP_CHECKS_TABLE}"
        lines += ["", f"Verdicts not as expected: {len(unexpected)}, by cause ({where}).", ""]
        lines += [f"- {line}" for line in cause_lines(unexpected.to_dict("records"))]
    else:
        lines += ["", "Verdicts not as expected: 0."]
    lines += ["", f"Exit code: {int(result.exit_code)} ({result.exit_code.word})."]
    return "\n".join(lines) + "\n"
