"""Real multiruns into tmp_path: the sweep gate's exit codes, crashes, resume and launchers."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict
from rlsweep_fixtures import compose_run, job_line, multirun, needs_launcher, table_file, with_fault

from rlsweep import environment
from rlsweep.callbacks import RlsweepCallback, compose_mode_once, preflight_jobs, reuse_compositions
from rlsweep.causes import cause_lines, group_by_cause
from rlsweep.check import console_summary
from rlsweep.check import main as check_main
from rlsweep.config import job_list, run_spec
from rlsweep.errors import ConfigError
from rlsweep.exitcodes import ExitCode
from rlsweep.gate import SUMMARY_FILE, SWEEP_CHECKS_TABLE, run_gate
from rlsweep.job import run_job
from rlsweep.manifest import identify
from rlsweep.tables import CHECKS_TABLE, PART_FILE, TOKENS_TABLE, RunLocation
from rlsweep.verdicts import FORWARD_TENSORS

SMALL = ("layout=smoke", "tp=1,2")


def sweep_checks(sweep_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(sweep_dir / SWEEP_CHECKS_TABLE)


def run_cells(sweep_dir: Path) -> set[str]:
    return set(pd.read_parquet(sweep_dir / TOKENS_TABLE, columns=["cell"])["cell"])


def test_triton_sweep_is_green_with_a_bitwise_tp_row_for_every_cell(tmp_path):
    # tiny (V=3001) in CUDA-sized tiles of 1024 has 3 tiles of real columns: at tp=4 rank 3 holds padding only,
    # and the tp row is bitwise, so an all-padding rank must merge as the exact identity.
    done = multirun(tmp_path, "profile=triton_cpu_bf16", "layout=smoke", "profile.vocab_tile=1024", "tp=1,4")
    assert done.returncode == 0, done.stdout + done.stderr
    tp_rows = sweep_checks(tmp_path).query("judgment == 'tp_invariance'")
    assert set(tp_rows["lhs_cell"]) == run_cells(tmp_path)
    assert tp_rows["passed"].all() and (tp_rows["metric"] == "mismatched_tokens").all()
    assert set(tp_rows["tp"]) == {4}
    assert "sweep gate: 2 runs, 0 verdicts not as expected, 0 missing or incomplete -> GREEN" in done.stdout
    assert (tmp_path / SUMMARY_FILE).is_file()


def test_runs_of_one_workload_name_are_grouped_by_their_inputs_bits(tmp_path):
    # hidden_scale changes every hidden state, not the workload's name: each scale's two profiles are compared, and
    # no run is compared with a run of the other scale (a tp_invariance row of tp=1 vs tp=1 on other tokens).
    done = multirun(tmp_path, "profile=cpu_bf16,triton_cpu_bf16", "workload.hidden_scale=1,8",
                    "profile.vocab_tile=1024", "layout.cells=[BN/packed]", "layout.needles=[]")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = sweep_checks(tmp_path)
    assert set(rows["judgment"]) == {"backend_parity"} and len(rows) == 4, rows[["judgment", "detail"]]
    assert rows["workload_hash"].nunique() == 2 and rows["run_id"].nunique() == 2


@pytest.mark.parametrize(
    "varied", [("layout.cells=[BN/packed],[BN/packed,B1/full]",), ("grad=false,true", "layout.cells=[BN/packed]")]
)
def test_every_cell_and_gradient_at_tp_2_is_judged_against_a_tp_1_run_that_computed_it(tmp_path, varied):
    # The group's first run (tp=1, job 0) lacks B1/full, or did not differentiate: the tp=2 run of the other value
    # is compared with the tp=1 run that has what it computed, never left unjudged.
    done = multirun(tmp_path, "profile=triton_cpu_bf16", "tp=1,2", *varied, "layout.needles=[]",
                    "profile.vocab_tile=1024")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    tokens = pd.read_parquet(tmp_path / TOKENS_TABLE, columns=["run_id", "tp", "cell", "grad_bits"])
    rows = sweep_checks(tmp_path).query("tp == 2")
    computed = tokens[tokens["tp"] == 2]
    for judgment, ran in (("tp_invariance", computed), ("gradient_invariance", computed.dropna(subset="grad_bits"))):
        judged = rows[rows["judgment"] == judgment][["run_id", "lhs_cell"]].drop_duplicates()
        assert set(judged.itertuples(index=False)) == set(ran[["run_id", "cell"]].drop_duplicates().itertuples(
            index=False)), (judgment, rows[["judgment", "lhs_cell", "detail"]])  # fmt: skip
    assert (rows["detail"].str.contains(" vs triton_cpu_bf16 tp=1 ")).all()


def test_every_run_of_a_profile_is_paired_with_every_run_of_another(tmp_path):
    # Two runs per profile at one tp (vocab_tile 256 and 1024): each of the four cross-profile pairs is judged. On
    # the default workload's 397 tokens the two Triton tiles sum some tokens' vocab differently: runs of one profile at
    # two tiles are no tp pair (rlsweep.gate.tp_pairs), so the sweep stays green.
    done = multirun(tmp_path, "workload=hunt", "profile=cpu_bf16,triton_cpu_bf16", "profile.vocab_tile=256,1024",
                    "layout.cells=[BN/packed]", "layout.needles=[]")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = sweep_checks(tmp_path).query("judgment == 'backend_parity'")
    pairs = set(zip(rows["run_id"], rows["detail"].str.extract(r"\((\w{16})\);")[0], strict=True))
    assert len(rows) == 8 and len(pairs) == 4, rows[["run_id", "detail"]]


def test_expected_red_that_passes_turns_the_sweep_red(tmp_path):
    declaration = "expected_red=[{profiles:[cpu_bf16],judgment:tp_invariance,reason:'claims stock TP varies'}]"
    done = multirun(tmp_path, "profile=cpu_bf16", *SMALL, declaration)
    assert done.returncode == 2, done.stdout + done.stderr
    red = sweep_checks(tmp_path).query("judgment == 'tp_invariance'")
    assert red["passed"].all() and not red["expected_pass"].any()


def test_a_crashing_job_leaves_the_others_and_exits_1(tmp_path):
    fault = (
        "import rlsweep.run\ncompute = rlsweep.run.compute\n"
        "def crashing(spec, *args, **kwargs):\n"
        "    if spec.tp == 2: raise RuntimeError('injected kernel crash')\n"
        "    return compute(spec, *args, **kwargs)\n"
        "rlsweep.run.compute = crashing"
    )
    done = with_fault(fault, "rlsweep", f"hydra.sweep.dir={tmp_path}", "profile=cpu_bf16", "layout=smoke", "tp=1,2,4",
                      "--multirun")  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    output = done.stdout + done.stderr
    job = f"job #1 ({job_line('profile=cpu_bf16', 'layout=smoke', 'tp=2')})"
    assert f"FAILED: {job} failed: injected kernel crash" in output
    # Hydra's sweeper prints its own line for the failed job once; the progress line must not make it print again.
    assert done.stderr.count("Error executing job") <= 1, done.stderr
    assert done.stderr.splitlines()[-1] == f"rlsweep: error: {job} failed: injected kernel crash"
    assert set(pd.read_parquet(tmp_path / CHECKS_TABLE, columns=["tp"])["tp"]) == {1, 4}  # the others' tables
    assert not (tmp_path / CHECKS_TABLE / "job=1").exists()
    # Judged later from the tables on disk, the sweep is incomplete (3), naming the job that has no run.
    assert check_main([str(tmp_path)]) == 3


def test_a_job_that_cannot_run_stops_the_sweep_before_any_job_runs(tmp_path):
    done = multirun(tmp_path, "profile=cpu_bf16", "layout=smoke", "tp=1,2,0")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip() == (
        f"rlsweep: error: job #2 ({job_line('profile=cpu_bf16', 'layout=smoke', 'tp=0')}) cannot run: tp must be an "
        "integer >= 1, got 0"
    )
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_each_job_is_checked_against_its_own_contract_file(tmp_path):
    done = multirun(tmp_path, "layout=smoke", "contract=v1,v2", "contract.version=v1")
    assert done.returncode == 1, done.stdout + done.stderr
    job = f"job #1 ({job_line('layout=smoke', 'contract=v2', 'contract.version=v1')})"
    assert done.stderr.startswith(f"rlsweep: error: {job} cannot run: "), done.stderr
    assert "version='v1' is not the version of contract file v2" in done.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_sweep_whose_jobs_repeat_an_override_set_stops_before_any_job_runs(tmp_path):
    done = multirun(tmp_path, "profile=cpu_bf16", "layout=smoke", "tp=1,2,1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip() == (
        f"rlsweep: error: this sweep: job #2 ({job_line('profile=cpu_bf16', 'layout=smoke', 'tp=1')}) repeats job #0: "
        "a job's run is "
        "found by its overrides, so each job of a sweep must have its own; drop the repeated value"
    )
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize("values", [("tp=1", "tp=01"), ("seed=0", "seed=00"), ("grad=false", "grad=0")])
def test_jobs_that_spell_one_value_two_ways_stop_the_sweep_before_any_job_runs(values):
    """Each job's overrides differ, so the gate finds both, but their runs are one run counted twice."""
    with initialize_config_module("conf", version_base="1.3"):
        config = compose("config", overrides=["layout=smoke"], return_hydra_config=True)
        with pytest.raises(ConfigError, match=re.escape(f"job #1 (layout=smoke {values[1]}) composes the same run "
                                                        f"config as job #0 (layout=smoke {values[0]})")):  # fmt: skip
            preflight_jobs(config, [("layout=smoke", value) for value in values])


