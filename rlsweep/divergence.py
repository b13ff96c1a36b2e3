"""The first op that diverges: every module's inputs and output in two cells, restored to logical tokens, and the
innermost module whose inputs are bitwise equal in both while its output is not (docs/whole_model.md).

Hooks on every module of the body record, for each call, the rows of each per-token tensor (leading dims the call's
[batch, position]) under the logical token each row holds (``rlsweep.model_cells.CURRENT_SLOTS``; padding and
fillers are dropped). Two cells' records are then compared token by token, module by module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from kernels.bitwise import bit_pattern, first_bit_difference
from rlsweep.hf_model import BuiltModel
from rlsweep.model_cells import CURRENT_SLOTS, DEFAULT_CHUNK_SIZE, TRAINER_CELL, TokenWorkload, cell_hidden
from rlsweep.tables import DIVERGENCE_COLUMNS


@dataclass
class ModuleRecord:
    """One module's rows by logical token: the bytes of its per-token inputs, its output row."""

    module_class: str
    order: int  # when it first started, in the cell's execution
    inputs: dict[int, bytes] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)


def per_token(value: Any, shape: torch.Size) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, a tuple or list of them, a model output) laid out [batch, position, ...]."""
    if isinstance(value, torch.Tensor):
        return [value] if value.dim() >= 2 and value.shape[:2] == shape else []
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in per_token(item, shape)]
    if hasattr(value, "last_hidden_state"):
        return per_token(value.last_hidden_state, shape)
    return []


@contextmanager
def recording(built: BuiltModel) -> Iterator[dict[str, ModuleRecord]]:
    """Record every module of the body (``ModuleRecord`` by module path) while the block runs cells."""
    records: dict[str, ModuleRecord] = {}
    handles = []

    def started(path: str, module: torch.nn.Module) -> None:
        if path not in records:
            records[path] = ModuleRecord(type(module).__name__, len(records))

    def ended(path: str, args: tuple, kwargs: dict, output: Any) -> None:
        slots = CURRENT_SLOTS.get()
        if slots is None:
            return
        # A mask describes the layout, not a token: it differs between cells by design and is never an input here.
        inputs = per_token([*args, *(v for k, v in kwargs.items() if "mask" not in k)], slots.shape)
        outputs = per_token(output, slots.shape)
        if not outputs:
            return
        record = records[path]
        for b, position in (slots >= 0).nonzero().tolist():
            token = int(slots[b, position])
            record.inputs[token] = b"".join(bit_pattern(t[b, position]).numpy().tobytes() for t in inputs)
            record.outputs[token] = outputs[0][b, position].detach().cpu().clone()

    for path, module in built.body.named_modules(prefix="model"):
        handles.append(module.register_forward_pre_hook(lambda m, a, path=path: started(path, m)))
        handles.append(module.register_forward_hook(
            lambda m, a, k, o, path=path: ended(path, a, k, o), with_kwargs=True))  # fmt: skip
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def record_cell(built: BuiltModel, workload: TokenWorkload, cell: str, chunk_size: int) -> dict[str, ModuleRecord]:
    """Every module's rows in ``cell``, by logical token."""
    with recording(built) as records:
        cell_hidden(built, workload, cell, chunk_size=chunk_size)
    return records


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape != b.shape or a.dtype != b.dtype or first_bit_difference(a, b) is not None


def divergence(canonical: dict[str, ModuleRecord], other: dict[str, ModuleRecord], *, cell: str,
               canonical_cell: str) -> pd.DataFrame:  # fmt: skip
    """One row per module of both cells, in the canonical cell's execution order: the tokens both recorded, whether
    every one of their inputs is bitwise equal, how many outputs differ and by how much at most, and whether it is
    the first diverging module: of the modules with equal inputs and a differing output, those with no such module
    inside them, the first to start."""
    rows = []
    for path, record in sorted(canonical.items(), key=lambda item: item[1].order):
        theirs = other.get(path)
        if theirs is None:
            continue
        tokens = sorted(set(record.outputs) & set(theirs.outputs))
        inputs_equal = all(record.inputs[t] == theirs.inputs[t] for t in tokens)
        differing = [t for t in tokens if bits_differ(record.outputs[t], theirs.outputs[t])]
        max_diff = max(
            ((record.outputs[t].double() - theirs.outputs[t].double()).abs().max().item() for t in differing),
            default=0.0,
        )
        rows.append({
            "cell": cell, "canonical_cell": canonical_cell, "module": path, "module_class": record.module_class,
            "order": record.order, "depth": path.count("."), "tokens": len(tokens), "inputs_equal": inputs_equal,
            "tokens_differing": len(differing), "max_abs_diff": max_diff, "first_diverging": False,
        })  # fmt: skip
    table = pd.DataFrame(rows, columns=list(DIVERGENCE_COLUMNS))
    culprits = table[table.inputs_equal & (table.tokens_differing > 0)]
    leaves = [
        index for index, path in culprits.module.items()
        if not any(other_path.startswith(path + ".") for other_path in culprits.module)
    ]  # fmt: skip
    if leaves:
        table.loc[min(leaves, key=lambda index: table.order[index]), "first_diverging"] = True
    return table


def first_diverging(built: BuiltModel, workload: TokenWorkload, cell: str, canonical_cell: str = TRAINER_CELL, *,
                    chunk_size: int = DEFAULT_CHUNK_SIZE):  # fmt: skip
    """The divergence table of ``cell`` against ``canonical_cell`` (``divergence``)."""
    canonical = record_cell(built, workload, canonical_cell, chunk_size)
    return divergence(canonical, record_cell(built, workload, cell, chunk_size), cell=cell,
                      canonical_cell=canonical_cell)  # fmt: skip
