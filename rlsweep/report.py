"""``python -m rlsweep.report DIR``: a Markdown and a self-contained HTML report with plots (docs/analysis.md).

Runs the sweep gate over the tables under DIR (nothing is written into DIR unless it is the output) and
writes, into DIR or ``--out``: ``report.md``, ``report.html`` (plots embedded as base64 data URIs) and the
PNG plots. The exit code is the gate's (``rlsweep.exitcodes.ExitCode``, docs/sweeps.md); a report that
cannot be made is ERROR.
"""

# ruff: noqa: E402 -- the signal handlers go in before the imports below, which take seconds (pandas, torch)
from __future__ import annotations

import argparse
import base64
import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlsweep.exitcodes import ExitCode, exit_without_teardown, one_line_usage, run_command, stop_at_once

PROG = "python -m rlsweep.report"
if __name__ == "__main__":
    stop_at_once(PROG)

import pandas as pd

from rlsweep import analysis, plots
from rlsweep.check import add_directory_argument, console_summary
from rlsweep.discovery import holder, sweep_marks
from rlsweep.errors import OutputDirError, TablesNotFoundError
from rlsweep.gate import (
    DIVERGENCE_PNG,
    HEATMAP_PNG,
    HISTOGRAM_PNG,
    REPORT_HTML,
    REPORT_MARKDOWN,
    GateResult,
    RunTables,
    reported_only,
    run_gate,
)
from rlsweep.locks import locked
from rlsweep.manifest import verify_run
from rlsweep.spec import CANONICAL_CELL
from rlsweep.tables import (
    CHECKS_TABLE,
    PARTITION_KEY,
    RUN_TABLES,
    read_metadata,
    table_folder,
    unwritable_reason,
    write_tables,
)
from rlsweep.verdicts import REPORTED_ONLY, Judgment, as_expected

PLOTS = (HEATMAP_PNG, HISTOGRAM_PNG)  # every report's; a whole model's adds DIVERGENCE_PNG
RED, RED_EXPECTED_RED, EXPECTED_RED = "RED", "RED (declared red, passed)", "expected red"
FIRST_DIVERGENCE = "first (sample, pos)"
RED_COLUMNS = ["status", "profile", "tp", "judgment", "tensor", "lhs_cell", "rhs_cell", "metric", "value", "threshold"]
RED_COLUMNS += [FIRST_DIVERGENCE, "run_dir"]
RED_WORDS = tuple(code.word for code in ExitCode if code != ExitCode.GREEN)
RED_GROUPS = ["status", "profile", "tp", "judgment"]  # report.html folds the red table into one <details> each
NOT_RECORDED = "not recorded"
ENVIRONMENT_FIELDS = [
    "device",
    "python",
    "torch",
    "triton",
    "git commit",
    "sources sha256",
    "contract",
    "contract sha256",
]


@dataclass
class Section:
    """One part of the report: paragraphs, then an optional table and an optional plot (a PNG file name)."""

    title: str
    paragraphs: list[str] = field(default_factory=list)
    table: pd.DataFrame | None = None
    image: str | None = None
    fold_by: list[str] | None = None  # HTML only: one collapsible <details> per group of these columns


def red_verdicts(checks: pd.DataFrame) -> pd.DataFrame:
    """Verdicts not as expected (RED first), then failed verdicts that were declared expected red."""
    unexpected = ~as_expected(checks["passed"], checks["expected_pass"])
    expected_red = ~checks["passed"] & ~checks["expected_pass"]
    chosen = checks[unexpected | expected_red]
    status = pd.Series(EXPECTED_RED, index=chosen.index)
    status[~as_expected(chosen["passed"], chosen["expected_pass"])] = RED
    status[chosen["passed"] & ~chosen["expected_pass"]] = RED_EXPECTED_RED
    first = [
        "" if pd.isna(sample) else f"({sample}, {position})"
        for sample, position in zip(chosen["first_sample_id"], chosen["first_position"], strict=True)
    ]
    order = status.map({RED: 0, RED_EXPECTED_RED: 1, EXPECTED_RED: 2}).sort_values(kind="stable").index
    chosen = chosen.assign(status=status, **{FIRST_DIVERGENCE: first})
    return chosen.loc[order, RED_COLUMNS].reset_index(drop=True)