@pytest.mark.parametrize("launcher", [None, pytest.param("hydra/launcher=joblib", marks=needs_launcher("joblib"))])
def test_the_launcher_runs_each_job_as_its_preflight_composed_it_without_composing_it_again(monkeypatch, launcher):
    """Hydra's sweeper and basic launcher composed every job again after the preflight had: three compositions a job.
    They now get a copy of the preflight's, each its own; a launcher that sends the loader elsewhere does not."""
    overrides = ["layout=smoke", *([launcher] if launcher else [])]
    with initialize_config_module("conf", version_base="1.3"):
        config = compose("config", overrides=overrides, return_hydra_config=True)
        jobs = [("layout=smoke", f"tp={tp}") for tp in (1, 2)]
        reuse_compositions(config, preflight_jobs(config, jobs))
        loader = GlobalHydra.instance().config_loader()
        composing = []
        load_configuration = loader.load_configuration
        monkeypatch.setattr(
            loader, "load_configuration", lambda *a, **k: composing.append(1) or load_configuration(*a, **k)
        )
        first = loader.load_sweep_config(config, list(jobs[1]))
        with open_dict(first):
            first.hydra.job.num = 7  # as the launcher numbers its job: the next one asked gets a clean copy
        again = loader.load_sweep_config(config, list(jobs[1]))
        assert again.tp == 2 and OmegaConf.is_missing(again.hydra.job, "num")
        assert len(composing) == (2 if launcher else 0)
        loader.load_sweep_config(config, ["layout=smoke", "tp=4"])  # not a job of the preflight: composed
        assert len(composing) == (3 if launcher else 1)


