"""Fault injection: no GREEN from a crash, a partial or stale sweep, a neutered control or a broken gate.

Each case breaks one thing (a table, a manifest, a job, the gate itself, the lock) and asserts the exit
code, the one-line message and that nothing prints GREEN. Exit codes: rlsweep.exitcodes.ExitCode.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import forkserver
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from rlsweep_fixtures import (
    CONTROL_DECLARED,
    chmodded,
    copy_outputs,
    job_line,
    multirun,
    needs_launcher,
    needs_permissions,
    run_rlsweep,
    suite_overrides,
    table_file,
    tables_left,
    with_fault,
)
from safetensors.torch import save_file

from rlsweep import analysis
from rlsweep.check import main as check_main
from rlsweep.discovery import JOBS_FILE, MULTIRUN_FILE, refuse_run_over_sweep, refuse_sweep_over_run, write_job_list
from rlsweep.errors import OutputDirError, ReplayInputError, TablesNotFoundError
from rlsweep.exitcodes import ExitCode, combine
from rlsweep.gate import (
    REPORT_FILES,
    ROW_RUN_DIR,
    SUMMARY_FILE,
    SWEEP_CHECKS_TABLE,
    backend_parity,
    declaration_check,
    parity_pairs,
    run_gate,
    tp_invariance,
    tp_pairs,
    verdict_rows,
    without_baseline,
)
from rlsweep.locks import LOCK_FILE, locked
from rlsweep.manifest import HYDRA_CONFIG, MANIFEST_FILE, file_sha256
from rlsweep.report import main as report_main
from rlsweep.spec import CANONICAL_CELL
from rlsweep.tables import (
    CHECKS_SCHEMA,
    CHECKS_TABLE,
    METADATA_KEY,
    PART_FILE,
    TOKENS_TABLE,
    RunLocation,
    TableError,
    publish_tables,
    read_table,
    write_tables,
)
from rlsweep.tensor_files import TensorFile

# One worker builds the module's green sweep once and runs every test here.
pytestmark = pytest.mark.xdist_group("fail_closed")
SMALL = ("profile=cpu_bf16", "layout=smoke", "tp=1,2")


def assert_not_green(done: subprocess.CompletedProcess, code: ExitCode) -> None:
    """The exit code, no traceback, and no GREEN as the final word (a sweep's green runs may say GREEN)."""
    output = done.stdout + done.stderr
    assert done.returncode == code, output
    assert "Traceback" not in output, output
    verdicts = [line for line in output.splitlines() if line.startswith(("sweep gate:", "rlsweep run "))]
    final = [line for line in verdicts if line.startswith("sweep gate:")] or verdicts
    assert not final or not final[-1].endswith("GREEN"), output


def check(directory: Path, capsys) -> tuple[int, str]:
    code = check_main([str(directory)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture(scope="module")
def green_sweep(tmp_path_factory) -> Path:
    """A real green two-job sweep; tests copy it before breaking anything."""
    sweep_dir = tmp_path_factory.mktemp("green_sweep")
    done = multirun(sweep_dir, *SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    return sweep_dir


@pytest.fixture
def sweep(green_sweep, tmp_path) -> Path:
    copy = tmp_path / "sweep"
    copy_outputs(green_sweep, copy)
    return copy


def test_exit_codes_have_one_meaning_and_error_wins_over_incomplete_over_red():
    assert [int(code) for code in ExitCode] == [0, 1, 2, 3]
    assert combine([ExitCode.RED, ExitCode.INCOMPLETE, ExitCode.ERROR]) == ExitCode.ERROR
    assert combine([ExitCode.RED, ExitCode.INCOMPLETE]) == ExitCode.INCOMPLETE
    assert combine([ExitCode.GREEN, ExitCode.RED]) == ExitCode.RED
    assert combine([]) == ExitCode.GREEN


def test_the_untouched_sweep_is_green(sweep, capsys):
    code, output = check(sweep, capsys)
    assert code == ExitCode.GREEN, output


def test_under_a_dir_of_several_sweeps_each_is_judged_on_its_own(green_sweep, tmp_path, capsys):
    # Two sweeps of the same config (say two commits' runs under outputs/): a tp=1 run of one is no tp baseline for
    # the other's, and the report's baselines follow the gate's.
    for name in ("a", "b"):
        shutil.copytree(green_sweep, tmp_path / name, ignore=shutil.ignore_patterns(".rlsweep.lock", "sweep_checks*"))
    code, output = check(tmp_path, capsys)
    assert code == ExitCode.GREEN, output
    rows = pd.read_parquet(tmp_path / SWEEP_CHECKS_TABLE)
    alone = pd.read_parquet(green_sweep / SWEEP_CHECKS_TABLE)
    assert set(rows["tp"]) == {2} and len(rows) == 2 * len(alone), rows[["tp", "judgment", "detail"]]
    runs = analysis.baseline_runs(analysis.load_tokens(tmp_path))
    assert [Path(d).parent.name for d in runs["run_dir"]] == [Path(d).parent.name for d in runs["baseline"]]


def test_a_link_to_runs_outside_the_dir_is_named_not_passed_over(green_sweep, sweep, tmp_path, capsys):
    # The search under a dir does not follow links: a linked sweep's runs would be left out, and the dir GREEN.
    tree = tmp_path / "tree"
    copy_outputs(green_sweep, tree / "here")
    (tree / "latest").symlink_to(tree / "here")  # judged where it lies
    (tree / "elsewhere").symlink_to(sweep)
    code, output = check(tree, capsys)
    assert code == ExitCode.INCOMPLETE, output
    assert f"{tree / 'elsewhere'}: a link to {str(sweep)!r}" in output and f"rlsweep.check {sweep} judges" in output
    (tree / "elsewhere").unlink()
    assert check(tree, capsys)[0] == ExitCode.GREEN


def warned_or_raised(load, path: Path) -> str:
    """What an analysis loader said of ``path``: its IncompleteRunsWarning, or the error it raised instead."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            load(path)
        except TablesNotFoundError as err:
            return str(err)
    return " ".join(str(w.message) for w in caught if issubclass(w.category, analysis.IncompleteRunsWarning))


@needs_permissions
@pytest.mark.parametrize("mode", [0o000, 0o300, 0o600], ids=["no access", "not listable", "not searchable"])
@pytest.mark.parametrize("where", ["b", "b/1", f"b/{TOKENS_TABLE}", f"b/{CHECKS_TABLE}/job=1"])
def test_a_dir_that_cannot_be_read_is_incomplete_naming_it_never_passed_over(
    green_sweep, tmp_path, capsys, where, mode
):
    """Path.rglob stopped at a dir it could not list without a word: its runs were left out and the tree was GREEN
    ("1 runs"), or a job read as having no run dir; the analysis API loaded the rest without a warning."""
    tree = tmp_path / "tree"
    for name in ("a", "b"):
        copy_outputs(green_sweep, tree / name)
    hidden_away = tree / where
    with chmodded(hidden_away, mode):
        code, output = check(tree, capsys)
        assert code == ExitCode.INCOMPLETE, output
        named = [line for line in output.splitlines() if line.startswith("  INCOMPLETE") and str(hidden_away) in line]
        assert named and "Permission denied" in named[0] and "Traceback" not in output, output
        for load in (analysis.load_tokens, analysis.load_checks):
            said = warned_or_raised(load, tree)
            assert str(hidden_away) in said and "Permission denied" in said, said
        if (where, mode) == ("b", 0o000):
            assert report_main([str(tree), "--out", str(tmp_path / "report")]) == ExitCode.INCOMPLETE
            report = (tmp_path / "report" / "report.md").read_text()
            assert str(hidden_away) in report and "Permission denied" in report


@needs_permissions
@pytest.mark.parametrize(
    "what",
    [JOBS_FILE, MULTIRUN_FILE, "1/.hydra/overrides.yaml", f"1/{MANIFEST_FILE}", f"{CHECKS_TABLE}/job=1/{PART_FILE}"],
)
def test_a_file_that_cannot_be_read_is_incomplete_saying_so(sweep, capsys, what):
    """An unreadable job list was an error, an unreadable job record a job with "no run dir": the path and that its
    permissions stop the reading must be named, and the sweep is never judged without it."""
    unreadable = sweep / what
    with chmodded(unreadable, 0o000):
        code, output = check(sweep, capsys)
    assert code == ExitCode.INCOMPLETE, output
    assert f"{str(unreadable)!r} cannot be read: Permission denied" in output, output


@needs_permissions
def test_an_unreadable_tensor_file_is_named_as_unreadable(tmp_path):
    """A sweep's pre-flight opens the weight and replay files with safetensors, which words every failed open as
    "No such file or directory": a file that exists but may not be read was reported as missing."""
    path = tmp_path / "head.safetensors"
    save_file({"lm_head.weight": torch.randn(31, 8)}, path)
    weights = TensorFile(str(path), "weight file", "model.weights.path")
    with chmodded(path, 0o000), pytest.raises(ReplayInputError, match="cannot be read: Permission denied"):
        weights.headers()


@needs_permissions
@pytest.mark.parametrize("broken", [False, True], ids=["complete", "a job missing"])
def test_a_read_only_sweep_is_checked_and_says_its_outputs_were_not_written(sweep, tmp_path, capsys, broken):
    """An archived sweep (chmod -R a-w) could not be checked: the lock and the gate's tables are written into it."""
    if broken:
        (sweep / "1" / MANIFEST_FILE).unlink()
    (sweep / SWEEP_CHECKS_TABLE).unlink(missing_ok=True)
    with chmodded(sweep, 0o555, recursive=True):
        code, output = check(sweep, capsys)
        assert code == (ExitCode.INCOMPLETE if broken else ExitCode.GREEN), output
        assert f"sweep gate: {1 if broken else 2} runs" in output
        notes = [line for line in output.splitlines() if "read-only" in line]
        assert len(notes) == 1 and str(sweep) in notes[0], output
        assert f"{SWEEP_CHECKS_TABLE} and {SUMMARY_FILE} were not written" in notes[0], output
        assert not (sweep / SWEEP_CHECKS_TABLE).exists()
        assert report_main([str(sweep)]) == ExitCode.ERROR  # the report's files go into DIR: refused, naming --out
        assert "--out" in capsys.readouterr().err
        code = report_main([str(sweep), "--out", str(tmp_path / "report")])
        assert code == (ExitCode.INCOMPLETE if broken else ExitCode.GREEN), capsys.readouterr()


@needs_permissions
def test_a_sweep_whose_files_are_read_only_is_checked_in_its_writable_dir(sweep, capsys):
    """Files archived read-only one by one, its lock file among them: the lock was opened for writing, and the check
    of a dir it could write into failed."""
    (sweep / LOCK_FILE).write_text("")
    with contextlib.ExitStack() as stack:
        for path in [path for path in sweep.rglob("*") if path.is_file()]:
            stack.enter_context(chmodded(path, 0o444))
        code, output = check(sweep, capsys)
    assert code == ExitCode.GREEN, output
    assert "read-only" not in output and (sweep / SUMMARY_FILE).stat().st_mode & 0o200  # written anew


@pytest.mark.parametrize("table", [TOKENS_TABLE, CHECKS_TABLE, MANIFEST_FILE])
def test_a_truncated_file_makes_the_sweep_incomplete(sweep, capsys, table):
    path = sweep / "1" / MANIFEST_FILE if table == MANIFEST_FILE else table_file(sweep / "1", table)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    code, output = check(sweep, capsys)
    assert code == ExitCode.INCOMPLETE, output
    assert "job #1" in output and "GREEN" not in output


def test_a_rewritten_table_with_valid_parquet_is_not_trusted(sweep, capsys):
    # A checks table whose verdicts were flipped to pass and whose metadata was stripped: valid Parquet,
    # but not the table the manifest names.
    path = table_file(sweep / "0", CHECKS_TABLE)
    table = pq.read_table(path).replace_schema_metadata(None)
    pq.write_table(
        table.set_column(table.schema.get_field_index("passed"), "passed", pa.array([True] * len(table))), path
    )
    code, output = check(sweep, capsys)
    assert code == ExitCode.INCOMPLETE, output
    assert "sha256 differs" in output


def weaken_chain_limits(metadata: dict) -> None:
    metadata["contract"]["chain_logprob_aggregates"]["clip_interval"] = [1e-300, 1e300]


# Metadata edited and the manifest's sha256 of the table made to match (as a hand-edit of both would): the gate takes
# declarations, inputs and thresholds from that metadata, so it must be the run's own or the run is not trusted.
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda metadata: metadata.pop("contract"), "its metadata holds no readable contract"),
        (weaken_chain_limits, "its metadata's contract (sha256 "),
        (lambda metadata: metadata["config"].update(seed=7), "its metadata's config is not the one its run's manifest"),
    ],
    ids=["no contract", "another contract", "another config"],
)
def test_table_metadata_that_is_not_the_runs_own_is_refused_naming_the_table(sweep, capsys, edit, message):
    path = table_file(sweep / "1", CHECKS_TABLE)
    table = pq.read_table(path)
    metadata = json.loads(table.schema.metadata[METADATA_KEY])
    edit(metadata)
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(metadata).encode()}), path)
    manifest_path = sweep / "1" / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["tables"][CHECKS_TABLE]["sha256"] = file_sha256(path, "table")
    manifest_path.write_text(json.dumps(manifest))
    code, output = check(sweep, capsys)
    assert code == ExitCode.ERROR and f"{str(path)!r}: {message}" in output, output


