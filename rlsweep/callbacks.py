"""rlsweep's Hydra callback: output-dir check, every job checked before the first runs, the sweep lock, progress.

Hydra turns an ordinary exception raised in a callback into a warning and goes on, so nothing here may
judge: the sweep gate runs after Hydra returns (``rlsweep.__main__``), and a callback that fails ends the
process through SystemExit(1) with one line. Progress lines are information only and never raise.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.hydra import Hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from rlsweep.config import job_list, run_spec, sweep_record
from rlsweep.discovery import refuse_run_over_sweep, refuse_sweep_over_run, write_job_list
from rlsweep.errors import ConfigError
from rlsweep.exitcodes import ExitCode, one_line
from rlsweep.gate import remove_sweep_outputs
from rlsweep.listing import list_tree
from rlsweep.locks import acquire
from rlsweep.manifest import HYDRA_CONFIG, MANIFEST_FILE, canonical_sha256, verify_run
from rlsweep.run import preflight
from rlsweep.tables import CHECKS_SCHEMA, CHECKS_TABLE, RUN_TABLES, read_table, unwritable_reason
from rlsweep.verdicts import as_expected

CALLBACK_TARGET = "rlsweep.callbacks.RlsweepCallback"
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


@dataclass
class Session:
    """What the Hydra app leaves for the process: a single run's code, or the dir of the sweep to gate."""

    code: ExitCode | None = None
    sweep_dir: Path | None = None
    # A multirun ran in this process (a job of it here, or its end under any launcher): it must have been recorded.
    multirun: bool = False
    job_error: str | None = None  # the error of the sweep job that last failed in this process, in one line
    failed: dict[tuple[str, ...], str] = field(default_factory=dict)  # a failed job's overrides -> its error line


SESSION = Session()


class FailedJob(JobReturn):
    """A failed job's return, read by the sweeper in the launching process (``on_job_end`` makes it one, wherever the
    job ran): Hydra's would write "Error executing job ..." and raise, so a sweep said one failure in two lines and
    the others not at all. Its error is recorded instead: one line each, which ``rlsweep.__main__`` ends with."""

    @property
    def return_value(self) -> Any:
        SESSION.failed.setdefault(tuple(self.overrides or ()), one_line(self._return_value))
        return None


def check_output_dir(directory: str, key: str) -> None:
    """``directory`` can be written; an empty one (a quoted unset variable) is never taken for the current dir."""
    if not str(directory).strip():
        raise ConfigError(f"{key}={directory!r} is empty: name the output directory ('.' for the current directory)")
    reason = unwritable_reason(Path(directory))
    if reason:
        raise ConfigError(f"output directory {directory!r} ({key}) cannot be written: {reason}")


def check_start_dir(config: DictConfig) -> None:
    """A run reads and writes every path it is given (hydra.sweep.dir, tables_dir, the weight and replay files) from
    where rlsweep started: a job that changed into its own dir would write a sweep's tables under the job's dir."""
    if config.hydra.job.chdir:
        raise ConfigError(
            "hydra.job.chdir=true: rlsweep reads every path it is given (hydra.sweep.dir, tables_dir, weight and "
            "replay files) from where it was started, so a job in its own dir would read and write them elsewhere; "
            "leave hydra.job.chdir=false (paths in the config may be absolute)"
        )


def check_hydra_record(config: DictConfig) -> None:
    """Hydra writes its record of a run where rlsweep reads it (``rlsweep.manifest.HYDRA_CONFIG``): a sweep finds each
    job's run by the overrides there, and a run's tables count only while they match the config saved there."""
    subdir = config.hydra.output_subdir
    if subdir is None or Path(subdir) != HYDRA_CONFIG.parent:
        raise ConfigError(
            f"hydra.output_subdir={subdir!r}: rlsweep reads Hydra's record of a run from {str(HYDRA_CONFIG.parent)!r} "
            "(a sweep finds each job's run by its overrides there: elsewhere it would run every job and find none; a "
            f"run's tables count only while they match the config saved there); leave it {str(HYDRA_CONFIG.parent)!r}"
        )


