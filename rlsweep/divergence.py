"""The first op that diverges: every module's inputs and output in two cells (``rlsweep.recording``), restored to
logical tokens, and the innermost module whose inputs are bitwise equal in both while its output is not
(docs/whole_model.md). Two cells' records are compared token by token, module by module.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from kernels.bitwise import bit_view
from rlsweep.hf_model import BuiltModel
from rlsweep.model_cells import DEFAULT_CHUNK_SIZE, TRAINER_CELL, TokenWorkload
from rlsweep.recording import ModuleRecord, record_cell
from rlsweep.tables import DIVERGENCE_COLUMNS


def aligned(mine: ModuleRecord, theirs: ModuleRecord):
    """The tokens both records hold, and each record's input bytes and outputs at them, in token order; None for
    rows whose calls disagreed in shape or dtype (``ModuleRecord.rows``)."""
    tokens_a, inputs_a, outputs_a = mine.rows
    tokens_b, inputs_b, outputs_b = theirs.rows
    common = torch.tensor(sorted(set(tokens_a.tolist()) & set(tokens_b.tolist())), dtype=torch.int64)
    at_a, at_b = torch.searchsorted(tokens_a, common), torch.searchsorted(tokens_b, common)

    def at(rows: torch.Tensor | None, where: torch.Tensor) -> torch.Tensor | None:
        return None if rows is None else rows[where]

    return common, (at(inputs_a, at_a), at(inputs_b, at_b)), (at(outputs_a, at_a), at(outputs_b, at_b))


def outputs_differing(a: torch.Tensor | None, b: torch.Tensor | None, count: int) -> torch.Tensor | None:
    """Per token, whether its output rows' bits differ; None where the two cannot be compared (shape or dtype)."""
    if a is None or b is None or a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
        return None
    return (bit_view(a) != bit_view(b)).reshape(count, -1).any(dim=1)


def compared(equality: RowEquality) -> tuple[int, bool, int, float]:
    """(tokens both recorded, whether all their inputs are bitwise equal, outputs whose bits differ, max |diff|)."""
    if not len(equality.tokens):
        return 0, True, 0, 0.0
    differ = ~equality.outputs
    if not bool(differ.any()):
        return len(equality.tokens), bool(equality.inputs.all()), 0, 0.0
    return len(equality.tokens), bool(equality.inputs.all()), int(differ.sum()), equality.largest_difference(differ)


def ancestors(path: str) -> Iterator[str]:
    """The paths around a module's ``path``, the nearest first: ``model.layers.0.mlp`` -> ``model.layers.0``,
    ``model.layers``, ``model``."""
    while "." in path:
        path = path.rsplit(".", 1)[0]
        yield path


def innermost(paths: Sequence[str]) -> set[str]:
    """The paths among ``paths`` with none of the others inside them (``model.layers.0.mlp.act_fn``, not the
    ``model.layers.0.mlp`` around it): where a difference both show began."""
    return {path for path in paths if not any(other.startswith(path + ".") for other in paths)}


def row_mixing(*cells: Mapping[str, ModuleRecord]) -> set[str]:
    """The modules whose output row may depend on other rows than its input row: attention modules (a class named
    ``...Attention``), modules given the layout in a call (``ModuleRecord.sees_layout``: a mask, a KV cache), and
    every module around one of them. The others are row-local: a token's output is a function of its input rows."""
    mixing = {
        path for records in cells for path, record in records.items()
        if record.sees_layout or record.module_class.endswith("Attention")
    }  # fmt: skip
    return mixing | {outer for path in mixing for outer in ancestors(path)}