def test_a_tampered_manifest_is_incomplete(sweep, capsys):
    path = sweep / "0" / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["tables"][TOKENS_TABLE]["sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    code, output = check(sweep, capsys)
    assert code == ExitCode.INCOMPLETE, output


def test_tables_from_another_config_than_the_one_beside_them_are_incomplete(sweep, capsys):
    config = sweep / "1" / HYDRA_CONFIG
    config.write_text(config.read_text().replace("seed: 0", "seed: 1", 1))
    code, output = check(sweep, capsys)
    assert code == ExitCode.INCOMPLETE, output
    assert "not from the config beside them" in output


@pytest.mark.parametrize("missing", ["manifest", "job dir"])
def test_a_missing_job_is_named(sweep, capsys, missing):
    if missing == "manifest":
        (sweep / "1" / MANIFEST_FILE).unlink()
    else:
        shutil.rmtree(sweep / "1")
    code, output = check(sweep, capsys)
    assert code == ExitCode.INCOMPLETE, output
    assert f"job #1 ({job_line('profile=cpu_bf16', 'layout=smoke', 'tp=2')})" in output


def write_failing_copy(source: Path, target: Path) -> None:
    """A valid rlsweep table beside the run's own: its rows, every verdict flipped to failed where it has any."""
    table = pq.read_table(source)
    if "passed" in table.schema.names:
        table = table.set_column(table.schema.get_field_index("passed"), "passed", pa.array([False] * len(table)))
    target.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, target)