def run_in_tables_dir(config: DictConfig) -> None:
    """``tables_dir=D`` makes D the run's dir: Hydra's record of the run and its log go there too, beside the tables
    and the manifest that must match that record. In another dir the record, without a manifest, would read as a
    run that never finished, and D's tables would go unchecked against the config that made them.

    Hydra makes the run's dir from this same config after the callback (``hydra.core.utils.run_job``). A
    ``hydra.run.dir`` given as well, naming another dir, is refused: the run has one dir.
    """
    tables_dir = os.path.abspath(config.tables_dir)
    for override in config.hydra.overrides.hydra:
        key, _, value = str(override).partition("=")
        if key.lstrip("+~") == "hydra.run.dir" and os.path.abspath(config.hydra.run.dir) != tables_dir:
            raise ConfigError(
                f"tables_dir={config.tables_dir!r} and hydra.run.dir={value!r} name two dirs for one run: with "
                "tables_dir the run's dir is tables_dir (its tables, manifest, log and Hydra's record); give one"
            )
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.run.dir = config.tables_dir


def fatal(step: Callable[[], None]) -> None:
    """Run a callback step; any failure is one line and exit 1, which Hydra cannot swallow."""
    try:
        step()
    except BaseException as err:
        print(f"rlsweep: error: {one_line(err)}", file=sys.stderr, flush=True)
        raise SystemExit(int(ExitCode.ERROR)) from None


def require_callback() -> None:
    """A sweep is gated only while this callback runs; a job refuses to run in a sweep without it."""
    targets = [str(entry.get("_target_")) for entry in (HydraConfig.get().callbacks or {}).values()]
    if CALLBACK_TARGET not in targets:
        raise ConfigError(f"hydra.callbacks must include {CALLBACK_TARGET} (it locks and gates sweeps); got {targets}")


def red_so_far(sweep_dir: Path) -> tuple[int, int]:
    """(complete runs, verdicts not as expected) among the runs already complete under ``sweep_dir``."""
    complete, red = 0, 0
    for job_dir in sorted({path.parent for path in list_tree(sweep_dir).named(MANIFEST_FILE)}):
        state = verify_run(job_dir)
        if state.complete:
            checks = read_table(state.files[CHECKS_TABLE], CHECKS_SCHEMA).to_pandas()
            complete += 1
            red += int((~as_expected(checks["passed"], checks["expected_pass"])).sum())
    return complete, red


def job_subdir(job_config: DictConfig, num: int) -> str | None:
    """The run dir of job ``num`` inside the sweep dir (``hydra.sweep.subdir``, as the launcher numbers the job), or
    None where it resolves only once the job runs; one outside the sweep dir is refused."""
    with open_dict(job_config):
        job_config.hydra.job.num = job_config.hydra.job.id = num
    try:
        subdir = str(job_config.hydra.sweep.subdir)
    except Exception:  # an interpolation only the launcher can resolve: the gate still finds a shared or lost dir
        return None
    normal = os.path.normpath(subdir)
    if os.path.isabs(subdir) or normal == "." or normal.split(os.sep)[0] == "..":
        raise ConfigError(
            f"hydra.sweep.subdir={subdir!r} is not a dir inside the sweep dir: the gate finds a job's run there only"
        )
    if normal.split(os.sep)[0] in RUN_TABLES:
        raise ConfigError(
            f"hydra.sweep.subdir={subdir!r} lies inside the sweep's {normal.split(os.sep)[0]}/ dataset folder: a "
            "dataset reader would load the job's files as table rows; keep job dirs outside tokens/ and checks/"
        )
    return normal


def nested(one: str | None, other: str) -> bool:
    """Whether two job dirs in a sweep (``job_subdir``) lie one inside the other."""
    return one is not None and (one.startswith(other + os.sep) or other.startswith(one + os.sep))


