"""The logical tokens of a run, keyed by (sample_id, position) and stored in canonical packed order (docs/index.md)."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

import kernels
from rlsweep.errors import ReplayInputError
from rlsweep.spec import MAX_SEQ_LEN, POSITION_BITS, ModelSpec, WorkloadSpec
from rlsweep.synthetic import normal_matrix, standard_normal, uniform
from rlsweep.tensor_files import TensorFile, TensorHeader, bits_sha256, tensor_header

REPLAY_TENSORS = ("hidden_states", "target_ids", "seq_lens")
REPLAY_OPTIONAL = ("active_mask",)


@dataclass(frozen=True)
class WorkloadShape:
    """Token counts of a workload, known before any tensor is made: per sample, all tokens and the active ones."""

    seq_lens: tuple[int, ...]
    active_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def num_active(self) -> int:
        return sum(self.active_lens)


@dataclass(frozen=True)
class Workload:
    """Every logical token once, samples concatenated in sample order (the canonical packing).

    ``hidden`` [T, H] in the execution dtype; ``targets`` [T] int64 with kernels.IGNORE_INDEX on
    inactive (prompt) rows; ``active`` [T] bool; ``sample_ids``/``positions`` [T] int64 on the CPU.
    ``sampled`` [T] bool (CPU): active tokens whose target was drawn from the model's softmax, so metrics of a
    sampled sequence (the chain metrics) skip probe tokens, whose targets are boundary columns.
    """

    name: str
    seed: int
    sample_ids: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor
    targets: torch.Tensor
    active: torch.Tensor
    sampled: torch.Tensor
    seq_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.sample_ids.shape[0])

    def sample_rows(self, sample: int) -> torch.Tensor:
        """Logical row indices of one sample, in position order."""
        start = sum(self.seq_lens[:sample])
        return torch.arange(start, start + self.seq_lens[sample])

    @property
    def sha256(self) -> str:
        """The digest of what the kernels are given, as bits: every token's key, hidden state, target and active
        flag. Two runs compute the same tokens exactly when theirs are equal, whatever their workload's name."""
        parts = (self.sample_ids, self.positions, self.hidden, self.targets, self.active)
        return hashlib.sha256("".join(bits_sha256(part) for part in parts).encode()).hexdigest()

    def upstream(self) -> torch.Tensor:
        """The gradient a loss sends back to each token's logp [T] fp32 (CPU): normal on every token, a function of
        (seed, sample_id, position) only, so every layout cell gets the same. Prompt tokens get one too, as a loss
        over a padded batch may send: their logp is the constant 0 (the kernels' target is IGNORE_INDEX), so a
        backward must give them d hidden 0 whatever it is, and one that lets it through is red."""
        keys = token_keys(self.sample_ids, self.positions)[:, None]
        return standard_normal(self.seed, "grad_logp", keys, torch.zeros(1, 1, dtype=torch.int64))[:, 0].float()

    def filler(self, count: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` unrelated rows: hidden [count, H] from their own stream and uniform targets [count]."""
        ids = torch.arange(count, dtype=torch.int64, device=self.hidden.device)
        hidden = normal_matrix(
            self.seed, "filler_hidden", ids, self.hidden.shape[1], scale=1.0, dtype=self.hidden.dtype
        )
        draws = uniform(self.seed, "filler_target", ids[:, None].cpu(), torch.zeros(1, 1, dtype=torch.int64))[:, 0]
        targets = (draws * vocab_size).to(torch.int64).clamp_max(vocab_size - 1)
        return hidden, targets.to(self.hidden.device)


def build_workload(
    config: WorkloadSpec, model: ModelSpec, weight: torch.Tensor, *, seed: int, dtype: torch.dtype
) -> Workload:
    shape = workload_shape(config, model)  # every count checked before a tensor is made
    if config.source == "replay":
        return replay_workload(config, model, shape, device=weight.device, seed=seed, dtype=dtype)
    return synthetic_workload(config, weight, seed=seed, dtype=dtype)


def token_keys(sample_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return (sample_ids << POSITION_BITS) | positions


def synthetic_workload(config: WorkloadSpec, weight: torch.Tensor, *, seed: int, dtype: torch.dtype) -> Workload:
    """Hidden states from (seed, sample_id, position), each sample's scaled by its ``WorkloadSpec.scales`` entry;
    completion targets sampled from the model itself, or ``probe_columns`` on the probe samples' active tokens."""
    sample_ids = torch.cat([torch.full((n,), s, dtype=torch.int64) for s, n in enumerate(config.seq_lens)])
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in config.seq_lens])
    active = torch.cat([torch.arange(n) >= p for n, p in zip(config.seq_lens, config.prompt_lens, strict=True)])
    probe = active & torch.isin(sample_ids, torch.tensor(config.probe_samples, dtype=torch.int64))
    sampled = active & ~probe
    keys = token_keys(sample_ids, positions)
    row_scales = torch.tensor(config.scales, dtype=torch.float64)[sample_ids]
    hidden = normal_matrix(seed, "hidden", keys.to(weight.device), weight.shape[1], scale=row_scales, dtype=dtype)
    targets = torch.full_like(sample_ids, kernels.IGNORE_INDEX)
    targets[sampled] = sample_targets(hidden[sampled.to(hidden.device)], weight, keys[sampled], seed=seed)
    targets[probe] = probe_columns(weight.shape[0], int(probe.sum()))
    return Workload(
        config.name,
        seed,
        sample_ids,
        positions,
        hidden,
        targets.to(weight.device),
        active,
        sampled,
        tuple(config.seq_lens),
    )


def boundary_columns(vocab_size: int) -> Iterator[int]:
    """``probe_columns``' order, each column once: the vocab's two ends, then both sides of every multiple of
    2**k below it, coarsest k first, down to the finest tile."""
    yield from (0, vocab_size - 1)  # the last real column sits next to the padding (vocab_size >= 2: spec.py)
    seen = {0, vocab_size - 1}
    coarsest = (vocab_size - 1).bit_length() - 1  # 2**coarsest: the largest power of two below vocab_size
    finest = kernels.MIN_VOCAB_TILE.bit_length() - 1
    for width in (1 << k for k in range(coarsest, finest - 1, -1)):
        for column in (c for boundary in range(width, vocab_size, width) for c in (boundary - 1, boundary)):
            if column not in seen:
                seen.add(column)
                yield column


def probe_columns(vocab_size: int, count: int) -> torch.Tensor:
    """``count`` probe targets int64 [count]: vocab columns on tile and shard boundaries, cycling when count exceeds
    them. Tiles are powers of two >= 16 and shards whole tiles, so coarse boundaries first reach every shard edge
    for any profile and tp; the columns depend on neither, so runs at any tp and profile get the same workload."""
    columns = list(itertools.islice(boundary_columns(vocab_size), count))
    return torch.tensor(list(itertools.islice(itertools.cycle(columns), count)), dtype=torch.int64)


def sample_targets(hidden: torch.Tensor, weight: torch.Tensor, keys: torch.Tensor, *, seed: int) -> torch.Tensor:
    """Inverse-CDF sampling from float64 softmax(hidden @ weight.T), one counter-based uniform per token."""
    logits = hidden.double() @ weight.double().T
    cdf = torch.softmax(logits, dim=-1).cpu().cumsum(dim=-1)
    draws = uniform(seed, "target", keys[:, None], torch.zeros(1, 1, dtype=torch.int64))
    picked = torch.searchsorted(cdf, draws * cdf[:, -1:])[:, 0]
    return picked.clamp_max(weight.shape[0] - 1)


def workload_shape(config: WorkloadSpec, model: ModelSpec) -> WorkloadShape:
    """The workload's token counts: from the spec's lengths, or from a replay file's header."""
    if config.source == "replay":
        return replay_shape(config, model)
    return WorkloadShape(
        tuple(config.seq_lens), tuple(n - p for n, p in zip(config.seq_lens, config.prompt_lens, strict=True))
    )


def replay_file(config: WorkloadSpec) -> TensorFile:
    return TensorFile(str(config.path), "replay file", "workload.path")


def replay_shape(config: WorkloadSpec, model: ModelSpec) -> WorkloadShape:
    """Every replay tensor's dtype and shape from the header; only ``seq_lens`` and ``active_mask`` are loaded."""
    file = replay_file(config)
    where = file.describe()
    headers = file.headers()
    rows = check_replay_headers(where, headers, model)
    small = file.load([name for name in ("seq_lens", *REPLAY_OPTIONAL) if name in headers])
    return counted_shape(where, small, rows)


def check_replay_headers(where: str, headers: Mapping[str, TensorHeader], model: ModelSpec) -> int:
    """T, from headers whose tensors are all there with the dtypes and shapes a replay needs (ReplayInputError)."""
    missing = [name for name in REPLAY_TENSORS if name not in headers]
    if missing:
        raise ReplayInputError(
            f"{where} is missing {missing}; it must hold {list(REPLAY_TENSORS)} "
            f"and optionally {list(REPLAY_OPTIONAL)}, found {sorted(headers)}"
        )
    hidden = headers["hidden_states"]
    if len(hidden.shape) != 2 or hidden.shape[1] != model.hidden_size or not hidden.is_floating:
        raise ReplayInputError(
            f"{where}: hidden_states must be a floating [T, {model.hidden_size}] tensor (model.hidden_size), "
            f"got {hidden.describe()}"
        )
    rows = hidden.shape[0]
    if rows == 0:
        raise ReplayInputError(f"{where}: hidden_states has no row (T = 0): there is no token to compute")
    for name in ("target_ids", "seq_lens"):
        if headers[name].dtype != torch.int64 or len(headers[name].shape) != 1:
            raise ReplayInputError(f"{where}: {name} must be a 1-D int64 tensor, got {headers[name].describe()}")
    if headers["target_ids"].shape[0] != rows:
        raise ReplayInputError(
            f"{where}: target_ids has {headers['target_ids'].shape[0]} rows but hidden_states has {rows}"
        )
    if headers["seq_lens"].shape[0] > rows:
        raise ReplayInputError(
            f"{where}: seq_lens has {headers['seq_lens'].shape[0]} samples for T={rows} tokens (each needs one)"
        )
    active = headers.get("active_mask")
    if active is not None and (active.dtype != torch.bool or active.shape != (rows,)):
        raise ReplayInputError(f"{where}: active_mask must be bool [{rows}], got {active.describe()}")
    return rows


def counted_shape(where: str, tensors: Mapping[str, torch.Tensor], rows: int) -> WorkloadShape:
    """The token counts of ``seq_lens`` and the optional ``active_mask`` among ``tensors``, checked against T=rows."""
    seq_lens = tensors["seq_lens"].tolist()  # Python ints: an int64 sum can wrap round to T
    for sample, n in enumerate(seq_lens):
        if not 1 <= n <= MAX_SEQ_LEN:
            raise ReplayInputError(
                f"{where}: seq_lens[{sample}] = {n} is outside [1, {MAX_SEQ_LEN}] (a position must fit the token "
                f"key's {POSITION_BITS} bits)"
            )
    if sum(seq_lens) != rows:
        raise ReplayInputError(
            f"{where}: seq_lens {seq_lens} sum to {sum(seq_lens)}, but they must be >= 1 and sum to T={rows}"
        )
    mask = tensors.get("active_mask", torch.ones(rows, dtype=torch.bool))
    sample_ids = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    active_lens = torch.bincount(sample_ids[mask], minlength=len(seq_lens))
    if int(active_lens.sum()) == 0:
        raise ReplayInputError(f"{where}: active_mask marks none of the {rows} tokens active: nothing would be judged")
    return WorkloadShape(tuple(seq_lens), tuple(active_lens.tolist()))


def replay_workload(
    config: WorkloadSpec,
    model: ModelSpec,
    shape: WorkloadShape,
    *,
    device: torch.device,
    seed: int,
    dtype: torch.dtype,
) -> Workload:
    """Captured tensors from a safetensors file whose header ``replay_shape`` checked; then their values.

    Every tensor is read at once and checked again as its header was: a file rewritten since ``shape`` was counted
    is refused, never computed as a mix of two versions.
    """
    file = replay_file(config)
    where = file.describe()
    tensors = file.load([*REPLAY_TENSORS, *(n for n in REPLAY_OPTIONAL if n in file.headers())])
    rows = check_replay_headers(where, {name: tensor_header(tensor) for name, tensor in tensors.items()}, model)
    read = counted_shape(where, tensors, rows)
    if read != shape:
        raise ReplayInputError(
            f"{where} changed while the run read it: it held samples of lengths {list(shape.seq_lens)} "
            f"({shape.num_active} active tokens), then {list(read.seq_lens)} ({read.num_active}); keep the file "
            "unchanged while it runs"
        )
    hidden, targets = tensors["hidden_states"], tensors["target_ids"]
    rows = shape.num_tokens
    active = tensors.get("active_mask", torch.ones(rows, dtype=torch.bool))
    # An inactive token's target is never read: it may be the ignore index (-100) a capture's labels hold there.
    bad = ((targets < 0) | (targets >= model.vocab_size)) & (active | (targets != kernels.IGNORE_INDEX))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ReplayInputError(
            f"{where}: target_ids[{row}] = {int(targets[row])} is outside [0, {model.vocab_size}) (model.vocab_size)"
            + (
                f"; {kernels.IGNORE_INDEX} may mark only a token active_mask leaves out"
                * bool(targets[row] == kernels.IGNORE_INDEX)
            )
        )
    hidden = file.cast_finite("hidden_states", hidden, dtype)
    if not bool(hidden[active].any()):  # zero hidden states give every logit 0
        raise ReplayInputError(
            f"{where}: hidden_states are zero on every active token in {kernels.dtype_name(dtype)}, so every logit is "
            f"0 and every kernel gives logp = -log({model.vocab_size}): no verdict could fail"
        )
    lens = torch.tensor(shape.seq_lens)
    sample_ids = torch.repeat_interleave(torch.arange(len(shape.seq_lens)), lens)
    positions = torch.cat([torch.arange(n) for n in shape.seq_lens])
    kernel_targets = torch.where(active, targets, kernels.IGNORE_INDEX)
    return Workload(
        config.name,
        seed,
        sample_ids,
        positions,
        hidden.to(device),
        kernel_targets.to(device),
        active,
        active,  # a capture's targets are whatever produced them: none is a probe
        shape.seq_lens,
    )
