"""A run's two tables built from what it computed and judged: tokens (one row per cell and token) and checks
(one row per verdict), each with the run columns (docs/tables.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import torch

from rlsweep.execute import CellResult
from rlsweep.tables import CHECKS_SCHEMA, TOKENS_SCHEMA, build_table
from rlsweep.verdicts import Verdict
from rlsweep.workload import Workload


def tokens_table(
    run: Mapping[str, Any],
    results: Sequence[CellResult],
    reference: CellResult | None,
    workload: Workload | None,
    bound: Mapping[str, torch.Tensor],
) -> pa.Table:
    """One row per (cell, sample_id, position), every cell in logical order; no row where nothing ran."""
    columns: dict[str, list] = {name: [] for name in TOKENS_SCHEMA.names}
    for result in results:
        count = workload.num_tokens
        columns["cell"] += [result.cell.name] * count
        columns["sample_id"] += workload.sample_ids.tolist()
        columns["position"] += workload.positions.tolist()
        columns["target_id"] += workload.targets.cpu().tolist()
        columns["active"] += workload.active.tolist()
        columns["logp"] += result.logp.float().tolist()
        columns["lse"] += result.lse.float().tolist()
        columns["ref_logp"] += reference.logp.double().tolist()
        columns["ref_lse"] += reference.lse.double().tolist()
        columns["logp_bound"] += bound["logp"].tolist()
        columns["lse_bound"] += bound["lse"].tolist()
        columns["owner_rank"] += result.owner_rank.tolist()
    return build_table(TOKENS_SCHEMA, run, columns, len(columns["cell"]))


def checks_table(run: Mapping[str, Any], verdicts: Sequence[Verdict]) -> pa.Table:
    """One row per verdict."""
    names = [name for name in CHECKS_SCHEMA.names if name in Verdict.__dataclass_fields__]
    columns = {name: [getattr(verdict, name) for verdict in verdicts] for name in names}
    return build_table(CHECKS_SCHEMA, run, columns, len(verdicts))