def verdict_grid(checks: pd.DataFrame) -> pd.DataFrame:
    """One row per profile x model x tp, one column per judgment: 'passed/total', plus the count not as expected."""
    counts = analysis.summary(checks)
    text = counts["passed"].astype(str) + "/" + (counts["passed"] + counts["failed"]).astype(str)
    text = text.where(counts["unexpected"] == 0, text + " (" + counts["unexpected"].astype(str) + " RED)")
    grid = counts.assign(text=text).pivot(index=["profile", "model", "tp"], columns="judgment", values="text")
    grid.columns = [str(column) for column in grid.columns]
    return grid.fillna("").reset_index()


def relative(run_dirs: pd.Series, root: Path) -> pd.Series:
    def short(path: str) -> str:
        return str(Path(path).relative_to(root)) if Path(path).is_relative_to(root) else path

    return run_dirs.astype(str).map(short)


def recorded_environment(run: RunTables) -> dict[str, Any]:
    """What a run recorded of where it ran: its tables' ``environment`` metadata and its manifest's ``code``."""
    state = verify_run(run.directory)
    recorded = dict(read_metadata(state.files[CHECKS_TABLE]).get("environment", {}))
    return {**recorded, "code": state.manifest.get("code", {})}


def describe_device(device: str, recorded: dict[str, Any]) -> str:
    """'cuda: NVIDIA H200; capability 9.0; 8 GPUs; CUDA 12.8', or 'cpu: AMD EPYC (x86_64); capability AVX512;
    2 threads'."""
    info = recorded.get("device")
    if not isinstance(info, dict) or not info.get("name"):
        return f"{device}: name {NOT_RECORDED}"
    details = {"capability": "capability {}", "count": "{} GPUs", "cuda": "CUDA {}", "threads": "{} threads"}
    parts = [info["name"], *(text.format(info[key]) for key, text in details.items() if info.get(key))]
    return f"{device}: " + "; ".join(map(str, parts))


def environments(result: GateResult, root: Path) -> pd.DataFrame:
    """One column per distinct environment (device, versions, code, contract), its first row the runs that ran in it."""
    rows = []
    for run in result.runs:
        recorded = recorded_environment(run)
        rows.append(
            {
                "device": describe_device(run.run["device"], recorded),
                "python": recorded.get("python") or NOT_RECORDED,
                "torch": recorded.get("torch") or NOT_RECORDED,
                "triton": recorded.get("triton") or NOT_RECORDED,
                "git commit": recorded.get("git_commit") or NOT_RECORDED,
                "sources sha256": recorded["code"].get("sources_sha256") or NOT_RECORDED,
                "contract": run.run["contract_version"],
                "contract sha256": run.run["contract_sha256"],
                "runs": str(run.directory),
            }
        )
    frame = pd.DataFrame(rows, columns=[*ENVIRONMENT_FIELDS, "runs"])
    frame["runs"] = relative(frame["runs"], root)
    grouped = frame.groupby(ENVIRONMENT_FIELDS, sort=False)["runs"].agg(lambda runs: ", ".join(runs))
    table = grouped.reset_index()[["runs", *ENVIRONMENT_FIELDS]].T  # one column per environment: long hashes fit
    table.columns = [f"environment {number}" for number in range(1, len(table.columns) + 1)]
    return table.rename_axis("").reset_index()


def chain_entry(row: Any) -> str:
    """One chain metric of one run: 'value / threshold', a failed one marked; an unthresholded one reported only."""
    entry = f"{row.value:.4g}" if pd.isna(row.threshold) else f"{row.value:.4g} / {row.threshold:.4g}"
    if not as_expected(row.passed, row.expected_pass):
        return f"{entry} {RED}"
    if not row.passed:
        return f"{entry} ({EXPECTED_RED})"
    return f"{entry} ({REPORTED_ONLY})" if row.reported else entry