@pytest.mark.parametrize(
    ("overrides", "multirun", "compositions"),
    [
        (["layout=smoke"], False, 1),  # a run: Hydra's mode check, then the run's composition
        (["layout=smoke", "tp=1,2"], True, 1),  # --multirun: a run's check refuses the sweep; the sweep's composes
        (["sweep=ci"], False, 2),  # a config that names MULTIRUN: the run's composition is not the sweep's
        (["layout=smoke", "hydra.mode=RUN"], False, 1),  # a mode named on the command line: nothing appended
    ],
)
def test_the_command_line_composes_once_what_hydra_composes_twice_and_gets_the_same_config(
    monkeypatch, overrides, multirun, compositions
):
    """Hydra composes the config to read its mode, then again (with ``hydra.mode=...`` appended where none was named)
    for the run or the sweep's master config; ``compose_mode_once`` hands the first to the second, which must be the
    config Hydra would have composed, hydra node and all."""
    with initialize_config_module("conf", version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        named = hydra.get_mode("config", list(overrides))  # Hydra's own, as its command line runs it
        mode = named or (RunMode.MULTIRUN if multirun else RunMode.RUN)
        appended = [] if named else [f"hydra.mode={mode.name}"]
        expected = OmegaConf.to_yaml(hydra.compose_config("config", [*overrides, *appended], run_mode=mode))
        composing = []
        compose = ConfigLoaderImpl._compose_config_from_defaults_list
        monkeypatch.setattr(
            ConfigLoaderImpl,
            "_compose_config_from_defaults_list",
            lambda *a, **k: composing.append(1) or compose(*a, **k),
        )
        with compose_mode_once():
            assert hydra.get_mode("config", list(overrides)) == named
            config = hydra.compose_config("config", [*overrides, *appended], run_mode=mode)
        assert OmegaConf.to_yaml(config) == expected
        assert len(composing) == compositions
        hydra.compose_config("config", [*overrides, *appended], run_mode=mode)  # handed over once: composed again
        assert len(composing) == compositions + 1


@pytest.mark.parametrize(
    ("subdir", "message"),
    [
        ("x", "tp=2) cannot run: its run dir, hydra.sweep.subdir='x', is job #0's too"),
        ("/elsewhere", "tp=1) cannot run: hydra.sweep.subdir='/elsewhere' is not a dir inside the sweep dir"),
        ("../up", "tp=1) cannot run: hydra.sweep.subdir='../up' is not a dir inside the sweep dir"),
        ("tokens/x${hydra.job.num}", "tp=1) cannot run: hydra.sweep.subdir='tokens/x0' lies inside the sweep's"),
        ("checks", "tp=1) cannot run: hydra.sweep.subdir='checks' lies inside the sweep's checks/ dataset folder"),
    ],
)
def test_jobs_whose_run_dirs_are_shared_or_outside_the_sweep_stop_it_before_any_job_runs(subdir, message):
    """Jobs sharing a dir replaced each other's runs, and a dir outside the sweep was never found: every job ran, and
    the sweep ended INCOMPLETE. Job dirs in the sweep's own dataset folders ran too, and broke the sweep's datasets
    for every reader."""
    overrides = ["layout=smoke", f"hydra.sweep.subdir={subdir}"]
    with initialize_config_module("conf", version_base="1.3"):
        config = compose("config", overrides=overrides, return_hydra_config=True)
        with pytest.raises(ConfigError, match=re.escape(message)):
            preflight_jobs(config, [(*overrides, f"tp={tp}") for tp in (1, 2)])


@pytest.mark.parametrize("start", ["on_run_start", "on_multirun_start"])
def test_hydra_job_chdir_is_refused_before_anything_is_written(tmp_path, capsys, start):
    """In a job that changed into its own dir a relative hydra.sweep.dir named a dir under that job's: the sweep's
    tables landed there, or outside the sweep dir through ``..`` and the sweep was judged GREEN without them."""
    overrides = ["layout=smoke", "hydra.job.chdir=true", f"hydra.run.dir={tmp_path}", f"hydra.sweep.dir={tmp_path}"]
    with initialize_config_module("conf", version_base="1.3"):
        config = compose("config", overrides=overrides, return_hydra_config=True)
        with pytest.raises(SystemExit) as stop:
            getattr(RlsweepCallback(), start)(config)
    assert stop.value.code == ExitCode.ERROR
    assert capsys.readouterr().err.startswith("rlsweep: error: hydra.job.chdir=true: rlsweep reads every path")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("subdir", ["null", "meta"])
@pytest.mark.parametrize("start", ["on_run_start", "on_multirun_start"])
def test_a_hydra_record_written_elsewhere_is_refused_before_anything_is_written(tmp_path, capsys, start, subdir):
    """Without .hydra/overrides.yaml no job's run could be found: the sweep ran every job and was INCOMPLETE."""
    overrides = [
        "layout=smoke",
        f"hydra.output_subdir={subdir}",
        f"hydra.run.dir={tmp_path}",
        f"hydra.sweep.dir={tmp_path}",
    ]
    with initialize_config_module("conf", version_base="1.3"):
        config = compose("config", overrides=overrides, return_hydra_config=True)
        with pytest.raises(SystemExit) as stop:
            getattr(RlsweepCallback(), start)(config)
    assert stop.value.code == ExitCode.ERROR
    shown = "None" if subdir == "null" else repr(subdir)
    assert capsys.readouterr().err.startswith(f"rlsweep: error: hydra.output_subdir={shown}: rlsweep reads Hydra's")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("start", "key"), [("on_run_start", "hydra.run.dir"), ("on_multirun_start", "hydra.sweep.dir")]
)
def test_an_empty_output_dir_is_refused_not_taken_for_the_current_dir(tmp_path, monkeypatch, capsys, start, key):
    """``hydra.sweep.dir="$OUT"`` with OUT unset wrote the sweep's job dirs and datasets into the current directory."""
    monkeypatch.chdir(tmp_path)
    with initialize_config_module("conf", version_base="1.3"):
        config = compose("config", overrides=["layout=smoke", "tp=1", f"{key}="], return_hydra_config=True)
        with pytest.raises(SystemExit) as stop:
            getattr(RlsweepCallback(), start)(config)
    assert stop.value.code == ExitCode.ERROR
    assert (
        capsys.readouterr().err == f"rlsweep: error: {key}='' is empty: name the output directory ('.' for the "
        "current directory)\n"
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("jobs", "message"),
    [
        ([("tp=1", "tables_dir=/t")], "job #0 (layout=smoke tp=1 tables_dir=/t) cannot run: tables_dir='/t' in a"),
        (
            [("tp=1", "hydra.sweep.subdir=a"), ("tp=2", "hydra.sweep.subdir=a/b")],
            "cannot run: its run dir, hydra.sweep.subdir='a/b', and job #0's ('a') lie one inside the other",
        ),
    ],
    ids=["tables_dir", "nested job dirs"],
)
def test_a_job_whose_outputs_would_go_astray_stops_the_sweep_before_any_job_runs(jobs, message):
    """tables_dir in a sweep was refused only once its job ran, after the jobs before it; a job dir inside another
    job's would be judged as part of that job's."""
    with initialize_config_module("conf", version_base="1.3"):
        config = compose("config", overrides=["layout=smoke"], return_hydra_config=True)
        with pytest.raises(ConfigError, match=re.escape(message)):
            preflight_jobs(config, [("layout=smoke", *job) for job in jobs])