@pytest.mark.parametrize(
    "stray",
    [
        f"{TOKENS_TABLE}/job=0/part-1.parquet",
        f"{CHECKS_TABLE}/job=1/part-1.parquet",
        f"{CHECKS_TABLE}/job=1/_part-1.parquet",
        f"{CHECKS_TABLE}/job=7/data.parquet",
    ],
)
def test_a_table_file_that_no_manifest_names_makes_the_sweep_incomplete(sweep, capsys, stray):
    table = stray.split("/")[0]
    write_failing_copy(table_file(sweep / "0", table), sweep / stray)
    code, output = check(sweep, capsys)
    assert code == ExitCode.INCOMPLETE, output
    assert str(sweep / stray) in output and "GREEN" not in output


def test_a_table_file_beside_a_single_runs_own_is_not_judged_as_part_of_it(green_run, tmp_path, capsys):
    tmp_path = copy_outputs(green_run, tmp_path / "run")
    stray = tmp_path / CHECKS_TABLE / "part-1.parquet"
    write_failing_copy(tmp_path / CHECKS_TABLE / PART_FILE, stray)
    assert not pd.read_parquet(tmp_path / CHECKS_TABLE)["passed"].all()  # what a plain reader of the run loads
    code, output = check(tmp_path, capsys)
    assert code == ExitCode.INCOMPLETE, output
    assert "part-1.parquet" in output and "GREEN" not in output
    code, output = report_main([str(tmp_path), "--out", str(tmp_path / "report")]), capsys.readouterr().err
    assert code == ExitCode.ERROR and "part-1.parquet" in output, output  # no complete run to report on


def crash_job_1(sweep: Path) -> None:
    """Job #1 as a crash leaves it: Hydra's record of the job, no manifest, no tables."""
    (sweep / "1" / MANIFEST_FILE).unlink()
    for table in (TOKENS_TABLE, CHECKS_TABLE):
        shutil.rmtree(sweep / table / "job=1")


@pytest.mark.parametrize(
    "edit, code, message",
    [
        ("drop job #1 by hand", ExitCode.ERROR, "was changed after the sweep wrote it"),
        ("repeat job #0 by hand", ExitCode.ERROR, "was changed after the sweep wrote it"),
        ("drop job #1 through rlsweep", ExitCode.INCOMPLETE, "not a job of"),
        (
            "repeat job #0 through rlsweep",
            ExitCode.ERROR,
            f"job #1 ({job_line('profile=cpu_bf16', 'layout=smoke', 'tp=1')}) repeats job #0",
        ),
        ("another sweep in multirun.yaml", ExitCode.ERROR, "multirun.yaml"),
    ],
)
def test_a_job_list_edited_after_a_crash_is_never_green(sweep, capsys, edit, code, message):
    crash_job_1(sweep)
    path = sweep / JOBS_FILE
    record = json.loads(path.read_text())
    jobs = record["jobs"][:1] if edit.startswith("drop") else [record["jobs"][0]] * 2
    if edit.endswith("by hand"):
        path.write_text(json.dumps({**record, "jobs": jobs}))
    elif edit.endswith("through rlsweep"):
        write_job_list(sweep, record["sweep"], jobs)
    else:
        multirun_yaml = sweep / MULTIRUN_FILE
        multirun_yaml.write_text(multirun_yaml.read_text().replace("- tp=1,2", "- tp=1"))
    result, output = check(sweep, capsys)
    assert result == code, output
    assert message in output and "GREEN" not in output


@pytest.mark.parametrize("record", [MULTIRUN_FILE, JOBS_FILE, "both"])
def test_a_sweep_whose_records_are_gone_is_still_judged_as_a_sweep(sweep, capsys, record):
    # Job #1 gone with its partitions too: judged as loose runs, the one left would be GREEN on its own.
    for name in [MULTIRUN_FILE, JOBS_FILE] if record == "both" else [record]:
        (sweep / name).unlink()
    for path in (sweep / "1", sweep / TOKENS_TABLE / "job=1", sweep / CHECKS_TABLE / "job=1"):
        shutil.rmtree(path)
    result, output = check(sweep, capsys)
    assert result == ExitCode.ERROR, output
    assert "cannot be read as the sweep's job list" in output and "GREEN" not in output


def test_a_job_dir_left_by_an_earlier_sweep_makes_the_sweep_incomplete(sweep):
    # The same sweep dir, run again with fewer jobs: job #1's dir and partitions from the first sweep remain, and a
    # plain pd.read_parquet of the sweep's datasets still loads them.
    done = multirun(sweep, *SMALL[:2], "tp=1")
    assert_not_green(done, ExitCode.INCOMPLETE)
    assert f"{sweep / '1'}: not a job of {sweep / JOBS_FILE}" in done.stdout
    assert set(pd.read_parquet(sweep / CHECKS_TABLE, columns=["tp"])["tp"]) == {1, 2}


@pytest.mark.parametrize("crashed", [False, True], ids=["every job complete", "job #1 crashed"])
def test_a_job_dir_checked_alone_is_never_the_sweeps_green(sweep, capsys, crashed):
    # The job's tables live in the sweep's partitions; the sweep's other jobs and its cross-run verdicts are not under
    # the job dir, so what is judged there is not the sweep's verdict.
    if crashed:
        crash_job_1(sweep)
    code, output = check(sweep / "0", capsys)
    assert code == ExitCode.INCOMPLETE, output
    job = f"job #0 ({job_line('profile=cpu_bf16', 'layout=smoke', 'tp=1')})"
    assert output.strip().splitlines()[-1].startswith(f"sweep gate: {job} of the sweep {sweep} only: 1 runs")
    assert f"python -m rlsweep.check {sweep}" in output
    verdicts = len(pd.read_parquet(sweep / CHECKS_TABLE / "job=0"))
    assert "profile" in output and f" {verdicts} " in output  # the job's own verdicts, read from the sweep's partitions


def test_a_string_passed_column_is_refused_on_read(green_sweep, tmp_path):
    # "False" as a string is truthy: such a column must never be read as verdicts.
    table = pq.read_table(table_file(green_sweep / "0", CHECKS_TABLE))
    index = table.schema.get_field_index("passed")
    pq.write_table(table.set_column(index, "passed", pa.array(["False"] * len(table))), tmp_path / "checks.parquet")
    with pytest.raises(TableError, match=r"passed: string \(expected bool\)"):
        read_table(tmp_path / "checks.parquet", CHECKS_SCHEMA)


def test_a_table_of_the_schemas_columns_in_another_order_is_refused_naming_the_order(green_sweep, tmp_path):
    table = pq.read_table(table_file(green_sweep / "0", CHECKS_TABLE))
    pq.write_table(table.select([*table.schema.names[1:], table.schema.names[0]]), tmp_path / "checks.parquet")
    with pytest.raises(TableError, match=r"schema: column 0 is profile \(expected run_id, in the schema's order\)"):
        read_table(tmp_path / "checks.parquet", CHECKS_SCHEMA)


