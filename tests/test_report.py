"""python -m rlsweep.report on a real sweep: the files, the embedded plots, the red table and the exit codes."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys

import pytest

from rlsweep import analysis
from rlsweep.exitcodes import ExitCode
from rlsweep.gate import run_gate
from rlsweep.report import PLOTS, RED, REPORT_HTML, REPORT_MARKDOWN, main
from rlsweep.tables import CHECKS_TABLE

DATA_URI = re.compile(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


@pytest.fixture(scope="module")
def report_dir(small_sweep, tmp_path_factory):
    """The report of the shared sweep, written elsewhere so the sweep dir stays as the multirun left it."""
    out = tmp_path_factory.mktemp("report")
    done = subprocess.run(
        [sys.executable, "-m", "rlsweep.report", str(small_sweep), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == run_gate(small_sweep).exit_code == 2, done.stdout + done.stderr
    assert "-> RED" in done.stdout
    return out


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


def test_a_green_run_dir_exits_0_and_writes_only_to_out(small_sweep, tmp_path, capsys):
    green = next(d for d in analysis.run_dirs(small_sweep) if run_gate(d).exit_code == 0)
    before = sorted(p.name for p in green.iterdir())
    assert main([str(green), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / REPORT_HTML).is_file()
    assert sorted(p.name for p in green.iterdir()) == before
    assert "Gate: **GREEN** (exit code 0)" in (tmp_path / "out" / REPORT_MARKDOWN).read_text()


def test_a_crashed_job_is_incomplete_and_still_reported(small_sweep, tmp_path):
    copy = tmp_path / "sweep"
    shutil.copytree(small_sweep, copy, ignore=shutil.ignore_patterns(".rlsweep.lock"))
    (analysis.run_dirs(copy)[-1] / CHECKS_TABLE).unlink()
    assert main([str(copy)]) == ExitCode.INCOMPLETE
    report = (copy / REPORT_MARKDOWN).read_text()
    assert "Gate: **INCOMPLETE** (exit code 3)" in report and "checks.parquet is missing" in report


@pytest.mark.parametrize("make", [lambda p: p / "absent", lambda p: p])
def test_a_directory_without_tables_is_a_usage_error(tmp_path, capsys, make):
    directory = make(tmp_path)
    assert main([str(directory)]) == 1
    assert str(directory) in capsys.readouterr().err
    assert not (tmp_path / REPORT_HTML).exists()
