"""A backend of one's own is one module plus one profile YAML (docs/extending.md), run end to end."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import forkserver
import pandas as pd
import pytest
from rlsweep_fixtures import compose_run, import_path, suite_overrides

from rlsweep.config import run_spec
from rlsweep.errors import ConfigError
from rlsweep.exitcodes import ExitCode

TESTS = Path(__file__).parent
TOY_CONF = TESTS / "toy_conf"


def rlsweep(
    directory: Path, *overrides: str, config_dir: Path = TOY_CONF, modules: Path | str = TESTS
) -> subprocess.CompletedProcess:
    """``python -m rlsweep --config-dir <config_dir> ... --multirun`` with ``modules`` (tests/) on the import path."""
    args = ["--config-dir", str(config_dir), f"hydra.sweep.dir={directory}", *suite_overrides(overrides), "--multirun"]
    env = {"PYTHONPATH": import_path(modules)}
    return forkserver.run("-m", "rlsweep", args, env=env, cwd=TESTS.parent, timeout=600)


@pytest.mark.xdist_group("extending")
def test_a_toy_backend_from_a_test_module_runs_and_is_judged_end_to_end(tmp_path):
    done = rlsweep(tmp_path, "profile=toy_cpu", "layout=smoke", "tp=1,3")
    assert done.returncode == ExitCode.GREEN, done.stdout + done.stderr
    checks = pd.read_parquet(tmp_path / "checks")
    assert set(checks["profile"]) == {"toy_cpu"} and set(checks["backend_family"]) == {"toy"}
    provenance = checks[checks["judgment"] == "provenance"]
    assert provenance["passed"].all() and provenance["detail"].str.contains("matmul: toy (aten::mm)", regex=False).any()
    sweep = pd.read_parquet(tmp_path / "sweep_checks.parquet")
    tp_rows = sweep[sweep["judgment"] == "tp_invariance"]
    assert len(tp_rows) and (tp_rows["metric"] == "mismatched_tokens").all() and (tp_rows["value"] == 0).all()


@pytest.mark.xdist_group("extending")
def test_a_trainer_function_written_from_the_docs_is_judged_as_it_truly_is_at_tp_1_and_2(tmp_path):
    """tests/trainer_backend.py is docs/extending.md's trainer recipe: fp32 log_softmax then gather, and the same
    under torch.compile(dynamic=True). Each runs at tp 1 and 2 with nothing written for tp 2, its provenance observed
    (the compiled one as the graph that ran), and is red exactly where its bits moved: the compiled graph for a
    1-row call is another graph, whose bits may differ on this CPU."""
    profiles = "profile=my_trainer_cpu,my_trainer_compiled_cpu"
    done = rlsweep(tmp_path, profiles, "tp=1,2", "layout.cells=[BN/packed,B1/chunked]", "layout.chunk_size=5")
    checks, tokens = pd.read_parquet(tmp_path / "checks"), pd.read_parquet(tmp_path / "tokens")
    provenance = checks[checks["judgment"] == "provenance"]
    assert provenance["passed"].all(), provenance["detail"].tolist()
    nodes = provenance[provenance["metric"] == "mismatched_nodes"]
    compiled = nodes[nodes["profile"] == "my_trainer_compiled_cpu"]["detail"]
    assert compiled.str.contains(r"logprob: my_trainer_compiled \(torch\.compile::graph\)").all(), compiled.tolist()
    eager = checks[checks["profile"] == "my_trainer_cpu"]
    assert eager["passed"].all(), eager[~eager["passed"]]["detail"].tolist()
    # Red as it truly is: a cell's invariance verdict fails exactly when its stored logp bits differ from the
    # canonical cell's, which the tables show on their own.
    moved = set()
    for (profile, tp), run in tokens[tokens["active"]].groupby(["profile", "tp"]):
        cells = run.pivot_table(index=["sample_id", "position"], columns="cell", values="logp", aggfunc="first")
        bits = cells.apply(lambda column: column.to_numpy().view("int32"))
        if (bits["B1/chunked"] != bits["BN/packed"]).any():
            moved.add((profile, tp))
    invariance = checks[(checks["judgment"] == "forward_invariance") & (checks["tensor"] == "logp")]
    failed = {(row.profile, row.tp) for row in invariance.itertuples() if not row.passed}
    assert failed == moved
    assert done.returncode == (ExitCode.RED if moved else ExitCode.GREEN), done.stdout + done.stderr


SNEAKY = """
import torch
import kernels
from trainer_backend import CAPABILITY, REDUCES
from kernels.backend import STOCK_MATMUL_OPS


