"""``python -m rlsweep.report DIR``: a Markdown and a self-contained HTML report with plots (docs/analysis.md).

Runs the sweep gate over the tables under DIR (nothing is written into DIR unless it is the output) and
writes, into DIR or ``--out``: ``report.md``, ``report.html`` (plots embedded as base64 data URIs) and the
PNG plots. The exit code is the gate's (``rlsweep.exitcodes.ExitCode``, docs/sweeps.md); a report that
cannot be made is ERROR.
"""

from __future__ import annotations

import argparse
import base64
import html
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from rlsweep import analysis, plots
from rlsweep.check import console_summary
from rlsweep.errors import TablesNotFoundError
from rlsweep.exitcodes import ExitCode, guarded
from rlsweep.gate import GateResult, run_gate
from rlsweep.layouts import CANONICAL_CELL
from rlsweep.locks import locked
from rlsweep.tables import write_tables

PROG = "python -m rlsweep.report"
REPORT_MARKDOWN = "report.md"
REPORT_HTML = "report.html"
HEATMAP_PNG = "dlogp_heatmap.png"
HISTOGRAM_PNG = "dlogp_histogram.png"
PLOTS = (HEATMAP_PNG, HISTOGRAM_PNG)
RED, RED_EXPECTED_RED, EXPECTED_RED = "RED", "RED (declared red, passed)", "expected red"
FIRST_DIVERGENCE = "first (sample, pos)"
RED_COLUMNS = ["status", "profile", "tp", "judgment", "tensor", "lhs_cell", "rhs_cell", "metric", "value", "threshold"]
RED_COLUMNS += [FIRST_DIVERGENCE, "run_dir"]
RED_WORDS = tuple(code.word for code in ExitCode if code != ExitCode.GREEN)


@dataclass
class Section:
    """One part of the report: paragraphs, then an optional table and an optional plot (a PNG file name)."""

    title: str
    paragraphs: list[str] = field(default_factory=list)
    table: pd.DataFrame | None = None
    image: str | None = None


def red_verdicts(checks: pd.DataFrame) -> pd.DataFrame:
    """Verdicts not as expected (RED first), then failed verdicts that were declared expected red."""
    unexpected = checks["passed"] != checks["expected_pass"]
    expected_red = ~checks["passed"] & ~checks["expected_pass"]
    chosen = checks[unexpected | expected_red]
    status = pd.Series(EXPECTED_RED, index=chosen.index)
    status[chosen["passed"] != chosen["expected_pass"]] = RED
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


