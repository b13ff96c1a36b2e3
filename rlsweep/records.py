"""A run's two tables built from what it computed and judged: tokens (one row per cell and token) and checks
(one row per verdict), each with the run columns (docs/tables.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import pyarrow as pa
import torch

from kernels import GradientBound
from rlsweep.execute import CellResult
from rlsweep.judgments import CellGold
from rlsweep.tables import CHECKS_SCHEMA, DIVERGENCE_COLUMNS, DIVERGENCE_SCHEMA, TOKENS_SCHEMA, build_table
from rlsweep.tensor_files import bits_sha256
from rlsweep.verdicts import Verdict


def tokens_table(
    run: Mapping[str, Any],
    results: Sequence[CellResult],
    golds: Sequence[CellGold],
    gradient: GradientBound | None = None,
) -> pa.Table:
    """One row per (cell, sample_id, position), every cell in logical order with its gold's reference and bounds
    (``golds[i]`` is ``results[i]``'s); no row where nothing ran."""
    columns: dict[str, list] = {name: [] for name in TOKENS_SCHEMA.names}
    for result, gold in zip(results, golds, strict=True):
        reference, workload, bound = gold.reference, gold.workload, gold.standard.bound
        count = workload.num_tokens
        if result.grad_hidden is None or gradient is None:
            columns["grad_norm"] += [math.nan] * count
            columns["grad_used"] += [math.nan] * count
            columns["grad_bits"] += [None] * count
        else:
            grad = result.grad_hidden.double()
            columns["grad_norm"] += grad.norm(dim=1).tolist()
            error = (grad - gradient.reference_hidden).abs()
            # No error uses none of a bound, even of 0; a NaN element uses all of it and more (the verdict fails it).
            used = torch.where(error == 0, 0.0, error.nan_to_num(nan=math.inf, posinf=math.inf) / gradient.hidden)
            columns["grad_used"] += used.amax(dim=1).tolist()
            columns["grad_bits"] += [row_bits(row) for row in result.grad_hidden]
        columns["grad_weight_bits"] += [result.grad_weight_bits] * count
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


def row_bits(row: torch.Tensor) -> str:
    """A token's d hidden as a short fingerprint of its bits: equal rows have equal ones, so runs compare bitwise."""
    return bits_sha256(row)[:16]


def checks_table(run: Mapping[str, Any], verdicts: Sequence[Verdict]) -> pa.Table:
    """One row per verdict."""
    names = [name for name in CHECKS_SCHEMA.names if name in Verdict.__dataclass_fields__]
    columns = {name: [getattr(verdict, name) for verdict in verdicts] for name in names}
    return build_table(CHECKS_SCHEMA, run, columns, len(verdicts))


def divergence_table(run: Mapping[str, Any], rows: pd.DataFrame | None) -> pa.Table:
    """A whole model's divergence rows (``rlsweep.divergence``) with the run columns; no row for a head's run, or
    where every cell gave the canonical cell's bits."""
    columns = {name: [] if rows is None else rows[name].tolist() for name in DIVERGENCE_COLUMNS}
    return build_table(DIVERGENCE_SCHEMA, run, columns, 0 if rows is None else len(rows))
