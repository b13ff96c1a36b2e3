"""The gate trusts a run's checks table only where it holds exactly the verdicts the run's config implies.

Each case rewrites a run's checks table together with its manifest's sha256 (so every file hash still matches) the
way a hand edit, a bad merge or a tool would, or removes the config saved beside the run: never GREEN, INCOMPLETE.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rlsweep_fixtures import (
    CONTROL_DECLARED,
    copy_outputs,
    multirun,
    run_rlsweep,
    suite_overrides,
    table_file,
    tables_left,
    with_fault,
)

from rlsweep.exitcodes import ExitCode
from rlsweep.gate import run_gate
from rlsweep.manifest import HYDRA_CONFIG, MANIFEST_FILE, file_sha256
from rlsweep.tables import CHECKS_TABLE

pytestmark = pytest.mark.xdist_group("planned_verdicts")


@pytest.fixture(scope="module")
def red_as_declared(tmp_path_factory) -> Path:
    """A GREEN sweep whose control's reds are declared: passing, failing-as-declared and declaration rows."""
    sweep_dir = tmp_path_factory.mktemp("declared")
    done = multirun(sweep_dir, "profile=cpu_bf16,negative_control_cpu", "layout=smoke", CONTROL_DECLARED)
    assert done.returncode == ExitCode.GREEN, done.stdout + done.stderr
    return sweep_dir


@pytest.fixture
def sweep(red_as_declared, tmp_path) -> Path:
    copy = tmp_path / "sweep"
    copy_outputs(red_as_declared, copy)
    return copy


def rewrite_checks(run_dir: Path, edit: Callable[[pd.DataFrame], pd.DataFrame]) -> None:
    """Rewrite a run's checks table through ``edit``, keeping its schema and metadata, and its manifest's sha256."""
    path = table_file(run_dir, CHECKS_TABLE)
    table = pq.read_table(path)
    edited = pa.Table.from_pandas(edit(table.to_pandas()), schema=table.schema, preserve_index=False)
    pq.write_table(edited, path)
    manifest = json.loads((run_dir / MANIFEST_FILE).read_text())
    manifest["tables"][CHECKS_TABLE]["sha256"] = file_sha256(path, "table")
    (run_dir / MANIFEST_FILE).write_text(json.dumps(manifest))


EDITS = {
    "the failing rows dropped": lambda c: c[c.passed],
    "a row dropped": lambda c: c.drop(c.index[5]),
    "a row repeated": lambda c: pd.concat([c, c.iloc[[3]]], ignore_index=True),
    "a row of a cell the layout lacks": lambda c: pd.concat(
        [c, c.iloc[[3]].assign(lhs_cell="BN/pad_left")], ignore_index=True
    ),
    "the declared reds declared no more": lambda c: c.assign(expected_pass=True, passed=True),
    "a passing row declared red": lambda c: c.assign(expected_pass=c.expected_pass & (c.index != 2)),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_checks_table_rewritten_with_its_hash_is_incomplete_not_green(sweep, edit):
    runs = sorted(d for d in sweep.iterdir() if (d / MANIFEST_FILE).is_file())
    for run_dir in runs:
        rewrite_checks(run_dir, EDITS[edit])
    result = run_gate(sweep)
    assert result.exit_code == ExitCode.INCOMPLETE, result.incomplete
    assert any("is not the verdicts its config implies" in line for line in result.incomplete), result.incomplete


def test_the_untouched_sweep_and_a_table_rewritten_unchanged_are_green(sweep):
    for run_dir in sorted(d for d in sweep.iterdir() if (d / MANIFEST_FILE).is_file()):
        rewrite_checks(run_dir, lambda checks: checks)
    result = run_gate(sweep)
    assert result.exit_code == ExitCode.GREEN, result.incomplete


@pytest.fixture(scope="module")
def red_by_a_declaration(tmp_path_factory) -> Path:
    """A RED single run whose only red row is a declaration that matched nothing (a cell it has not)."""
    run_dir = tmp_path_factory.mktemp("unmatched")
    declaration = "+profile.expected_red=[{judgment: forward_invariance, cells: [BN/pad_left], reason: test}]"
    done = run_rlsweep(run_dir, "profile=negative_control_cpu", "layout=smoke", declaration)
    assert done.returncode == ExitCode.RED, done.stdout + done.stderr
    return run_dir


@pytest.fixture
def single_run(red_by_a_declaration, tmp_path) -> Path:
    copy = tmp_path / "run"
    copy_outputs(red_by_a_declaration, copy)
    return copy


def test_a_red_declaration_row_dropped_with_its_hash_is_incomplete_not_green(single_run):
    assert run_gate(single_run).exit_code == ExitCode.RED
    rewrite_checks(single_run, lambda checks: checks[checks.judgment != "expected_red"])
    result = run_gate(single_run)
    assert result.exit_code == ExitCode.INCOMPLETE
    assert any("declaration row(s) missing" in line for line in result.incomplete), result.incomplete


@pytest.mark.parametrize("removed", [HYDRA_CONFIG, HYDRA_CONFIG.parent])
def test_a_run_whose_saved_config_is_gone_is_incomplete(single_run, removed):
    target = single_run / removed
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    result = run_gate(single_run)
    assert result.exit_code == ExitCode.INCOMPLETE
    assert any("which is gone" in line for line in result.incomplete), result.incomplete


def test_a_sweep_job_whose_saved_config_is_gone_is_incomplete(sweep):
    (sweep / "0" / HYDRA_CONFIG).unlink()
    result = run_gate(sweep)
    assert result.exit_code == ExitCode.INCOMPLETE
    assert any("job #0" in line for line in result.incomplete), result.incomplete


def test_a_run_that_lost_planned_verdicts_is_an_error_before_it_writes_a_table(tmp_path):
    # A harness a few lines off: kernel_bias rows dropped between judging and writing. The run is held to its plan
    # as the gate would hold it, so it ends with exit 1 and no table, not GREEN with a table the gate calls INCOMPLETE.
    fault = (
        "import rlsweep.run as run; judge = run.judge_cells; "
        "run.judge_cells = lambda *a, **k: [v for v in judge(*a, **k) if v.judgment != 'kernel_bias']"
    )
    done = with_fault(fault, "rlsweep", f"hydra.run.dir={tmp_path}", *suite_overrides(["layout=smoke"]))
    assert done.returncode == ExitCode.ERROR, done.stdout + done.stderr
    assert "planned verdict(s) missing: kernel_bias" in done.stderr and len(done.stderr.splitlines()) == 1
    assert tables_left(tmp_path) == []
