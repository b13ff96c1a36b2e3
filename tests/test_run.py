"""End-to-end runs of ``python -m rlsweep``: tables, verdicts, expected reds and exit codes."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import forkserver
import pandas as pd
import pytest
import torch
from rlsweep_fixtures import build_inputs, compose_run, run_rlsweep, table_file, tables_left

from rlsweep.config import run_spec
from rlsweep.exitcodes import ExitCode
from rlsweep.gate import run_gate
from rlsweep.layouts import plan_cells
from rlsweep.manifest import verify_run
from rlsweep.spec import CANONICAL_CELL
from rlsweep.tables import (
    CHECKS_SCHEMA,
    CHECKS_TABLE,
    SCHEMA_VERSION,
    TOKENS_SCHEMA,
    TOKENS_TABLE,
    read_metadata,
)

CONF = Path(str(resources.files("conf")))


def expected_cells(*overrides: str) -> list[str]:
    spec = run_spec(compose_run(*overrides))
    workload = build_inputs(spec)[1]
    return [cell.name for cell in plan_cells(spec.layout, workload)], workload.num_tokens


def read(directory):
    """A single run's tables, read as a plain pandas user does: one dataset folder each."""
    return pd.read_parquet(directory / TOKENS_TABLE), pd.read_parquet(directory / CHECKS_TABLE)


def assert_bitwise_across_cells(tokens: pd.DataFrame) -> None:
    canonical = tokens[tokens.cell == CANONICAL_CELL].set_index(["sample_id", "position"])
    for cell, rows in tokens.groupby("cell"):
        rows = rows.set_index(["sample_id", "position"]).loc[canonical.index]
        for column in ("logp", "lse"):
            lhs = torch.tensor(rows[column].to_numpy()).view(torch.int32)
            rhs = torch.tensor(canonical[column].to_numpy()).view(torch.int32)
            assert torch.equal(lhs, rhs), (cell, column)


def test_default_run_writes_both_tables_and_passes(tmp_path):
    # Run from a project of one's own whose conf/ folder must not shadow the shipped configs.
    project = tmp_path / "project"
    (project / "conf" / "profile").mkdir(parents=True)
    (project / "conf" / "profile" / "cpu_bf16.yaml").write_text("name: not_the_shipped_profile\n")
    tmp_path = tmp_path / "run"
    done = run_rlsweep(tmp_path, cwd=project)
    assert done.returncode == 0, done.stderr
    assert verify_run(tmp_path).complete, verify_run(tmp_path).reason
    tokens, checks = read(tmp_path)
    assert list(tokens.columns) == TOKENS_SCHEMA.names and list(checks.columns) == CHECKS_SCHEMA.names
    cells, num_tokens = expected_cells()
    assert sorted(tokens.cell.unique()) == sorted(cells)
    assert len(tokens) == len(cells) * num_tokens
    assert not tokens.duplicated(["cell", "sample_id", "position"]).any()
    assert checks.passed.all() and checks.expected_pass.all()
    assert (checks.contract_sha256 == checks.contract_sha256.iloc[0]).all()
    metadata = read_metadata(table_file(tmp_path, CHECKS_TABLE))
    assert metadata["schema_version"] == SCHEMA_VERSION
    assert read_metadata(table_file(tmp_path, TOKENS_TABLE))["schema_version"] == SCHEMA_VERSION
    assert {"config", "contract", "observed_provenance", "environment", "started", "finished"} <= set(metadata)
    assert metadata["environment"]["torch"] == torch.__version__
    progress = done.stdout + done.stderr
    assert all(f"cell {i}/{len(cells)} {name}:" in progress for i, name in enumerate(cells, start=1))


def test_triton_smoke_layout_is_bitwise_across_cells(tmp_path):
    done = run_rlsweep(tmp_path, "profile=triton_cpu_bf16", "layout=smoke")
    assert done.returncode == 0, done.stdout + done.stderr
    tokens, checks = read(tmp_path)
    assert checks.passed.all()
    assert_bitwise_across_cells(tokens)


@pytest.mark.slow
def test_triton_full_layout_is_bitwise_across_cells(tmp_path):
    # Tiles of 1024: a quarter of the interpreter's programs; layout invariance does not depend on the tile.
    done = run_rlsweep(tmp_path, "profile=triton_cpu_bf16", "profile.vocab_tile=1024")
    assert done.returncode == 0, done.stdout + done.stderr
    tokens, checks = read(tmp_path)
    assert checks.passed.all() and len(tokens) == len(expected_cells()[0]) * expected_cells()[1]
    assert_bitwise_across_cells(tokens)


def test_negative_control_exits_2_naming_the_first_divergence(tmp_path):
    done = run_rlsweep(tmp_path, "profile=negative_control_cpu")
    assert done.returncode == 2
    _, checks = read(tmp_path)
    red = checks[~checks.passed]
    assert (red.judgment == "forward_invariance").all() and red.first_sample_id.notna().all()
    first = red.iloc[0]
    assert f"sample_id={int(first.first_sample_id)}, position={int(first.first_position)}" in done.stdout


def test_expected_red_that_passes_is_red(tmp_path):
    declaration = "+profile.expected_red=[{judgment: forward_invariance, cells: [B1/full], reason: test}]"
    done = run_rlsweep(tmp_path, "layout=smoke", declaration)
    assert done.returncode == 2
    _, checks = read(tmp_path)
    flipped = checks[checks.passed != checks.expected_pass]
    assert set(flipped.lhs_cell) == {"B1/full"} and flipped.passed.all()


