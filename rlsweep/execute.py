"""Kernel calls: each layout cell's calls through ``kernels.lm_head_logprob``, results in logical order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

import kernels
from rlsweep.layouts import NONE, Call, Cell, restore_logical_order
from rlsweep.workload import Workload

REFERENCE_BACKEND = "reference"


# hidden[T, H], weight[V, H], targets[T] -> LogprobResult: a dispatched op, or the reference call.
LogprobCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], kernels.LogprobResult]


@dataclass(frozen=True)
class CellResult:
    """One cell's outputs restored to logical order: logp/lse [T] (CPU), owner_rank [T], per-call provenance."""

    cell: Cell
    logp: torch.Tensor
    lse: torch.Tensor
    owner_rank: torch.Tensor
    provenance: tuple[kernels.Provenance, ...]


@dataclass(frozen=True)
class Filler:
    """Unrelated rows for needle calls: hidden [F, H] and targets [F]."""

    hidden: torch.Tensor
    targets: torch.Tensor


def call_inputs(call: Call, workload: Workload, filler: Filler) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [rows, H] and targets [rows] of one call; pad rows are zero with IGNORE_INDEX targets."""
    device = workload.hidden.device
    hidden = workload.hidden.new_zeros((call.rows, workload.hidden.shape[1]))
    targets = torch.full((call.rows,), kernels.IGNORE_INDEX, dtype=torch.int64, device=device)
    logical = (call.logical != NONE).to(device)
    hidden[logical] = workload.hidden[call.logical[call.logical != NONE].to(device)]
    targets[logical] = workload.targets[call.logical[call.logical != NONE].to(device)]
    from_filler = (call.filler != NONE).to(device)
    if bool(from_filler.any()):
        index = call.filler[call.filler != NONE].to(device)
        hidden[from_filler] = filler.hidden[index]
        targets[from_filler] = filler.targets[index]
    return hidden, targets


def run_cell(cell: Cell, workload: Workload, weight: torch.Tensor, filler: Filler, compute: LogprobCall) -> CellResult:
    """Every call of the cell, then logical order; kernels' typed errors propagate unchanged."""
    logps, lses, owners, provenance = [], [], [], []
    for call in cell.calls:
        hidden, targets = call_inputs(call, workload, filler)
        result = compute(hidden, weight, targets)
        logps.append(result.logp.cpu())
        lses.append(result.lse.cpu())
        owners.append(result.owner_rank.cpu())
        provenance.append(result.provenance)
    total = workload.num_tokens
    return CellResult(
        cell=cell,
        logp=restore_logical_order(cell, logps, total),
        lse=restore_logical_order(cell, lses, total),
        owner_rank=restore_logical_order(cell, owners, total),
        provenance=tuple(provenance),
    )


def run_reference(
    canonical: Cell, workload: Workload, weight: torch.Tensor, filler: Filler, vocab_tile: int
) -> CellResult:
    """The float64 gold, once per run, on the canonical cell at tp=1."""
    reference = partial(kernels.lm_head_logprob, backend=REFERENCE_BACKEND, vocab_tile=vocab_tile)
    return run_cell(canonical, workload, weight, filler, reference)