def test_a_gate_that_raises_ends_the_sweep_with_exit_1(tmp_path):
    fault = (
        "import rlsweep.gate\ndef boom(root): raise RuntimeError('injected gate fault')\nrlsweep.gate.run_gate = boom"
    )
    fault += "\nimport rlsweep.check\nrlsweep.check.run_gate = boom"
    done = with_fault(fault, "rlsweep", f"hydra.sweep.dir={tmp_path}", "profile=negative_control_cpu", "layout=smoke",
                      "tp=1", "--multirun")  # fmt: skip
    assert_not_green(done, ExitCode.ERROR)
    assert "rlsweep: error: RuntimeError: injected gate fault" in done.stderr


def test_a_job_that_calls_sys_exit_fails_the_sweep_instead_of_ending_it_green(tmp_path):
    # SystemExit is no Exception: it left the job and Hydra, and guarded took exit 0 for the sweep's (GREEN, ungated).
    fault = (
        "import sys, rlsweep.run\ncompute = rlsweep.run.compute\n"
        "def exiting(spec, *args, **kwargs):\n"
        "    if spec.tp == 1: sys.exit()\n"
        "    return compute(spec, *args, **kwargs)\n"
        "rlsweep.run.compute = exiting"
    )
    done = with_fault(fault, "rlsweep", f"hydra.sweep.dir={tmp_path}", *SMALL, "--multirun")
    output = done.stdout + done.stderr
    assert done.returncode == ExitCode.ERROR and "Traceback" not in output and "sweep gate:" not in output, output
    assert done.stderr.splitlines()[-1] == (
        f"rlsweep: error: job #0 ({job_line('profile=cpu_bf16', 'layout=smoke', 'tp=1')}) failed: the run ended early "
        "through sys.exit(None) in module '__main__', before its verdicts"
    )
    assert set(pd.read_parquet(tmp_path / CHECKS_TABLE, columns=["tp"])["tp"]) == {2}  # the other job ran


def test_a_sweep_terminated_by_sigterm_ends_with_one_line_and_exit_1(tmp_path):
    # A scheduler's time limit or a cancelled CI job: the signal's default ended the process silently with 143.
    fault = "import os, signal, rlsweep.run\nrlsweep.run.compute = lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM)"
    done = with_fault(fault, "rlsweep", f"hydra.sweep.dir={tmp_path}", *SMALL, "--multirun")
    assert done.returncode == ExitCode.ERROR, done.stdout + done.stderr
    assert done.stderr == "rlsweep: error: terminated (SIGTERM)\n"
    assert "job #1 starting" not in done.stdout and not (tmp_path / CHECKS_TABLE).exists()


JOBLIB = ("hydra/launcher=joblib", "hydra.launcher.n_jobs=2")  # two workers: the jobs run in other processes


@pytest.mark.parametrize(
    "launcher", [(), pytest.param(JOBLIB, marks=needs_launcher("joblib"))], ids=["basic", "joblib"]
)
def test_a_sweep_whose_start_callback_never_recorded_it_is_exit_1_not_green(tmp_path, launcher):
    # Hydra turns a callback's exception into a warning and runs the jobs; with no sweep recorded, no gate ran and
    # the sweep ended 0. Under joblib the jobs run in other processes: the launching one must know all the same.
    fault = "import rlsweep.callbacks as c\nc.RlsweepCallback.on_multirun_start = lambda *a, **k: 1 / 0"
    done = with_fault(fault, "rlsweep", f"hydra.sweep.dir={tmp_path}", *SMALL, *launcher, "--multirun")
    assert done.returncode == ExitCode.ERROR and "sweep gate:" not in done.stdout, done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == (
        "rlsweep: error: the sweep's jobs ran but its start callback did not record the sweep, so no gate judged it"
    )


def test_a_gate_that_cannot_write_its_tables_ends_with_exit_1(tmp_path):
    (tmp_path / "sweep_checks.parquet").mkdir()  # the gate's own table cannot be written
    done = multirun(tmp_path, "profile=negative_control_cpu", "layout=smoke", "tp=1,2")
    assert_not_green(done, ExitCode.ERROR)
    assert "sweep_checks.parquet" in done.stderr


def test_a_sweep_removes_the_last_gate_outputs_before_its_jobs_run(tmp_path):
    # An earlier sweep's verdict and summary, then a sweep into the same dir killed before its gate writes.
    (tmp_path / SWEEP_CHECKS_TABLE).write_bytes(b"an earlier sweep's verdicts")
    (tmp_path / SUMMARY_FILE).write_text("sweep gate: 2 runs -> GREEN\n")
    for name in REPORT_FILES:  # and its report, whose "Gate: GREEN" would outlive it
        (tmp_path / name).write_text("Gate: GREEN")
    fault = "import os, rlsweep.check\nrlsweep.check.run_gate = lambda root: os._exit(137)"
    done = with_fault(fault, "rlsweep", f"hydra.sweep.dir={tmp_path}", "profile=cpu_bf16", "layout=smoke",
                      "model=tiny", "tp=1", "--multirun")  # fmt: skip
    assert done.returncode == 137, done.stdout + done.stderr
    assert (tmp_path / "0" / MANIFEST_FILE).is_file()  # its job ran
    assert not [name for name in (SWEEP_CHECKS_TABLE, SUMMARY_FILE, *REPORT_FILES) if (tmp_path / name).exists()]


def test_a_job_killed_between_its_tables_leaves_an_incomplete_run_that_resume_redoes(tmp_path, capsys):
    # The process dies after the tokens partition is in place and before the checks one and the manifest.
    fault = (
        "import os, rlsweep.run\npublish = rlsweep.run.publish_tables\n"
        "def dying(location, tables):\n"
        "    publish(location, {k: v for k, v in tables.items() if k == 'tokens'})\n    os._exit(137)\n"
        "rlsweep.run.publish_tables = dying"
    )
    done = with_fault(fault, "rlsweep", f"hydra.sweep.dir={tmp_path}", *SMALL, "--multirun")
    assert done.returncode == 137
    assert (tmp_path / TOKENS_TABLE / "job=0" / PART_FILE).is_file() and not (tmp_path / "0" / MANIFEST_FILE).exists()
    code, output = check(tmp_path, capsys)
    assert code == ExitCode.INCOMPLETE and "GREEN" not in output
    assert "no run's manifest.json names this table" in output
    resumed = multirun(tmp_path, *SMALL)
    assert resumed.returncode == ExitCode.GREEN, resumed.stdout + resumed.stderr
    assert "is complete in" not in resumed.stdout  # nothing was complete, so nothing was skipped


def test_resume_reruns_a_job_whose_content_differs(sweep):
    manifest_path = sweep / "0" / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["content_sha256"] = "0" * 64  # as if weights, replay files or code had changed since
    manifest_path.write_text(json.dumps(manifest))
    done = multirun(sweep, *SMALL)
    assert done.returncode == ExitCode.GREEN, done.stdout + done.stderr
    assert done.stdout.count("is complete in") == 1  # job 1 skipped, job 0 rerun
    assert json.loads(manifest_path.read_text())["content_sha256"] != "0" * 64


