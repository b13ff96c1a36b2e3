"""``python -m rlsweep`` (or ``rlsweep``): one run, or a Hydra multirun of runs gated at its end.

Exit codes are ``rlsweep.exitcodes.ExitCode`` (docs/sweeps.md). Hydra is told to re-raise errors
(HYDRA_FULL_ERROR) so that every failure, Hydra's own included, ends here as one line and exit 1; the
sweep gate runs after Hydra returns, where no exception can be turned into a warning.
"""

# ruff: noqa: E402 -- the signal handlers go in before the imports below, which take seconds (torch, Hydra)
from __future__ import annotations

from rlsweep.exitcodes import (
    ErrorLine,
    ExitCode,
    describe_exit,
    exit_site,
    exit_without_teardown,
    guarded,
    one_line,
    one_line_usage,
    run_command,
    stop_at_once,
)

PROG = "rlsweep"
# python -m rlsweep runs this file as __main__, the console script imports it as rlsweep.__main__: either way this
# process is the command, and a signal from here on ends it with one line. A process that re-imports its parent's
# main module (a launcher's worker does, as __mp_main__) keeps its own handlers.
if __name__ in ("__main__", "rlsweep.__main__"):
    stop_at_once(PROG)

import gc
import os
import shlex
import sys
from pathlib import Path
from typing import NoReturn

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rlsweep import CONF_DIR
from rlsweep.callbacks import SESSION, compose_mode_once, require_callback
from rlsweep.check import gate_directory
from rlsweep.config import register_configs, run_spec, saved_config_sha256
from rlsweep.errors import ConfigError, RlsweepError, UsageError
from rlsweep.job import run_job
from rlsweep.manifest import HYDRA_CONFIG
from rlsweep.run import choose_triton_mode
from rlsweep.spec import backend_exit, check_tables_dir
from rlsweep.tables import RunLocation

register_configs()
choose_triton_mode()


class JobFailed(RlsweepError):
    """A sweep job that stopped on an error: Hydra's sweeper re-raises it once the batch is done (exit 1)."""


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def app(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.RUN:  # its error is this process's one line, not Hydra's "Error executing job"
        SESSION.code = guarded(PROG, lambda: run_at(cfg, single_run_location(cfg), resume=False, standalone=True))
        return
    SESSION.multirun = True
    try:
        require_callback()
        if cfg.tables_dir is not None:
            raise ConfigError(f"tables_dir={cfg.tables_dir!r} in a sweep: the jobs write into the sweep's datasets")
        location = RunLocation.sweep_job(
            Path(hydra_cfg.runtime.output_dir), Path(hydra_cfg.sweep.dir), hydra_cfg.job.num
        )
        run_at(cfg, location, resume=True, standalone=False)
    except Exception as err:
        overrides = " ".join(hydra_cfg.overrides.task)
        SESSION.job_error = f"job #{hydra_cfg.job.num} ({overrides}) failed: {one_line(err)}"  # its progress line
        raise JobFailed(SESSION.job_error) from err


def single_run_location(cfg: DictConfig) -> RunLocation:
    """A single run's dataset root: ``tables_dir`` where set (an empty one is refused: as a path it is '.'), else the
    Hydra run dir."""
    if cfg.tables_dir is None:
        return RunLocation.single(Path(HydraConfig.get().runtime.output_dir))
    check_tables_dir(cfg.tables_dir)
    return RunLocation.single(Path(cfg.tables_dir))


def run_at(cfg: DictConfig, location: RunLocation, *, resume: bool, standalone: bool) -> ExitCode:
    """The run of a composed config at ``location``: its RunSpec is parsed here, at the top, and nowhere else.

    A ``sys.exit()`` inside the run (a backend module's, a library's) is its error: let through, exit 0 ended the
    process GREEN with no tables, and in a sweep skipped the other jobs and the gate.
    """
    # The manifest names the config Hydra saved beside the tables only where one is: not with tables_dir elsewhere,
    # nor with hydra.output_subdir=null; a run whose saved config is later deleted is then incomplete.
    saved = saved_config_sha256(cfg) if (location.run_dir / HYDRA_CONFIG).is_file() else None
    try:
        return run_job(lambda: run_spec(cfg), location, resume=resume, standalone=standalone, saved_config_sha256=saved)
    except SystemExit as stop:
        raise RlsweepError(run_exit(cfg, stop)) from None


def run_exit(cfg: DictConfig, stop: SystemExit) -> str:
    """The error line of a run that a ``sys.exit()`` ended: its profile's backend module's, named as such, or any
    other code's (a library's), named by its module."""
    module, site = cfg.profile.get("backend_module"), exit_site(stop)
    if module and site and site.split(".")[0] == module.split(".")[0]:
        return backend_exit(cfg.profile.name, module, stop, "the run computed, before its verdicts")
    return f"the run ended early through {describe_exit(stop)}, before its verdicts"


def check_command_line(argv: list[str]) -> None:
    """Hydra's command line, read as Hydra reads it, its errors one line each (Hydra's parser would print its usage
    and exit 2). Overrides are one group: argparse leaves those after a flag that follows the group unread
    (``tp=1,2 --multirun seed=3``), so they are refused saying where they go, not as bare unrecognized arguments."""
    parser = one_line_usage(get_args_parser())
    args, unread = parser.parse_known_args(argv)
    late = [arg for arg in unread if not arg.startswith("-")]
    if late and len(late) == len(unread):  # an unknown flag among them: argparse's own line names it
        position = max(index for index, arg in enumerate(argv) if arg == late[0])
        flag = next((arg for arg in reversed(argv[:position]) if arg.startswith("-")), "the flags")
        rest = list(argv)
        for override in [*args.overrides, *late]:
            rest.remove(override)
        said = "an override after {} is" if len(late) == 1 else "overrides after {} are"
        raise UsageError(
            f"{shlex.join(late)}: {said.format(flag)} not read (argparse takes the overrides as one group); put "
            f"every override before {flag}: {shlex.join([PROG, *args.overrides, *late, *rest])}"
        )
    parser.parse_args(argv)


def command() -> ExitCode:
    check_command_line(sys.argv[1:])
    with compose_mode_once():
        app()
    if SESSION.failed:  # one line each, in the launching process, whichever launcher ran the jobs; no gate
        for line in SESSION.failed.values():
            ErrorLine.say(PROG, line)
        return ExitCode.ERROR
    if SESSION.sweep_dir is not None:
        return gate_directory(SESSION.sweep_dir)
    if SESSION.multirun:  # the sweep's start callback never recorded it: nothing would gate its jobs
        raise RlsweepError("the sweep's jobs ran but its start callback did not record the sweep, so no gate judged it")
    return SESSION.code if SESSION.code is not None else ExitCode.GREEN


def main() -> int:
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # read by Hydra when it reports an error: re-raise it to us
    sys.argv[0] = PROG  # usage lines and shell completion name the command, not __main__.py
    # What the imports built (torch, Triton, pandas, Hydra: ~450k objects) lives as long as the process. Frozen, the
    # garbage collector no longer walks it in every full collection; what a run allocates is collected as before.
    # Measured on a 2-core CPU: model=qwen3_tiny profile=hf_sdpa_cpu_bf16, 7.8 s -> 6.5 s.
    gc.freeze()
    return run_command(PROG, command)


def cli() -> NoReturn:
    """The ``rlsweep`` console command: ``main``, then the process ends without tearing its modules down."""
    exit_without_teardown(main())


if __name__ == "__main__":
    cli()