def preflight_jobs(config: DictConfig, jobs: list[tuple[str, ...]]) -> dict[tuple[str, ...], DictConfig]:
    """Compose every job of the sweep and check it as its run would (``rlsweep.run.preflight``), before any runs;
    each job's overrides -> its config as composed (``reuse_compositions``).

    A job that cannot run (a geometry its profile cannot serve, a contract row it lacks) stops the sweep here,
    in one line naming the job, instead of after the jobs before it have spent their time; so does a job whose
    overrides spell another job's values (``tp=1,01``): it would run and count the same run twice.
    """
    loader = GlobalHydra.instance().config_loader()
    first: dict[str, int] = {}  # the resolved config's hash (a run's id) -> the first job that composes it
    subdirs: dict[str, int] = {}  # a job's run dir in the sweep -> the first job whose it is
    composed: dict[tuple[str, ...], DictConfig] = {}
    for num, overrides in enumerate(jobs):
        try:
            job_config = loader.load_sweep_config(config, list(overrides))
            composed[tuple(overrides)] = copy.deepcopy(job_config)  # before job_subdir numbers this copy
            if job_config.hydra.sweep.dir != config.hydra.sweep.dir:  # it would write its run and tables there
                raise ConfigError(
                    f"its hydra.sweep.dir is {job_config.hydra.sweep.dir!r}, not the sweep's "
                    f"{config.hydra.sweep.dir!r}: hydra.sweep.dir may not depend on a swept value"
                )
            if job_config.get("tables_dir") is not None:
                raise ConfigError(
                    f"tables_dir={job_config.tables_dir!r} in a sweep: the jobs write into the sweep's datasets"
                )
            subdir = job_subdir(job_config, num)
            if subdir is not None and subdirs.setdefault(subdir, num) != num:
                raise ConfigError(
                    f"its run dir, hydra.sweep.subdir={subdir!r}, is job #{subdirs[subdir]}'s too: each job needs a "
                    "dir of its own (the default is its number)"
                )
            outer = next((other for other in subdirs if other != subdir and nested(subdir, other)), None)
            if subdir is not None and outer is not None:
                raise ConfigError(
                    f"its run dir, hydra.sweep.subdir={subdir!r}, and job #{subdirs[outer]}'s ({outer!r}) lie one "
                    "inside the other: each job needs a dir of its own, beside the others (the default is its number)"
                )
            spec = run_spec(job_config)  # its hydra node: its choices
            preflight(spec)
        except Exception as err:
            raise ConfigError(f"job #{num} ({' '.join(overrides)}) cannot run: {one_line(err)}") from err
        earlier = first.setdefault(canonical_sha256(spec.config), num)
        if earlier != num:
            raise ConfigError(
                f"job #{num} ({' '.join(overrides)}) composes the same run config as job #{earlier} "
                f"({' '.join(jobs[earlier])}): the sweep would run and count one run twice, as if it had tried two "
                "values; drop the repeated value"
            )
    return composed


