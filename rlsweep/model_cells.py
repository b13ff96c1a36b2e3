"""A whole model's forward over the ways trainers and inference engines call it (docs/whole_model.md).

Token workloads: prompts of token ids from seeded counters, and responses sampled from the model itself with
counter-based uniforms, so the rollout distribution is the model's. Cells: every way the same sequences reach the
body (packed, padded, alone, permuted, chunked prefill and decode through a KV cache, needles). Each cell gives every
sequence's final hidden states back in logical order, so one head call (``kernels.lm_head_logprob``) and one bitwise
comparison judge them all.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

import kernels
from rlsweep.errors import ConfigError, ReplayInputError
from rlsweep.hf_model import BuiltModel
from rlsweep.synthetic import check_seed, uniform
from rlsweep.tensor_files import TensorFile, bits_sha256

PAD_TOKEN = 0  # what a padded position holds; the mask keeps every real token from reading it


@dataclass(frozen=True)
class TokenWorkload:
    """Sequences of token ids (prompt then response), each [L] int64 on the CPU; the response tokens are the judged
    ones: a position's target is the next token."""

    sequences: tuple[torch.Tensor, ...]
    prompt_lens: tuple[int, ...]

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(int(s.numel()) for s in self.sequences)

    @property
    def sha256(self) -> str:
        """The digest of what the model is given: every sequence's token ids and every prompt's length."""
        parts = [bits_sha256(ids) for ids in self.sequences] + [json.dumps(self.prompt_lens)]
        return hashlib.sha256("".join(parts).encode()).hexdigest()

    def targets(self) -> list[torch.Tensor]:
        """Per sequence [L]: the next token where it is a response token, else IGNORE_INDEX."""
        out = []
        for ids, prompt in zip(self.sequences, self.prompt_lens, strict=True):
            target = torch.full_like(ids, kernels.IGNORE_INDEX)
            target[prompt - 1 : -1] = ids[prompt:]
            out.append(target)
        return out


def synthetic_prompts(seed: int, vocab: int, prompt_lens: Sequence[int]) -> list[torch.Tensor]:
    """Token ids uniform over the vocab, a pure function of (seed, sample, position)."""
    check_seed(seed, "workload.seed")
    prompts = []
    for sample, length in enumerate(prompt_lens):
        positions = torch.arange(length, dtype=torch.int64)[None, :]
        u = uniform(seed, "prompt_token", torch.tensor([[sample]], dtype=torch.int64), positions)[0]
        prompts.append(torch.clamp((u * vocab).to(torch.int64), max=vocab - 1))
    return prompts


def sampling_model(built: BuiltModel) -> torch.nn.Module:
    """A float32 copy of the model's weights (as rounded to its dtype) with eager attention: what samples responses.
    Every profile of one dtype gives it the same weights, and none of its attention kernels, so their runs sample the
    same tokens and compare (``backend_parity``)."""
    import copy

    from rlsweep.invariant_body import uninstall

    model = copy.deepcopy(built.model).to(torch.float32)
    uninstall(model)
    model.set_attn_implementation("eager")
    return model


@torch.no_grad()
def sample_responses(built: BuiltModel, prompts: Sequence[torch.Tensor], response_lens: Sequence[int], seed: int):
    """Each prompt continued by ``response_lens`` tokens drawn from the model's next-token distribution (the logits of
    ``sampling_model``, softmax in float64) by inverse CDF of a counter-based uniform per (sample, position): the
    prompt prefilled into a KV cache, then one token per step, as a rollout engine decodes."""
    from transformers import DynamicCache

    check_seed(seed, "workload.seed")
    if len(prompts) != len(response_lens):
        raise ConfigError(f"{len(prompts)} prompts but {len(response_lens)} response lengths")
    device = built.head_weight.device
    model = sampling_model(built)
    keyword = cache_keyword(model)  # the name this transformers' forward takes a KV cache by
    sequences = []
    for sample, (prompt, n) in enumerate(zip(prompts, response_lens, strict=True)):
        ids, fed, cache = prompt.clone(), prompt, DynamicCache(config=model.config)
        for _ in range(n):
            logits = model(input_ids=fed[None].to(device), use_cache=True, **{keyword: cache}).logits[0, -1]
            probs = torch.softmax(logits.double().cpu(), dim=-1)
            u = uniform(seed, "sample", torch.tensor([[sample]]), torch.tensor([[ids.numel()]]))[0, 0]
            token = int(torch.searchsorted(torch.cumsum(probs, 0), u * probs.sum()).clamp(max=probs.numel() - 1))
            fed = torch.tensor([token])
            ids = torch.cat([ids, fed])
        sequences.append(ids)
    return sequences