def test_a_weights_file_changed_during_a_sweep_is_incomplete_not_green(tmp_path):
    # Judged apart by their weight hash, the tp=2 run would have gone without any tp verdict and the sweep GREEN.
    heads = []
    for seed in (1, 2):
        heads.append(tmp_path / f"head{seed}.safetensors")
        weight = torch.randn(301, 32, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        save_file({"lm_head.weight": weight}, heads[-1])
    path = tmp_path / "head.safetensors"
    shutil.copy(heads[0], path)
    fault = (
        "import shutil, rlsweep.job as job\n"
        "original = job.write_manifest\n"
        f"job.write_manifest = lambda *a, **k: (original(*a, **k), shutil.copy({str(heads[1])!r}, {str(path)!r}))[0]"
    )
    head = ["model=replay", "model.hidden_size=32", "model.vocab_size=301", f"model.weights.path={path}"]
    sweep_dir = tmp_path / "sweep"
    done = with_fault(fault, "rlsweep", f"hydra.sweep.dir={sweep_dir}", *SMALL, *head, "--multirun")
    assert_not_green(done, ExitCode.INCOMPLETE)
    assert f"read the weights file {str(path)!r} with 2 different contents" in done.stdout
    assert "tp=2 (emulated) computed other inputs" in done.stdout  # and the run left without its tp verdicts
    again = forkserver.run("-m", "rlsweep.check", ["sweep"], cwd=tmp_path, timeout=300)
    assert_not_green(again, ExitCode.INCOMPLETE)
    assert "with 2 different contents (" in again.stdout


def test_a_run_whose_inputs_no_smaller_tp_run_computed_is_named_as_unjudged(sweep):
    runs = sorted(run_gate(sweep).runs, key=lambda run: run.run["tp"])
    assert without_baseline(runs) == []
    moved = replace(runs[1], run={**runs[1].run, "workload_hash": "other"})
    (line,) = without_baseline([runs[0], moved])
    assert line.startswith(f"{moved.directory}: cpu_bf16 tp=2 (emulated) computed other inputs") and "tp=1" in line


def test_a_parity_declaration_applies_to_the_rows_of_either_profile(sweep):
    # A parity row is kept under the profile first by name; a declaration that selects the other is about it too.
    declared = [{"profiles": ["zz_control"], "judgment": "backend_parity", "reason": "control"}]
    stock = min(run_gate(sweep).runs, key=lambda run: run.run["tp"])
    stock = replace(stock, config={**stock.config, "expected_red": declared})
    control = replace(stock, run={**stock.run, "profile": "zz_control", "run_id": "zz"})
    ((lhs, rhs),) = parity_pairs([control, stock])
    assert (lhs.run["profile"], rhs.run["profile"]) == ("cpu_bf16", "zz_control")
    rows = verdict_rows(lhs, backend_parity(lhs, rhs))
    assert rows and not any(row["expected_pass"] for row in rows)
    assert declaration_check([stock, control], rows, [{"zz", stock.run["run_id"]}] * len(rows)) == []


def test_a_parity_row_is_charged_to_the_run_that_computed_no_tokens(green_sweep):
    # Its partner first by name was charged: a backend whose kernels never ran read as the other profile's red.
    stock = min(run_gate(green_sweep).runs, key=lambda run: run.run["tp"])
    stopped = replace(stock, directory=stock.directory.parent / "zz", run={**stock.run, "profile": "zz_stopped",
                      "run_id": "zz"}, tokens=stock.tokens.iloc[:0])  # fmt: skip
    ((lhs, rhs),) = parity_pairs([stock, stopped])
    rows = verdict_rows(lhs, backend_parity(lhs, rhs))
    assert rows and not any(row["passed"] for row in rows)
    for row in rows:
        assert (row["profile"], row["run_id"], row[ROW_RUN_DIR]) == ("zz_stopped", "zz", stopped.directory)
        assert f"{stopped.label} computed none of {CANONICAL_CELL}" in row["detail"]
    ((first, _),) = parity_pairs([stock, replace(stopped, tokens=stock.tokens)])  # both computed: the order by name
    assert first is stock


@pytest.mark.parametrize("name", ["aa_hot", "zz_hot"])
def test_a_parity_row_is_charged_to_the_run_farther_from_the_reference_whatever_its_name(green_sweep, name):
    # It was charged to the profile first by name: a backend off the reference by a few bounds, named after cpu_bf16,
    # showed as cpu_bf16's red and not its own.
    stock = min(run_gate(green_sweep).runs, key=lambda run: run.run["tp"])
    hot = stock.tokens.assign(logp=(stock.tokens["ref_logp"] - 4 * stock.tokens["logp_bound"]).astype("float32"))
    buggy = replace(stock, directory=stock.directory.parent / name, run={**stock.run, "profile": name, "run_id": name},
                    tokens=hot)  # fmt: skip
    for order in ([stock, buggy], [buggy, stock]):
        ((lhs, rhs),) = parity_pairs(order)
        rows = verdict_rows(lhs, backend_parity(lhs, rhs))
        logp = [row for row in rows if row["tensor"] == "logp"]
        assert logp and not any(row["passed"] for row in logp)
        for row in rows:
            assert (row["profile"], row["run_id"], row[ROW_RUN_DIR]) == (name, name, buggy.directory)


class CellReads(pd.DataFrame):
    """A tokens table that counts how often its cell column is read (frames made from it are plain)."""

    reads = 0

    @property
    def _constructor(self):
        return pd.DataFrame

    def __getitem__(self, key):
        CellReads.reads += isinstance(key, str) and key == "cell"
        return super().__getitem__(key)


def test_the_gate_reads_each_runs_cells_a_bounded_number_of_times_however_many_runs_a_group_holds(sweep):
    # Reading every earlier run's cells for each cell of each run made a group of 50 runs quadratic in its tokens.
    base = run_gate(sweep).runs[0]
    runs = [replace(base, directory=sweep / f"x{i}", run={**base.run, "tp": 1 + i % 4, "run_id": str(i)},
                    tokens=CellReads(base.tokens)) for i in range(40)]  # fmt: skip
    CellReads.reads = 0
    judged = sum(len(tp_invariance(lhs, earlier)) for lhs, earlier in tp_pairs(runs))
    assert judged == 2 * len(base.tokens["cell"].unique()) * 39
    assert CellReads.reads <= 5 * len(runs) * len(base.tokens["cell"].unique()), CellReads.reads


def test_a_full_disk_is_one_line_and_leaves_no_table(tmp_path):
    fault = (
        "import errno, os, pyarrow.parquet as pq\n"
        "def full(*args, **kwargs): raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
        "pq.write_table = full"
    )
    done = with_fault(fault, "rlsweep", f"hydra.run.dir={tmp_path}", "layout=smoke")
    assert_not_green(done, ExitCode.ERROR)
    assert "No space left on device" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert f"{str(tmp_path / TOKENS_TABLE / PART_FILE)!r} cannot be written" in done.stderr, done.stderr
    assert tables_left(tmp_path) == []
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_failed_rerun_invalidates_the_old_tables(green_run, tmp_path, capsys):
    tmp_path = copy_outputs(green_run, tmp_path / "run")
    assert check(tmp_path, capsys)[0] == ExitCode.GREEN  # the gate's outputs in the run dir, and a report's
    for name in REPORT_FILES:
        (tmp_path / name).write_text("Gate: GREEN")
    done = run_rlsweep(tmp_path, "layout=smoke", "tp=0")
    assert_not_green(done, ExitCode.ERROR)
    assert tables_left(tmp_path) == []
    assert not [name for name in (SWEEP_CHECKS_TABLE, SUMMARY_FILE, *REPORT_FILES) if (tmp_path / name).exists()]
    code, output = check(tmp_path, capsys)
    assert code == ExitCode.INCOMPLETE, output


def snapshot(directory: Path) -> dict[str, int]:
    """Every path under ``directory`` with its modification time: what a refused command must leave as it was."""
    return {str(path.relative_to(directory)): path.stat().st_mtime_ns for path in directory.rglob("*")}


def test_a_sweep_into_a_single_runs_dir_is_refused_before_any_job(green_run, tmp_path):
    tmp_path = copy_outputs(green_run, tmp_path / "run")
    before = snapshot(tmp_path)
    done = multirun(tmp_path, "layout=smoke", "tp=1,2")
    assert_not_green(done, ExitCode.ERROR)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert str(tmp_path) in done.stderr and MANIFEST_FILE in done.stderr and "hydra.sweep.dir" in done.stderr
    assert "starting" not in done.stdout and snapshot(tmp_path) == before


@pytest.mark.parametrize("inside", ["nested", TOKENS_TABLE])
def test_a_sweep_into_a_dir_inside_another_sweep_is_refused(sweep, inside):
    """Nested, the outer sweep's gate judged the inner one's runs with its own; in its tokens/ folder, the inner one's
    records and job dirs broke the outer one's dataset for a plain reader, and its check said INCOMPLETE."""
    with pytest.raises(OutputDirError, match=re.escape(f"{str(sweep / inside)!r} (hydra.sweep.dir) lies inside the "
                                                       f"sweep {str(sweep)!r} (multirun.yaml, jobs.json")):  # fmt: skip
        refuse_sweep_over_run(sweep / inside)
    refuse_sweep_over_run(sweep)  # its own dir: a resume


def test_a_single_run_in_a_sweep_dir_is_never_judged_as_one_of_its_runs(sweep, tmp_path, capsys):
    run = tmp_path / "run"
    assert run_rlsweep(run, "layout=smoke", "tp=2").returncode == ExitCode.GREEN
    for name in (MANIFEST_FILE, ".hydra", f"{TOKENS_TABLE}/{PART_FILE}", f"{CHECKS_TABLE}/{PART_FILE}"):
        (shutil.copytree if (run / name).is_dir() else shutil.copy)(run / name, sweep / name)
    code, output = check(sweep, capsys)
    assert code == ExitCode.INCOMPLETE, output
    assert f"{sweep}: a single run" in output and "sweep gate: 2 runs" in output


@pytest.mark.parametrize("into", ["hydra.run.dir", "tables_dir", None], ids=["run dir", "tables_dir", "no callback"])
def test_a_single_run_into_a_sweep_dir_is_refused_and_deletes_nothing(sweep, tmp_path, capsys, into):
    before = snapshot(sweep)
    if into == "tables_dir":
        done = run_rlsweep(tmp_path / "run", "layout=smoke", f"tables_dir={sweep}")
    else:  # without rlsweep's callback Hydra writes its record first; the run itself still refuses the dir
        done = run_rlsweep(sweep, "layout=smoke", *([] if into else ["~hydra.callbacks.rlsweep"]))
    assert_not_green(done, ExitCode.ERROR)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"{str(sweep)!r}{f' ({into})' if into else ''} holds a sweep (multirun.yaml" in done.stderr
    after = snapshot(sweep)
    if into is None:  # Hydra's record of the run is new there; the sweep's tables are as they were

        def tables(files: dict[str, int]) -> dict[str, int]:
            return {path: time for path, time in files.items() if path.startswith((TOKENS_TABLE, CHECKS_TABLE))}

        assert tables(after) == tables(before)
        return
    assert after == before
    code, output = check(sweep, capsys)
    assert code == ExitCode.GREEN, output


def test_a_single_run_into_a_job_dir_of_a_sweep_is_refused_and_deletes_nothing(sweep, capsys):
    """A run into a job's dir replaced that job's manifest with its own, leaving its partition unnamed: the sweep
    was INCOMPLETE, and a resume skipped the job (its dir held a complete run of the same content) so it stayed so."""
    before = snapshot(sweep)
    done = run_rlsweep(sweep / "0", "layout=smoke", "tp=1")
    assert_not_green(done, ExitCode.ERROR)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"{str(sweep / '0')!r} (hydra.run.dir) lies inside the sweep {str(sweep)!r}" in done.stderr
    assert snapshot(sweep) == before
    code, output = check(sweep, capsys)
    assert code == ExitCode.GREEN, output


@pytest.mark.parametrize("folder", [TOKENS_TABLE, f"{CHECKS_TABLE}/job=1"])
def test_a_check_of_a_tables_folder_writes_nothing_there(sweep, capsys, folder):
    """The check of a sweep's dataset folder took its lock there, a file in the sweep's dataset, to find no run."""
    before = snapshot(sweep)
    code, output = check(sweep / folder, capsys)
    assert code == ExitCode.ERROR and f"python -m rlsweep.check {sweep} judges it" in output, output
    assert snapshot(sweep) == before


@pytest.fixture(scope="module")
def green_run(tmp_path_factory) -> Path:
    """A real green single run; tests copy it before writing near it."""
    run_dir = tmp_path_factory.mktemp("green_run")
    done = run_rlsweep(run_dir, "layout=smoke")
    assert done.returncode == ExitCode.GREEN, done.stdout + done.stderr
    return run_dir


@pytest.mark.parametrize("key", ["tables_dir", "hydra.run.dir", "hydra.sweep.dir"])
@pytest.mark.parametrize("inside", [TOKENS_TABLE, f"{CHECKS_TABLE}/deeper", "sub"])
def test_nothing_is_written_inside_another_runs_dir_or_its_dataset_folders(green_run, tmp_path, capsys, key, inside):
    """tables_dir=<run>/tokens wrote a run's tables into another run's dataset folder (a reader of that run loaded
    them as its rows, and its check said INCOMPLETE) and exited GREEN; a run or a sweep inside another run's dir
    was judged with it."""
    run = tmp_path / "run"
    copy_outputs(green_run, run)
    before = snapshot(run)
    target = run / inside
    if key == "tables_dir":
        args = suite_overrides(["layout=smoke", f"tables_dir={target}"])
        done = forkserver.run("-m", "rlsweep", args, cwd=tmp_path, timeout=300)
    elif key == "hydra.run.dir":
        done = run_rlsweep(target, "layout=smoke")
    else:
        done = multirun(target, "layout=smoke", "tp=1")
    assert_not_green(done, ExitCode.ERROR)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"{str(target)!r} ({key}) lies inside the run dir {str(run)!r}" in done.stderr
    assert "kernel calls" not in done.stdout + done.stderr and snapshot(run) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]  # nothing left elsewhere either
    assert check(run, capsys)[0] == ExitCode.GREEN