def test_a_job_whose_sweep_dir_depends_on_a_swept_value_stops_the_sweep_before_any_job_runs():
    """Its run and tables went to a dir of their own, outside the sweep: the sweep ran it and was INCOMPLETE."""
    with initialize_config_module("conf", version_base="1.3"):
        config = compose("config", overrides=["layout=smoke", "hydra.sweep.dir=/out/${tp}"], return_hydra_config=True)
        with pytest.raises(ConfigError, match=re.escape("job #1 (layout=smoke tp=2) cannot run: its hydra.sweep.dir "
                                                        "is '/out/2', not the sweep's '/out/1'")):  # fmt: skip
            preflight_jobs(config, [("layout=smoke", f"tp={tp}") for tp in (1, 2)])


def test_a_glob_sweep_lists_the_options_of_its_group_as_hydras_sweeper_does():
    """``glob(...)`` needs the sweep's config loader to list a group's options; without it the sweep stopped on
    Hydra's "ConfigLoader is not set", naming nothing."""
    with initialize_config_module("conf", version_base="1.3"):
        record = {"params": {"tp": "1,2"}, "task": ["profile=glob(triton_*cpu*)"]}
        jobs = job_list(record, "this sweep", GlobalHydra.instance().config_loader())
    assert jobs == [
        (f"tp={tp}", f"profile={profile}") for tp in (1, 2) for profile in ("triton_cpu_bf16", "triton_fused_cpu_bf16")
    ]


