"""Layout cells: ways of feeding the same logical tokens to the kernels (docs/index.md).

A cell is a list of calls; each call row names the logical row it computes (or pad/filler), so
any cell's per-call outputs can be put back in logical order with ``restore_logical_order``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlsweep.errors import ConfigError
from rlsweep.spec import CANONICAL_CELL, CELL_KINDS, DECODE_CELL, NEEDLE, LayoutSpec
from rlsweep.workload import Workload, WorkloadShape

NONE = -1  # a row that computes no logical token (pad), or a row that is not filler


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

    @property
    def call_tokens(self) -> tuple[torch.Tensor, ...]:
        """The logical rows each call computes, in call order, pad and filler left out: a partition of the tokens."""
        return tuple(call.logical[call.logical != NONE] for call in self.calls)


def logical_call(rows: list[torch.Tensor]) -> Call:
    """A call made of logical rows (NONE entries are pad rows)."""
    logical = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)
    return Call(logical, torch.full_like(logical, NONE))


def pad(count: int) -> torch.Tensor:
    return torch.full((count,), NONE, dtype=torch.int64)


def chunks(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(rows.split(size))


def packed(workload: Workload, layout: LayoutSpec) -> list[Cell]:
    return [Cell(CANONICAL_CELL, (logical_call([torch.arange(workload.num_tokens)]),))]


def padded(side: str) -> Callable[[Workload, LayoutSpec], list[Cell]]:
    def build(workload: Workload, layout: LayoutSpec) -> list[Cell]:
        width = max(workload.seq_lens)
        rows = []
        for sample, n in enumerate(workload.seq_lens):
            own = workload.sample_rows(sample)
            rows += [own, pad(width - n)] if side == "right" else [pad(width - n), own]
        return [Cell(f"BN/pad_{side}", (logical_call(rows),))]

    return build


def permuted(workload: Workload, layout: LayoutSpec) -> list[Cell]:
    """Samples in reverse order in one call."""
    order = reversed(range(len(workload.seq_lens)))
    return [Cell("BN/permuted", (logical_call([workload.sample_rows(s) for s in order]),))]


def bn_chunked(workload: Workload, layout: LayoutSpec) -> list[Cell]:
    """One call per chunk index k holding chunk k of every sample long enough to have one."""
    per_sample = [chunks(workload.sample_rows(s), layout.chunk_size) for s in range(len(workload.seq_lens))]
    steps = max(len(c) for c in per_sample)
    calls = [logical_call([c[k] for c in per_sample if k < len(c)]) for k in range(steps)]
    return [Cell("BN/chunked", tuple(calls))]


def b1_full(workload: Workload, layout: LayoutSpec) -> list[Cell]:
    calls = [logical_call([workload.sample_rows(s)]) for s in range(len(workload.seq_lens))]
    return [Cell("B1/full", tuple(calls))]


def b1_chunked(workload: Workload, layout: LayoutSpec) -> list[Cell]:
    calls = [
        logical_call([chunk])
        for s in range(len(workload.seq_lens))
        for chunk in chunks(workload.sample_rows(s), layout.chunk_size)
    ]
    return [Cell("B1/chunked", tuple(calls))]


def decode(workload: Workload, layout: LayoutSpec) -> list[Cell]:
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


def needles(workload: Workload, layout: LayoutSpec) -> list[Cell]:
    """Per needle (m, pos): one call, every logical row (packed) inserted at row ``pos`` of ``m`` filler rows."""
    cells = []
    for needle in layout.needles:
        own = torch.arange(workload.num_tokens)
        filler = torch.arange(needle.m, dtype=torch.int64)
        logical = torch.cat([pad(needle.pos), own, pad(needle.m - needle.pos)])
        filler_rows = torch.cat([filler[: needle.pos], pad(len(own)), filler[needle.pos :]])
        cells.append(Cell(needle.cell_name, (Call(logical, filler_rows),)))
    return cells


CELL_BUILDERS: dict[str, Callable[[Workload, LayoutSpec], list[Cell]]] = {
    CANONICAL_CELL: packed,
    "BN/pad_right": padded("right"),
    "BN/pad_left": padded("left"),
    "BN/permuted": permuted,
    "BN/chunked": bn_chunked,
    "B1/full": b1_full,
    "B1/chunked": b1_chunked,
    DECODE_CELL: decode,
    NEEDLE: needles,
}
assert tuple(CELL_BUILDERS) == CELL_KINDS


def plan_cells(layout: LayoutSpec, workload: Workload) -> list[Cell]:
    """Every cell of the layout, canonical first; none may make the canonical cell's calls again."""
    cells = [cell for kind in layout.cells for cell in CELL_BUILDERS[kind](workload, layout)]
    same = same_as_canonical(cells)
    if same:
        kept = [kind for kind in layout.cells if not any(name.startswith(kind) for name in same)]
        raise ConfigError(
            f"layout cell(s) {', '.join(same)} make the very calls of {CANONICAL_CELL} for this workload (sample "
            f"lengths {list(workload.seq_lens)}, layout.chunk_size={layout.chunk_size}): their invariance verdicts "
            "could show nondeterminism only, never a layout's effect; leave them out (layout.cells=["
            + ",".join(kept)
            + "]) or use a workload whose samples make them differ"
        )
    return cells


def same_as_canonical(cells: list[Cell]) -> list[str]:
    """Names of the cells (after the first, the canonical one) whose calls are the canonical cell's, row for row."""
    canonical = cells[0].calls

    def same(calls: tuple[Call, ...]) -> bool:
        return len(calls) == len(canonical) and all(
            torch.equal(a.logical, b.logical) and torch.equal(a.filler, b.filler)
            for a, b in zip(calls, canonical, strict=True)
        )

    return [cell.name for cell in cells[1:] if same(cell.calls)]


def largest_calls(layout: LayoutSpec, shape: WorkloadShape) -> dict[str, int]:
    """Cell name -> rows of its largest call, from the token counts alone (no cell is built).

    Mirrors ``CELL_BUILDERS``; tests/test_input_bounds.py compares it with the calls ``plan_cells`` makes.
    """
    lens, total = shape.seq_lens, shape.num_tokens
    rows = {
        CANONICAL_CELL: total,
        "BN/pad_right": len(lens) * max(lens),
        "BN/pad_left": len(lens) * max(lens),
        "BN/permuted": total,
        "BN/chunked": sum(min(layout.chunk_size, n) for n in lens),  # chunk 0 of every sample
        "B1/full": max(lens),
        "B1/chunked": min(layout.chunk_size, max(lens)),
        DECODE_CELL: max(total - shape.num_active, sum(a > 0 for a in shape.active_lens)),  # prefill or first step
    }
    assert set(rows) | {"needle"} == set(CELL_KINDS), "a new cell kind needs its largest call here"
    rows |= {needle.cell_name: total + needle.m for needle in layout.needles}
    return {name: rows[name] for name in layout.cell_names}


def filler_rows_needed(cells: list[Cell]) -> int:
    return max((int(call.filler.max()) + 1 for cell in cells for call in cell.calls if call.rows), default=0)


def restore_logical_order(cell: Cell, per_call: list[torch.Tensor], num_tokens: int) -> torch.Tensor:
    """Per-call outputs [rows_i] -> one tensor [num_tokens] in logical order; every token exactly once."""
    if len(per_call) != len(cell.calls):
        raise ValueError(f"cell {cell.name}: {len(per_call)} outputs for {len(cell.calls)} calls")
    out = per_call[0].new_zeros((num_tokens, *per_call[0].shape[1:])) if per_call else torch.zeros(num_tokens)
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
