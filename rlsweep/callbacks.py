"""Hydra callbacks of a multirun: progress per job, and the sweep gate when the last job is done."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from rlsweep.check import gate_directory
from rlsweep.gate import find_run_dirs
from rlsweep.tables import CHECKS_TABLE


def red_so_far(sweep_dir: Path) -> tuple[int, int]:
    """(complete runs, verdicts not as expected) among the tables already on disk."""
    complete, _ = find_run_dirs(sweep_dir)
    red = 0
    for directory in complete:
        checks = pd.read_parquet(directory / CHECKS_TABLE, columns=["passed", "expected_pass"])
        red += int((checks["passed"] != checks["expected_pass"]).sum())
    return len(complete), red


class SweepGate(Callback):
    """Prints which job runs and how many verdicts are red so far; gates the sweep at its end.

    Hydra turns an ordinary exception raised in a callback into a warning, so the gate leaves
    through SystemExit to make the process exit non-zero.
    """

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if HydraConfig.get().mode.name != "MULTIRUN":
            return
        job = HydraConfig.get().job
        print(f"[rlsweep sweep] job #{job.num} starting: {' '.join(HydraConfig.get().overrides.task)}", flush=True)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if HydraConfig.get().mode.name != "MULTIRUN":
            return
        job = HydraConfig.get().job
        if job_return.status == JobStatus.FAILED:
            try:
                job_return.return_value  # noqa: B018  (re-raises the job's exception)
            except Exception as err:
                print(f"[rlsweep sweep] job #{job.num} FAILED ({' '.join(job_return.overrides)}): "
                      f"{type(err).__name__}: {err}", flush=True)  # fmt: skip
        runs, red = red_so_far(Path(config.hydra.sweep.dir))
        print(f"[rlsweep sweep] job #{job.num} done; {runs} runs complete, {red} verdicts not as expected so far",
              flush=True)  # fmt: skip

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        code = gate_directory(config.hydra.sweep.dir)
        if code:
            raise SystemExit(code)