def chain_table(checks: pd.DataFrame, root: Path) -> pd.DataFrame:
    """The chain_aggregates verdicts pivoted: one row per metric (in the order judged), one column per run."""
    rows = checks[checks["judgment"] == Judgment.CHAIN_AGGREGATES].astype(
        {analysis.RUN_DIR: str, "metric": str, "tensor": str}
    )
    if rows["tensor"].nunique() > 1:  # the same metric of two tensors: two rows
        rows = rows.assign(metric=rows["metric"] + " (" + rows["tensor"] + ")")
    run_dirs = relative(rows[analysis.RUN_DIR], root)
    run = rows["profile"].astype(str) + " tp=" + rows["tp"].astype(str) + " (" + run_dirs + ")"
    rows = rows.assign(reported=reported_only(rows))
    entries = rows.assign(run=run, entry=[chain_entry(row) for row in rows.itertuples()])
    table = entries.pivot(index="metric", columns="run", values="entry")
    table = table.loc[list(dict.fromkeys(entries["metric"])), list(dict.fromkeys(entries["run"]))]
    return table.fillna("").reset_index().rename_axis(columns=None)


# chunk_size: the run's layout.chunk_size, which tells apart the runs of a sweep over it (conf/sweep/invariant_body).
DIVERGENCE_SHOWN = ["profile", "tp", "chunk_size", "cell", "module", "module_class", "tokens", "tokens_differing",
                    "max_abs_diff"]  # fmt: skip
# Of the trainer_rollout rows, the ones shown.
ROLLOUT_METRICS = ["k1_kl", "k2_kl", "k3_kl", "ppl_ratio", "max_abs_dlogp"]


def whole_model_sections(checks: pd.DataFrame, divergence: pd.DataFrame) -> list[Section]:
    """A whole model's sections: verl's metrics of the trainer's cell against each rollout cell, and the first module
    to diverge in each cell whose bits moved (with its plot). None for a sweep of heads alone."""
    rollout = checks[checks["judgment"] == Judgment.TRAINER_ROLLOUT]
    if not len(rollout) and not len(divergence):
        return []
    sections = []
    if len(rollout):
        shown = rollout[rollout["metric"].isin(ROLLOUT_METRICS)]
        table = shown.pivot_table(index=["profile", "tp", "lhs_cell"], columns="metric", values="value",
                                  aggfunc="first", observed=True).reset_index()  # fmt: skip
        metrics = [metric for metric in ROLLOUT_METRICS if metric in table]
        table = table.rename(columns={"lhs_cell": "rollout cell"})[["profile", "tp", "rollout cell", *metrics]]
        table[metrics] = table[metrics].map("{:.4g}".format)
        sections.append(Section(
            "Whole model: trainer against rollout",
            [f"verl's mismatch metrics of the trainer's cell ({CANONICAL_CELL}) against each rollout cell, per run "
             "(reported, not judged: docs/whole_model.md#trainer-against-rollout). A bitwise invariant body gives "
             "k1 = k2 = k3 = 0 and a perplexity ratio of exactly 1; every metric is in the checks table."],
            table,
        ))  # fmt: skip
    first = divergence[divergence["first_diverging"]] if len(divergence) else divergence
    if len(first):
        sections.append(Section(
            "Whole model: the first diverging module",
            ["For each cell whose logp or lse bits moved against the canonical cell, the innermost module whose "
             "inputs are bitwise equal in both cells and whose output is not (docs/whole_model.md#the-first-diverging-"
             "op-rlsweepdivergencepy). The plot: tokens each module's output moved, modules in execution order, one "
             "line per moved cell; the divergence table holds every module's row."],
            first[DIVERGENCE_SHOWN].sort_values(["profile", "tp", "chunk_size", "cell"]).reset_index(drop=True),
            image=DIVERGENCE_PNG,
        ))  # fmt: skip
    return sections


