"""A whole Hugging Face causal LM under test: built from a config or read from a local checkpoint dir, never from
a model hub, with synthetic weights bit-identical on every device, and a fingerprint of its config and weights
(docs/whole_model.md).

``transformers`` is the optional extra ``model`` (``pip install -e ".[model]"``); this module imports it only when
a model is built, and says in one line what to install when it is missing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlsweep.errors import ConfigError
from rlsweep.synthetic import GENERATION_ROWS, SEED_LIMIT, check_seed, normal_matrix
from rlsweep.tensor_files import bits_sha256

# Fields transformers writes into a config of its own accord (save_pretrained, from_pretrained, the model's
# construction): none says what the model computes, so none is part of its fingerprint.
VOLATILE_CONFIG_FIELDS = frozenset({
    "transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "_attn_implementation",
    "_attn_implementation_autoset", "_commit_hash", "use_cache", "output_attentions", "output_hidden_states",
    "return_dict", "_experts_implementation",
})  # fmt: skip
SOURCES = ("config", "checkpoint")
GEOMETRY = ("hidden_size", "vocab_size")  # the head's sizes, read from a whole model's config
# The attention a profile may name: transformers' stock implementations, or the invariant body
# (``rlsweep.invariant_body``: every linear, norm, activation and attention of the body through ``kernels.body``).
ATTENTION = ("eager", "sdpa", "invariant")
STOCK_ATTENTION = ("eager", "sdpa")
# What a whole model's body runs behind a head profile, one that names no body_attention (profile=cpu_bf16).
DEFAULT_ATTENTION = "sdpa"


def body_attention(named: str | None) -> str:
    """The attention a whole model's body runs for a profile's ``body_attention``: the one it names, else
    DEFAULT_ATTENTION (a head profile's null)."""
    return named or DEFAULT_ATTENTION


# Bodies that claim every module's output bitwise equal in every cell: their runs judge each cell's modules too
# (``forward_invariance`` of tensor ``modules``), not the logprobs alone.
BITWISE_BODIES = ("invariant",)
# How the packed cell confines attention: to each sequence (as a correct trainer does), or not at all (an all-ones
# mask with restarting position ids: the packing mistake, run as a negative control).
PACKING = ("confined", "unconfined")
NORM_JITTER = 0.1  # an RMSNorm weight is 1 + this * N(0, 1): a norm computed in the wrong dtype shows
LOGIT_STD = 4.0  # the head's weight std (tied or not) is this / sqrt(hidden): logits of a realistic scale (std 3 - 5)


@dataclass(frozen=True)
class WholeModelSpec:
    """What builds the model: ``source`` "config" (``hf_config``: the fields of a transformers config, with its
    ``model_type``; weights synthetic from ``seed``) or "checkpoint" (``path``: a local dir with config.json and
    *.safetensors)."""

    name: str
    source: str
    hf_config: Mapping[str, Any] | None = None
    path: str | None = None
    seed: int = 0

    @staticmethod
    def parse(raw: Mapping[str, Any]) -> WholeModelSpec:
        """From a plain mapping (a composed ``model`` node); every refusal is one line naming the value."""
        name, source = raw.get("name"), raw.get("source")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"model.name={name!r}: a whole model needs a non-empty name")
        if source not in SOURCES:
            raise ConfigError(f"model.body.source={source!r} is not one of {list(SOURCES)}")
        seed = raw.get("seed", 0)
        check_seed(seed, "model.body.seed")
        if source == "config":
            fields = raw.get("hf_config")
            if not isinstance(fields, Mapping) or not isinstance(fields.get("model_type"), str):
                raise ConfigError(
                    f"model.body.hf_config={fields!r}: source=config needs the transformers config's fields, with its "
                    "model_type (e.g. qwen3)"
                )
            refuse_remote_code(fields, "model.body.hf_config")
            return WholeModelSpec(name, source, hf_config=dict(fields), seed=seed)
        path = raw.get("path")
        checkpoint_dir(path)
        return WholeModelSpec(name, source, path=str(path), seed=seed)

    def config_fields(self) -> Mapping[str, Any]:
        """The transformers config's fields: ``hf_config``, or the checkpoint's config.json (read in one line's
        refusal when it is not a JSON object)."""
        if self.hf_config is not None:
            return self.hf_config
        config_file = checkpoint_dir(self.path) / "config.json"
        try:
            fields = json.loads(config_file.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ConfigError(f"model.body.path={self.path!r}: {config_file} is unreadable ({err})") from None
        if not isinstance(fields, dict):
            raise ConfigError(f"model.body.path={self.path!r}: {config_file} is not a JSON object")
        refuse_remote_code(fields, str(config_file))
        return fields

    def geometry(self) -> dict[str, Any]:
        """The head's geometry as the model's config gives it: hidden_size and vocab_size (what model.* must be)."""
        fields = self.config_fields()
        return {key: fields.get(key) for key in GEOMETRY}


def refuse_remote_code(fields: Mapping[str, Any], where: str) -> None:
    """A config naming code outside transformers (``auto_map``) would need ``trust_remote_code``: refused."""
    if "auto_map" in fields:
        raise ConfigError(
            f"{where} has an auto_map ({dict(fields['auto_map'])!r}): its model needs trust_remote_code, which rlsweep "
            "never passes; use a model_type transformers defines"
        )


def checkpoint_dir(path: Any) -> Path:
    """A local checkpoint dir with config.json and at least one *.safetensors; anything else, a hub id included,
    is refused in one line, before transformers could try to reach a hub."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"model.body.path={path!r}: source=checkpoint needs a local directory")
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(
            f"model.body.path={path!r} is not a local directory: rlsweep never reaches a model hub; download the "
            "checkpoint and give its directory"
        )
    if not (directory / "config.json").is_file():
        raise ConfigError(f"model.body.path={path!r} has no config.json")
    if not any(directory.glob("*.safetensors")):
        raise ConfigError(f"model.body.path={path!r} has no *.safetensors weights")
    return directory


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise ConfigError(
            f'a whole model needs transformers ({err}): pip install -e ".[model]" (transformers==5.24.0)'
        ) from None
    return transformers


@dataclass(frozen=True)
class BuiltModel:
    """The model in eval mode in its dtype, and its identity: the config's and the weights' sha256."""

    name: str
    model: torch.nn.Module
    config_fingerprint: str
    weights_hash: str
    attention: str
    packing: str = "confined"  # PACKING: how model_cells.packed confines attention

    @property
    def head_weight(self) -> torch.Tensor:
        """lm_head.weight [V, H]: what ``kernels.lm_head_logprob`` takes."""
        return self.model.get_output_embeddings().weight.detach()

    @property
    def body(self) -> torch.nn.Module:
        """The decoder without its head: final hidden states, after the last norm."""
        return self.model.get_decoder()


def build_model(spec: WholeModelSpec, *, dtype: torch.dtype, attention: str, device: torch.device | str = "cpu",
                packing: str = "confined"):  # fmt: skip
    """The model of ``spec`` with ``attention`` (one of ``ATTENTION``) in ``dtype`` on ``device``; ``packing`` (one of
    ``PACKING``) says how its packed cell confines attention. The invariant body is built as the stock sdpa model,
    then run through the invariant ops (``rlsweep.invariant_body.install``)."""
    if attention not in ATTENTION:
        raise ConfigError(f"attention={attention!r} is not one of {list(ATTENTION)}")
    if packing not in PACKING:
        raise ConfigError(f"packing={packing!r} is not one of {list(PACKING)}")
    transformers = transformers_module()
    stock = attention if attention in STOCK_ATTENTION else "sdpa"
    if spec.source == "config":
        fields = dict(spec.hf_config)
        model_type = fields.pop("model_type")
        try:
            config = transformers.AutoConfig.for_model(model_type, **fields)
        except ValueError as err:
            raise ConfigError(f"model.body.hf_config.model_type={model_type!r}: {err}".splitlines()[0]) from None
        with torch.device(device):  # its own init runs there (fast on a GPU), then every parameter is replaced
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=stock, dtype=dtype)
        fill_synthetic(model, spec.seed)
    else:
        directory = checkpoint_dir(spec.path)
        spec.config_fields()  # readable, and no auto_map
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, trust_remote_code=False, attn_implementation=stock, dtype=dtype
        ).to(device)
    if attention == "invariant":
        from rlsweep.invariant_body import install

        install(model)
    model.eval()
    model.requires_grad_(False)
    return BuiltModel(spec.name, model, config_fingerprint(model.config), weights_hash(model), attention, packing)


def parameter_scale(name: str, shape: tuple[int, ...], *, head: bool = False) -> tuple[float, float]:
    """(mean, std) of a synthetic parameter: norms near 1, embeddings of unit std, a linear layer's weight of std
    1/sqrt(fan in) (activations stay of order 1 through the layers), the head's (``head``: an embedding tied to it
    too) scaled to logits of std ``LOGIT_STD``, biases small."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and len(shape) == 1:
        return 1.0, NORM_JITTER
    if leaf == "bias":
        return 0.0, 0.02
    if head or name.startswith("lm_head."):  # an embedding tied to the head is the head's weight
        return 0.0, LOGIT_STD / math.sqrt(shape[-1])
    if "embed" in name:
        return 0.0, 1.0
    return 0.0, 1.0 / math.sqrt(shape[-1])