def test_every_tp_is_served_by_ranks_that_may_hold_only_padding(tmp_path):
    # At tp=13 ranks 3 to 12 of tiny's vocab in tiles of 1024 hold padding only; the run is judged as any other.
    done = multirun(tmp_path, "profile=cpu_bf16", "layout=smoke", "profile.vocab_tile=1024", "tp=1,13")
    assert done.returncode == 0, done.stdout + done.stderr
    tokens = pd.read_parquet(tmp_path / TOKENS_TABLE)
    assert set(tokens["tp"]) == {1, 13} and tokens.loc[tokens.active, "owner_rank"].max() <= 2


def test_rerun_into_the_same_sweep_dir_skips_complete_jobs(tmp_path):
    first = multirun(tmp_path, "profile=cpu_bf16", *SMALL)
    assert first.returncode == 0, first.stdout + first.stderr
    written = {path: path.stat().st_mtime_ns for path in tmp_path.rglob(PART_FILE)}
    second = multirun(tmp_path, "profile=cpu_bf16", *SMALL)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("is complete in") == 2 and "(same content)" in second.stdout
    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob(PART_FILE)} == written


def test_a_resumed_job_whose_run_lies_in_another_jobs_partition_runs_again(tmp_path, capsys):
    """With job dirs named by their overrides, a sweep resumed with its jobs in another order found job #0's run
    complete in job=1's partition and skipped it; job #1 then replaced that partition: INCOMPLETE after the resume."""
    cfg = compose_run("layout=smoke")
    run_dir = tmp_path / "layout=smoke"
    for number in (1, 0):
        run_job(lambda: run_spec(cfg), RunLocation.sweep_job(run_dir, tmp_path, number), resume=True, standalone=False)
    assert "skipping" not in capsys.readouterr().out
    assert table_file(run_dir, TOKENS_TABLE) == tmp_path / TOKENS_TABLE / "job=0" / PART_FILE


