"""The lm_head under test: its geometry fingerprint and its weight, synthetic or from safetensors (SPEC §4.2)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from rlsweep.config import WEIGHT_SOURCES, ModelConfig
from rlsweep.errors import ConfigError, ReplayInputError
from rlsweep.synthetic import normal_matrix

GENERATION_ROWS = 8192  # synthetic weights are made in row blocks to bound memory on big heads


@dataclass(frozen=True)
class LmHead:
    """weight[V, H] in the execution dtype, with the identity every table row records."""

    name: str
    weight: torch.Tensor
    config_fingerprint: str
    weight_hash: str


def config_fingerprint(model: ModelConfig) -> str:
    """sha256 of the canonical geometry (not of the weight source)."""
    geometry = {
        "name": model.name,
        "hidden_size": model.hidden_size,
        "vocab_size": model.vocab_size,
        "padded_vocab_size": model.padded_vocab_size,
        "tie_word_embeddings": model.tie_word_embeddings,
    }
    return hashlib.sha256(json.dumps(geometry, sort_keys=True).encode()).hexdigest()


def weight_sha256(weight: torch.Tensor) -> str:
    """sha256 of the weight's bytes exactly as the kernels receive them."""
    data = weight.detach().contiguous().cpu().view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def check_geometry(model: ModelConfig) -> None:
    for key in ("hidden_size", "vocab_size"):
        value = getattr(model, key)
        if value < 1:
            raise ConfigError(f"model.{key} must be >= 1, got {value!r} (model {model.name!r})")
    if model.padded_vocab_size is not None and model.padded_vocab_size < model.vocab_size:
        raise ConfigError(
            f"model.padded_vocab_size={model.padded_vocab_size!r} is smaller than vocab_size={model.vocab_size}"
        )
    if model.weights.kind not in WEIGHT_SOURCES:
        raise ConfigError(f"model.weights.kind={model.weights.kind!r} is not one of {', '.join(WEIGHT_SOURCES)}")


def build_lm_head(model: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> LmHead:
    """Make or read the head; the weight hash is computed from what was built."""
    check_geometry(model)
    if model.weights.kind == "synthetic":
        weight = synthetic_weight(model, dtype=dtype, device=device)
    else:
        weight = file_weight(model, dtype=dtype).to(device)
    return LmHead(model.name, weight, config_fingerprint(model), weight_sha256(weight))


def synthetic_weight(model: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Counter-based normals scaled so unit-std hidden states give logits of std ``logit_std``."""
    scale = model.weights.logit_std / math.sqrt(model.hidden_size)
    rows = torch.arange(model.vocab_size, dtype=torch.int64, device=device)
    blocks = [
        normal_matrix(model.weights.seed, "weight", block, model.hidden_size, scale=scale, dtype=dtype)
        for block in rows.split(GENERATION_ROWS)
    ]
    return torch.cat(blocks)


def file_weight(model: ModelConfig, *, dtype: torch.dtype) -> torch.Tensor:
    """``lm_head.weight`` [V, H] (or [padded V, H], trimmed) from a safetensors file, cast to ``dtype``."""
    source = model.weights
    if not source.path:
        raise ConfigError("model.weights.kind=file needs model.weights.path (a local .safetensors file)")
    path = Path(source.path)
    if not path.is_file():
        raise ReplayInputError(f"weight file {str(path)!r} does not exist (model.weights.path)")
    with safe_open(str(path), framework="pt") as handle:
        names = list(handle.keys())
        if source.tensor not in names:
            raise ReplayInputError(f"weight file {str(path)!r} has no tensor {source.tensor!r}; it holds {names[:20]}")
        weight = handle.get_tensor(source.tensor)
    allowed_rows = {model.vocab_size, model.padded_vocab_size or model.vocab_size}
    if weight.dim() != 2 or weight.shape[1] != model.hidden_size or weight.shape[0] not in allowed_rows:
        raise ReplayInputError(
            f"{source.tensor} in {str(path)!r} has shape {tuple(weight.shape)}; model {model.name!r} needs "
            f"[{model.vocab_size}, {model.hidden_size}]"
            + (f" or [{model.padded_vocab_size}, ...]" * bool(model.padded_vocab_size))
        )
    if not weight.is_floating_point():
        raise ReplayInputError(f"{source.tensor} in {str(path)!r} has dtype {weight.dtype}; a floating dtype is needed")
    finite = torch.isfinite(weight)
    if not bool(finite.all()):
        index = tuple(int(i) for i in (~finite).nonzero()[0])
        raise ReplayInputError(f"{source.tensor} in {str(path)!r} holds {weight[index].item()} at index {index}")
    # Padded checkpoint rows are never real tokens: the kernels pad the vocab themselves.
    return weight[: model.vocab_size].to(dtype).contiguous()
