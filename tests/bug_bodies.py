"""Realistic bugs in a whole model's body, planted for a run as a profile's backend module:
``profile.backend_module=bug_bodies`` with ``RLSWEEP_BODY_BUG`` naming the bug (the run's process only: each test
run is its own process). Each patches transformers' Qwen3 classes the way a faulty fork or kernel override would."""

from __future__ import annotations

import functools
import os

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3 import modeling_qwen3


def norms_in_bf16() -> None:
    """RMSNorm computed in the input's dtype (bf16) instead of fp32."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    modeling_qwen3.Qwen3RMSNorm.forward = forward


def rope_base_1e4() -> None:
    """A RoPE base of 1e4 where the config says 1e6."""
    stock = modeling_qwen3.Qwen3RotaryEmbedding.forward

    def forward(self, x, position_ids):
        dim = self.inv_freq.numel() * 2
        self.inv_freq = 1.0 / (1e4 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
        return stock(self, x, position_ids)

    modeling_qwen3.Qwen3RotaryEmbedding.forward = forward


def position_ids_dropped() -> None:
    """The body drops the position ids it is given and counts positions from its cache instead (as a model or engine
    that never passes them on): right for one sequence in one call, wrong for every sequence after the first of a
    packed row and for a left-padded batch's tokens, whose pads it counts. RoPE itself is right on what it gets."""
    stock = modeling_qwen3.Qwen3Model.forward

    @functools.wraps(stock)  # its signature: what takes the KV cache
    def forward(self, *args, **kwargs):
        kwargs.pop("position_ids", None)
        return stock(self, *args, **kwargs)

    modeling_qwen3.Qwen3Model.forward = forward


def norm_eps_1e3() -> None:
    """RMSNorm's epsilon 1e-3 where the config says 1e-6 (a fork that hard-codes another model's value)."""
    stock = modeling_qwen3.Qwen3RMSNorm.forward

    def forward(self, x):
        self.variance_epsilon = 1e-3
        return stock(self, x)

    modeling_qwen3.Qwen3RMSNorm.forward = forward


def scores_over_head_dim() -> None:
    """Attention's scores scaled by 1 / head_dim instead of 1 / sqrt(head_dim) (the module's ``scaling``)."""
    stock = modeling_qwen3.Qwen3Attention.__init__

    def init(self, config, layer_idx):
        stock(self, config, layer_idx)
        self.scaling = self.head_dim**-1.0

    modeling_qwen3.Qwen3Attention.__init__ = init


def scores_scaled_1pct() -> None:
    """Attention's scores 1 % hotter than the config implies (a temperature folded into the module's ``scaling``)."""
    stock = modeling_qwen3.Qwen3Attention.__init__

    def init(self, config, layer_idx):
        stock(self, config, layer_idx)
        self.scaling = 1.01 * self.head_dim**-0.5

    modeling_qwen3.Qwen3Attention.__init__ = init


def padding_mask_ignored() -> None:
    """The attention mask built without the padding (a leaked padding mask): a left-padded row's tokens attend to
    the pads before them; causality still hides a right-padded row's pads."""
    from transformers import masking_utils

    masking_utils.padding_mask_function = lambda padding_mask: lambda batch, head, query, key: key >= 0


def attention_swapped() -> None:
    """A plugin that registers its own function under "sdpa": the config still says sdpa."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        return modeling_qwen3.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
    assert sdpa_attention_forward is not attention


def softmax_in_bf16() -> None:
    """Eager attention with its softmax computed in the scores' dtype (bf16): exp, sum and division each rounded to
    bf16, where the stock function takes the softmax in fp32."""

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key, value = (modeling_qwen3.repeat_kv(t, module.num_key_value_groups) for t in (key, value))
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask[:, :, :, : key.shape[-2]]
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        weights = weights / weights.sum(-1, keepdim=True)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    modeling_qwen3.eager_attention_forward = attention


def silu_in_bf16() -> None:
    """The MLP's SiLU as x * sigmoid(x) with the sigmoid rounded to bf16 first (two roundings where one is due)."""

    def forward(self, x):
        return x * torch.sigmoid(x)

    type(modeling_qwen3.ACT2FN["silu"]).forward = forward