def test_a_profile_claiming_more_than_its_backend_keeps_is_refused_by_dispatch(tmp_path):
    done = run_rlsweep(
        tmp_path, "layout=smoke", "profile.determinism_scope=cross_tp_bitwise", "profile.merge_order=global_tile"
    )
    assert done.returncode == 2, done.stdout + done.stderr
    _, checks = read(tmp_path)
    red = checks[~checks.passed]
    assert red.judgment.iloc[0] == "provenance"
    assert "aten: determinism scope 'cross_tp_bitwise' not guaranteed" in red.detail.iloc[0]
    # What provenance prevented is judged red, not missing: every planned kernel verdict is a "not run" row.
    not_run = red.iloc[1:]
    assert set(not_run.judgment) == {
        "forward_accuracy", "forward_invariance", "chain_aggregates", "smoke", "kernel_accuracy", "kernel_bias"
    }  # fmt: skip
    assert not_run.detail.str.startswith("not run: provenance").all() and not not_run.passed.any()
    # One root cause, one line: the provenance verdict and every verdict it stopped, counted (they were 20 lines).
    (listed,) = done.stdout.split("/divergence/part-0.parquet\n")[1].splitlines()
    assert listed.startswith(f"  {len(red)} verdicts: provenance (expected pass) at forward_accuracy logp BN/packed")
    assert listed.endswith(f"; first: {' '.join(red.detail.iloc[0].split())}")


def test_a_verdict_never_computed_is_never_red_as_declared(tmp_path):
    # Every judgment declared red, on a run whose provenance stops the kernels: only the provenance row was computed,
    # so it alone may fail as declared; the rows that never ran stay red, and so does the run.
    declared = ("provenance", "forward_accuracy", "forward_invariance", "chain_aggregates", "smoke", "kernel_accuracy",
                "kernel_bias")  # fmt: skip
    declaration = ",".join(f"{{judgment: {judgment}, reason: test}}" for judgment in declared)
    done = run_rlsweep(
        tmp_path, "layout=smoke", "profile.determinism_scope=cross_tp_bitwise", "profile.merge_order=global_tile",
        f"+profile.expected_red=[{declaration}]",
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    _, checks = read(tmp_path)
    not_run = checks[checks.detail.str.startswith("not run: provenance stopped the kernels (no logprob backend")]
    assert not_run.detail.str.contains("determinism scope 'cross_tp_bitwise' not guaranteed").all()
    assert len(not_run) > 20 and not not_run.passed.any() and not_run.expected_pass.all()
    provenance = checks[checks.judgment == "provenance"]
    assert not provenance.passed.any() and not provenance.expected_pass.any()
    # A declaration that only never-computed rows could match matched nothing: each is a red row of its own.
    unmatched = checks[checks.judgment == "expected_red"]
    assert set(unmatched.tensor) == set(declared) - {"provenance"} and not unmatched.passed.any()
    assert run_gate(tmp_path).exit_code == ExitCode.RED


@pytest.mark.parametrize(("profile", "strict", "exit_code", "failed_as_declared"),
                         [("cpu_bf16", "true", 2, False), ("cpu_bf16", "false", 0, False),
                          ("negative_control_cpu", "false", 0, True)])  # fmt: skip
def test_a_declaration_that_is_not_strict_lets_a_covered_row_pass_or_fail(
    tmp_path, profile, strict, exit_code, failed_as_declared
):
    """For a stock stack whose bits in a cell follow the CPU's kernels: a strict declaration's row that passes is red
    (a stale declaration); one that is not strict lets it pass, and still lets it fail as declared."""
    declaration = f"{{judgment: forward_invariance, strict: {strict}, reason: test}}"
    done = run_rlsweep(tmp_path, "layout=smoke", f"profile={profile}", f"+profile.expected_red=[{declaration}]")
    assert done.returncode == exit_code, done.stdout + done.stderr
    _, checks = read(tmp_path)
    covered = checks[checks.judgment == "forward_invariance"]
    assert len(covered) and (covered.passed == (not failed_as_declared)).all()
    assert (covered.expected_pass == (strict == "false" and not failed_as_declared)).all()
    matched = checks[checks.judgment == "expected_red"]
    assert matched.empty  # it matched its rows, passed or failed


def test_an_inconsistent_logprob_contract_is_a_usage_error(tmp_path):
    done = run_rlsweep(tmp_path, "layout=smoke", "profile.determinism_scope=cross_tp_bitwise")
    assert done.returncode == 1
    assert "merge_order must be global_tile for cross_tp_bitwise; got 'rank_shard'" in done.stderr
    assert tables_left(tmp_path) == []


def test_help_describes_every_group_with_its_options():
    done = forkserver.run("-m", "rlsweep", ["--help"], timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for group in ("model", "profile", "workload", "layout", "contract", "sweep"):
        options = sorted(path.stem for path in (CONF / group).glob("*.yaml"))
        assert f"{group}: {', '.join(options)}" in lines  # the options, as Hydra lists them
        assert any(line.startswith(f"  {group} ") and len(line.split()) > 3 for line in lines), group  # described
    assert "rlsweep -sc install=bash" in done.stdout