def other_thread_count(patch: pytest.MonkeyPatch) -> None:
    """torch's CPU thread count decides how aten splits a reduction, so it can change a run's bits."""
    threads = torch.get_num_threads()
    patch.setattr(torch, "get_num_threads", lambda: threads + 1)


@pytest.mark.parametrize(
    "change",
    [
        lambda patch: patch.setattr(torch, "__version__", "0.0.0"),
        lambda patch: patch.setattr(importlib.metadata, "version", lambda name: "0.0.0"),  # triton's, read installed
        other_thread_count,
        lambda patch: patch.setattr(environment, "cpu_name", lambda: "another CPU"),
        lambda patch: patch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "ANOTHER"),  # ATen's kernels
    ],
    ids=["torch", "triton", "CPU threads", "CPU", "ATen CPU capability"],
)
def test_resume_content_covers_the_environment_that_computes(monkeypatch, change):
    config = run_spec(compose_run("layout=smoke")).config
    before = identify(config).content_sha256
    change(monkeypatch)
    assert identify(config).content_sha256 != before


@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param(("hydra/launcher=joblib", "hydra.launcher.n_jobs=2"), marks=needs_launcher("joblib")),
        pytest.param(("hydra/launcher=submitit_local",), marks=needs_launcher("submitit")),
    ],
)
def test_launchers_run_the_sweep_and_the_gate(tmp_path, launcher):
    done = multirun(tmp_path, "profile=cpu_bf16", *SMALL, *launcher)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(list((tmp_path / CHECKS_TABLE).glob(f"job=*/{PART_FILE}"))) == 2
    # Stock PyTorch's tp rows are judged by the rounding model, and each says whether it was bitwise all the same.
    tp_rows = sweep_checks(tmp_path).query("judgment == 'tp_invariance'")
    assert len(tp_rows) and (tp_rows["metric"] == "max_error_over_bound").all() and (tp_rows["threshold"] == 1).all()
    assert tp_rows["detail"].str.contains(r"also bitwise: (?:True|False)").all()
    assert "of which also bitwise" in (tmp_path / SUMMARY_FILE).read_text()