def mlp_batch_scaled() -> None:
    """An MLP whose output moves by 2^-6 only when the call holds more than one sequence."""
    stock = modeling_qwen3.Qwen3MLP.forward

    def forward(self, x):
        out = stock(self, x)
        return out * (1 + 2**-6) if x.shape[0] > 1 else out

    modeling_qwen3.Qwen3MLP.forward = forward


def scaled_residual_layer(applies) -> None:
    """Decoder layers whose residual add after attention scales the residual by 1 + 2^-6 where ``applies(residual)``:
    glue between modules, in no module of its own."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):  # fmt: skip
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, cache=cache, use_cache=use_cache, position_embeddings=position_embeddings,
            **kwargs,
        )  # fmt: skip
        hidden_states = (residual * (1 + 2**-6) if applies(residual) else residual) + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))

    modeling_qwen3.Qwen3DecoderLayer.forward = forward


def residual_batch_scaled() -> None:
    """The residual scaled only when the call holds more than one sequence."""
    scaled_residual_layer(lambda residual: residual.shape[0] > 1)


def residual_scaled() -> None:
    """The residual scaled in every call: every layout computes it alike, so no invariance verdict sees it."""
    scaled_residual_layer(lambda residual: True)


def final_norm_skipped() -> None:
    """The model's last RMSNorm replaced by an identity (a fork that moved the norm into its head, and a head that
    does not apply it)."""
    stock = modeling_qwen3.Qwen3Model.__init__

    def init(self, config):
        stock(self, config)
        self.norm = torch.nn.Identity()

    modeling_qwen3.Qwen3Model.__init__ = init


def gate_up_swapped() -> None:
    """The MLP's activation applied to the up projection instead of the gate (a checkpoint converter that swapped
    the two halves of a fused gate_up_proj)."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    modeling_qwen3.Qwen3MLP.forward = forward


def hidden_scaled_after_norm() -> None:
    """The body's final hidden states divided by a temperature of 1.01 after the last norm, before the head."""
    stock = modeling_qwen3.Qwen3Model.forward

    @functools.wraps(stock)
    def forward(self, *args, **kwargs):
        out = stock(self, *args, **kwargs)
        out.last_hidden_state = out.last_hidden_state / 1.01
        return out

    modeling_qwen3.Qwen3Model.forward = forward


def embeddings_scaled() -> None:
    """Embeddings multiplied by sqrt(hidden_size) before the first layer (another family's normaliser, Gemma's, put
    into a Qwen3 model)."""
    stock = modeling_qwen3.Qwen3Model.forward

    @functools.wraps(stock)
    def forward(self, input_ids=None, *args, **kwargs):
        kwargs["inputs_embeds"] = self.embed_tokens(input_ids) * self.config.hidden_size**0.5
        return stock(self, None, *args, **kwargs)

    modeling_qwen3.Qwen3Model.forward = forward


