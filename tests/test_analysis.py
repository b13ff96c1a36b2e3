"""rlsweep.analysis on a real sweep: dtypes, summary counts, dlogp, first divergence, worst tokens, errors."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq
import pytest
from rlsweep_fixtures import copy_outputs, multirun, table_file

from rlsweep import analysis
from rlsweep.check import main as check_main
from rlsweep.errors import SelectionError, TablesNotFoundError
from rlsweep.gate import SWEEP_CHECKS_TABLE, VERDICT_COUNTS
from rlsweep.layouts import CANONICAL_CELL
from rlsweep.manifest import MANIFEST_FILE
from rlsweep.tables import CHECKS_SCHEMA, CHECKS_TABLE, PARTITION_KEY, RUN_COLUMNS, TOKENS_TABLE, TableError

# One worker builds the shared small_sweep (conftest) once and runs every test that reads it.
pytestmark = pytest.mark.xdist_group("small_sweep")


@pytest.fixture(scope="module")
def tokens(small_sweep):
    return analysis.load_tokens(small_sweep)


@pytest.fixture(scope="module")
def checks(small_sweep):
    return analysis.load_checks(small_sweep)


def raw_checks(sweep_dir) -> pd.DataFrame:
    """The checks tables exactly as pandas reads them, without the analysis layer."""
    runs = pd.read_parquet(sweep_dir / CHECKS_TABLE).drop(columns=PARTITION_KEY)  # the sweep's checks dataset
    return pd.concat([runs, pd.read_parquet(sweep_dir / SWEEP_CHECKS_TABLE)], ignore_index=True)


def test_dtypes_are_stable_and_as_written(tokens, checks):
    strings = [field.name for field in RUN_COLUMNS if field.type == "string"]
    for column in [*strings, "cell", analysis.RUN_DIR]:
        assert isinstance(tokens[column].dtype, pd.CategoricalDtype), column
    for column in [*strings, "judgment", "tensor", "lhs_role", "rhs_role", "lhs_cell", "metric", analysis.LEVEL]:
        assert isinstance(checks[column].dtype, pd.CategoricalDtype), column
    assert tokens["tp"].dtype == "int64" and checks["tp"].dtype == "int64"
    assert (tokens["logp"].dtype, tokens["lse"].dtype, tokens["ref_logp"].dtype) == ("float32", "float32", "float64")
    assert checks["first_sample_id"].dtype == "Int64" and checks["first_position"].dtype == "Int64"
    assert tokens["cell"].cat.categories[0] == CANONICAL_CELL  # layout order, canonical first


def test_load_checks_has_run_and_sweep_rows(small_sweep, checks):
    raw = raw_checks(small_sweep)
    assert len(checks) == len(raw)
    sweep_rows = len(pd.read_parquet(small_sweep / SWEEP_CHECKS_TABLE))
    assert (checks[analysis.LEVEL] == analysis.SWEEP_LEVEL).sum() == sweep_rows > 0
    sweep = checks[checks[analysis.LEVEL] == analysis.SWEEP_LEVEL]
    assert set(sweep["judgment"]) <= {"tp_invariance", "backend_parity"}
    # a sweep verdict belongs to its lhs run: same run_id in that run dir's own checks
    for row in sweep.itertuples():
        assert row.run_id in set(pd.read_parquet(table_file(Path(row.run_dir), CHECKS_TABLE))["run_id"])


def test_summary_counts_match_the_checks_tables(small_sweep, checks):
    counts = analysis.summary(checks)
    assert list(counts.columns) == [*analysis.SUMMARY_GROUPS, *VERDICT_COUNTS]
    raw = raw_checks(small_sweep)
    expected = (
        raw.assign(failed=~raw["passed"], unexpected=raw["passed"] != raw["expected_pass"])
        .groupby(list(analysis.SUMMARY_GROUPS))[list(VERDICT_COUNTS)]
        .sum()
    )
    got = counts.astype({"profile": str, "model": str, "judgment": str}).set_index(list(analysis.SUMMARY_GROUPS))
    pd.testing.assert_frame_equal(got.sort_index(), expected.astype("int64").sort_index(), check_names=False)
    assert counts["unexpected"].sum() > 0  # the undeclared negative control is red


def test_dlogp_of_a_cell_with_itself_is_zero_and_bit_equal(tokens):
    cell = {"profile": "negative_control_cpu", "tp": 1, "cell": CANONICAL_CELL}
    diffs = analysis.dlogp(tokens, cell, cell)
    assert len(diffs) == int(analysis.select(tokens, cell)["active"].sum()) > 0
    assert diffs["bits_equal"].all() and (diffs["dlogp"] == 0).all()
    assert analysis.first_divergence(diffs)["first_position"].isna().all()


def test_dlogp_agrees_with_every_forward_invariance_verdict(tokens, checks):
    rows = checks[(checks["judgment"] == "forward_invariance") & (checks[analysis.LEVEL] == analysis.RUN_LEVEL)]
    assert (~rows["passed"]).any() and rows["passed"].any()
    for row in rows.itertuples():
        lhs = {analysis.RUN_DIR: row.run_dir, "cell": row.lhs_cell}
        rhs = {analysis.RUN_DIR: row.run_dir, "cell": row.rhs_cell}
        diffs = analysis.dlogp(tokens, lhs, rhs, tensor=row.tensor)
        assert int((~diffs["bits_equal"]).sum()) == row.value  # metric: mismatched_tokens
        assert row.passed == bool(diffs["bits_equal"].all())


def test_dlogp_across_tp_agrees_with_the_tp_invariance_verdicts(tokens, checks):
    rows = checks[checks["judgment"] == "tp_invariance"]
    assert len(rows)
    for row in rows.itertuples():
        lhs = {"profile": row.profile, "tp": row.tp, "cell": row.lhs_cell}
        baseline_tp = int(tokens.loc[tokens["profile"] == row.profile, "tp"].min())
        rhs = {"profile": row.profile, "tp": baseline_tp, "cell": row.lhs_cell}
        diffs = analysis.dlogp(tokens, lhs, rhs, tensor=row.tensor)
        assert row.metric == "max_error_over_bound"
        assert (diffs["dlogp"].abs() / diffs["allowed"]).max() == pytest.approx(row.value, rel=1e-12)
        assert f"also bitwise: {bool(diffs['bits_equal'].all())}" in row.detail


def test_first_divergence_matches_a_red_forward_invariance_row(tokens, checks):
    red = checks[(checks["judgment"] == "forward_invariance") & ~checks["passed"] & (checks["tensor"] == "logp")]
    assert len(red)
    for row in red.itertuples():
        diffs = analysis.dlogp(
            tokens,
            {analysis.RUN_DIR: row.run_dir, "cell": row.lhs_cell},
            {analysis.RUN_DIR: row.run_dir, "cell": row.rhs_cell},
        )
        first = analysis.first_divergence(diffs).dropna(subset=["first_position"]).iloc[0]
        assert (first["sample_id"], first["first_position"]) == (row.first_sample_id, row.first_position)
        assert analysis.first_divergence(diffs)["diverging_tokens"].sum() == row.value


def test_worst_tokens_rank_by_magnitude(tokens):
    diffs = analysis.dlogp(
        tokens, {"profile": "negative_control_cpu", "tp": 2}, {"profile": "cpu_bf16", "tp": 1, "cell": CANONICAL_CELL}
    )
    worst = analysis.worst_tokens(diffs, n=5)
    assert len(worst) == 5
    assert worst["dlogp"].abs().iloc[0] == diffs["dlogp"].abs().max() > 0
    assert worst["dlogp"].abs().is_monotonic_decreasing


def test_dlogp_against_the_reference(tokens):
    selector = {"profile": "cpu_bf16", "tp": 1, "cell": CANONICAL_CELL}
    diffs = analysis.dlogp(tokens, selector, analysis.REFERENCE)
    chosen = analysis.select(tokens, selector)
    chosen = chosen[chosen["active"]]
    expected = chosen["logp"].astype("float64") - chosen["ref_logp"]
    assert sorted(diffs["dlogp"]) == sorted(expected)
    assert (diffs["dlogp"] != 0).any()


def test_bad_selections_are_typed_errors_naming_the_selector(tokens):
    with pytest.raises(SelectionError, match="picks 2 runs"):
        analysis.dlogp(tokens, {"profile": "cpu_bf16", "tp": 2}, {"profile": "cpu_bf16", "cell": CANONICAL_CELL})
    with pytest.raises(SelectionError, match="'nope'"):
        analysis.dlogp(tokens, {"profile": "nope"}, analysis.REFERENCE)
    with pytest.raises(SelectionError, match="'flavour' is not a column"):
        analysis.select(tokens, {"flavour": 1})
    with pytest.raises(SelectionError, match="only logp has a reference"):
        analysis.dlogp(tokens, {"profile": "cpu_bf16"}, analysis.REFERENCE, tensor="lse")


def test_missing_or_empty_paths_are_typed_errors(tmp_path):
    with pytest.raises(TablesNotFoundError, match=str(tmp_path / "absent")):
        analysis.load_tokens(tmp_path / "absent")
    with pytest.raises(TablesNotFoundError, match=str(tmp_path)):
        analysis.load_checks(tmp_path)


def test_one_run_dir_loads_alone(small_sweep, tokens):
    run_dir = analysis.run_dirs(small_sweep)[0]
    with pytest.warns(analysis.IncompleteRunsWarning, match="of the sweep"):  # a job dir is part of its sweep
        one = analysis.load_tokens(run_dir)
    assert set(one[analysis.RUN_DIR]) == {str(run_dir)}
    assert len(one) == len(pd.read_parquet(table_file(run_dir, TOKENS_TABLE)))


def floats(values, dtype="float32", index=None) -> pd.Series:
    return pd.Series(values, dtype=dtype, index=index)


def test_bits_equal_compares_series_of_one_length_index_and_dtype():
    assert analysis.bits_equal(floats([1.0, -0.0]), floats([1.0, 0.0])).tolist() == [True, False]
    with pytest.raises(SelectionError, match="lhs has 2 values, rhs 1"):
        analysis.bits_equal(floats([1.0, 2.0]), floats([1.0]))
    with pytest.raises(SelectionError, match="different index labels or order"):
        analysis.bits_equal(floats([1.0, 2.0], index=[0, 1]), floats([2.0, 1.0], index=[1, 0]))
    with pytest.raises(SelectionError, match="lhs is float32, rhs float64"):
        analysis.bits_equal(floats([1.0]), floats([1.0], dtype="float64"))


def test_sweep_rows_of_runs_not_loaded_are_refused(small_sweep, tmp_path):
    # A sweep_checks.parquet left by an earlier sweep names runs that are no longer this sweep's.
    sweep_dir = tmp_path / "sweep"
    shutil.copytree(small_sweep, sweep_dir)
    stale = pd.read_parquet(sweep_dir / SWEEP_CHECKS_TABLE)
    stale.loc[0, "run_id"] = "0123456789abcdef"
    table = pa.Table.from_pandas(stale, schema=CHECKS_SCHEMA, preserve_index=False)
    metadata = pq.read_schema(sweep_dir / SWEEP_CHECKS_TABLE).metadata  # each row's run dir, as the gate wrote it
    pq.write_table(table.replace_schema_metadata(metadata), sweep_dir / SWEEP_CHECKS_TABLE)
    with pytest.raises(TableError, match=rf"{SWEEP_CHECKS_TABLE}.*0123456789abcdef"):
        analysis.load_checks(sweep_dir)
    pq.write_table(table, sweep_dir / SWEEP_CHECKS_TABLE)  # no record of whose rows they are
    with pytest.raises(TableError, match=rf"{SWEEP_CHECKS_TABLE}.*does not record the run dir of each of its"):
        analysis.load_checks(sweep_dir)


def test_a_sweep_checked_again_from_its_parent_dir_counts_each_verdict_once(small_sweep, checks, tmp_path):
    # The parent's gate judges the sweep's runs again: its table and the sweep's own hold the same verdicts.
    sweep_dir = tmp_path / "sweep"
    copy_outputs(small_sweep, sweep_dir)
    assert check_main([str(tmp_path)]) == 2
    assert (tmp_path / SWEEP_CHECKS_TABLE).is_file()
    again = analysis.load_checks(tmp_path)
    assert (again[analysis.LEVEL] == analysis.SWEEP_LEVEL).sum() == (
        checks[analysis.LEVEL] == analysis.SWEEP_LEVEL
    ).sum()
    assert analysis.summary(again).equals(analysis.summary(checks))


def run_again(job: Path) -> None:
    """As a rerun of ``job`` with other code leaves it: the same run_id, other logp bits, a new manifest."""
    path = table_file(job, TOKENS_TABLE)
    table = pq.read_table(path)
    logp = table.schema.get_field_index("logp")
    pq.write_table(
        table.set_column(logp, "logp", pa.compute.multiply(table["logp"], pa.scalar(1.001, pa.float32()))), path
    )
    manifest = json.loads((job / MANIFEST_FILE).read_text())
    manifest["tables"][TOKENS_TABLE]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (job / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_sweep_rows_are_of_their_own_sweeps_runs_where_sweeps_share_run_ids(small_sweep, tmp_path):
    # Two sweeps of one config (two commits' under outputs/) have the same run ids; their verdicts differ here.
    for name in ("a", "b"):
        copy_outputs(small_sweep, tmp_path / name)
    run_again(tmp_path / "b" / "1")
    assert check_main([str(tmp_path / "b")]) == check_main([str(tmp_path)]) == 2
    checks = analysis.load_checks(tmp_path)
    rows = checks[checks[analysis.LEVEL] == analysis.SWEEP_LEVEL]
    for name in ("a", "b"):
        own = analysis.load_checks(tmp_path / name)
        own = own[own[analysis.LEVEL] == analysis.SWEEP_LEVEL]
        mine = rows[rows[analysis.RUN_DIR].astype(str).str.startswith(str(tmp_path / name))]
        assert sorted(mine["detail"]) == sorted(own["detail"]), name


def test_sweep_rows_of_runs_run_again_since_are_refused(small_sweep, tmp_path):
    # A dir's gate judged its sweep; the sweep's job ran again (same run ids) and its own gate wrote anew.
    copy_outputs(small_sweep, tmp_path / "a")
    assert check_main([str(tmp_path)]) == 2
    run_again(tmp_path / "a" / "1")
    assert check_main([str(tmp_path / "a")]) == 2
    assert len(analysis.load_checks(tmp_path / "a"))
    with pytest.raises(TableError, match=rf"{tmp_path / SWEEP_CHECKS_TABLE}.*run again or removed since \(a/1\)"):
        analysis.load_checks(tmp_path)


def test_a_job_dir_checked_alone_adds_no_verdict_to_its_sweep(tmp_path):
    # The gate over job 0 alone sees no tp=2 run, so the tp=2 declaration selects nothing there: red, in 0/.
    declared = ",".join(
        f"{{profiles:[negative_control_cpu],tp:[{tp}],judgment:forward_invariance,cells:[B1/full,needle/*],reason:c}}"
        for tp in (1, 2)
    )
    sweep_dir = tmp_path / "sweep"
    done = multirun(sweep_dir, "profile=negative_control_cpu", "tp=1,2", "layout=smoke", f"expected_red=[{declared}]")
    assert done.returncode == 0, done.stdout + done.stderr
    assert check_main([str(analysis.run_dirs(sweep_dir)[0])]) == 3
    assert check_main([str(sweep_dir)]) == 0
    checks = analysis.load_checks(sweep_dir)
    assert analysis.summary(checks)["unexpected"].sum() == 0, checks[checks["passed"] != checks["expected_pass"]]


DLOGP_FRAME = pd.DataFrame({"dlogp": [0.5, -2.0]})
BAD_ARGUMENTS = {
    "a selector that is not a mapping": (lambda t: analysis.select(t, [("tp", 2)]), r"a selector maps columns"),
    "a frame that is not load_tokens'": (lambda t: analysis.dlogp(DLOGP_FRAME, {"tp": 1}), r"a load_tokens frame"),
    "a tokens frame for first_divergence": (lambda t: analysis.first_divergence(t), r"expected a dlogp frame"),
    "a fractional n": (lambda t: analysis.worst_tokens(DLOGP_FRAME, 1.5), r"n=1.5 must be an integer >= 0"),
    "a bool n": (lambda t: analysis.worst_tokens(DLOGP_FRAME, True), r"n=True must be an integer >= 0"),
    "by as one string": (lambda t: analysis.summary(t, by="profile"), r"by must be a list of column names"),
    "a tokens frame for summary": (lambda t: analysis.summary(t), r"a load_checks frame: it has no column 'judgment'"),
    "no tokens": (lambda t: analysis.dlogp_vs_canonical(t.iloc[:0]), r"the tokens frame holds no rows"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_arguments_to_the_helpers_are_typed_errors_naming_them(tokens, case):
    call, match = BAD_ARGUMENTS[case]
    with pytest.raises(SelectionError, match=match):
        call(tokens)


def test_runs_left_out_of_a_frame_are_named_in_a_warning(small_sweep, tmp_path):
    """A frame of part of the runs must not read as the whole: the ones left out are named, as check names them."""
    sweep_dir = tmp_path / "sweep"
    copy_outputs(small_sweep, sweep_dir)
    whole = analysis.load_tokens(sweep_dir)
    (sweep_dir / "1" / MANIFEST_FILE).unlink()  # job 1 died before its manifest
    with pytest.warns(analysis.IncompleteRunsWarning, match=r"\d+ thing\(s\) under .* missing or incomplete") as caught:
        part = analysis.load_tokens(sweep_dir)
    assert (
        "job #1" in str(caught[0].message) and 0 < part[analysis.RUN_DIR].nunique() < whole[analysis.RUN_DIR].nunique()
    )


@pytest.mark.parametrize("gate", ["never ran", "ran on a job dir only"])
def test_a_sweep_whose_own_verdicts_are_missing_is_named_in_a_warning(small_sweep, tmp_path, gate):
    """A sweep run again and killed between its start (which removes sweep_checks.parquet) and its gate: the frame of
    its runs' rows lacked every tp and parity verdict without a word, while rlsweep.check said it was not GREEN."""
    sweep_dir = tmp_path / "sweep"
    shutil.copytree(small_sweep, sweep_dir, ignore=shutil.ignore_patterns(".rlsweep.lock", SWEEP_CHECKS_TABLE))
    if gate == "ran on a job dir only":  # a gate over part of the sweep: its table is no verdict of the sweep
        check_main([str(sweep_dir / "0")])
    with pytest.warns(analysis.IncompleteRunsWarning, match=re.escape(f"{SWEEP_CHECKS_TABLE} under")) as caught:
        checks = analysis.load_checks(sweep_dir)
    assert f"python -m rlsweep.check {sweep_dir}" in str(caught[0].message)
    assert set(checks[analysis.LEVEL]) == {analysis.RUN_LEVEL}


def test_a_job_dir_alone_is_named_in_a_warning_as_part_of_its_sweep(small_sweep):
    """The gate calls a job dir checked alone INCOMPLETE (its sweep's other jobs and verdicts are elsewhere); a frame
    of it read as a whole sweep."""
    job = analysis.run_dirs(small_sweep)[0]
    for load in (analysis.load_tokens, analysis.load_checks):
        with pytest.warns(analysis.IncompleteRunsWarning, match=re.escape(f"of the sweep {small_sweep} only")):
            load(job)