def parameter_seed(seed: int, name: str) -> int:
    """A seed of its own per parameter name: the value of a parameter never depends on which others exist."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % SEED_LIMIT


@torch.no_grad()
def fill_synthetic(model: torch.nn.Module, seed: int) -> None:
    """Every parameter from counter-based normals of its name and ``seed`` (exact arithmetic: the same bits on
    every device), rounded once to the parameter's dtype, computed where the parameter lives in blocks of
    ``GENERATION_ROWS`` rows (as the head's synthetic weight: a 151936-row embedding at once would take tens of GB).
    Buffers (RoPE's inverse frequencies) stay as the model's own construction computed them."""
    output = model.get_output_embeddings()
    head = None if output is None else output.weight
    for name, param in model.named_parameters():  # tied parameters are listed once
        shape = tuple(param.shape)
        mean, std = parameter_scale(name, shape, head=param is head)
        width = shape[-1]
        flat = param.data.view(-1, width)
        for block in torch.arange(len(flat), dtype=torch.int64, device=param.device).split(GENERATION_ROWS):
            values = normal_matrix(parameter_seed(seed, name), "weight", block, width, scale=std, mean=mean,
                                   dtype=param.dtype)  # fmt: skip
            flat[int(block[0]) : int(block[-1]) + 1].copy_(values)


def config_fingerprint(config: Any) -> str:
    """sha256 of the config's canonical form: every field that differs from its class's defaults, with its
    model_type, less what transformers adds by itself (``VOLATILE_CONFIG_FIELDS``)."""
    fields = {k: v for k, v in config.to_diff_dict().items() if k not in VOLATILE_CONFIG_FIELDS}
    fields["model_type"] = config.model_type
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def weights_hash(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape and the sha256 of its bits, ``bits_sha256``), in
    name order."""
    tensors = dict(model.named_parameters())
    tensors.update((name, buffer) for name, buffer in model.named_buffers() if buffer is not None)
    lines = (f"{name}|{t.dtype}|{tuple(t.shape)}|{bits_sha256(t)}\n" for name, t in sorted(tensors.items()))
    return hashlib.sha256("".join(lines).encode()).hexdigest()