def test_a_run_with_tables_dir_is_whole_there_and_leaves_no_unfinished_run_dir(tmp_path, capsys):
    """Hydra's record of a tables_dir run went to outputs/runs/<date>/<time> without a manifest, a run dir that never
    finished for every later check of outputs/ (INCOMPLETE for good), and the tables went unchecked against it."""
    tables = tmp_path / "tables"
    done = forkserver.run("-m", "rlsweep", suite_overrides(["layout=smoke", f"tables_dir={tables}"]), cwd=tmp_path)
    assert done.returncode == ExitCode.GREEN, done.stdout + done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tables"]
    assert (tables / HYDRA_CONFIG).is_file() and (tables / MANIFEST_FILE).is_file()
    code, output = check(tmp_path, capsys)
    assert code == ExitCode.GREEN and "sweep gate: 1 runs" in output, output
    again = run_rlsweep(tmp_path / "elsewhere", "layout=smoke", f"tables_dir={tables}")  # hydra.run.dir too
    assert_not_green(again, ExitCode.ERROR)
    assert "name two dirs for one run" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("into", ["the job's dir", "a dir in it"])
def test_a_dir_inside_a_sweep_through_a_link_is_refused_as_by_its_name(sweep, tmp_path, into):
    (tmp_path / "link").symlink_to(sweep / "0")
    target = tmp_path / "link" / ("" if into == "the job's dir" else "deeper")
    # (A sweep into the job's dir itself is refused first for the single run it holds.)
    for refuse in (refuse_run_over_sweep, refuse_sweep_over_run)[: 1 if into == "the job's dir" else 2]:
        with pytest.raises(OutputDirError, match=re.escape(f"lies inside the sweep {str(sweep)!r}")):
            refuse(target)