def rope_keys_skipped() -> None:
    """RoPE applied to the queries alone: the keys reach attention unrotated (every layout alike)."""

    def rotate(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + modeling_qwen3.rotate_half(q) * sin, k

    modeling_qwen3.apply_rotary_pos_emb = rotate


def rope_interleaved() -> None:
    """RoPE rotating adjacent pairs (x0, x1), (x2, x3) ... (GPT-J's convention) where the model's tables and weights
    follow the half-split one (x_i, x_i+D/2): a converter's mix-up."""

    def rotate_pairs(x):
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    def rotate(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin

    modeling_qwen3.apply_rotary_pos_emb = rotate


def attention_module(values: str, heads_first: bool) -> None:
    """Qwen3's attention module as a fork writes it, with its value projection ``values`` ("v_proj" or "k_proj") and,
    where ``heads_first``, the attention output transposed once more before o_proj (heads and tokens mixed)."""

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value = getattr(self, values)(hidden_states).view(hidden_shape).transpose(1, 2)
        query, key = modeling_qwen3.apply_rotary_pos_emb(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        function = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, modeling_qwen3.eager_attention_forward
        )
        out, weights = function(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                                sliding_window=self.sliding_window, **kwargs)  # fmt: skip
        out = out.transpose(1, 2) if heads_first else out
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    modeling_qwen3.Qwen3Attention.forward = forward


def values_from_keys() -> None:
    """The values projected by k_proj (a copy-paste slip in a fork's attention)."""
    attention_module("k_proj", heads_first=False)


def attention_heads_transposed() -> None:
    """The attention output transposed once more before o_proj: its rows mix heads and tokens."""
    attention_module("v_proj", heads_first=True)


def kv_cache_fp8(stored_only: bool) -> None:
    """A KV cache kept in float8_e4m3 (an inference engine's fp8 KV cache) where the trainer's forward is bf16: what
    attention reads back is rounded to 3 mantissa bits; with ``stored_only`` a call's own keys and values reach its
    attention as computed, and only the cached ones come back rounded."""
    from transformers import DynamicCache

    stock = DynamicCache.update

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rounded = [t.to(torch.float8_e4m3fn).to(t.dtype) for t in (key_states, value_states)]
        keys, values = stock(self, *rounded, layer_idx, *args, **kwargs)
        if not stored_only:
            return keys, values
        count = key_states.shape[2]
        return (torch.cat([keys[:, :, :-count], key_states], dim=2),
                torch.cat([values[:, :, :-count], value_states], dim=2))  # fmt: skip

    DynamicCache.update = update


def kv_cache_fp8_read() -> None:
    """Every key and value attention reads from the cache rounded to fp8, the call's own included."""
    kv_cache_fp8(stored_only=False)


def kv_cache_fp8_stored() -> None:
    """Only what the cache held from earlier calls comes back rounded to fp8."""
    kv_cache_fp8(stored_only=True)


def linear_batched_bf16_sum() -> None:
    """Linear layers that take another kernel path when the call holds more than one sequence: its products summed in
    two halves of K, each rounded to bf16 before they are added (a split-K kernel for batched shapes that keeps its
    partials in the output dtype). A call of one sequence, the packed row, is the stock matmul."""
    stock = torch.nn.Linear.forward

    def forward(self, x):
        if x.dim() < 3 or x.shape[0] == 1:
            return stock(self, x)
        half = x.shape[-1] // 2
        first = torch.nn.functional.linear(x[..., :half], self.weight[:, :half])
        return first + torch.nn.functional.linear(x[..., half:], self.weight[:, half:], self.bias)

    torch.nn.Linear.forward = forward


def attention_split_from_length() -> None:
    """The invariant body's attention with its key blocks sized from the call's key count (16 keys a block below 48
    keys, else 64): a split that follows the sequence length, so one sequence alone and the packed row reduce a row's
    keys in different blocks."""
    from dataclasses import replace

    from kernels import body
    from rlsweep import invariant_body

    def invariant_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        tiling = replace(body.INTERPRETER_ATTENTION, block_n=16 if key.shape[2] < 48 else 64)
        return body.attention(query, key, value, attention_mask, scaling, tiling), None

    invariant_body.invariant_attention = invariant_attention


def linear_left_stock() -> None:
    """An invariant body whose linear layers kept torch's own forward (a replacement that matched no module)."""
    from rlsweep import invariant_body

    invariant_body.linear_forward = torch.nn.Linear.forward


BUGS = {
    bug.__name__: bug
    for bug in (norms_in_bf16, norm_eps_1e3, rope_base_1e4, position_ids_dropped, scores_over_head_dim,
                scores_scaled_1pct, padding_mask_ignored, attention_swapped, softmax_in_bf16, silu_in_bf16,
                mlp_batch_scaled, residual_batch_scaled, linear_batched_bf16_sum, attention_split_from_length,
                linear_left_stock, residual_scaled, final_norm_skipped, gate_up_swapped, hidden_scaled_after_norm,
                embeddings_scaled, rope_keys_skipped, rope_interleaved, values_from_keys, attention_heads_transposed,
                kv_cache_fp8_read, kv_cache_fp8_stored)
}  # fmt: skip
BUGS[os.environ["RLSWEEP_BODY_BUG"]]()
