"""The first op that diverges: every module's inputs and output in two cells, restored to logical tokens, and the
innermost module whose inputs are bitwise equal in both while its output is not (docs/whole_model.md).

Hooks on every module of the body record, for each call, the rows of each per-token tensor (leading dims the call's
[batch, position]) under the logical token each row holds (``rlsweep.model_cells.CURRENT_SLOTS``; padding and
fillers are dropped). Two cells' records are then compared token by token, module by module.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import pandas as pd
import torch

from kernels.bitwise import bit_pattern, bit_view
from kernels.launches import bookkeeping
from rlsweep.hf_model import BuiltModel
from rlsweep.model_cells import (
    CURRENT_KEY_SLOTS,
    CURRENT_SLOTS,
    DEFAULT_CHUNK_SIZE,
    TRAINER_CELL,
    TokenWorkload,
    cell_hidden,
    watching_attention,
)
from rlsweep.tables import DIVERGENCE_COLUMNS

LAYOUT_KEYWORDS = ("mask", "cache", "past_key")  # a call's keyword that gives a module other rows than its own


@dataclass
class CacheCheck:
    """An attention function's keys and values read back from a KV cache against the ones their tokens got when they
    were computed (the call's own), bitwise: rows compared, rows whose bits differ, the first such token, and a call
    whose key count is not what its cache was given."""

    compared: int = 0
    differing: int = 0
    first: int | None = None
    miscounted: str = ""
    own: dict[str, torch.Tensor] = field(default_factory=dict)  # "key", "value" [tokens, Hkv, D], "known" [tokens]

    def compare(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """``keys`` and ``values`` [B, Hkv, K, D] read back at the logical tokens ``slots`` [B, K] (-1: padding)."""
        if "known" not in self.own:
            return
        known = self.own["known"]
        slots = slots.to(known.device)
        held = (slots >= 0) & (slots < len(known))
        held[held.clone()] &= known[slots[held]]
        batch, column = held.nonzero(as_tuple=True)
        if not len(batch):
            return
        tokens = slots[batch, column]
        differ = torch.zeros(len(batch), dtype=torch.bool, device=known.device)
        for name, read in (("key", keys), ("value", values)):
            got = read.transpose(1, 2)[batch, column].to(known.device)
            differ |= (bit_view(got) != bit_view(self.own[name][tokens])).reshape(len(batch), -1).any(dim=1)
        self.compared += len(batch)
        self.differing += int(differ.sum())
        if self.first is None and bool(differ.any()):
            self.first = int(tokens[differ][0])

    def keep(self, tokens: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The keys and values [T, Hkv, D] the ``tokens`` got in the call that computed them."""
        size = int(tokens.max()) + 1
        if "known" not in self.own or len(self.own["known"]) < size:
            grown = {name: keys.new_zeros((size, *keys.shape[1:])) for name in ("key", "value")}
            grown["known"] = torch.zeros(size, dtype=torch.bool, device=keys.device)
            for name, old in self.own.items():
                grown[name][: len(old)] = old
            self.own = grown
        at = tokens.to(keys.device)
        self.own["key"][at], self.own["value"][at], self.own["known"][at] = keys, values, True


class RecordedCall(NamedTuple):
    """One call of a module, by logical token: its tokens, the rows of its per-token inputs (its main input first,
    ``main_first``), its output rows, and whether the first input is the main one."""

    tokens: torch.Tensor
    inputs: list[torch.Tensor]
    output: torch.Tensor
    main: bool


@dataclass
class ModuleRecord:
    """One module's rows by logical token, gathered call by call: each call's tokens, the rows of its per-token
    inputs and its output rows. A token recorded twice keeps its last call's rows."""

    module_class: str
    order: int  # when it first started, in the cell's execution
    calls: list[RecordedCall] = field(default_factory=list)
    sees_layout: bool = False  # a call was given the layout (``LAYOUT_KEYWORDS``): a mask or a KV cache
    # An attention module's calls of its attention function: its output rows, and as its inputs the query, the key and
    # value rows of the call's own tokens (a KV cache's earlier ones left out), and the module's RoPE cos and sin.
    function: ModuleRecord | None = None
    cache: CacheCheck = field(default_factory=CacheCheck)  # an attention module's: what its KV cache gave back

    @cached_property
    def picked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens ascending, where each token's last rows are among the calls' rows concatenated)."""
        tokens = torch.cat([call.tokens for call in self.calls])
        last = {token: index for index, token in enumerate(tokens.tolist())}
        order = sorted(last)
        return torch.tensor(order, dtype=torch.int64), torch.tensor([last[t] for t in order], dtype=torch.int64)

    @cached_property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(tokens ascending, input bytes [tokens, k], outputs [tokens, ...]); None where calls' rows disagree in
        shape or dtype, which no comparison could match. Read once recording has ended: the canonical cell's record
        is compared with every moved cell's, and gathers its rows once."""
        if not self.calls:
            return torch.empty(0, dtype=torch.int64), None, None
        tokens, picked = self.picked
        return (
            tokens,
            stacked([token_bytes(call.inputs, len(call.tokens)) for call in self.calls], picked),
            stacked([call.output for call in self.calls], picked),
        )

    @cached_property
    def main_input(self) -> torch.Tensor | None:
        """The main input's rows [tokens, ...] in ``rows``' token order (``main_first``); None where a call had none
        or the calls' rows disagree in shape or dtype."""
        if not self.calls or not all(call.main for call in self.calls):
            return None
        return self.input_rows(0)

    def input_rows(self, index: int) -> torch.Tensor | None:
        """The rows of each call's per-token input ``index`` [tokens, ...], in ``rows``' token order; None where a call
        had fewer or the calls' rows disagree in shape or dtype."""
        if not self.calls or any(len(call.inputs) <= index for call in self.calls):
            return None
        return stacked([call.inputs[index] for call in self.calls], self.picked[1])