def token_workload(built: BuiltModel, seed: int, prompt_lens: Sequence[int], response_lens: Sequence[int]):
    """Synthetic prompts and sampled responses: the workload of a whole-model run."""
    for key, lens in (("prompt_lens", prompt_lens), ("response_lens", response_lens)):
        if not lens or any(not isinstance(n, int) or n < 1 for n in lens):
            raise ConfigError(f"workload.{key}={list(lens)!r}: one positive int per sequence")
    if len(prompt_lens) != len(response_lens):
        raise ConfigError(f"workload: {len(prompt_lens)} prompt_lens but {len(response_lens)} response_lens")
    limit = getattr(built.model.config, "max_position_embeddings", None)
    longest = max(p + r for p, r in zip(prompt_lens, response_lens, strict=True))
    if limit is not None and longest > limit:
        raise ConfigError(
            f"workload: a sequence of {longest} tokens is longer than the model's max_position_embeddings={limit}"
        )
    key = (built.config_fingerprint, built.weights_hash, str(built.head_weight.device), seed, tuple(prompt_lens),
           tuple(response_lens))  # fmt: skip
    if key not in SAMPLED:
        vocab = built.head_weight.shape[0]
        prompts = synthetic_prompts(seed, vocab, prompt_lens)
        SAMPLED.clear()  # one workload kept: a sweep's jobs in one process sample the same one
        SAMPLED[key] = TokenWorkload(tuple(sample_responses(built, prompts, response_lens, seed)), tuple(prompt_lens))
    return SAMPLED[key]


# The last sampled workload, by (config fingerprint, weights hash, device, seed, lengths): the tokens are a function
# of exactly these (``sample_responses``), and every profile of one dtype samples the same ones, so the jobs of a
# sweep that Hydra runs in one process sample once.
SAMPLED: dict[tuple, TokenWorkload] = {}


REPLAY_TOKENS = ("input_ids", "seq_lens", "prompt_lens")  # a replayed token workload's tensors, all integer