@kernels.register_backend(
    "sneaky", kernels={"matmul": STOCK_MATMUL_OPS, "logprob": REDUCES, "tp_merge": REDUCES}, capability=CAPABILITY
)
class Sneaky:  # its lse through amax and sum, which it does not declare
    def logits_logprob(self, logits, targets):
        x = logits.float()
        top = x.amax(-1, keepdim=True)
        lse = (top + (x - top).exp().sum(-1, keepdim=True).log()).squeeze(-1)
        return torch.log_softmax(x, -1).gather(-1, targets[:, None]).squeeze(-1), lse
"""


def test_a_backend_refused_mid_run_is_one_cause_with_the_verdicts_it_kept_from_running(tmp_path):
    """A provenance mismatch in a cell's call was listed twice: the provenance verdict said the error and each call's
    mismatch, the verdicts it stopped said the error alone, so a reader saw two causes for one."""
    (tmp_path / "sneaky_backend.py").write_text(SNEAKY)
    profile = (TOY_CONF / "profile" / "my_trainer_cpu.yaml").read_text().replace("my_trainer", "sneaky")
    (tmp_path / "conf" / "profile").mkdir(parents=True)
    (tmp_path / "conf" / "profile" / "sneaky_cpu.yaml").write_text(profile.replace("trainer_backend", "sneaky_backend"))
    modules = os.pathsep.join([str(tmp_path), str(TESTS)])
    done = rlsweep(
        tmp_path / "sweep", "profile=sneaky_cpu", "layout=smoke", config_dir=tmp_path / "conf", modules=modules
    )
    assert done.returncode == ExitCode.RED, done.stdout + done.stderr
    checks = pd.read_parquet(tmp_path / "sweep" / "checks")
    assert checks["detail"].str.contains("launched 'aten::amax', which it does not declare").any()
    listed = [line for line in done.stdout.splitlines() if " verdicts: " in line or " verdict: " in line]
    red = len(checks[~checks["passed"]])
    assert [line.split(" (")[0].strip() for line in listed] == [
        f"{red} verdicts: provenance",
        f"RED {red} verdicts: sneaky_cpu provenance",
    ]


def write_profile(config_dir: Path, **fields: str) -> None:
    (config_dir / "profile").mkdir(parents=True, exist_ok=True)
    profile = (TOY_CONF / "profile" / "toy_cpu.yaml").read_text()
    for key, value in fields.items():
        profile = "\n".join(f"{key}: {value}" if line.startswith(f"{key}:") else line for line in profile.splitlines())
    (config_dir / "profile" / "toy_cpu.yaml").write_text(profile + "\n")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"backend_module": "no_such_backend_module"}, "backend_module='no_such_backend_module' cannot be imported"),
        ({"backend_family": "toy_typo"}, "backend_family='toy_typo' is not one of"),
    ],
    ids=["module not importable", "module registers another id"],
)
def test_a_profile_whose_backend_cannot_be_found_stops_before_any_job(tmp_path, fields, message):
    write_profile(tmp_path / "conf", **fields)
    done = rlsweep(tmp_path / "sweep", "profile=toy_cpu", "layout=smoke", "tp=1,2", config_dir=tmp_path / "conf")
    assert done.returncode == ExitCode.ERROR, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "job #0" in lines[0], done.stderr
    assert not (tmp_path / "sweep").exists()


@pytest.mark.xdist_group("extending")
def test_resume_reruns_a_job_whose_backend_module_changed(tmp_path):
    # The backend is a user's module outside rlsweep: an edit to it must redo the job, not reuse its old verdicts.
    project = tmp_path / "project"
    (project / "conf" / "profile").mkdir(parents=True)
    shutil.copy(TESTS / "toy_backend.py", project)
    shutil.copy(TOY_CONF / "profile" / "toy_cpu.yaml", project / "conf" / "profile")
    overrides = ("profile=toy_cpu", "layout=smoke", "tp=1")
    first = rlsweep(tmp_path / "sweep", *overrides, config_dir=project / "conf", modules=project)
    assert first.returncode == ExitCode.GREEN, first.stdout + first.stderr
    backend = project / "toy_backend.py"
    merge = "lse = top + torch.log(total)"
    assert merge in backend.read_text()
    backend.write_text(backend.read_text().replace(merge, f"{merge} + 0.5"))  # every lse off by 0.5
    second = rlsweep(tmp_path / "sweep", *overrides, config_dir=project / "conf", modules=project)
    assert second.returncode == ExitCode.RED, second.stdout + second.stderr
    assert "skipping" not in second.stdout


@pytest.mark.parametrize("code", ["0", "None", "'text'"])
def test_a_backend_module_that_exits_while_imported_is_an_error_naming_it(tmp_path, monkeypatch, code):
    # sys.exit() is no Exception: a sweep's checks said "rlsweep: error: 0" (a single run: no module named).
    name = f"exits_at_import_{abs(hash(code))}"
    (tmp_path / f"{name}.py").write_text(f"import sys\nsys.exit({code})\n")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(ConfigError) as caught:
        run_spec(compose_run("layout=smoke", f"profile.backend_module={name}"))
    assert str(caught.value).startswith(
        f"profile 'cpu_bf16': its backend module {name!r} (profile.backend_module) exited, through "
        f"sys.exit({eval(code)!r}), while being imported; "
    ), caught.value


EXITING_BACKEND = """
import kernels
from kernels.backend import STOCK_MATMUL_OPS
from toy_backend import TILE_OPS, ToyBackend