def build_sections(root: Path, result: GateResult, checks: pd.DataFrame) -> list[Section]:
    counts = analysis.summary(checks, by=[analysis.RUN_DIR])
    run_rows = checks[checks[analysis.LEVEL] == analysis.RUN_LEVEL]  # every run has verdicts, not always tokens
    runs = run_rows[[analysis.RUN_DIR, "profile", "model", "workload", "tp", "tp_mode"]].drop_duplicates()
    runs = runs.astype({analysis.RUN_DIR: str}).merge(counts.astype({analysis.RUN_DIR: str}), on=analysis.RUN_DIR)
    runs[analysis.RUN_DIR] = relative(runs[analysis.RUN_DIR], root)
    red = red_verdicts(checks)
    red["run_dir"] = relative(red["run_dir"], root)
    red[["value", "threshold"]] = red[["value", "threshold"]].map("{:.4g}".format)
    unexpected = int((red["status"] != EXPECTED_RED).sum())
    status = (
        f"Gate: **{result.exit_code.word}** (exit code {int(result.exit_code)}). "
        f"{result.runs_judged}, "
        f"{len(result.incomplete)} missing or incomplete, {len(checks)} verdicts "
        f"({int((checks['level'] == analysis.SWEEP_LEVEL).sum())} across runs), {unexpected} not as expected, "
        f"{int((red['status'] == EXPECTED_RED).sum())} failed as declared (expected red)."
    )
    chain = chain_table(checks, root)
    return [
        Section("Gate", [status, *[f"INCOMPLETE {line}" for line in result.incomplete]]),
        Section(
            "Environment",
            [
                "Where the runs computed, as each recorded it (tables' metadata, manifest): one column per distinct "
                "device, python, torch and triton versions, code and contract. 'git commit' ends in '+dirty' when "
                "the checkout had uncommitted changes; 'sources sha256' hashes the kernels, rlsweep and conf sources "
                "that ran (and the profile's backend_module where it loads one), so it tells two dirty trees apart."
            ],
            environments(result, root),
        ),
        Section("Runs", ["Verdict counts per run; run dirs relative to the report's input."], runs),
        Section(
            "Verdicts by profile, model, tp and judgment",
            ["Each entry: passed/total verdicts; (N RED) counts verdicts whose outcome is not the expected one."],
            verdict_grid(checks),
        ),
        Section(
            "Layout and TP invariance: max |dlogp| vs the canonical cell",
            [
                f"Every cell of every run against {CANONICAL_CELL} of the same profile's smallest-tp run, on the "
                "active tokens (logp). A cell's colour is its verdict (the worst of its forward_invariance and "
                "tp_invariance verdicts): green passed, amber failed as declared (expected red), red not as expected; "
                "grey: the baseline's canonical cell, which no verdict compares. The shade within a colour is the "
                "max |dlogp| (lightest: 0, every active token bitwise equal)."
            ],
            image=HEATMAP_PNG,
        ),
        Section(
            "Accuracy: dlogp vs the float64 reference",
            [
                f"logp of {CANONICAL_CELL} at each profile's smallest tp minus ref_logp; dashed lines: the contract's "
                "atol where its rows have one (v1; v2 judges by per-token bounds)."
            ],
            image=HISTOGRAM_PNG,
        ),
        Section(
            "Chain aggregates: what the mismatch does to an RL update",
            [
                f"The {Judgment.CHAIN_AGGREGATES} verdicts: each metric of the per-token dlogp of {CANONICAL_CELL} "
                "against the float64 reference, per run (profile tp=N (run dir)). Each entry: value / threshold "
                "(the upper limit; a signed metric also has a lower one, named in the verdict's detail); "
                f"{RED}: failed though expected to pass; ({EXPECTED_RED}): failed as declared; ({REPORTED_ONLY}): "
                "the contract has no row for that metric."
            ]
            if len(chain)
            else [f"No {Judgment.CHAIN_AGGREGATES} verdict (provenance stopped every kernel)."],
            chain if len(chain) else None,
        ),
        Section(
            "Red verdicts",
            [
                f"All {len(red)} failed or not-as-expected verdicts, none left out. {RED!r}: failed though expected "
                f"to pass; {RED_EXPECTED_RED!r}: a declared-red verdict that passed (the control lost its power); "
                f"{EXPECTED_RED!r}: failed as declared. {FIRST_DIVERGENCE!r}: the first diverging logical token "
                "(sample_id, position)."
            ]
            if len(red)
            else ["No failed verdict."],
            red if len(red) else None,
            fold_by=RED_GROUPS,
        ),
    ]


def markdown_table(frame: pd.DataFrame) -> str:
    cells = frame.astype(object).where(frame.notna(), "").astype(str)
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(v.replace("|", "\\|") for v in row) + " |" for row in cells.itertuples(index=False)]
    return "\n".join(lines)