def replayed_workload(path: str, vocab: int, key: str = "workload.path") -> TokenWorkload:
    """Sequences captured from a real rollout: a safetensors file of ``input_ids`` [T] (the sequences concatenated),
    ``seq_lens`` [S] and ``prompt_lens`` [S]. Anything the cells could not run, or that would judge no token, is a
    ReplayInputError naming the file and the value: a missing tensor, a non-integer or multi-dimensional one,
    lengths that do not add up, a prompt that leaves no response token, a token id outside the vocab."""
    source = TensorFile(path, "token replay file", key)
    headers = source.headers()
    for name in REPLAY_TOKENS:
        found = headers.get(name)
        if found is None:
            raise ReplayInputError(f"{source.describe()} has no {name!r} tensor (it needs {list(REPLAY_TOKENS)})")
        if found.dtype is None or found.dtype.is_floating_point or found.dtype == torch.bool or len(found.shape) != 1:
            raise ReplayInputError(
                f"{source.describe()}: {name} is {found.describe()}; it must be a 1-D integer tensor"
            )
    tensors = {name: t.to(torch.int64) for name, t in source.load(REPLAY_TOKENS).items()}
    ids, seq_lens, prompt_lens = (tensors[name] for name in REPLAY_TOKENS)
    if seq_lens.numel() == 0 or seq_lens.numel() != prompt_lens.numel():
        raise ReplayInputError(
            f"{source.describe()}: seq_lens has {seq_lens.numel()} entries and prompt_lens {prompt_lens.numel()}; "
            "one of each per sequence, at least one sequence"
        )
    if sum(seq_lens.tolist()) != ids.numel() or bool((seq_lens < 2).any()):  # Python ints: int64's sum can wrap
        raise ReplayInputError(
            f"{source.describe()}: seq_lens {seq_lens.tolist()[:8]} must each be >= 2 and add up to input_ids' "
            f"{ids.numel()} tokens"
        )
    short = ((prompt_lens < 1) | (prompt_lens >= seq_lens)).nonzero()
    if short.numel():
        i = int(short[0])
        raise ReplayInputError(
            f"{source.describe()}: sequence {i} has prompt_lens {int(prompt_lens[i])} of seq_lens {int(seq_lens[i])}; "
            "a prompt needs at least 1 token and must leave at least 1 response token"
        )
    outside = ((ids < 0) | (ids >= vocab)).nonzero()
    if outside.numel():
        i = int(outside[0])
        raise ReplayInputError(f"{source.describe()}: input_ids[{i}] = {int(ids[i])} is outside the vocab [0, {vocab})")
    sequences = tuple(ids.split(seq_lens.tolist()))
    return TokenWorkload(tuple(s.clone() for s in sequences), tuple(int(p) for p in prompt_lens))


# --- cells -------------------------------------------------------------------------------------------------------


