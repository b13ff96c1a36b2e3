"""python -m rlsweep.report on a real sweep: the files, the embedded plots, the environment, the chain metrics,
the red table (every row, folded in the HTML), the plots' labels and the exit codes."""

from __future__ import annotations

import base64
import importlib.metadata
import itertools
import platform
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from rlsweep_fixtures import copy_outputs, heatmap_verdict, multirun, run_rlsweep, seen_verdict, table_file

from rlsweep import analysis, environment, plots
from rlsweep.exitcodes import ExitCode
from rlsweep.gate import run_gate
from rlsweep.report import (
    ENVIRONMENT_FIELDS,
    PLOTS,
    RED,
    RED_GROUPS,
    REPORT_HTML,
    REPORT_MARKDOWN,
    chain_table,
    describe_device,
    main,
    recorded_environment,
    red_verdicts,
)
from rlsweep.tables import CHECKS_TABLE
from rlsweep.verdicts import REPORTED_ONLY, Judgment, Outcome

# One worker builds the shared small_sweep (conftest) once and runs every test that reads it.
pytestmark = pytest.mark.xdist_group("small_sweep")

DATA_URI = re.compile(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
DETAILS = re.compile(r"<details><summary>(.*?)</summary>(.*?)</details>", re.S)


def test_report_files_exist_and_the_html_embeds_every_plot(report_dir):
    for name in [REPORT_MARKDOWN, REPORT_HTML, *PLOTS]:
        assert (report_dir / name).stat().st_size > 0, name
    embedded = DATA_URI.findall((report_dir / REPORT_HTML).read_text())
    assert len(embedded) == len(PLOTS)
    assert sorted(base64.b64decode(data) for data in embedded) == sorted((report_dir / p).read_bytes() for p in PLOTS)
    assert not re.search(r'src="(?!data:)', (report_dir / REPORT_HTML).read_text())  # nothing external
    markdown = (report_dir / REPORT_MARKDOWN).read_text()
    assert all(f"]({plot})" in markdown for plot in PLOTS)


def test_the_red_table_lists_every_unexpected_verdict_with_its_first_divergence(small_sweep, report_dir):
    checks = analysis.load_checks(small_sweep)
    red = checks[checks["passed"] != checks["expected_pass"]]
    assert len(red)
    markdown = (report_dir / REPORT_MARKDOWN).read_text()
    rows = [line for line in markdown.splitlines() if line.startswith(f"| {RED} |")]
    assert len(rows) == len(red)
    for row in red.itertuples():
        cells = f"| {row.judgment} | {row.tensor} | {row.lhs_cell} | {row.rhs_cell} |"
        first = f"| ({row.first_sample_id}, {row.first_position}) |"
        assert any(cells in line and first in line and f"| {row.tp} |" in line for line in rows), row


def test_a_green_run_dir_exits_0_and_writes_only_to_out(tmp_path, capsys):
    green = tmp_path / "run"  # a run of its own: a sweep's job dir alone is only part of its sweep (INCOMPLETE)
    assert run_rlsweep(green, "layout=smoke").returncode == ExitCode.GREEN
    before = sorted(p.name for p in green.iterdir())
    assert main([str(green), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / REPORT_HTML).is_file()
    assert sorted(p.name for p in green.iterdir()) == before
    assert "Gate: **GREEN** (exit code 0)" in (tmp_path / "out" / REPORT_MARKDOWN).read_text()


def test_a_job_dir_is_reported_as_part_of_its_sweep_never_as_its_verdict(small_sweep, tmp_path):
    job = analysis.run_dirs(small_sweep)[0]
    assert main([str(job), "--out", str(tmp_path)]) == ExitCode.INCOMPLETE
    assert f"of the sweep {small_sweep} only: 1 runs" in (tmp_path / REPORT_MARKDOWN).read_text()


def test_a_crashed_job_is_incomplete_and_still_reported(small_sweep, tmp_path):
    copy = tmp_path / "sweep"
    copy_outputs(small_sweep, copy)
    missing = table_file(analysis.run_dirs(copy)[-1], CHECKS_TABLE)
    missing.unlink()
    assert main([str(copy)]) == ExitCode.INCOMPLETE
    report = (copy / REPORT_MARKDOWN).read_text()
    assert "Gate: **INCOMPLETE** (exit code 3)" in report and str(missing) in report


@pytest.mark.parametrize("make", [lambda p: p / "absent", lambda p: p])
def test_a_directory_without_tables_is_a_usage_error(tmp_path, capsys, make):
    directory = make(tmp_path)
    assert main([str(directory)]) == 1
    assert str(directory) in capsys.readouterr().err
    assert not (tmp_path / REPORT_HTML).exists()


@pytest.mark.parametrize("job", [False, True])  # a job dir's tables are in its sweep's datasets
@pytest.mark.parametrize("inside", ["tokens", "checks/job=1", "tokens/job=0/deeper"])
def test_an_out_inside_a_tables_folder_is_refused(small_sweep, capsys, inside, job):
    out = small_sweep / inside
    directory = analysis.run_dirs(small_sweep)[0] if job else small_sweep
    before = sorted(str(p.relative_to(small_sweep)) for p in small_sweep.rglob("*"))
    assert main([str(directory), "--out", str(out)]) == ExitCode.ERROR
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(out) in err and "tables folder" in err, err
    assert sorted(str(p.relative_to(small_sweep)) for p in small_sweep.rglob("*")) == before


@pytest.mark.parametrize("inside", ["tokens", "checks/job=0", "tokens/job=1/deeper", ".", "0", "1/deeper"])
def test_an_out_in_another_sweeps_dir_or_tables_is_refused(small_sweep, tmp_path, capsys, inside):
    """--out into another sweep's tokens/ made that sweep unreadable to every reader (and INCOMPLETE to its check);
    into its dir or a job's, the report read as that sweep's or run's."""
    other = tmp_path / "other"
    copy_outputs(small_sweep, other)
    out = other / inside
    before = sorted(str(p.relative_to(other)) for p in other.rglob("*"))
    assert main([str(small_sweep), "--out", str(out)]) == ExitCode.ERROR
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"--out {str(out)!r}" in err, err
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*")) == before
    if inside == ".":  # a job dir's report into its own sweep's dir, outside its tables folders: allowed
        assert main([str(other / "0"), "--out", str(other / "report")]) == ExitCode.INCOMPLETE


def test_an_empty_out_or_an_out_that_is_a_file_is_refused(small_sweep, tmp_path, capsys):
    assert main([str(small_sweep), "--out", ""]) == ExitCode.ERROR
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--out ''" in err and "empty" in err, err
    file = tmp_path / "report.txt"
    file.write_text("not a directory")
    assert main([str(small_sweep), "--out", str(file)]) == ExitCode.ERROR
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{str(file)!r} is a file" in err and "Errno" not in err, err


def markdown_section(markdown: str, title: str) -> str:
    return markdown.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_environment_table_names_what_every_run_recorded(small_sweep, report_dir):
    result = run_gate(small_sweep)
    section = markdown_section((report_dir / REPORT_MARKDOWN).read_text(), "Environment")
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in section.splitlines() if line.startswith("| ")}
    assert list(rows) == ["", "runs", *ENVIRONMENT_FIELDS]
    assert rows[""] == "|  | environment 1 |"  # one machine, one checkout, one contract
    run, recorded = result.runs[0].run, recorded_environment(result.runs[0])
    expected = {
        "runs": ", ".join(str(run.directory.relative_to(small_sweep)) for run in result.runs),
        "device": f"{run['device']}: {recorded['device']['name']}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": importlib.metadata.version("triton"),
        "git commit": recorded["git_commit"],
        "sources sha256": recorded["code"]["sources_sha256"],
        "contract": run["contract_version"],
        "contract sha256": run["contract_sha256"],
    }
    assert expected.keys() == {"runs", *ENVIRONMENT_FIELDS}
    for field, value in expected.items():
        assert value and value in rows[field], (field, value, rows[field])


def test_the_device_names_what_ran_and_a_missing_gpu_as_missing(monkeypatch):
    cpu = {"device": environment.device_info("cpu")}
    capability = torch.backends.cpu.get_cpu_capability()
    want = f"cpu: {environment.cpu_name()}; capability {capability}; {torch.get_num_threads()} threads"
    assert describe_device("cpu", cpu) == want
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cuda = describe_device("cuda", {"device": environment.device_info("cuda")})
    assert cuda == f"cuda: none: torch.cuda.is_available() is False on {environment.cpu_name()}"
    assert describe_device("cuda", {}) == "cuda: name not recorded"


def test_the_chain_section_has_every_chain_verdict_per_run_and_metric(small_sweep, report_dir):
    checks = analysis.load_checks(small_sweep)
    chain = checks[checks["judgment"] == Judgment.CHAIN_AGGREGATES]
    table = chain_table(checks, small_sweep).set_index("metric")
    assert list(table.index) == list(dict.fromkeys(chain["metric"].astype(str)))
    assert len(table.columns) == chain["run_dir"].nunique()
    for row in chain.itertuples():
        column = f"{row.profile} tp={row.tp} ({Path(row.run_dir).relative_to(small_sweep)})"
        assert table.loc[row.metric, column] == f"{row.value:.4g} / {row.threshold:.4g}", row
    markdown = (report_dir / REPORT_MARKDOWN).read_text()
    section = markdown_section(markdown, "Chain aggregates: what the mismatch does to an RL update")
    assert all(f"| {metric} |" in section for metric in table.index)


def test_a_chain_metric_without_threshold_is_reported_not_judged_unless_it_failed(small_sweep):
    checks = analysis.load_checks(small_sweep)
    chain = checks[checks["judgment"] == Judgment.CHAIN_AGGREGATES]
    unjudged, failing, not_run = chain["metric"].iloc[0], chain.index[-1], chain.index[-2]
    unjudged_rows = chain.index[chain["metric"] == unjudged]
    checks.loc[unjudged_rows, "threshold"] = float("nan")
    checks.loc[unjudged_rows, "detail"] = f"{REPORTED_ONLY}: contract v1 has no row for it"
    checks.loc[failing, "passed"] = False  # expected to pass: RED
    checks.loc[not_run, ["value", "threshold", "passed"]] = [float("nan"), float("nan"), False]  # as provenance stops
    table = chain_table(checks, small_sweep).set_index("metric")
    assert all(entry.endswith(f"({REPORTED_ONLY})") for entry in table.loc[unjudged])
    assert sorted(entry for entry in table.to_numpy().ravel() if entry.endswith(f" {RED}")) == sorted(
        [f"{checks.loc[failing, 'value']:.4g} / {checks.loc[failing, 'threshold']:.4g} {RED}", f"nan {RED}"]
    )


def test_the_html_folds_every_red_verdict_and_leaves_none_out(small_sweep, report_dir):
    red = red_verdicts(analysis.load_checks(small_sweep))
    folded = DETAILS.findall((report_dir / REPORT_HTML).read_text())
    groups = red.groupby(RED_GROUPS, sort=False).size()
    assert len(folded) == len(groups) > 0
    for (summary, table), count in zip(folded, groups, strict=True):
        assert summary.endswith(f": {count} verdict" + ("s" if count != 1 else ""))
        assert table.count("<tr") == count + 1  # the header, then one row per verdict
    markdown = (report_dir / REPORT_MARKDOWN).read_text()
    assert f"All {len(red)} failed or not-as-expected verdicts, none left out." in markdown


def test_every_plot_labels_its_axes_and_explains_its_marks(small_sweep):
    tokens = analysis.load_tokens(small_sweep)
    outcomes = analysis.cell_outcomes(analysis.load_checks(small_sweep))
    heatmap = plots.heatmap(analysis.dlogp_vs_canonical(tokens), outcomes)
    grid, colorbar = heatmap.axes
    assert grid.get_xlabel() and grid.get_ylabel() and colorbar.get_ylabel()
    assert [text.get_text() for legend in heatmap.legends for text in legend.get_texts()]
    atol = {profile: 0.125 for profile in tokens["profile"].unique()}
    histograms = plots.histograms(analysis.dlogp_vs_reference(tokens), atol)
    assert histograms.axes[-1].get_xlabel()
    for ax in histograms.axes:
        assert ax.get_ylabel() and ax.get_title()
        labels = [text.get_text() for text in ax.get_legend().get_texts()]
        assert len(labels) == 2 and "0.125" in labels[1], labels
    plots.png_bytes(heatmap), plots.png_bytes(histograms)  # closes both figures


def test_the_heatmap_colours_each_cell_by_its_verdict_and_shades_it_by_its_magnitude(small_sweep):
    # The hue was the magnitude: an all-GREEN sweep's tp=2 column of a profile that claims no bitwise tp invariance
    # was dark red. Here the control's tp=1 reds are taken as declared, so every outcome is drawn.
    checks = analysis.load_checks(small_sweep)
    declared = (checks["profile"] == "negative_control_cpu") & (checks["tp"] == 1) & ~checks["passed"]
    checks.loc[declared, "expected_pass"] = False
    grid = analysis.dlogp_vs_canonical(analysis.load_tokens(small_sweep))
    drawn = plots.heatmap_cells(grid, analysis.cell_outcomes(checks))
    figure = plots.heatmap(grid, analysis.cell_outcomes(checks))
    colors = figure.axes[0].images[0].get_array()
    seen = {}
    for (i, cell), (j, column) in itertools.product(enumerate(drawn.cells), drawn.columns.iterrows()):
        expected = heatmap_verdict(checks, column, cell)
        assert seen_verdict(colors[i, j]) == expected, (column.to_dict(), cell)
        seen.setdefault(expected, []).append(drawn.shades[i, j])
    assert set(seen) == {*Outcome, None}
    # cpu_bf16's tp=2 cells differ from tp=1 (the bound allows it) and pass: a shade of green, not the lightest.
    passed = drawn.verdicts[:, (drawn.columns["profile"] == "cpu_bf16") & (drawn.columns["tp"] == 2)]
    assert (passed == Outcome.PASSED).all() and min(seen[Outcome.PASSED]) == 0 < max(seen[Outcome.PASSED])
    plots.png_bytes(figure)  # closes it


def test_a_seed_sweep_is_reported_with_each_seed_against_its_own_baseline(tmp_path):
    # Runs that differ only by seed hold different tokens: the gate and the report group them apart alike.
    done = multirun(tmp_path, "profile=cpu_bf16", "layout=smoke", "seed=0,1", "tp=1")
    assert done.returncode == 0, done.stdout + done.stderr
    runs = analysis.baseline_runs(analysis.load_tokens(tmp_path))
    assert len(runs) == 2 and (runs["baseline"] == runs[analysis.RUN_DIR]).all()
    assert main([str(tmp_path)]) == ExitCode.GREEN


def test_the_divergence_plot_draws_each_chunk_size_of_a_cell_as_a_line_of_its_own():
    """A sweep over layout.chunk_size has a moved chunked cell in each of its runs: one line each, not their rows
    merged into one line that zigzags between two runs' modules."""
    modules = ["model.embed_tokens", "model.layers.0.self_attn", "model.norm"]
    table = pd.DataFrame([
        {"profile": "p", "tp": 1, "chunk_size": chunk, "cell": "B1/chunked", "module": module, "order": order,
         "tokens_differing": moved * chunk, "first_diverging": order == 1}
        for chunk in (3, 7) for order, (module, moved) in enumerate(zip(modules, (0, 5, 7), strict=True))
    ])  # fmt: skip
    figure = plots.divergence(table)
    lines = [line for line in figure.axes[0].get_lines() if line.get_linestyle() != "None"]
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert labels == ["B1/chunked (chunk 3)", "B1/chunked (chunk 7)"]
    assert [list(line.get_ydata()) for line in lines] == [[0, 15, 21], [0, 35, 49]]
    plots.png_bytes(figure)  # closes it