def render_markdown(title: str, sections: Sequence[Section]) -> str:
    lines = [f"# {title}", ""]
    for section in sections:
        lines += [f"## {section.title}", "", *(f"{p}\n" for p in section.paragraphs)]
        if section.table is not None:
            lines += [markdown_table(section.table), ""]
        if section.image:
            lines += [f"![{section.title}]({section.image})", ""]
    return "\n".join(lines)


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
.table { overflow-x: auto; margin: 0.5em 0 1.5em; }
table { border-collapse: collapse; font-size: 0.78em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; white-space: nowrap; }
th { background: #f2f2f2; } tr:nth-child(even) td { background: #fafafa; }
img { max-width: 100%; border: 1px solid #ddd; }
.status-red { color: #b00020; font-weight: bold; }
details { margin: 0.3em 0; } summary { cursor: pointer; }
"""


def html_paragraph(text: str) -> str:
    escaped = html.escape(text)
    parts = escaped.split("**")  # the only Markdown the report's paragraphs use is **bold**
    bold = [f'<b class="status-red">{p}</b>' if p in RED_WORDS else f"<b>{p}</b>" for p in parts[1::2]]
    parts[1::2] = bold
    return "<p>" + "".join(parts) + "</p>"


def html_table(frame: pd.DataFrame) -> str:
    table = frame.to_html(index=False, escape=True, na_rep="", border=0)
    for word in (RED, RED_EXPECTED_RED):  # the verdicts that make the gate red stand out
        table = table.replace(f"<td>{html.escape(word)}</td>", f'<td class="status-red">{html.escape(word)}</td>')
    return f'<div class="table">{table}</div>'  # a wide table scrolls, not the page


def html_folded(frame: pd.DataFrame, by: list[str]) -> str:
    """One closed <details> per group of ``by``; its summary names the group and counts its rows."""
    blocks = []
    for key, group in frame.groupby(by, sort=False):
        label = " · ".join(
            f"{name}={value}" if name == "tp" else str(value) for name, value in zip(by, key, strict=True)
        )
        red = ' class="status-red"' if key[0] != EXPECTED_RED else ""
        rows = f"{len(group)} verdict" + ("s" if len(group) != 1 else "")
        blocks.append(
            f"<details><summary><span{red}>{html.escape(label)}</span>: {rows}</summary>"
            f"{html_table(group.drop(columns=by))}</details>"
        )
    return "\n".join(blocks)


def render_html(title: str, sections: Sequence[Section], images: dict[str, bytes]) -> str:
    body = [f"<h1>{html.escape(title)}</h1>"]
    for section in sections:
        body += [f"<h2>{html.escape(section.title)}</h2>", *map(html_paragraph, section.paragraphs)]
        if section.table is not None:
            table = section.table
            body.append(html_folded(table, section.fold_by) if section.fold_by else html_table(table))
        if section.image:
            data = base64.b64encode(images[section.image]).decode("ascii")
            body.append(f'<img alt="{html.escape(section.title)}" src="data:image/png;base64,{data}">')
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def write_report(root: Path, out: Path, result: GateResult) -> list[Path]:
    """The report of ``result`` (gate over ``root``) into ``out``; returns the files written."""
    tokens = analysis.tokens_frame([(run.directory, run.tokens) for run in result.runs])
    runs = [(run.directory, run.checks) for run in result.runs]
    checks = analysis.checks_frame(runs, [(root, result.sweep_checks, result.sweep_run_dirs)])
    accuracy_rows = checks[
        (checks["judgment"] == Judgment.FORWARD_ACCURACY)
        & (checks["tensor"] == "logp")
        & (checks["metric"] == "max_abs_diff")
        & (checks["lhs_cell"] == CANONICAL_CELL)
    ]
    atol = accuracy_rows.groupby("profile", observed=True)["threshold"].max().to_dict()
    images = {}
    if len(tokens):  # without tokens (provenance stopped every kernel) there is nothing to plot, only verdicts
        heatmap = plots.heatmap(analysis.dlogp_vs_canonical(tokens), analysis.cell_outcomes(checks))
        images[HEATMAP_PNG] = plots.png_bytes(heatmap)
        images[HISTOGRAM_PNG] = plots.png_bytes(plots.histograms(analysis.dlogp_vs_reference(tokens), atol))
    frames = [run.divergence.assign(chunk_size=int(run.config["layout"]["chunk_size"])) for run in result.runs
              if run.divergence is not None and len(run.divergence)]  # fmt: skip
    divergence = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=DIVERGENCE_SHOWN)
    if len(divergence):  # the cells whose bits moved (a bitwise body's table has every cell's modules, most at 0)
        moved = divergence.groupby(list(plots.DIVERGENCE_RUN), observed=True)["tokens_differing"].transform("sum")
        divergence = divergence[moved > 0]
    if len(divergence):
        images[DIVERGENCE_PNG] = plots.png_bytes(plots.divergence(divergence))
    sections = build_sections(root, result, checks)
    red_section = sections.pop()  # the red verdicts stay last
    sections += [*whole_model_sections(checks, divergence), red_section]
    for section in sections:
        if section.image is not None and section.image not in images:
            section.paragraphs.append("No plot: no run computed a token (provenance stopped every kernel).")
            section.image = None
    title = f"rlsweep report: {root}"
    out.mkdir(parents=True, exist_ok=True)
    text = {REPORT_MARKDOWN: render_markdown(title, sections), REPORT_HTML: render_html(title, sections, images)}
    write_tables(out, {}, files={**images, **text})
    return [out / name for name in [*images, *text]]


def report_dir(out: str | None, directory: Path) -> Path:
    """Where the report goes: DIRECTORY (which must be writable), or ``--out`` unless it is empty, not a writable
    directory, inside a tables folder of any run or sweep (its files there would be read as rows of the table and
    fail the gate), or a run's or sweep's dir other than DIRECTORY's own, or inside one (its files would read as
    that run's or sweep's report, and a rerun there would remove them)."""
    if out is None:
        reason = unwritable_reason(directory)
        if reason:
            raise OutputDirError(f"DIR cannot hold the report: {reason}; write it elsewhere with --out OTHER_DIR")
        return directory
    if not out.strip():
        raise OutputDirError(f"--out {out!r} is empty: name the directory to write the report into (default: DIR)")
    reason = unwritable_reason(Path(out))
    if reason:
        raise OutputDirError(f"--out {out!r} cannot hold the report: {reason}")
    owner = holder(Path(out))
    if owner is None:
        return Path(out)
    folder = table_folder(Path(out), owner)
    if folder is not None:
        raise OutputDirError(
            f"--out {out!r} is inside {str(folder)!r}, a tables folder of {str(owner)!r}: a dataset reader would "
            "take the report's files for table rows and the gate would find the run or sweep incomplete; choose a "
            f"directory outside its {', '.join(f'{table}/' for table in RUN_TABLES)} and {PARTITION_KEY}=<n> folders"
        )
    own = directory.resolve()
    if owner != own and not own.is_relative_to(owner):
        kind = "sweep" if sweep_marks(owner) else "run"
        raise OutputDirError(
            f"--out {out!r} {'is' if owner == Path(out).resolve() else 'lies inside'} the {kind} dir {str(owner)!r}, "
            f"which DIR {str(directory)!r} is not part of: the report's files would read as that {kind}'s; choose a "
            "directory outside every other run and sweep (default: DIR)"
        )
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    def command() -> ExitCode:
        parser = one_line_usage(argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0]))
        add_directory_argument(parser)
        parser.add_argument("--out", default=None, help="where to write the report (default: DIRECTORY)")
        args = parser.parse_args(argv)
        out = report_dir(args.out, args.directory)
        result = run_gate(args.directory)
        if not result.runs:
            raise TablesNotFoundError(f"no complete run under {str(args.directory)!r}: {'; '.join(result.incomplete)}")
        with locked(out):
            written = write_report(args.directory, out, result)
        print(console_summary(result))
        print("report: " + ", ".join(str(path) for path in written))
        if len(result.unexpected):
            print(f"all {len(result.unexpected)} verdicts not as expected: 'Red verdicts' in {out / REPORT_MARKDOWN}")
        return result.exit_code

    return run_command(PROG, command)


if __name__ == "__main__":
    exit_without_teardown(main())