def reuse_compositions(config: DictConfig, composed: dict[tuple[str, ...], DictConfig]) -> None:
    """Hand Hydra's sweeper and launcher each job's config as ``preflight_jobs`` composed it: both compose every job
    again (the sweeper to check its batch, the launcher to run it), and a composition (~0.14 s on a 2-core CPU) is
    most of a small job's time. Each gets a copy of its own, so a job runs exactly the config its preflight checked.
    Only under the basic launcher, whose jobs run in this process: another launcher sends the sweep's config loader
    to its workers as Hydra made it. Overrides the preflight did not compose are composed as before."""
    if OmegaConf.select(config, "hydra.launcher._target_") != BASIC_LAUNCHER:
        return
    loader = GlobalHydra.instance().config_loader()
    compose = loader.load_sweep_config

    def load_sweep_config(master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        found = composed.get(tuple(sweep_overrides)) if master_config is config else None
        return compose(master_config, sweep_overrides) if found is None else copy.deepcopy(found)

    loader.load_sweep_config = load_sweep_config


@contextmanager
def compose_mode_once() -> Iterator[None]:
    """Within it, Hydra's command line composes the config once before a run or a sweep starts, not twice.

    Hydra composes it first to read the mode it names (``Hydra.get_mode``: a sweep config says MULTIRUN), then again,
    from the same overrides and at most a ``hydra.mode=...`` it appends, for the run or the sweep's master config: a
    composition is ~0.3 s on a 2-core CPU, a fifth of a small run's time. Here the mode is read from a composition
    made as the next one will be made (a run's first; where a run's check refuses the overrides, a sweep's), which
    is then handed to that next composition with the appended override applied as Hydra applies it. Any other next
    composition is made as before."""
    read_mode = Hydra.get_mode

    def get_mode(hydra: Hydra, config_name: str | None, overrides: list[str]) -> Any:
        loader = hydra.config_loader
        for run_mode in (RunMode.RUN, RunMode.MULTIRUN):  # a run's composition checks its overrides; get_mode's not
            try:
                config = loader.load_configuration(
                    config_name, list(overrides), run_mode, validate_sweep_overrides=run_mode == RunMode.RUN
                )
            except Exception:
                continue
            hand_over(loader, config_name, list(overrides), run_mode, config)
            return config.hydra.mode
        return None  # as Hydra's: the next composition raises the error

    Hydra.get_mode = get_mode
    try:
        yield
    finally:
        Hydra.get_mode = read_mode


def hand_over(loader: Any, name: str | None, given: list[str], mode: RunMode, config: DictConfig) -> None:
    """``loader``'s next composition is ``config`` where it is asked for the same config name, mode and overrides,
    and at most ``hydra.mode=...`` overrides after them (Hydra's command line appends one); any other is composed."""
    load_configuration = loader.load_configuration

    def next_composition(
        config_name: str | None,
        overrides: list[str],
        run_mode: RunMode,
        from_shell: bool = True,
        validate_sweep_overrides: bool = True,
    ) -> DictConfig:
        del loader.load_configuration  # once: the loader's own method again
        added = overrides[len(given) :]
        if (config_name, run_mode, overrides[: len(given)]) != (name, mode, given) or any(
            not line.startswith("hydra.mode=") for line in added
        ):
            return load_configuration(config_name, overrides, run_mode, from_shell, validate_sweep_overrides)
        parser = OverridesParser.create()
        if validate_sweep_overrides:
            ConfigLoaderImpl.validate_sweep_overrides_legal(parser.parse_overrides(overrides), run_mode, from_shell)
        appended = parser.parse_overrides(added)
        ConfigLoaderImpl._apply_overrides_to_config(appended, config)  # as Hydra applies them, after the others
        config.hydra.overrides.hydra.extend([override.input_line for override in appended])
        return config

    loader.load_configuration = next_composition


class RlsweepCallback(Callback):
    """Registered in conf/config.yaml as ``hydra.callbacks.rlsweep``."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        def start() -> None:
            check_start_dir(config)
            check_hydra_record(config)
            key = "hydra.run.dir" if config.get("tables_dir") is None else "tables_dir"
            directory = OmegaConf.select(config, key)
            check_output_dir(directory, key)
            # Before Hydra writes its record of the run into the dir: a sweep's dir, or another run's, is left as it
            # was.
            refuse_run_over_sweep(Path(directory), key)
            if key == "tables_dir":
                run_in_tables_dir(config)
            # Held until this process ends, from before Hydra writes its record of the run: a second writer stops
            # here, leaving the record of the run that holds the dir as it was.
            acquire(Path(config.hydra.run.dir))

        fatal(start)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        def start() -> None:
            check_start_dir(config)
            check_hydra_record(config)
            check_output_dir(config.hydra.sweep.dir, "hydra.sweep.dir")
            sweep_dir = Path(config.hydra.sweep.dir)
            refuse_sweep_over_run(sweep_dir)
            record = sweep_record(config.hydra, "this sweep")
            jobs = job_list(record, "this sweep", GlobalHydra.instance().config_loader())
            composed = preflight_jobs(config, jobs)
            acquire(sweep_dir)  # held until this process ends, gate included
            remove_sweep_outputs(sweep_dir)  # before any job: a sweep killed before its gate leaves no verdict
            write_job_list(sweep_dir, record, jobs)
            SESSION.sweep_dir = sweep_dir
            reuse_compositions(config, composed)

        fatal(start)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        SESSION.multirun = True  # in the launching process, whichever launcher ran the jobs and wherever

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if HydraConfig.get().mode.name != "MULTIRUN":
            return
        job = HydraConfig.get().job
        print(f"[rlsweep sweep] job #{job.num} starting: {' '.join(HydraConfig.get().overrides.task)}", flush=True)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if HydraConfig.get().mode.name != "MULTIRUN":
            return
        job = HydraConfig.get().job
        if job_return.status == JobStatus.FAILED:  # its return_value would print Hydra's own error line once more
            print(f"[rlsweep sweep] FAILED: {SESSION.job_error or f'job #{job.num} failed before its run'}", flush=True)
            SESSION.job_error = None
            job_return.__class__ = FailedJob
        try:
            runs, red = red_so_far(Path(config.hydra.sweep.dir))
        except Exception as err:
            print(f"[rlsweep sweep] job #{job.num} done; progress unavailable: {one_line(err)}", flush=True)
            return
        print(f"[rlsweep sweep] job #{job.num} done; {runs} runs complete, {red} verdicts not as expected so far",
              flush=True)  # fmt: skip