def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path):
    with locked(tmp_path):  # the sweep first: the single run leaves Hydra's record of a run, which a sweep refuses
        sweep = multirun(tmp_path, "layout=smoke", "tp=1")
        single = run_rlsweep(tmp_path, "layout=smoke")
    for done in (single, sweep):
        assert_not_green(done, ExitCode.ERROR)
        assert "is in use by another rlsweep writer (pid" in done.stderr
    assert tables_left(tmp_path) == []


def test_a_refused_writer_leaves_the_record_of_the_run_that_holds_the_dir(green_run, tmp_path):
    tmp_path = copy_outputs(green_run, tmp_path / "run")  # the first run, green
    record = (tmp_path / HYDRA_CONFIG).read_bytes()
    with locked(tmp_path):  # as the first run would hold it while it runs
        second = run_rlsweep(tmp_path, "layout=smoke", "seed=1")
    assert_not_green(second, ExitCode.ERROR)
    assert "is in use by another rlsweep writer (pid" in second.stderr
    assert (tmp_path / HYDRA_CONFIG).read_bytes() == record
    assert check_main([str(tmp_path)]) == ExitCode.GREEN


def test_a_control_whose_declarations_match_nothing_is_red(tmp_path):
    # With only the canonical cell there is no forward_invariance row for the control's declaration to match.
    done = multirun(tmp_path, "profile=negative_control_cpu", "layout=smoke", "layout.cells=[BN/packed]",
                    "layout.needles=[]", "tp=1", CONTROL_DECLARED)  # fmt: skip
    assert_not_green(done, ExitCode.RED)
    checks = pd.read_parquet(tmp_path / CHECKS_TABLE)  # the sweep's checks dataset: its one job
    row = checks[checks.judgment == "expected_red"]
    assert len(row) == 1 and not row.passed.iloc[0] and row.value.iloc[0] == 0
    assert "negative_control_cpu" in row.detail.iloc[0]


def test_a_declaration_that_selects_no_run_is_red(tmp_path):
    declaration = "expected_red=[{profiles:[no_such_profile],judgment:forward_invariance,reason:typo}]"
    single = run_rlsweep(tmp_path / "run", "layout=smoke", declaration)
    assert_not_green(single, ExitCode.RED)
    assert "selects no run" in single.stdout
    done = multirun(tmp_path / "sweep", "layout=smoke", "tp=1", declaration)
    assert_not_green(done, ExitCode.RED)
    assert "selects no run of this sweep" in done.stdout


def test_a_declaration_is_judged_against_its_own_sweep_under_a_dir_of_several(tmp_path, capsys):
    # Under one parent, sweep "control" has the runs the declaration of sweep "stock" selects; "stock" has none.
    small = ("layout=smoke", "layout.needles=[]", "tp=1", CONTROL_DECLARED)
    control = multirun(tmp_path / "control", "profile=negative_control_cpu", "layout.cells=[BN/packed,B1/full]", *small)
    assert control.returncode == ExitCode.GREEN, control.stdout + control.stderr
    stock = multirun(tmp_path / "stock", "profile=cpu_bf16", "layout.cells=[BN/packed]", *small)
    assert_not_green(stock, ExitCode.RED)
    code, output = check(tmp_path, capsys)
    assert code == ExitCode.RED, output
    assert "selects no run of this sweep" in output


def test_a_sweep_declaration_that_matches_no_tp_row_is_red(tmp_path):
    declaration = "expected_red=[{profiles:[cpu_bf16],judgment:tp_invariance,cells:[nope],reason:typo}]"
    done = multirun(tmp_path, *SMALL, declaration)
    assert_not_green(done, ExitCode.RED)
    sweep_checks = pd.read_parquet(tmp_path / "sweep_checks.parquet")
    assert (sweep_checks.judgment == "expected_red").sum() == 1


def test_a_contract_missing_a_judged_row_is_refused_before_any_kernel(tmp_path):
    done = run_rlsweep(tmp_path, "layout=smoke", "~contract.judgments.forward_invariance.rows.lse.bfloat16")
    assert_not_green(done, ExitCode.ERROR)
    assert "judgments.forward_invariance.rows.lse.bfloat16" in done.stderr
    assert "kernel calls" not in done.stdout + done.stderr and tables_left(tmp_path) == []


def test_a_contract_with_an_unknown_key_is_refused(tmp_path):
    done = run_rlsweep(tmp_path, "layout=smoke", "+contract.judgments.forward_accuracy.rows.logp.bfloat16.atoll=1")
    assert_not_green(done, ExitCode.ERROR)
    assert "unknown key(s) ['atoll']" in done.stderr


def test_duplicate_cells_are_refused_up_front(tmp_path):
    done = run_rlsweep(tmp_path, "layout.cells=[BN/packed,B1/full,B1/full]")
    assert_not_green(done, ExitCode.ERROR)
    assert "['B1/full'] appear more than once" in done.stderr


def test_a_usage_error_is_exit_1_not_red_and_names_the_command():
    done = forkserver.run("-m", "rlsweep", ["--no-such-flag"], timeout=120)
    assert_not_green(done, ExitCode.ERROR)
    # One line, its usage folded in (Hydra's parser printed 7 lines of usage, then the error), naming the command.
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("rlsweep: error: unrecognized arguments: --no-such-flag (usage: rlsweep [--help]")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["tp=1,2", "--multirun", "seed=3", "x=y"], "seed=3 x=y: overrides after --multirun are not read "
         "(argparse takes the overrides as one group); put every override before --multirun: rlsweep tp=1,2 seed=3 "
         "x=y --multirun"),
        (["-m", "tp=1", "--cfg", "job", "seed=3"], "seed=3: an override after --cfg is not read (argparse takes the "
         "overrides as one group); put every override before --cfg: rlsweep tp=1 seed=3 -m --cfg job"),
    ],
)  # fmt: skip
def test_an_override_after_a_flag_is_a_usage_error_saying_where_it_goes(argv, line, tmp_path):
    # argparse takes the overrides as one group: those after the flag ended in its bare 'unrecognized arguments'.
    done = forkserver.run("-m", "rlsweep", argv, cwd=tmp_path, timeout=120)
    assert_not_green(done, ExitCode.ERROR)
    assert done.stderr.splitlines() == [f"rlsweep: error: {line}"]
    assert not any(tmp_path.iterdir())  # refused before Hydra wrote anything


