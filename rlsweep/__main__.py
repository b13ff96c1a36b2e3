"""``python -m rlsweep``: one run (or a Hydra multirun of runs) of the lm_head logprob harness.

Exit codes: 0 every verdict as expected, 2 some verdict not as expected, 1 bad input or crash.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import kernels
from rlsweep.config import register_configs
from rlsweep.errors import RlsweepError
from rlsweep.run import RunOutcome, execute

register_configs()


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
    try:
        outcome = execute(cfg, directory)
    except (RlsweepError, kernels.KernelInputError) as err:
        print(f"rlsweep: error: {err}", file=sys.stderr)
        sys.exit(1)
    print(summary(outcome))
    # A multirun job returns normally on red verdicts: the sweep gate judges all runs from the tables.
    if HydraConfig.get().mode == RunMode.RUN and outcome.exit_code:
        sys.exit(outcome.exit_code)
    return outcome.exit_code


if __name__ == "__main__":
    main()
