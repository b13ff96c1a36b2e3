"""Layout cells: ways of feeding the same logical tokens to the kernels (docs/index.md).

A cell is a list of calls; each call row names the logical row it computes (or pad/filler), so
any cell's per-call outputs can be put back in logical order with ``restore_logical_order``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlsweep.config import LayoutConfig
from rlsweep.errors import ConfigError
from rlsweep.workload import MAX_SEQ_LEN, Workload, WorkloadShape

CANONICAL_CELL = "BN/packed"
DECODE_CELL = "decode"
CELL_KINDS = (
    "BN/packed",
    "BN/pad_right",
    "BN/pad_left",
    "BN/permuted",
    "BN/chunked",
    "B1/full",
    "B1/chunked",
    "decode",
    "needle",
)
NONE = -1  # a row that computes no logical token (pad), or a row that is not filler
MAX_NEEDLE_ROWS = 1 << 24  # filler rows of one needle call: only rejects typos, the memory estimate decides the rest


@dataclass(frozen=True)
class Call:
    """One kernel call: ``logical`` [n] logical row or NONE; ``filler`` [n] filler index or NONE."""

    logical: torch.Tensor
    filler: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.logical.shape[0])


@dataclass(frozen=True)
class Cell:
    name: str
    calls: tuple[Call, ...]

    @property
    def call_rows(self) -> tuple[int, ...]:
        """Row count of every call, in call order: what a reader needs to see what differed."""
        return tuple(call.rows for call in self.calls)


def logical_call(rows: list[torch.Tensor]) -> Call:
    """A call made of logical rows (NONE entries are pad rows)."""
    logical = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)
    return Call(logical, torch.full_like(logical, NONE))


def pad(count: int) -> torch.Tensor:
    return torch.full((count,), NONE, dtype=torch.int64)


def chunks(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(rows.split(size))


def packed(workload: Workload, layout: LayoutConfig) -> list[Cell]:
    return [Cell("BN/packed", (logical_call([torch.arange(workload.num_tokens)]),))]


def padded(side: str) -> Callable[[Workload, LayoutConfig], list[Cell]]:
    def build(workload: Workload, layout: LayoutConfig) -> list[Cell]:
        width = max(workload.seq_lens)
        rows = []
        for sample, n in enumerate(workload.seq_lens):
            own = workload.sample_rows(sample)
            rows += [own, pad(width - n)] if side == "right" else [pad(width - n), own]
        return [Cell(f"BN/pad_{side}", (logical_call(rows),))]

    return build


def permuted(workload: Workload, layout: LayoutConfig) -> list[Cell]:
    """Samples in reverse order in one call."""
    order = reversed(range(len(workload.seq_lens)))
    return [Cell("BN/permuted", (logical_call([workload.sample_rows(s) for s in order]),))]


def bn_chunked(workload: Workload, layout: LayoutConfig) -> list[Cell]:
    """One call per chunk index k holding chunk k of every sample long enough to have one."""
    per_sample = [chunks(workload.sample_rows(s), layout.chunk_size) for s in range(len(workload.seq_lens))]
    steps = max(len(c) for c in per_sample)
    calls = [logical_call([c[k] for c in per_sample if k < len(c)]) for k in range(steps)]
    return [Cell("BN/chunked", tuple(calls))]


def b1_full(workload: Workload, layout: LayoutConfig) -> list[Cell]:
    calls = [logical_call([workload.sample_rows(s)]) for s in range(len(workload.seq_lens))]
    return [Cell("B1/full", tuple(calls))]


def b1_chunked(workload: Workload, layout: LayoutConfig) -> list[Cell]:
    calls = [
        logical_call([chunk])
        for s in range(len(workload.seq_lens))
        for chunk in chunks(workload.sample_rows(s), layout.chunk_size)
    ]
    return [Cell("B1/chunked", tuple(calls))]


def decode(workload: Workload, layout: LayoutConfig) -> list[Cell]:
    """A prefill call of every inactive (prompt) row, then one call per decode step.

    Step k holds the k-th completion token of every sample still generating, so a call's rows
    come from different samples and the call shrinks as samples finish.
    """
    inactive = torch.nonzero(~workload.active)[:, 0]
    completions = [r[workload.active[r]] for r in map(workload.sample_rows, range(len(workload.seq_lens)))]
    steps = max((len(c) for c in completions), default=0)
    calls = [logical_call([inactive])] if len(inactive) else []
    calls += [logical_call([c[k : k + 1] for c in completions if k < len(c)]) for k in range(steps)]
    return [Cell(DECODE_CELL, tuple(calls))]


def needle_cell_name(m: int, pos: int) -> str:
    return f"needle/M={m}/pos={pos}"


def needles(workload: Workload, layout: LayoutConfig) -> list[Cell]:
    """Per needle (m, pos): one call, every logical row (packed) inserted at row ``pos`` of ``m`` filler rows."""
    cells = []
    for needle in layout.needles:
        own = torch.arange(workload.num_tokens)
        filler = torch.arange(needle.m, dtype=torch.int64)
        logical = torch.cat([pad(needle.pos), own, pad(needle.m - needle.pos)])
        filler_rows = torch.cat([filler[: needle.pos], pad(len(own)), filler[needle.pos :]])
        cells.append(Cell(needle_cell_name(needle.m, needle.pos), (Call(logical, filler_rows),)))
    return cells


CELL_BUILDERS: dict[str, Callable[[Workload, LayoutConfig], list[Cell]]] = {
    "BN/packed": packed,
    "BN/pad_right": padded("right"),
    "BN/pad_left": padded("left"),
    "BN/permuted": permuted,
    "BN/chunked": bn_chunked,
    "B1/full": b1_full,
    "B1/chunked": b1_chunked,
    "decode": decode,
    "needle": needles,
}
assert tuple(CELL_BUILDERS) == CELL_KINDS


def check_layout(layout: LayoutConfig) -> None:
    unknown = [kind for kind in layout.cells if kind not in CELL_KINDS]
    if unknown:
        raise ConfigError(f"layout {layout.name!r}: unknown cell kinds {unknown}; valid: {', '.join(CELL_KINDS)}")
    if not layout.cells or layout.cells[0] != CANONICAL_CELL:
        raise ConfigError(
            f"layout {layout.name!r}: the first cell must be the canonical {CANONICAL_CELL!r}, got {list(layout.cells)}"
        )
    if layout.chunk_size < 1:
        raise ConfigError(f"layout.chunk_size must be >= 1, got {layout.chunk_size!r} (valid: 1 to {MAX_SEQ_LEN})")
    if layout.chunk_size > MAX_SEQ_LEN:
        raise ConfigError(
            f"layout.chunk_size must be at most {MAX_SEQ_LEN} (the longest sample), got {layout.chunk_size!r}"
        )
    if "needle" in layout.cells and not layout.needles:
        raise ConfigError(f"layout {layout.name!r} lists 'needle' cells but layout.needles is empty")
    for needle in layout.needles:
        if not 1 <= needle.m <= MAX_NEEDLE_ROWS or not 0 <= needle.pos <= needle.m:
            raise ConfigError(
                f"layout.needles entry m={needle.m!r} pos={needle.pos!r}: need 1 <= m <= {MAX_NEEDLE_ROWS} "
                "and 0 <= pos <= m"
            )
    names = listed_cells(layout)
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"layout {layout.name!r}: cells {repeated} appear more than once; each cell must be unique")


def cell_names(layout: LayoutConfig) -> list[str]:
    """The names of the cells ``plan_cells`` builds, in order, without building them."""
    check_layout(layout)
    return listed_cells(layout)


def listed_cells(layout: LayoutConfig) -> list[str]:
    return [
        name
        for kind in layout.cells
        for name in ([needle_cell_name(n.m, n.pos) for n in layout.needles] if kind == "needle" else [kind])
    ]


def plan_cells(layout: LayoutConfig, workload: Workload) -> list[Cell]:
    """Every cell of the layout, canonical first."""
    check_layout(layout)
    return [cell for kind in layout.cells for cell in CELL_BUILDERS[kind](workload, layout)]


def largest_calls(layout: LayoutConfig, shape: WorkloadShape) -> dict[str, int]:
    """Cell name -> rows of its largest call, from the token counts alone (no cell is built).

    Mirrors ``CELL_BUILDERS``; tests/test_input_bounds.py compares it with the calls ``plan_cells`` makes.
    """
    check_layout(layout)
    lens, total = shape.seq_lens, shape.num_tokens
    rows = {
        "BN/packed": total,
        "BN/pad_right": len(lens) * max(lens),
        "BN/pad_left": len(lens) * max(lens),
        "BN/permuted": total,
        "BN/chunked": sum(min(layout.chunk_size, n) for n in lens),  # chunk 0 of every sample
        "B1/full": max(lens),
        "B1/chunked": min(layout.chunk_size, max(lens)),
        "decode": max(total - shape.num_active, sum(a > 0 for a in shape.active_lens)),  # prefill or first step
    }
    assert set(rows) | {"needle"} == set(CELL_KINDS), "a new cell kind needs its largest call here"
    rows |= {needle_cell_name(n.m, n.pos): total + n.m for n in layout.needles}
    return {name: rows[name] for name in listed_cells(layout)}


def filler_rows(layout: LayoutConfig) -> int:
    """Filler rows the needle cells use (``filler_rows_needed`` of the planned cells), from the config alone."""
    return max((n.m for n in layout.needles), default=0) if "needle" in layout.cells else 0


def filler_rows_needed(cells: list[Cell]) -> int:
    return max((int(call.filler.max()) + 1 for cell in cells for call in cell.calls if call.rows), default=0)


def restore_logical_order(cell: Cell, per_call: list[torch.Tensor], num_tokens: int) -> torch.Tensor:
    """Per-call outputs [rows_i] -> one tensor [num_tokens] in logical order; every token exactly once."""
    if len(per_call) != len(cell.calls):
        raise ValueError(f"cell {cell.name}: {len(per_call)} outputs for {len(cell.calls)} calls")
    out = per_call[0].new_zeros((num_tokens,)) if per_call else torch.zeros(num_tokens)
    seen = torch.zeros(num_tokens, dtype=torch.int64)
    for call, values in zip(cell.calls, per_call, strict=True):
        keep = call.logical != NONE
        index = call.logical[keep]
        out[index.to(out.device)] = values[keep.to(values.device)]
        seen.index_add_(0, index, torch.ones_like(index))
    if not bool((seen == 1).all()):
        bad = int((seen != 1).nonzero()[0, 0])
        raise ValueError(f"cell {cell.name} computes logical row {bad} {int(seen[bad])} times (must be exactly once)")
    return out