def test_check_on_a_directory_without_tables_is_a_usage_error(tmp_path, capsys):
    assert check_main([str(tmp_path)]) == 1
    assert "no rlsweep run" in capsys.readouterr().err


def test_sweep_declarations_apply_only_to_their_profiles_and_tp(tmp_path):
    declaration = "expected_red=[{profiles:[cpu_*],tp:[1],judgment:forward_invariance,cells:[B1/full],reason:x}]"
    done = multirun(tmp_path, "profile=cpu_bf16,negative_control_cpu", *SMALL, declaration)
    assert done.returncode == 2, done.stdout + done.stderr
    checks = pd.read_parquet(tmp_path / CHECKS_TABLE)
    declared = checks[~checks["expected_pass"]]
    assert set(zip(declared["profile"], declared["tp"], declared["lhs_cell"], strict=True)) == {
        ("cpu_bf16", 1, "B1/full")
    }
    # The control, declared nothing here, is caught at every tp, and the gate run again on the tables agrees.
    caught = checks[(checks["profile"] == "negative_control_cpu") & ~checks["passed"]]
    assert set(caught["judgment"]) == {"forward_invariance"} and set(caught["tp"]) == {1, 2}
    assert "-> RED" in done.stdout and check_main([str(tmp_path)]) == 2


# A grad=false job has no gradient verdicts: it leaves a gradient declaration to the jobs that judged gradients, and
# the gate finds it red only where no selected job did.
@pytest.mark.parametrize(("grad", "code"), [("false,true", 0), ("false", 2)])
def test_a_gradient_declaration_of_a_sweep_over_grad_is_judged_by_the_jobs_that_judged_gradients(tmp_path, grad, code):
    declaration = "expected_red=[{profiles:[negative*],judgment:gradient_accuracy,reason:x}]"
    done = multirun(tmp_path, "profile=negative_control_cpu", "layout=smoke", "layout.cells=[BN/packed]",
                    "layout.needles=[]", "tp=1", f"grad={grad}", declaration)  # fmt: skip
    assert done.returncode == code, done.stdout + done.stderr
    checks = pd.read_parquet(tmp_path / CHECKS_TABLE)
    assert not (checks["judgment"] == "expected_red").any()
    if code:
        assert "gradient_accuracy" in done.stdout and "matched 0 verdict(s) of this sweep" in done.stdout


def test_distributed_gloo_ranks_inside_a_sweep_match_emulated_bitwise(tmp_path):
    done = multirun(tmp_path, "profile=triton_cpu_bf16", "layout=smoke", "profile.vocab_tile=1024",
                    "tp=2", "tp_mode=emulated,distributed")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = sweep_checks(tmp_path).query("judgment == 'tp_invariance'")
    assert set(rows["tp_mode"]) == {"distributed"} and set(rows["lhs_cell"]) == run_cells(tmp_path)
    assert rows["passed"].all() and (rows["metric"] == "mismatched_tokens").all()


def red_row(judgment: str, detail: str, **columns) -> dict:
    """A checks row as the listings read it: failed though expected to pass unless ``columns`` say otherwise."""
    row = {"profile": "p", "tp": 1, "judgment": judgment, "tensor": "logp", "lhs_cell": "BN/packed", "metric": "m"}
    return {**row, "passed": False, "expected_pass": True, "detail": detail, **columns}