@pytest.mark.parametrize("main", [check_main, report_main])
@pytest.mark.parametrize("argv", [[], ["--no-such-flag", "."]])
def test_usage_errors_of_check_and_report_are_exit_1(main, argv, capsys):
    assert main(argv) == ExitCode.ERROR
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "error: " in err and "(usage: python -m rlsweep." in err, err


@pytest.mark.parametrize("main", [check_main, report_main])
@pytest.mark.parametrize("directory", ["", " "])
def test_an_empty_dir_argument_is_a_usage_error_not_the_current_dir(main, directory, sweep, monkeypatch, capsys):
    monkeypatch.chdir(sweep)  # a green sweep: judged in DIR's place, it would say GREEN
    assert main([directory]) == ExitCode.ERROR
    err = capsys.readouterr().err
    assert f"argument directory: {directory!r} is empty: name a run dir" in err, err
    assert not (sweep / "report.md").exists()


def test_check_on_a_dir_without_runs_is_an_error(tmp_path, capsys):
    code, output = check(tmp_path, capsys)
    assert code == ExitCode.ERROR and "no rlsweep run" in output


def test_a_run_whose_kernels_provenance_stopped_is_red_with_every_verdict_present(tmp_path):
    done = run_rlsweep(tmp_path, "layout=smoke", "profile.determinism_scope=cross_tp_bitwise",
                       "profile.merge_order=global_tile")  # fmt: skip
    assert_not_green(done, ExitCode.RED)
    report = forkserver.run("-m", "rlsweep.report", [str(tmp_path)])
    assert_not_green(report, ExitCode.RED)


FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_names_the_file_that_could_not_be_written(tmp_path, monkeypatch):
    # The manifest, the gate's tables and a report's files are written by write_tables, a run's tables by
    # publish_tables: the OSError left without its path ("[Errno 28] No space left on device").
    def full(*args, **kwargs):
        raise FULL

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OutputDirError) as caught:
        write_tables(tmp_path, {}, files={MANIFEST_FILE: "{}"})
    assert str(caught.value) == f"{str(tmp_path / MANIFEST_FILE)!r} cannot be written: No space left on device"
    monkeypatch.setattr(pq, "write_table", full)
    location = RunLocation.sweep_job(tmp_path / "0", tmp_path, 0)
    with pytest.raises(OutputDirError) as caught:
        publish_tables(location, {TOKENS_TABLE: pa.table({"x": [1]})})
    assert str(caught.value) == f"{str(location.table_file(TOKENS_TABLE))!r} cannot be written: No space left on device"
    assert not [path for path in tmp_path.rglob("*") if path.is_file()]


def caught_signals(pid: int) -> int:
    """The signals process ``pid`` has handlers for (SigCgt of /proc/<pid>/status), as a bit mask; 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)


def loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")
@pytest.mark.parametrize(
    ("module", "signum"),
    [("rlsweep", signal.SIGINT), ("rlsweep", signal.SIGTERM), ("rlsweep.check", signal.SIGTERM),
     ("rlsweep.report", signal.SIGINT)],
    ids=lambda value: getattr(value, "name", value),
)  # fmt: skip
def test_a_signal_while_a_command_starts_ends_it_with_one_line_and_exit_1(tmp_path, module, signum):
    # Before rlsweep's main installed its handlers, Ctrl-C printed a traceback from inside an import (exit 130) and
    # SIGTERM ended the process silently (143). The handlers must come before the imports that take seconds.
    prog = "rlsweep" if module == "rlsweep" else f"python -m {module}"
    said = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
    for delay in (0.0, 0.3):  # as soon as the handler is there, and later, inside the imports
        command = [sys.executable, "-m", module, f"hydra.run.dir={tmp_path}" if module == "rlsweep" else str(tmp_path)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not caught_signals(process.pid) & 1 << (signal.SIGTERM - 1) and time.monotonic() < deadline:
                time.sleep(0.002)
            early = not loaded(process.pid, "libtorch")  # the handler is in before torch is imported
            time.sleep(delay)
            process.send_signal(signum)
            _, err = process.communicate(timeout=120)
        finally:
            process.kill()
        assert early, f"{module}: its signal handlers come only after torch is imported"
        assert (process.returncode, err) == (ExitCode.ERROR, f"{prog}: error: {said}\n"), (delay, err)


def nan_head(directory: Path) -> list[str]:
    """Overrides of a run whose head has a NaN: its header passes a sweep's preflight, the run fails on its values."""
    head = torch.ones(3001, 64)
    head[0, 1] = float("nan")
    path = directory / "head.safetensors"
    save_file({"lm_head.weight": head}, path)
    return ["model=replay", "model.hidden_size=64", "model.vocab_size=3001", f"model.weights.path={path}",
            "layout=smoke"]  # fmt: skip


@pytest.mark.parametrize(
    "launcher", [(), pytest.param(JOBLIB, marks=needs_launcher("joblib"))], ids=["basic", "joblib"]
)
def test_each_failed_job_of_a_sweep_is_one_line_on_stderr_whatever_the_launcher(tmp_path, launcher):
    # Hydra's sweeper wrote "Error executing job with overrides: [...]" beside rlsweep's line for the first failure,
    # and said nothing on stderr of the others.
    overrides = nan_head(tmp_path)
    done = multirun(tmp_path / "sweep", *overrides, "tp=1,2", *launcher)
    assert done.returncode == ExitCode.ERROR and "sweep gate:" not in done.stdout, done.stdout + done.stderr
    reason = (f"weight file {str(tmp_path / 'head.safetensors')!r} (model.weights.path): lm_head.weight[0, 1] = nan is "
              "not finite")  # fmt: skip
    assert done.stderr.splitlines() == [
        f"rlsweep: error: job #{num} ({job_line(*overrides, f'tp={tp}')}) failed: {reason}"
        for num, tp in enumerate((1, 2))
    ], done.stderr


END_AFTER_WORK = """
import atexit, sys, threading, time
from pathlib import Path
from rlsweep.exitcodes import exit_without_teardown
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late():
    time.sleep(0.3)
    (out / "thread").write_text("joined")
threading.Thread(target=late).start()
sys.stdout.write("a line without its newline, still buffered")
exit_without_teardown(int(sys.argv[2]))
"""


@pytest.mark.parametrize("status", [0, 2, 3])
def test_a_command_that_ends_without_teardown_keeps_its_status_output_threads_and_atexit_handlers(tmp_path, status):
    """Command lines skip the interpreter's module teardown at their end (rlsweep.exitcodes.exit_without_teardown):
    what a caller or CI reads must be exactly what a normal exit gives."""
    done = subprocess.run([sys.executable, "-c", END_AFTER_WORK, str(tmp_path), str(status)], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).parent.parent)  # fmt: skip
    assert done.returncode == status, done.stderr
    assert done.stdout == "a line without its newline, still buffered"
    assert (tmp_path / "thread").read_text() == "joined" and (tmp_path / "atexit").read_text() == "ran"
