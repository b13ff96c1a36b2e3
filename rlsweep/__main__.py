"""``python -m rlsweep``: one run (or a Hydra multirun of runs) of the lm_head logprob harness.

Exit codes: 0 every verdict as expected, 2 some verdict not as expected, 1 bad input or crash.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import kernels
from rlsweep.config import register_configs
from rlsweep.errors import RlsweepError
from rlsweep.run import RunOutcome, choose_triton_mode, execute, run_id_of
from rlsweep.tables import completed_run_id

register_configs()
choose_triton_mode()


def summary(outcome: RunOutcome) -> str:
    verdicts = outcome.verdicts
    lines = [
        f"rlsweep run {outcome.run_id}: {len(verdicts)} checks, {sum(v.passed for v in verdicts)} passed, "
        f"{len(outcome.unexpected)} not as expected -> {'RED' if outcome.exit_code else 'GREEN'}",
        f"tables: {outcome.directory}",
    ]
    for verdict in outcome.unexpected[:20]:
        expectation = "expected pass" if verdict.expected_pass else "expected red, passed"
        lines.append(
            f"  {verdict.judgment} {verdict.lhs_cell or '-'} {verdict.tensor or '-'} ({expectation}): {verdict.detail}"
        )
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="config")
def main(cfg: DictConfig) -> int:
    directory = Path(cfg.tables_dir or HydraConfig.get().runtime.output_dir)
    single_run = HydraConfig.get().mode == RunMode.RUN
    if not single_run and completed_run_id(directory) == run_id_of(OmegaConf.to_container(cfg, resolve=True)):
        print(f"rlsweep: skipping: tables complete in {directory}")
        return 0
    try:
        outcome = execute(cfg, directory)
    except (RlsweepError, kernels.KernelInputError) as err:
        if not single_run:
            # In a multirun a bad job raises, so Hydra runs the other jobs, names this one and exits 1.
            raise RuntimeError(f"rlsweep: error: {err}") from err
        print(f"rlsweep: error: {err}", file=sys.stderr)
        sys.exit(1)
    print(summary(outcome))
    # A multirun job returns normally on red verdicts: the sweep gate judges all runs from the tables.
    if single_run and outcome.exit_code:
        sys.exit(outcome.exit_code)
    return outcome.exit_code


if __name__ == "__main__":
    main()