def confinement_mask(lengths: Sequence[int], attention: str, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, T, T] block-causal mask of sequences packed in one row: each token sees its own sequence's earlier
    tokens only. Restarting position ids alone do not confine attention (docs/whole_model.md): the cell builds it.
    sdpa and the invariant body take it as bool (True: attend); eager adds it, so it is 0 / the dtype's lowest there."""
    segment = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    allowed = torch.ones(len(segment), len(segment), dtype=torch.bool).tril() & (segment[:, None] == segment[None, :])
    if attention != "eager":
        return allowed[None, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@dataclass(frozen=True)
class Seq:
    """A sequence as a cell feeds it: its ids, and where its tokens start in the workload's logical order (-1: a
    filler, whose outputs are not the workload's)."""

    ids: torch.Tensor
    start: int

    def __len__(self) -> int:
        return int(self.ids.numel())

    def slots(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """The logical token index of positions [lo, hi) (all -1 for a filler)."""
        hi = len(self) if hi is None else hi
        if self.start < 0:
            return torch.full((hi - lo,), -1, dtype=torch.int64)
        return torch.arange(self.start + lo, self.start + hi, dtype=torch.int64)


# The logical token index of each [batch row, position] of the body call in progress (-1: padding or a filler):
# what rlsweep.divergence's hooks read to put a module's output rows back in logical order.
CURRENT_SLOTS: ContextVar[torch.Tensor | None] = ContextVar("model_slots", default=None)
# The logical token of each key the body call in progress attends over [batch row, key] (-1: padding or a filler):
# the call's own tokens after those its KV cache holds from the cell's earlier calls.
CURRENT_KEY_SLOTS: ContextVar[torch.Tensor | None] = ContextVar("model_key_slots", default=None)
# The first logical token of each logical token's sequence [T], while a cell runs: what it may attend back to.
SEQUENCE_STARTS: ContextVar[torch.Tensor | None] = ContextVar("model_sequence_starts", default=None)
CACHED_SLOTS = "rlsweep_slots"  # the attribute of a cell's KV cache holding the logical tokens of its keys


def layout_positions(length: int) -> torch.Tensor | None:
    """[B, length] int64: the position the layout gives each token of the body call in progress (its place in its
    own sequence; -1 for padding and fillers), whatever position ids the call was given. None outside a cell, or
    where the call's slots are not ``length`` long."""
    slots, starts = CURRENT_SLOTS.get(), SEQUENCE_STARTS.get()
    if slots is None or starts is None or slots.shape[1] != length:
        return None
    return torch.where(slots >= 0, slots - starts[slots.clamp(min=0)], -1)


def layout_allowed(queries: int, keys: int) -> torch.Tensor | None:
    """[B, 1, queries, keys] bool (True: attend) of the body call in progress: what its layout lets each query row
    attend to, whatever mask the call built. A query token attends to the keys of its own sequence up to its own
    position; a padding or filler row to nothing (it is not judged). The keys are the last ``keys`` of the call's key
    slots (a sliding-window cache keeps the most recent). None outside a cell, or where the slots do not cover the
    call (``queries`` other than the call's positions, fewer key slots than keys)."""
    query_slots, key_slots, starts = CURRENT_SLOTS.get(), CURRENT_KEY_SLOTS.get(), SEQUENCE_STARTS.get()
    if query_slots is None or key_slots is None or starts is None:
        return None
    if query_slots.shape[1] != queries or key_slots.shape[1] < keys:
        return None
    q, k = query_slots[:, :, None], key_slots[:, None, -keys:] if keys else key_slots[:, None, :0]
    first = starts[q.clamp(min=0)]
    return ((q >= 0) & (k >= 0) & (k <= q) & (k >= first))[:, None]


def body_hidden(built: BuiltModel, slots: torch.Tensor, **inputs) -> torch.Tensor:
    """The body's final hidden states (after its last norm) [B, L, H]; ``slots`` [B, L] as ``CURRENT_SLOTS``. A
    KV cache goes in as ``cache``: under the name this transformers' body takes (``cache`` from 5.24, before it
    ``past_key_values``, which 5.24 still takes with a warning; a name the body ignores would drop the cache)."""
    device = built.head_weight.device
    moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    key_slots = slots
    if "cache" in moved:
        cache = moved.pop("cache")
        cached = getattr(cache, CACHED_SLOTS, None)
        key_slots = slots if cached is None else torch.cat([cached, slots], dim=1)
        setattr(cache, CACHED_SLOTS, key_slots)
        moved[cache_keyword(built.body)] = cache
    tokens = CURRENT_SLOTS.set(slots), CURRENT_KEY_SLOTS.set(key_slots)
    try:
        return built.body(**moved).last_hidden_state
    finally:
        CURRENT_SLOTS.reset(tokens[0])
        CURRENT_KEY_SLOTS.reset(tokens[1])


def cache_keyword(body: torch.nn.Module) -> str:
    """The keyword under which ``body.forward`` takes a KV cache."""
    parameters = inspect.signature(body.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise ConfigError(f"{type(body).__name__}.forward takes no KV cache (neither cache= nor past_key_values=)")


def alone(built: BuiltModel, sequences: Sequence[Seq]) -> list[torch.Tensor]:
    return [body_hidden(built, s.slots()[None], input_ids=s.ids[None], use_cache=False)[0] for s in sequences]


def packed(built: BuiltModel, sequences: Sequence[Seq]) -> list[torch.Tensor]:
    """One row, as a trainer runs varlen: position ids restart per sequence, attention confined to each. A body
    built with ``packing="unconfined"`` makes the packing mistake instead: an all-ones mask, so each token attends to
    every earlier token of the row, the other sequences' included (the negative control)."""
    lengths = [len(s) for s in sequences]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    if built.packing == "unconfined":
        mask = torch.ones((1, sum(lengths)), dtype=torch.int64)
    else:
        mask = confinement_mask(lengths, built.attention, built.head_weight.dtype)
    slots = torch.cat([s.slots() for s in sequences])[None]
    row = body_hidden(built, slots, input_ids=torch.cat([s.ids for s in sequences])[None], position_ids=positions,
                      attention_mask=mask, use_cache=False)[0]  # fmt: skip
    return list(row.split(lengths))


def padded(built: BuiltModel, sequences: Sequence[Seq], side: str) -> list[torch.Tensor]:
    """One batch padded on ``side`` ("right" or "left") with a 2D attention mask; positions count real tokens."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), PAD_TOKEN, dtype=torch.int64)
    mask = torch.zeros((len(sequences), width), dtype=torch.int64)
    slots = torch.full((len(sequences), width), -1, dtype=torch.int64)
    wheres = []
    for row, s in enumerate(sequences):
        where = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[row, where], mask[row, where], slots[row, where] = s.ids, 1, s.slots()
        wheres.append(where)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = body_hidden(built, slots, input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    return [out[row, where] for row, where in enumerate(wheres)]


def permuted(built: BuiltModel, sequences: Sequence[Seq]) -> list[torch.Tensor]:
    """The right-padded batch in reversed order, restored."""
    return padded(built, list(reversed(sequences)), "right")[::-1]


def chunked(built: BuiltModel, sequences: Sequence[Seq], chunk: int) -> list[torch.Tensor]:
    """Each sequence prefilled ``chunk`` tokens at a time through a KV cache (chunked prefill)."""
    from transformers import DynamicCache

    out = []
    for s in sequences:
        cache = DynamicCache(config=built.model.config)
        parts = []
        for start in range(0, len(s), chunk):
            stop = min(start + chunk, len(s))
            positions = torch.arange(start, stop)[None]
            hidden = body_hidden(built, s.slots(start, stop)[None], input_ids=s.ids[None, start:stop],
                                 position_ids=positions, cache=cache, use_cache=True)  # fmt: skip
            parts.append(hidden[0])
        out.append(torch.cat(parts))
    return out


def decode(built: BuiltModel, sequences: Sequence[Seq], prompt_lens: Sequence[int]) -> list[torch.Tensor]:
    """As an inference engine runs a rollout: the prompts prefilled in one left-padded batch, then one token per
    step for the whole batch through the KV cache; a sequence that has ended feeds a masked pad."""
    from transformers import DynamicCache

    width, rows = max(prompt_lens), len(sequences)
    ids = torch.full((rows, width), PAD_TOKEN, dtype=torch.int64)
    mask = torch.zeros((rows, width), dtype=torch.int64)
    slots = torch.full((rows, width), -1, dtype=torch.int64)
    for row, (s, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
        ids[row, width - p :], mask[row, width - p :], slots[row, width - p :] = s.ids[:p], 1, s.slots(0, p)
    cache = DynamicCache(config=built.model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    prefill = body_hidden(built, slots, input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                          use_cache=True)  # fmt: skip
    out = [[prefill[row, width - p :]] for row, p in enumerate(prompt_lens)]
    steps = max(len(s) - p for s, p in zip(sequences, prompt_lens, strict=True))
    for step in range(steps):
        live = [p + step < len(s) for s, p in zip(sequences, prompt_lens, strict=True)]
        at = [p + step for p in prompt_lens]
        token = torch.tensor(
            [[int(s.ids[i]) if on else PAD_TOKEN] for s, i, on in zip(sequences, at, live, strict=True)]
        )
        step_slots = torch.tensor(
            [[int(s.slots(i, i + 1)) if on else -1] for s, i, on in zip(sequences, at, live, strict=True)]
        )
        mask = torch.cat([mask, torch.tensor([[int(on)] for on in live])], dim=1)
        position = torch.tensor([[i if on else 0] for i, on in zip(at, live, strict=True)])
        hidden = body_hidden(built, step_slots, input_ids=token, attention_mask=mask, position_ids=position,
                             cache=cache, use_cache=True)  # fmt: skip
        for row, on in enumerate(live):
            if on:
                out[row].append(hidden[row])
    return [torch.cat(parts) for parts in out]


def needle(built: BuiltModel, sequences: Sequence[Seq], others: int, position: int) -> list[torch.Tensor]:
    """The head's needle at the model level: the workload's sequences, in order, at batch rows ``position`` onwards
    among ``others`` filler sequences (the workload's, cycled), in one right-padded batch of ``others`` + n rows."""
    if not 0 <= position <= others:
        raise ConfigError(f"needle position {position} is outside a batch of {others} others plus the needle")
    fillers = [Seq(sequences[k % len(sequences)].ids, -1) for k in range(others)]
    batch = [*fillers[:position], *sequences, *fillers[position:]]
    return padded(built, batch, "right")[position : position + len(sequences)]


def batch_chunked(built: BuiltModel, sequences: Sequence[Seq], chunk: int) -> list[torch.Tensor]:
    """The right-padded batch prefilled ``chunk`` positions at a time through one KV cache (an engine's chunked
    prefill of a batch); the 2D mask covers the cached positions and the chunk's."""
    from transformers import DynamicCache

    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), PAD_TOKEN, dtype=torch.int64)
    mask = torch.zeros((len(sequences), width), dtype=torch.int64)
    slots = torch.full((len(sequences), width), -1, dtype=torch.int64)
    for row, s in enumerate(sequences):
        ids[row, : len(s)], mask[row, : len(s)], slots[row, : len(s)] = s.ids, 1, s.slots()
    cache = DynamicCache(config=built.model.config)
    parts = []
    for start in range(0, width, chunk):
        stop = min(start + chunk, width)
        positions = torch.arange(start, stop)[None].expand(len(sequences), -1)
        parts.append(body_hidden(built, slots[:, start:stop], input_ids=ids[:, start:stop], position_ids=positions,
                                 attention_mask=mask[:, :stop], cache=cache, use_cache=True))  # fmt: skip
    out = torch.cat(parts, dim=1)
    return [out[row, : len(s)] for row, s in enumerate(sequences)]


DEFAULT_CHUNK_SIZE = 5  # tokens per chunk of BN/chunked and B1/chunked, as layout.chunk_size defaults it


@contextmanager
def as_trainer(built: BuiltModel) -> Iterator[None]:
    """The block runs as a trainer's forward does: under ``torch.enable_grad()`` with the body's parameters requiring
    gradients (an autograd graph is recorded; no backward is taken). Put back to inference after it."""
    parameters = list(built.body.parameters())
    try:
        for parameter in parameters:
            parameter.requires_grad_(True)
        with torch.enable_grad():
            yield
    finally:
        for parameter in parameters:
            parameter.requires_grad_(False)


def cell_hidden(
    built: BuiltModel, workload: TokenWorkload, cell: str, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> list[torch.Tensor]:
    """Every sequence's final hidden states [L, H] in the layout cell named ``cell`` (the head's cell names,
    docs/whole_model.md#the-cells: one of ``rlsweep.spec.CELL_KINDS`` other than ``needle``, or
    ``needle/M=<m>/pos=<p>``); ``chunk_size``: the tokens per chunk of the chunked cells. The trainer's cell
    (``TRAINER_CELL``) runs as a trainer runs it (``as_trainer``), every other cell as an inference engine does, under
    ``torch.no_grad()``."""
    if cell == TRAINER_CELL:
        with as_trainer(built):
            return [hidden.detach() for hidden in layout_hidden(built, workload, cell, chunk_size)]
    with torch.no_grad():
        return layout_hidden(built, workload, cell, chunk_size)


def layout_hidden(built: BuiltModel, workload: TokenWorkload, cell: str, chunk_size: int) -> list[torch.Tensor]:
    """``cell_hidden`` in the grad mode of the caller."""
    starts = [0, *itertools.accumulate(workload.seq_lens)][:-1]
    sequences = [Seq(ids, start) for ids, start in zip(workload.sequences, starts, strict=True)]
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(f"chunk_size={chunk_size!r}: tokens per chunk, an int >= 1")
    first = torch.cat([torch.full((n,), start, dtype=torch.int64) for n, start in zip(workload.seq_lens, starts,
                                                                                      strict=True)])  # fmt: skip
    token = SEQUENCE_STARTS.set(first)  # on the CPU, as the slots
    try:
        return run_layout(built, sequences, workload, cell, chunk_size)
    finally:
        SEQUENCE_STARTS.reset(token)


def run_layout(built: BuiltModel, sequences: list[Seq], workload: TokenWorkload, cell: str,
               chunk_size: int) -> list[torch.Tensor]:  # fmt: skip
    """The body over ``sequences`` as the cell named ``cell`` calls it (``layout_hidden``)."""
    cells = {
        "BN/packed": lambda: packed(built, sequences),
        "BN/pad_right": lambda: padded(built, sequences, "right"),
        "BN/pad_left": lambda: padded(built, sequences, "left"),
        "BN/permuted": lambda: permuted(built, sequences),
        "BN/chunked": lambda: batch_chunked(built, sequences, chunk_size),
        "B1/full": lambda: alone(built, sequences),
        "B1/chunked": lambda: chunked(built, sequences, chunk_size),
        "decode": lambda: decode(built, sequences, workload.prompt_lens),
    }
    if cell in cells:
        return cells[cell]()
    name, _, arg = cell.partition("/")
    if name == "needle":
        parts = dict(part.partition("=")[::2] for part in arg.split("/"))
        if set(parts) == {"M", "pos"} and parts["M"].isdigit() and parts["pos"].isdigit():
            return needle(built, sequences, int(parts["M"]), int(parts["pos"]))
    raise ConfigError(f"model cell {cell!r} is not one of {', '.join(cells)}, needle/M=<m>/pos=<p>")


def cell_logprobs(built: BuiltModel, workload: TokenWorkload, cell: str, *, backend: str, tp: int = 1,
                  chunk_size: int = DEFAULT_CHUNK_SIZE):  # fmt: skip
    """The judged tokens' logp and lse [N] (response tokens, sequences in order) of ``cell``: its hidden states
    through the head of ``backend`` at ``tp`` (``kernels.lm_head_logprob``), in one call."""
    hidden = torch.cat(cell_hidden(built, workload, cell, chunk_size=chunk_size))
    targets = torch.cat(workload.targets()).to(hidden.device)
    result = kernels.lm_head_logprob(hidden, built.head_weight, targets, backend=backend, tp=tp)
    active = targets != kernels.IGNORE_INDEX
    return result.logp[active], result.lse[active]


TRAINER_CELL = "BN/packed"  # how a trainer calls the body: one packed varlen row
ROLLOUT_CELLS = ("decode", "BN/pad_left", "B1/full")  # how engines call it: the rollout side of the metrics
PPO_CLIP = (0.8, 1.2)  # the clip interval of clipfrac0, as the head's runs default it


def mismatch_values(trainer: torch.Tensor, rollout: torch.Tensor, sample_ids: torch.Tensor,
                    clip: tuple[float, float]) -> tuple[list[tuple[str, float]], int]:  # fmt: skip
    """verl's rollout-vs-training mismatch metrics (``rlsweep.mismatch.METRICS``) of dlogp = trainer - rollout over
    the judged tokens, the rollout the sampling side: (name, value) for every name each metric goes by (one value per
    metric, as the head's chain rows), and the number of tokens."""
    from rlsweep.mismatch import METRICS, ActiveTokens

    tokens = ActiveTokens.of(sample_ids.cpu(), rollout.cpu(), clip)
    dlogp = trainer.double().cpu() - rollout.double().cpu()
    values = [(metric.names, metric.value(dlogp, tokens)) for metric in METRICS]
    return [(name, value) for names, value in values for name in names], tokens.count


def judged_sample_ids(workload: TokenWorkload) -> torch.Tensor:
    """The sequence of each judged token, in order."""
    return torch.cat([torch.full((int((t >= 0).sum()),), i) for i, t in enumerate(workload.targets())])


def trainer_vs_rollout(built: BuiltModel, workload: TokenWorkload, *, backend: str, tp: int = 1,
                       rollout_cells: Sequence[str] = ROLLOUT_CELLS, clip: tuple[float, float] = PPO_CLIP):  # fmt: skip
    """``mismatch_values`` of the trainer's cell (``TRAINER_CELL``) against each rollout cell: one row per (rollout
    cell, metric name)."""
    import pandas as pd

    trainer, _ = cell_logprobs(built, workload, TRAINER_CELL, backend=backend, tp=tp)
    rows = []
    for cell in rollout_cells:
        rollout, _ = cell_logprobs(built, workload, cell, backend=backend, tp=tp)
        values, count = mismatch_values(trainer, rollout, judged_sample_ids(workload), clip)
        rows += [{"trainer_cell": TRAINER_CELL, "rollout_cell": cell, "metric": name, "value": value, "tokens": count}
                 for name, value in values]  # fmt: skip
    return pd.DataFrame(rows)


@contextmanager
def watching_attention(built: BuiltModel, call: Callable | None = None) -> Iterator[list[str]]:
    """The attention functions that actually ran while the block runs (``module.function``), whatever the config
    says was selected: transformers looks its attention up in ``ALL_ATTENTION_FUNCTIONS`` under the config's
    implementation on every call (falling back to the modeling module's ``eager_attention_forward``), so the entry is
    wrapped for the block and put back after it. ``call(function, module, args, kwargs)``, where given, makes each
    call (to record its inputs and output: ``rlsweep.module_accuracy``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    key = built.model.config._attn_implementation
    modeling = {sys.modules[type(m).__module__] for m in built.body.modules() if type(m).__name__.endswith("Attention")}
    default = next((m.eager_attention_forward for m in modeling if hasattr(m, "eager_attention_forward")), None)
    original = ALL_ATTENTION_FUNCTIONS.get_interface(key, default)
    ran: list[str] = []

    def watched(module: torch.nn.Module, *args, **kwargs):
        ran.append(f"{original.__module__}.{original.__qualname__}")
        if call is not None:
            return call(original, module, args, kwargs)
        return original(module, *args, **kwargs)

    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    before = local.get(key)
    local[key] = watched
    try:
        yield ran
    finally:
        if before is None:
            local.pop(key, None)
        else:
            local[key] = before


def attention_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """(query, key, value, attention mask) of an attention function's call, positional or by keyword."""
    query, key, value = (args[i] if len(args) > i else kwargs[name] for i, name in enumerate(("query", "key", "value")))
    return query, key, value, args[3] if len(args) > 3 else kwargs.get("attention_mask")


@contextmanager
def observing_body(built: BuiltModel) -> Iterator[dict[str, list[str]]]:
    """What the body runs inside the block: ``attention``, the attention functions transformers called, and
    ``kernels``, the dispatcher's ops that decide the bits (matmuls, reductions, attention kernels, custom ops:
    ``kernels.launches``), each once, in the order they first ran; filled in when the block ends."""
    from kernels.launches import observed_provenance, observing_dispatcher, recording_launches

    seen: dict[str, list[str]] = {"attention": [], "kernels": []}
    with watching_attention(built) as attention, observed_provenance(), recording_launches() as launches:
        with observing_dispatcher():
            yield seen
    seen["attention"] = list(dict.fromkeys(attention))
    seen["kernels"] = list(dict.fromkeys(launch.kernel for launch in launches))


def body_provenance(
    built: BuiltModel, workload: TokenWorkload, cell: str, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> dict[str, list[str]]:
    """What the body ran in ``cell`` (``observing_body``)."""
    with observing_body(built) as seen:
        cell_hidden(built, workload, cell, chunk_size=chunk_size)
    return seen