def build_sections(root: Path, result: GateResult, tokens: pd.DataFrame, checks: pd.DataFrame) -> list[Section]:
    counts = analysis.summary(checks, by=[analysis.RUN_DIR])
    runs = tokens[[analysis.RUN_DIR, "profile", "model", "workload", "tp", "tp_mode"]].drop_duplicates()
    runs = runs.astype({analysis.RUN_DIR: str}).merge(counts.astype({analysis.RUN_DIR: str}), on=analysis.RUN_DIR)
    runs[analysis.RUN_DIR] = relative(runs[analysis.RUN_DIR], root)
    red = red_verdicts(checks)
    red["run_dir"] = relative(red["run_dir"], root)
    red[["value", "threshold"]] = red[["value", "threshold"]].map("{:.4g}".format)
    unexpected = int((red["status"] != EXPECTED_RED).sum())
    status = (
        f"Gate: **{result.exit_code.word}** (exit code {int(result.exit_code)}). {len(result.runs)} runs, "
        f"{len(result.incomplete)} missing or incomplete, {len(checks)} verdicts "
        f"({int((checks['level'] == analysis.SWEEP_LEVEL).sum())} across runs), {unexpected} not as expected, "
        f"{int((red['status'] == EXPECTED_RED).sum())} failed as declared (expected red)."
    )
    return [
        Section("Gate", [status, *[f"INCOMPLETE {line}" for line in result.incomplete], *result.notes]),
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
                "active tokens (logp). A green 0 means every active token is bitwise equal."
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
            "Red verdicts",
            [
                f"{RED!r}: failed though expected to pass; {RED_EXPECTED_RED!r}: a declared-red verdict that passed "
                f"(the control lost its power); {EXPECTED_RED!r}: failed as declared. {FIRST_DIVERGENCE!r}: the first "
                "diverging logical token (sample_id, position)."
            ]
            if len(red)
            else ["No failed verdict."],
            red if len(red) else None,
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
"""


def html_paragraph(text: str) -> str:
    escaped = html.escape(text)
    parts = escaped.split("**")  # the only Markdown the report's paragraphs use is **bold**
    bold = [f'<b class="status-red">{p}</b>' if p in RED_WORDS else f"<b>{p}</b>" for p in parts[1::2]]
    parts[1::2] = bold
    return "<p>" + "".join(parts) + "</p>"


def render_html(title: str, sections: Sequence[Section], images: dict[str, bytes]) -> str:
    body = [f"<h1>{html.escape(title)}</h1>"]
    for section in sections:
        body += [f"<h2>{html.escape(section.title)}</h2>", *map(html_paragraph, section.paragraphs)]
        if section.table is not None:
            table = section.table.to_html(index=False, escape=True, na_rep="", border=0)
            for word in (RED, RED_EXPECTED_RED):  # the verdicts that make the gate red stand out
                table = table.replace(
                    f"<td>{html.escape(word)}</td>", f'<td class="status-red">{html.escape(word)}</td>'
                )
            body.append(f'<div class="table">{table}</div>')  # a wide table scrolls, not the page
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
    checks = analysis.checks_frame([(run.directory, run.checks) for run in result.runs], [(root, result.sweep_checks)])
    accuracy_rows = checks[
        (checks["judgment"] == "forward_accuracy")
        & (checks["tensor"] == "logp")
        & (checks["metric"] == "max_abs_diff")
        & (checks["lhs_cell"] == CANONICAL_CELL)
    ]
    atol = accuracy_rows.groupby("profile", observed=True)["threshold"].max().to_dict()
    images = {}
    if len(tokens):  # without tokens (provenance stopped every kernel) there is nothing to plot, only verdicts
        images[HEATMAP_PNG] = plots.png_bytes(plots.heatmap(analysis.dlogp_vs_canonical(tokens)))
        images[HISTOGRAM_PNG] = plots.png_bytes(plots.histograms(analysis.dlogp_vs_reference(tokens), atol))
    sections = build_sections(root, result, tokens, checks)
    for section in sections:
        if section.image is not None and section.image not in images:
            section.paragraphs.append("No plot: no run computed a token (provenance stopped every kernel).")
            section.image = None
    title = f"rlsweep report: {root}"
    out.mkdir(parents=True, exist_ok=True)
    text = {REPORT_MARKDOWN: render_markdown(title, sections), REPORT_HTML: render_html(title, sections, images)}
    write_tables(out, {}, files={**images, **text})
    return [out / name for name in [*images, *text]]


def main(argv: list[str] | None = None) -> int:
    def command() -> ExitCode:
        parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
        parser.add_argument("directory", type=Path, help="a run dir, a sweep dir or a whole outputs/ tree")
        parser.add_argument("--out", type=Path, default=None, help="where to write the report (default: DIRECTORY)")
        args = parser.parse_args(argv)
        result = run_gate(args.directory)
        if not result.runs:
            raise TablesNotFoundError(f"no complete run under {str(args.directory)!r}: {'; '.join(result.incomplete)}")
        out = args.out or args.directory
        with locked(out):
            written = write_report(args.directory, out, result)
        print(console_summary(result))
        print("report: " + ", ".join(str(path) for path in written))
        return result.exit_code

    return int(guarded(PROG, command))


if __name__ == "__main__":
    sys.exit(main())
