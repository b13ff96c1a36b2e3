"""The lm_head under test: its geometry fingerprint and its weight, synthetic or from safetensors (docs/index.md)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

import kernels
from rlsweep.errors import ReplayInputError
from rlsweep.spec import ModelSpec
from rlsweep.synthetic import GENERATION_ROWS, normal_matrix
from rlsweep.tensor_files import TensorFile, TensorHeader, bits_sha256, tensor_header


@dataclass(frozen=True)
class LmHead:
    """weight[V, H] in the execution dtype, with the identity every table row records."""

    name: str
    weight: torch.Tensor
    config_fingerprint: str
    weight_hash: str


def config_fingerprint(model: ModelSpec) -> str:
    """sha256 of the canonical geometry (not of the weight source)."""
    geometry = {
        "name": model.name,
        "hidden_size": model.hidden_size,
        "vocab_size": model.vocab_size,
        "padded_vocab_size": model.padded_vocab_size,
        "tie_word_embeddings": model.tie_word_embeddings,
    }
    return hashlib.sha256(json.dumps(geometry, sort_keys=True).encode()).hexdigest()


def check_weight_file(model: ModelSpec) -> None:
    """A weight file's header holds the head in a shape the model declares; nothing is loaded."""
    if model.weights.kind == "file":
        weight_header(model)


def build_lm_head(model: ModelSpec, *, dtype: torch.dtype, device: torch.device) -> LmHead:
    """Make or read the head; the weight hash is of the bytes built, exactly as the kernels receive them."""
    if model.weights.kind == "synthetic":
        weight = synthetic_weight(model, dtype=dtype, device=device)
    else:
        weight = file_weight(model, dtype=dtype).to(device)
    return LmHead(model.name, weight, config_fingerprint(model), bits_sha256(weight))


def synthetic_weight(model: ModelSpec, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Counter-based normals scaled so unit-std hidden states give logits of std ``logit_std``."""
    scale = model.weights.logit_std / math.sqrt(model.hidden_size)
    rows = torch.arange(model.vocab_size, dtype=torch.int64, device=device)
    blocks = [
        normal_matrix(model.weights.seed, "weight", block, model.hidden_size, scale=scale, dtype=dtype)
        for block in rows.split(GENERATION_ROWS)
    ]
    return torch.cat(blocks)


def weight_file(model: ModelSpec) -> TensorFile:
    return TensorFile(str(model.weights.path), "weight file", "model.weights.path")


def weight_header(model: ModelSpec) -> TensorHeader:
    """The head tensor's header: present, floating, [V, H] (or [padded V, H]); nothing is loaded."""
    file = weight_file(model)
    return checked_weight_header(model, file, file.headers())


def checked_weight_header(model: ModelSpec, file: TensorFile, headers: Mapping[str, TensorHeader]) -> TensorHeader:
    """``weight_header``'s checks on ``headers``: the file's, or those of the tensor as loaded."""
    source = model.weights
    if source.tensor not in headers:
        raise ReplayInputError(
            f"{file.describe()} has no tensor {source.tensor!r} (model.weights.tensor); it holds {sorted(headers)[:20]}"
        )
    head = headers[source.tensor]
    allowed_rows = {model.vocab_size, model.padded_vocab_size or model.vocab_size}
    if len(head.shape) != 2 or head.shape[1] != model.hidden_size or head.shape[0] not in allowed_rows:
        raise ReplayInputError(
            f"{source.tensor} in {file.describe()} has shape {list(head.shape)}; model {model.name!r} needs "
            f"[{model.vocab_size}, {model.hidden_size}]"
            + (f" or [{model.padded_vocab_size}, {model.hidden_size}]" * bool(model.padded_vocab_size))
        )
    if not head.is_floating:
        raise ReplayInputError(
            f"{source.tensor} in {file.describe()} has dtype {head.stored}; a floating dtype is needed"
        )
    return head


def file_weight(model: ModelSpec, *, dtype: torch.dtype) -> torch.Tensor:
    """``lm_head.weight`` [V, H] (or [padded V, H], trimmed) from a safetensors file, cast to ``dtype``."""
    weight_header(model)
    source, file = model.weights, weight_file(model)
    weight = file.load([source.tensor])[source.tensor]
    checked_weight_header(model, file, {source.tensor: tensor_header(weight)})  # the file may change after its header
    file.cast_finite(source.tensor, weight, weight.dtype)  # every row finite as stored, padded rows included
    # Padded checkpoint rows are never real tokens: the kernels pad the vocab themselves.
    real = weight[: model.vocab_size]
    if dtype != weight.dtype:  # only a cast can take a value found finite above past the range
        real = file.cast_finite(source.tensor, real, dtype)
    if torch.equal(real.amax(dim=0), real.amin(dim=0)):  # every row alike (all zero, say): a token's logits are equal
        raise ReplayInputError(
            f"{source.tensor} in {file.describe()}: every row of the head is the same in "
            f"{kernels.dtype_name(dtype)} (row 0 is {'all zero' if not bool(real[0].any()) else 'repeated'}), so every "
            f"logit of a token is equal and every kernel gives logp = -log({model.vocab_size}): no verdict could fail"
        )
    return real.contiguous()