def stacked(parts: list[torch.Tensor], picked: torch.Tensor) -> torch.Tensor | None:
    if len({(part.shape[1:], part.dtype) for part in parts}) != 1:
        return None
    return torch.cat(parts)[picked]


def token_bytes(rows: list[torch.Tensor], count: int) -> torch.Tensor:
    """Each token's rows of several tensors as one row of bytes [count, k] (their bit patterns, NaN-safe)."""
    parts = [bit_pattern(row).reshape(count, -1).contiguous().view(torch.uint8) for row in rows]
    return torch.cat(parts, dim=1) if parts else torch.empty((count, 0), dtype=torch.uint8)


def main_first(args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """A call's arguments with its main input first: the first positional one, else ``hidden_states`` (how
    transformers' decoder layers call their attention)."""
    rest = list(kwargs.values())
    if not args and isinstance(kwargs.get("hidden_states"), torch.Tensor):
        main = kwargs["hidden_states"]
        return [main, *(v for v in rest if v is not main)]
    return [*args, *rest]


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
    """Record every module of the body (``ModuleRecord`` by module path) while the block runs cells; inside
    ``rlsweep.model_cells.observing_body`` too, whose provenance leaves the recording's own ops out."""
    records: dict[str, ModuleRecord] = {}
    handles = []
    live: list[Any] = [None, None]  # the last call's slots and their (tokens, row indices by device)

    rope: dict[str, Any] = {}  # an attention module's position_embeddings (cos, sin), for its call in progress

    def started(path: str, module: torch.nn.Module, kwargs: dict) -> None:
        if path not in records:
            records[path] = ModuleRecord(type(module).__name__, len(records))
        if "position_embeddings" in kwargs:
            rope[path] = kwargs["position_embeddings"]

    def ended(path: str, args: tuple, kwargs: dict, output: Any) -> None:
        if any(word in key for key in kwargs for word in LAYOUT_KEYWORDS):
            records[path].sees_layout = True
        slots = CURRENT_SLOTS.get()
        if slots is None:
            return
        with bookkeeping():  # the copies below are not the body's: provenance, if observing, leaves them out
            keep(path, slots, args, kwargs, output)

    def rows_of(slots: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The logical tokens of a call's slots and where they are ([batch], [position] on ``device``), worked out
        once per call (every module of one forward shares its slots), not once per module."""
        if live[0] is not slots:
            where = (slots >= 0).nonzero(as_tuple=True)
            live[0], live[1] = slots, (slots[where].cpu(), where, {})
        tokens, where, by_device = live[1]
        if device not in by_device:
            by_device[device] = tuple(index.to(device) for index in where)
        return tokens, by_device[device]

    @torch.no_grad()
    def keep(path: str, slots: torch.Tensor, args: tuple, kwargs: dict, output: Any) -> None:
        # A mask describes the layout, not a token: it differs between cells by design and is never an input here.
        values = main_first(args, {k: v for k, v in kwargs.items() if "mask" not in k})
        inputs = per_token(values, slots.shape)
        outputs = per_token(output, slots.shape)
        if not outputs:
            return
        tokens, where = rows_of(slots, outputs[0].device)
        if not len(tokens):
            return
        rows = [t[rows_of(slots, t.device)[1]] for t in inputs]  # advanced indexing: copies, never views
        main = bool(values) and len(per_token(values[0], slots.shape)) == 1
        records[path].calls.append(RecordedCall(tokens, rows, outputs[0][where].cpu(), main))

    @torch.no_grad()
    def keep_function(path: str, slots: torch.Tensor, given: list[Any], output: Any) -> None:
        """An attention function's call by token: its query [B, Hq, Q, D], key and value [B, Hkv, K, D] (K >= Q: the
        call's own keys last, after a KV cache's) and output [B, Q, Hq, D], with the RoPE cos and sin its module was
        given."""
        query, key, value = given
        count = query.shape[2]
        out = output[0] if isinstance(output, tuple) else output
        shapes = [t.dim() == 4 for t in (query, key, value, out)]
        if not all(shapes) or tuple(slots.shape) != (query.shape[0], count) or out.shape[:2] != slots.shape:
            return
        tokens, where = rows_of(slots, query.device)
        if not len(tokens):
            return
        rows = [query.transpose(1, 2)[where]]
        rows += [t[:, :, t.shape[2] - count :].transpose(1, 2)[where] for t in (key, value)]
        cos_sin = rope.get(path)
        if isinstance(cos_sin, tuple) and all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in cos_sin):
            rows += [t.expand(query.shape[0], count, -1)[rows_of(slots, t.device)[1]] for t in cos_sin]
        record = records[path]
        if record.function is None:
            record.function = ModuleRecord("attention function", record.order)
        record.function.calls.append(RecordedCall(tokens, rows, out[rows_of(slots, out.device)[1]].cpu(), True))
        key_slots, earlier = CURRENT_KEY_SLOTS.get(), key.shape[2] - count
        if key_slots is not None and tuple(key_slots.shape) != (key.shape[0], key.shape[2]):
            record.cache.miscounted = record.cache.miscounted or (
                f"a call read {key.shape[2]} keys where the cell's cache was given {key_slots.shape[1]}"
            )
        elif key_slots is not None and earlier:
            record.cache.compare(key_slots[:, :earlier], key[:, :, :earlier], value[:, :, :earlier])
        record.cache.keep(tokens, rows[1], rows[2])

    paths = {module: path for path, module in built.body.named_modules(prefix="model")}

    def attention(function: Any, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        output = function(module, *args, **kwargs)
        slots, path = CURRENT_SLOTS.get(), paths.get(module)
        if slots is not None and path in records:
            names = ("query", "key", "value")
            given = [args[i] if len(args) > i else kwargs.get(name) for i, name in enumerate(names)]
            if all(isinstance(t, torch.Tensor) for t in given) and isinstance(
                output[0] if isinstance(output, tuple) else output, torch.Tensor
            ):
                with bookkeeping():
                    keep_function(path, slots, given, output)
        return output

    for module, path in paths.items():
        handles.append(module.register_forward_pre_hook(
            lambda m, a, k, path=path: started(path, m, k), with_kwargs=True))  # fmt: skip
        handles.append(module.register_forward_hook(
            lambda m, a, k, o, path=path: ended(path, a, k, o), with_kwargs=True))  # fmt: skip
    try:
        with watching_attention(built, attention):
            yield records
    finally:
        for handle in handles:
            handle.remove()


def record_cell(built: BuiltModel, workload: TokenWorkload, cell: str, chunk_size: int) -> dict[str, ModuleRecord]:
    """Every module's rows in ``cell``, by logical token."""
    with recording(built) as records:
        cell_hidden(built, workload, cell, chunk_size=chunk_size)
    return records


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