NODES = {"matmul": STOCK_MATMUL_OPS, "logprob": TILE_OPS, "tp_merge": TILE_OPS}


@kernels.register_backend("exiting", kernels=NODES, capability=kernels.BACKENDS["toy"].capability)
class ExitingBackend(ToyBackend):
    def matmul(self, hidden, weight):
        raise SystemExit(0)  # as sys.exit(0) does, inside the kernel call
"""


def test_a_backend_that_exits_inside_a_kernel_call_fails_its_job_naming_the_module(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "exiting_backend.py").write_text(EXITING_BACKEND)
    shutil.copy(TESTS / "toy_backend.py", project)
    write_profile(tmp_path / "conf", backend_family="exiting", backend_module="exiting_backend",
                  required_nodes="{matmul: exiting, logprob: exiting, tp_merge: exiting}")  # fmt: skip
    done = rlsweep(tmp_path / "sweep", "profile=toy_cpu", "layout=smoke", "tp=1", config_dir=tmp_path / "conf",
                   modules=project)  # fmt: skip
    assert done.returncode == ExitCode.ERROR, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"rlsweep: error: job #0 ({' '.join(suite_overrides(['profile=toy_cpu', 'layout=smoke', 'tp=1']))}) failed: "
        "profile 'toy_cpu': its backend module 'exiting_backend' (profile.backend_module) exited, through "
        "sys.exit(0), while the run computed, before its verdicts; a backend module registers its backend and its "
        "kernels return or raise: neither may end the process"
    ], done.stderr