@dataclass(frozen=True)
class RowEquality:
    """Per token both cells recorded for one module (``tokens``, ascending): whether its input rows (all of them, by
    bit pattern) and its output rows are bitwise equal in both cells; False where they cannot be compared (another
    shape or dtype). ``a``, ``b``: the output rows, for the size of a difference."""

    tokens: torch.Tensor
    inputs: torch.Tensor
    outputs: torch.Tensor
    a: torch.Tensor | None
    b: torch.Tensor | None

    @classmethod
    def of(cls, mine: ModuleRecord, theirs: ModuleRecord) -> RowEquality:
        common, (inputs_a, inputs_b), (a, b) = aligned(mine, theirs)
        none = torch.zeros(len(common), dtype=torch.bool)
        comparable = inputs_a is not None and inputs_b is not None and inputs_a.shape == inputs_b.shape
        inputs = (inputs_a == inputs_b).all(dim=1) if comparable else none
        differ = outputs_differing(a, b, len(common))
        return cls(common, inputs, none if differ is None else ~differ, a, b)

    def at(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(recorded, inputs equal, outputs equal) at ``tokens``: all False where this module has no such token."""
        if not len(self.tokens):
            none = torch.zeros_like(tokens, dtype=torch.bool)
            return none, none, none
        where = torch.searchsorted(self.tokens, tokens).clamp(max=len(self.tokens) - 1)
        recorded = self.tokens[where] == tokens
        return recorded, recorded & self.inputs[where], recorded & self.outputs[where]

    def largest_difference(self, moved: torch.Tensor) -> float:
        if self.a is None or self.b is None or self.a.shape != self.b.shape or self.a.dtype != self.b.dtype:
            return math.inf
        return (self.a[moved].double() - self.b[moved].double()).abs().max().item()


def equalities(canonical: Mapping[str, ModuleRecord], other: Mapping[str, ModuleRecord]) -> dict[str, RowEquality]:
    """Each module both cells recorded, in the canonical cell's execution order, with its ``RowEquality``: what
    ``divergence`` and ``row_local_mismatches`` read, computed once for a pair of cells that both judge."""
    return {
        path: RowEquality.of(record, other[path])
        for path, record in sorted(canonical.items(), key=lambda item: item[1].order) if path in other
    }  # fmt: skip


def row_local_mismatches(canonical: Mapping[str, ModuleRecord], other: Mapping[str, ModuleRecord], *,
                         equality: Mapping[str, RowEquality] | None = None):  # fmt: skip
    """What acts row by row gives equal rows equal bits, in both cells: (how many modules were compared on some token,
    one row per module that broke it: module, module_class, part, tokens_equal_inputs, tokens_differing,
    max_abs_diff, in the canonical cell's execution order). ``equality``: ``equalities`` of the two, when already
    computed.

    - A row-local module (not ``row_mixing``) owes a token whose input rows are equal the same output bits.
    - A module that mixes rows only through its children (a decoder layer around its attention, the model around its
      layers) is glue between them, and glue acts row by row: for a token whose inputs are equal, each child it calls
      gets equal inputs as long as the children before it gave that token equal outputs (``part``: the child's input),
      and its output is equal where every child's was (``part``: ``output``).
    - A module that mixes rows in its own code (an attention module, around its attention function) is not judged.
    """
    mixing = row_mixing(canonical, other)
    equality = equalities(canonical, other) if equality is None else equality
    paths = list(equality)
    children: dict[str, list[str]] = {path: [] for path in paths}
    for path in paths:
        parent = next((outer for outer in ancestors(path) if outer in children), None)  # the nearest recorded
        if parent is not None:
            children[parent].append(path)
    compared_modules, rows = 0, []
    for path in paths:
        judged = equality[path]
        if path not in mixing:
            parts: list[str] = []
        elif any(child in mixing for child in children[path]):
            parts = children[path]
        else:
            continue
        known = judged.inputs.clone()
        if not bool(known.any()):
            continue
        compared_modules += 1
        broken = None
        for child in parts:
            recorded, inputs_equal, outputs_equal = equality[child].at(judged.tokens)
            moved = known & recorded & ~inputs_equal
            if bool(moved.any()):
                broken = (f"input of {child}", moved, math.nan)
                break
            known &= outputs_equal
        if broken is None:
            moved = known & ~judged.outputs
            if bool(moved.any()):
                broken = ("output", moved, judged.largest_difference(moved))
        if broken is not None:
            part, moved, largest = broken
            rows.append({"module": path, "module_class": canonical[path].module_class, "part": part,
                         "tokens_equal_inputs": int(judged.inputs.sum()), "tokens_differing": int(moved.sum()),
                         "max_abs_diff": largest})  # fmt: skip
    return compared_modules, rows


def divergence(canonical: dict[str, ModuleRecord], other: dict[str, ModuleRecord], *, cell: str,
               canonical_cell: str, equality: Mapping[str, RowEquality] | None = None) -> pd.DataFrame:  # fmt: skip
    """One row per module of both cells, in the canonical cell's execution order: the tokens both recorded, whether
    every one of their inputs is bitwise equal, how many outputs differ and by how much at most, and whether it is
    the first diverging module: of the modules with equal inputs and a differing output, those with no such module
    inside them, the first to start. ``equality``: ``equalities`` of the two, when already computed."""
    rows = []
    for path, equal in (equalities(canonical, other) if equality is None else equality).items():
        record = canonical[path]
        tokens, inputs_equal, differing, max_diff = compared(equal)
        rows.append({
            "cell": cell, "canonical_cell": canonical_cell, "module": path, "module_class": record.module_class,
            "order": record.order, "depth": path.count("."), "tokens": tokens, "inputs_equal": inputs_equal,
            "tokens_differing": differing, "max_abs_diff": max_diff, "first_diverging": False,
        })  # fmt: skip
    table = pd.DataFrame(rows, columns=list(DIVERGENCE_COLUMNS))
    culprits = table[table.inputs_equal & (table.tokens_differing > 0)]
    inner = innermost(list(culprits.module))
    leaves = [index for index, path in culprits.module.items() if path in inner]
    if leaves:
        table.loc[min(leaves, key=lambda index: table.order[index]), "first_diverging"] = True
    return table


def first_diverging(built: BuiltModel, workload: TokenWorkload, cell: str, canonical_cell: str = TRAINER_CELL, *,
                    chunk_size: int = DEFAULT_CHUNK_SIZE):  # fmt: skip
    """The divergence table of ``cell`` against ``canonical_cell`` (``divergence``)."""
    canonical = record_cell(built, workload, canonical_cell, chunk_size)
    return divergence(canonical, record_cell(built, workload, cell, chunk_size), cell=cell,
                      canonical_cell=canonical_cell)  # fmt: skip
