"""Every module of a whole model's body, recorded by logical token while a cell runs (docs/whole_model.md).

Hooks on every module of the body record, for each call, the rows of each per-token tensor (leading dims the call's
[batch, position]) under the logical token each row holds (``rlsweep.model_cells.CURRENT_SLOTS``; padding and
fillers are dropped), and for each attention module what its attention function took and gave, and what its KV
cache gave back. ``rlsweep.divergence`` compares two cells' records; ``rlsweep.dataflow`` holds one cell's to the
model's architecture; ``rlsweep.module_accuracy`` judges the row-local modules' calls against float64.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import torch

from kernels.bitwise import bit_pattern, bit_view
from kernels.launches import bookkeeping
from rlsweep.hf_model import BuiltModel
from rlsweep.model_cells import (
    CURRENT_KEY_SLOTS,
    CURRENT_SLOTS,
    TokenWorkload,
    attention_inputs,
    cell_hidden,
    watching_attention,
)

MODULE_PREFIX = "model"  # a module's path in the records: the body's named_modules under this prefix
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
        held &= known[slots.clamp(0, len(known) - 1)]  # a token whose own key and value were kept
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
    def keep_function(path: str, slots: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor) -> None:  # fmt: skip
        """An attention function's call by token: its query [B, Hq, Q, D], key and value [B, Hkv, K, D] (K >= Q: the
        call's own keys last, after a KV cache's) and output [B, Q, Hq, D], with the RoPE cos and sin its module was
        given."""
        count = query.shape[2]
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

    paths = {module: path for path, module in built.body.named_modules(prefix=MODULE_PREFIX)}

    def attention(function: Any, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        output = function(module, *args, **kwargs)
        slots, path = CURRENT_SLOTS.get(), paths.get(module)
        out = output[0] if isinstance(output, tuple) else output
        given = attention_inputs(args, kwargs)[:3]
        if slots is not None and path in records and all(isinstance(t, torch.Tensor) for t in (*given, out)):
            with bookkeeping():
                keep_function(path, slots, *given, out)
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
