"""The invariant body: a Llama/Qwen3-family model built by transformers, run through ``kernels.body`` so that every
module's output row has the same bits in every layout cell (docs/whole_model.md#the-invariant-body).

It plugs in through transformers' own extension points, never a fork of the model code:
- an attention function and its mask function, registered under ``ATTENTION_KEY`` in transformers'
  ``AttentionInterface`` and ``AttentionMaskInterface`` (the mask always materialised as bool [B, 1, Q, K]);
- module replacement: each ``nn.Linear`` of the body, each RMSNorm and the rotary embedding take a subclass of their
  own class whose forward runs the invariant op (parameters, names and hooks stay as they were), and the MLP's SiLU
  becomes ``InvariantSiLU``.
The rotary embedding looks a position's cos and sin up in one table computed once by the model's own rotary module,
so a position's angles are the same bits in every call. The residual adds and the SiLU-times-up product stay torch's
elementwise ops: each rounds one exact (or correctly rounded) fp32 result to the dtype, the same bits on any path.

Anything the invariant ops do not cover is refused in one line: another activation, an RMSNorm of another form, a
RoPE whose angles depend on the sequence length, sliding-window attention, a linear layer of another class.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kernels import body as ops
from rlsweep.errors import ConfigError

ATTENTION_KEY = "rlsweep_invariant"  # the name transformers' registries know the invariant attention by
ATTENTION_FUNCTION = "invariant_attention"  # what body provenance expects transformers to call
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # rope types whose angles are a function of the position only


def invariant_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention function signature: query [B, Hq, Q, D], key and value [B, Hkv, K, D] (the cache's
    keys included), the bool mask of ``invariant_mask``; returns ([B, Q, Hq, D], no weights)."""
    if sliding_window is not None:
        raise ConfigError(f"sliding_window={sliding_window}: the invariant body's attention is full causal attention")
    if dropout:
        raise ConfigError(f"attention dropout={dropout}: the invariant body runs in eval mode, without dropout")
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    return ops.attention(query, key, value, attention_mask, scaling), None


def invariant_mask(*args: Any, **kwargs: Any) -> torch.Tensor:
    """transformers' sdpa mask, always materialised (never None for "plainly causal"): bool [B, 1, Q, K]."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


@functools.cache
def register() -> None:
    """Register ``invariant_attention`` and ``invariant_mask`` under ``ATTENTION_KEY``, once per process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_KEY, invariant_attention)
    AttentionMaskInterface.register(ATTENTION_KEY, invariant_mask)


class InvariantSiLU(torch.nn.Module):
    """SiLU through ``kernels.body.silu`` (bf16, fp32); float64, as the module accuracy's reference asks of it, is
    torch's own. Judged as an activation (``op_class``)."""

    op_class = "activation"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            return torch.nn.functional.silu(x)
        return ops.silu(x)


def linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float64:
        return torch.nn.functional.linear(x, self.weight.double(), None if self.bias is None else self.bias.double())
    return ops.linear(x, self.weight, self.bias)


def rmsnorm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def rotary_forward(self: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cos and sin of each position, looked up in the table of ``angle_table``, in x's dtype."""
    cos, sin = self.rlsweep_angles
    positions = position_ids.to(cos.device)
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= len(cos)):
        raise ConfigError(
            f"position ids [{int(positions.min())}, {int(positions.max())}] are outside the rotary table's "
            f"[0, {len(cos)}) (max_position_embeddings)"
        )
    return cos[positions].to(x.dtype), sin[positions].to(x.dtype)


@functools.cache
def invariant_class(base: type, forward: Any) -> type:
    """``Invariant<Base>``: ``base`` with ``forward`` (class names keep their suffix, so op classes still apply)."""
    return type(f"Invariant{base.__name__}", (base,), {"forward": forward, "__module__": __name__})


def swap_class(module: torch.nn.Module, forward: Any) -> None:
    module.__class__ = invariant_class(type(module), forward)


@torch.no_grad()
def angle_table(rotary: torch.nn.Module, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [positions, head_dim] fp32 of positions 0 .. positions - 1, by the module's own forward, once."""
    probe = torch.zeros((), dtype=torch.float32, device=device)
    cos, sin = rotary(probe, torch.arange(positions, device=device)[None])
    return cos[0].float(), sin[0].float()


def install(model: torch.nn.Module) -> None:
    """Run ``model``'s decoder through the invariant ops (in place); the head (``lm_head``) is left to the profile's
    head backend. Refuses, in one line naming the module, what the invariant ops do not cover."""
    register()
    config = model.config
    activation = getattr(config, "hidden_act", None)
    if activation != "silu":
        raise ConfigError(f"hidden_act={activation!r}: the invariant body runs SiLU MLPs (Llama/Qwen3 family) only")
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        raise ConfigError(f"rope_type={rope!r}: the invariant body takes RoPE whose angles depend on the position only "
                          f"({', '.join(STATIC_ROPE)})")  # fmt: skip
    decoder = model.get_decoder()
    device = next(decoder.parameters()).device
    for path, module in decoder.named_modules():
        name = type(module).__name__
        if isinstance(module, torch.nn.Linear):
            if type(module) is not torch.nn.Linear:
                raise ConfigError(f"{path} is a {name}, not a plain nn.Linear: the invariant body cannot replace it")
            swap_class(module, linear_forward)
        elif name.endswith("RMSNorm"):
            if not hasattr(module, "variance_epsilon") or getattr(module, "weight", None) is None:
                raise ConfigError(f"{path} is a {name} without weight and variance_epsilon: not an RMSNorm of the "
                                  "form weight * x / rms(x) the invariant body runs")  # fmt: skip
            swap_class(module, rmsnorm_forward)
        elif name.endswith("RotaryEmbedding"):
            module.rlsweep_angles = angle_table(module, config.max_position_embeddings, device)
            swap_class(module, rotary_forward)
        elif hasattr(module, "act_fn") and isinstance(module.act_fn, torch.nn.Module):
            module.act_fn = InvariantSiLU()
    model.set_attn_implementation(ATTENTION_KEY)


def uninstall(model: torch.nn.Module) -> None:
    """Undo ``install`` on ``model`` (a copy: the float32 model that samples responses and the float64 reference run
    the stock ops, as every profile's do), attention back to sdpa, the stock implementation it was built with; a model
    never installed is left as it is."""
    from transformers.activations import ACT2FN

    if model.config._attn_implementation == ATTENTION_KEY:
        model.set_attn_implementation("sdpa")
    for module in model.modules():
        if type(module).__module__ == __name__ and type(module) is not InvariantSiLU:
            module.__class__ = type(module).__bases__[0]
        if isinstance(getattr(module, "act_fn", None), InvariantSiLU):
            module.act_fn = ACT2FN["silu"]