def test_red_verdicts_are_one_line_per_cause_and_different_causes_never_merge():
    bitwise = "bitwise logp: {} of 27 active tokens differ; first at (sample_id={}, position=8); max |diff| {}"
    tp = "p tp={} (emulated) vs p tp=1 (emulated) ({}); " + bitwise.format(3, 0, "2e-06") + "; also bitwise: False"
    stopped = "not run: provenance stopped the kernels (no logprob backend for 'p' at tp={})"
    declaration = "expected_red {{judgment: smoke, profiles: ['p'] tp=[{}], cells: ['*'], tensors: ['*']}} (x)"
    same = bitwise.format(1, 1, "1e-06")
    stopped_tp = enumerate(FORWARD_TENSORS, 1)
    never_ran = [red_row(j, stopped.format(n), tensor=t, tp=n) for n, t in stopped_tp for j in ("smoke", "kernel_bias")]
    # the red provenance verdict that stopped them: one cause with the rows it kept from running
    refused = red_row("provenance", "no logprob backend for 'p' at tp=2", tensor="", lhs_cell="", metric="", tp=2)
    rows = [
        # three causes: the numbers, run ids, cells and tp degrees of their rows differ; one reason stopped 4 judgments
        *(red_row("forward_invariance", bitwise.format(n, n, f"{n}e-06"), lhs_cell=f"c{n}", tp=n) for n in (1, 2, 4)),
        *(red_row("tp_invariance", tp.format(n, f"{n:016x}"), tp=n) for n in (2, 4)),
        *never_ran,
        refused,
        # then a cause per row that differs from the first cause's rows in one thing, named
        red_row("forward_invariance", same, expected_pass=False, passed=True),  # passed though declared red
        red_row("forward_invariance", same, expected_pass=False),  # failed as declared
        red_row("forward_invariance", same, profile="q"),  # profile
        red_row("forward_invariance", same.replace("logp", "lse"), tensor="lse"),  # tensor
        red_row("forward_accuracy", same),  # judgment, with the same detail
        red_row("smoke", "not run: provenance stopped the kernels (the node did not run)"),  # the reason it never ran
        red_row("expected_red", declaration.format(1) + " matched 0 verdict(s)", tensor="smoke"),
        red_row("expected_red", declaration.format(2) + " matched 0 verdict(s)", tensor="smoke"),  # declaration
    ]  # fmt: skip
    causes = group_by_cause(rows)
    assert [len(cause.rows) for cause in causes] == [3, 2, 5] + [1] * 8
    assert causes[0].line.startswith(
        "3 verdicts: p forward_invariance logp (expected pass) at tp=1 c1, tp=2 c2, tp=4 c4; first: bitwise logp: 1 of"
    )
    assert causes[2].line.startswith("5 verdicts: p provenance (expected pass) at tp=1 smoke logp BN/packed m,")
    assert causes[2].line.endswith(
        "and 2 more; first: provenance stopped the kernels (no logprob backend for 'p' at tp=1)"
    )
    assert "(expected red, passed)" in causes[3].line and "(failed as declared)" in causes[4].line
    left = len(rows) - len(causes[0].rows) - len(causes[1].rows)
    assert cause_lines(rows, limit=2, rest="summary.md")[2:] == [f"... 9 more causes ({left} verdicts) in summary.md"]


@pytest.mark.xdist_group("small_sweep")
def test_the_gate_lists_red_verdicts_by_cause_in_its_console_and_summary(small_sweep):
    # The sweep's control fails forward_invariance in its non-canonical cells at each tp, in logp and in lse: a line
    # per tensor, each with its count, in place of a line per verdict.
    result = run_gate(small_sweep)
    unexpected = result.unexpected
    by_tensor = unexpected.groupby("tensor", observed=True).size()
    assert set(unexpected["judgment"]) == {"forward_invariance"} and (by_tensor > 1).all()
    causes = [f"{count} verdicts: negative_control_cpu forward_invariance {tensor} (expected pass) at tp=1 "
              for tensor, count in by_tensor.items()]  # fmt: skip
    console = [line.removeprefix("  RED ") for line in console_summary(result).splitlines() if "RED " in line]
    assert len(console) == len(causes) and all(map(str.startswith, console, causes)), console
    summary = (small_sweep / SUMMARY_FILE).read_text()  # the multirun's gate wrote it
    listed = [line[2:] for line in summary.split("by cause (every row: ")[-1].splitlines() if line.startswith("- ")]
    assert len(listed) == len(causes) and all(map(str.startswith, listed, causes)), summary
