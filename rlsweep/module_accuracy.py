"""Each module of a whole model against float64 of that module on the same inputs, within a bound derived for its
op class (docs/contract.md#whole-model-modules).

The inputs are the ones the module received in the run (recorded by a forward hook), so an error upstream never
counts against a module downstream: each op is judged on its own arithmetic. Op classes: ``linear``
(``nn.Linear``), ``rmsnorm`` (any module whose class name ends in ``RMSNorm`` with a ``weight`` and a
``variance_epsilon``, against the config's ``rms_norm_eps`` where it names one), ``rotary`` (a ``*RotaryEmbedding``'s
cos and sin, against the config's RoPE base),
``activation`` (an activation module of torch or transformers, the MLP's ``act_fn``), and ``attention``: the
attention function transformers called (its registry's, with the query, key, value and mask it was given, scaled as
the config implies),
and every softmax the dispatcher ran inside it, on the scores it received.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.launches import bookkeeping
from kernels.rounding import FP32_UNIT_ROUNDOFF, gamma, half_ulp
from rlsweep.hf_model import BuiltModel
from rlsweep.model_cells import (
    CURRENT_SLOTS,
    TRAINER_CELL,
    TokenWorkload,
    attention_inputs,
    cell_hidden,
    layout_allowed,
    layout_positions,
    watching_attention,
)
from rlsweep.recording import MODULE_PREFIX

ACCURACY_COLUMNS = ("module", "module_class", "op_class", "elements", "max_abs_error", "scale_error", "bound_used",
                    "passed")  # fmt: skip
# How far an attention's effective score scale may sit from the config's (``scale_error``): the scale rounded once to
# the input dtype (u: 2^-8 relative for bf16) and folded with other constants in fp32 (log2(e) for exp2, a square
# root split between q and k: SCALE_FP32_ROUNDINGS roundings of u_fp32), plus SCALE_SIGMAS standard errors of its
# estimate from the module's errors.
SCALE_FP32_ROUNDINGS = 8
SCALE_SIGMAS = 8.0


# Op classes whose every output row depends on its input row alone (not the tensor row_local of model_judgments,
# which judges every module around no attention, whatever its op class).
ROW_LOCAL_OP_CLASSES = ("linear", "rmsnorm", "activation")
ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")  # where activation classes live
SOFTMAX_OPS = ("aten._softmax.default", "aten._safe_softmax.default")  # what a softmax reaches at the dispatcher


def op_class(module: torch.nn.Module) -> str | None:
    """The op class a module of the body is judged as (a hooked module's; ``attention`` is judged at the attention
    function instead: ``recording_calls``)."""
    name = type(module).__name__
    declared = getattr(module, "op_class", None)  # a module of rlsweep's own says what it is (InvariantSiLU)
    if isinstance(declared, str):
        return declared
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if name.endswith("RMSNorm") and hasattr(module, "weight") and hasattr(module, "variance_epsilon"):
        return "rmsnorm"
    if name.endswith("RotaryEmbedding"):
        return "rotary"
    if type(module).__module__ in ACTIVATION_MODULES:
        return "activation"
    return None


@dataclass
class Call:
    path: str
    module: torch.nn.Module
    args: tuple
    kwargs: dict
    output: object
    kind: str | None = None  # the op class; None: op_class(module)
    layout: torch.Tensor | None = None  # an attention function's: what its cell's layout lets each query attend to
    positions: torch.Tensor | None = None  # a rotary embedding's: each token's position in its sequence (-1: none)


class SoftmaxRecorder(TorchDispatchMode):
    """Every softmax the dispatcher runs inside the block: (input, dim, output)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, int, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in SOFTMAX_OPS:
            self.calls.append((args[0].detach().clone(), int(args[1]), out.detach().clone()))
        return out


def copied_call(path: str, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any,
                rows: torch.Tensor | None = None, batch: int = 0, **fields: Any) -> Call:  # fmt: skip
    """A ``Call`` of copies of what ``module`` was given and returned (keyword arguments: tensors and numbers only),
    and of ``fields``; with ``rows``, only those rows of each tensor whose first dim is the call's ``batch``."""

    def copy(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if rows is not None and value.dim() and value.shape[0] == batch:
            return value.detach()[rows.to(value.device)]
        return value.detach().clone()

    out = tuple(copy(o) for o in output) if isinstance(output, tuple) else copy(output)
    kept = {k: copy(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor | float | int)}
    return Call(path, module, tuple(copy(a) for a in args), kept, out, **{k: copy(v) for k, v in fields.items()})


@contextmanager
def watching_calls(built: BuiltModel, hooked: Callable[[torch.nn.Module], bool], module_call: Callable,
                   attention_call: Callable) -> Iterator[None]:  # fmt: skip
    """While the block runs: ``module_call(path, module, args, kwargs, output)`` after each call of a body module that
    ``hooked`` picks, and ``attention_call(function, path, module, args, kwargs)`` makes each call of the attention
    function (``path``: its attention module's, ``.attention_function`` added)."""
    paths = {module: path for path, module in built.body.named_modules(prefix=MODULE_PREFIX)}

    def attention(function, module: torch.nn.Module, args: tuple, kwargs: dict):
        path = f"{paths.get(module, type(module).__name__)}.attention_function"
        return attention_call(function, path, module, args, kwargs)

    handles = [
        module.register_forward_hook(lambda m, a, k, o, path=path: module_call(path, m, a, k, o), with_kwargs=True)
        for module, path in paths.items()
        if hooked(module)
    ]
    try:
        with watching_attention(built, attention):
            yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def recording_calls(built: BuiltModel) -> Iterator[list[Call]]:
    """Every call of a module of a judged op class, with its inputs and output, while the block runs."""
    calls: list[Call] = []

    def keep(path: str, module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        calls.append(copied_call(path, module, args, kwargs, output, positions=rotary_positions(module, output)))

    def attention(function, path: str, module: torch.nn.Module, args: tuple, kwargs: dict):
        with SoftmaxRecorder() as softmaxes:
            output = function(module, *args, **kwargs)
        layout = call_layout(args, kwargs)
        calls.append(copied_call(path, module, args, kwargs, output, kind="attention", layout=layout))
        for x, dim, y in softmaxes.calls:
            calls.append(Call(f"{path}.softmax", module, (x,), {"dim": dim}, y, kind="attention"))
        return output

    with watching_calls(built, lambda module: op_class(module) is not None, keep, attention):
        yield calls


def rotary_positions(module: torch.nn.Module, output: Any) -> torch.Tensor | None:
    """A rotary embedding's call: the positions the cell's layout gives its tokens (``layout_positions``); None for
    any other module."""
    if op_class(module) != "rotary" or not isinstance(output, tuple) or output[0].dim() < 2:
        return None
    return layout_positions(output[0].shape[-2])


def call_layout(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """What the cell's layout lets each query row of this attention call attend to (``layout_allowed``)."""
    query, key, _, _ = attention_inputs(args, kwargs)
    return layout_allowed(query.shape[2], key.shape[2])


@contextmanager
def layout_calls(built: BuiltModel, unrecorded: frozenset[str] = frozenset()) -> Iterator[list[Call]]:
    """Every call of the attention function and of a rotary embedding while the block runs, with its inputs, output
    and what the cell's layout says (``Call.layout``, ``Call.positions``), as ``recording_calls`` keeps them, only the
    batch rows that hold a judged token (a needle's row, not its hundreds of fillers), and the copies rlsweep's
    bookkeeping, left out of an observed provenance: what ``accuracy_table`` judges in each cell. Entered inside
    ``rlsweep.model_cells.observing_body``, whose watch of the attention function then still sees the function
    transformers chose. The modules at the paths ``unrecorded`` (``unrecorded_paths``: row-local modules whose calls
    the divergence recording cannot lay out by token, an MoE's experts) are kept whole, every call."""
    calls: list[Call] = []
    kept_whole = {id(module) for path, module in built.body.named_modules(prefix=MODULE_PREFIX) if path in unrecorded}

    def keep(path: str, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any, batch: int, **fields):
        slots = CURRENT_SLOTS.get()
        whole = slots is None or len(slots) != batch  # not the call's own batch rows: nothing to pick
        rows = None if whole else (slots >= 0).any(dim=1).nonzero()[:, 0]
        with bookkeeping():
            calls.append(copied_call(path, module, args, kwargs, output, rows, batch, **fields))

    def module_call(path: str, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if id(module) in kept_whole:
            with bookkeeping():
                calls.append(copied_call(path, module, args, kwargs, output))
        else:
            keep(path, module, args, kwargs, output, output[0].shape[0], positions=rotary_positions(module, output))

    def attention(function, path: str, module: torch.nn.Module, args: tuple, kwargs: dict):
        output = function(module, *args, **kwargs)
        batch = attention_inputs(args, kwargs)[0].shape[0]
        keep(path, module, args, kwargs, output, batch, kind="attention", layout=call_layout(args, kwargs))
        return output

    hooked = lambda module: op_class(module) == "rotary" or id(module) in kept_whole  # noqa: E731
    with watching_calls(built, hooked, module_call, attention):
        yield calls


def recorded_calls(built: BuiltModel, records: dict) -> list[Call]:
    """The calls of every module of a row-local op class (``ROW_LOCAL_OP_CLASSES``) that
    ``rlsweep.recording.recording`` recorded in a cell (``ModuleRecord`` by module path): the input and output rows of
    its judged tokens (padding and fillers are not recorded), the output on the input's device. What ``accuracy_table``
    judges of those modules in each cell after the first, with no hooks of its own; a call recorded with other than one
    per-token input is left out (an op class with nothing judged is red)."""
    modules = dict(built.body.named_modules(prefix=MODULE_PREFIX))
    calls = []
    for path, record in records.items():
        module = modules.get(path)
        kind = op_class(module) if module is not None else None
        if kind in ROW_LOCAL_OP_CLASSES:
            calls += [Call(path, module, (call.inputs[0],), {}, call.output.to(call.inputs[0].device), kind=kind)
                      for call in record.calls if len(call.inputs) == 1]  # fmt: skip
    return calls


def unrecorded_paths(built: BuiltModel, records: dict) -> frozenset[str]:
    """The modules of a row-local op class (``ROW_LOCAL_OP_CLASSES``) of which ``rlsweep.recording.recording`` recorded
    no call by token in a cell (``records``: the canonical cell's), so ``recorded_calls`` cannot judge them in the other
    cells: modules called on rows other than the call's [batch, position] (an MoE's experts, on the tokens routed to
    them)."""
    laid_out = {path for path, record in records.items() if any(len(call.inputs) == 1 for call in record.calls)}
    return frozenset(
        path for path, module in built.body.named_modules(prefix=MODULE_PREFIX)
        if op_class(module) in ROW_LOCAL_OP_CLASSES and path not in laid_out
    )  # fmt: skip


def linear_reference(module: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x W^T (+ b): float64 of it, and the bound of K products summed in fp32 (gamma_{K+1} |x| |W|^T, the bias
    add included) then rounded once to y's dtype (half an ulp), as the head's matmul (kernels/rounding.py)."""
    x64, w64 = x.double(), module.weight.double()
    y64 = x64 @ w64.T
    magnitude = x64.abs() @ w64.abs().T
    if module.bias is not None:
        y64 = y64 + module.bias.double()
        magnitude = magnitude + module.bias.double().abs()
    summed = gamma(x.shape[-1] + 1) * magnitude
    return y64, summed + half_ulp(y64.abs() + summed, y.dtype)


def rmsnorm_reference(
    module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """y = w * (x / sqrt(mean(x^2) + eps)): float64 of it, and the bound of the normalisation in fp32 (H squares
    summed, the rsqrt and the product: gamma_{H+4} relative), its result rounded once to x's dtype, then the weight's
    product rounded once to y's dtype (half an ulp each)."""
    x64, w64 = x.double(), module.weight.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    y64 = w64 * normed
    fp32 = gamma(x.shape[-1] + 4) * normed.abs()
    narrowed = fp32 + half_ulp(normed.abs() + fp32, x.dtype)
    carried = w64.abs() * narrowed
    return y64, carried + half_ulp(y64.abs() + carried, y.dtype)


def rotary_angles(position_ids: torch.Tensor, theta: float, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's angles position * base^(-2i/dim) in float64 for the base the model's config names ([..., dim]: the two
    halves rotate together), and the bound of computing them in fp32: the exponent's rounding moves base^e by
    ln(base) u relative, the power, the reciprocal and the product by a few u more ((ln(base) + 8) u_fp32
    relative)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=position_ids.device) / dim))
    angles = position_ids.double()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles, (math.log(theta) + 8) * FP32_UNIT_ROUNDOFF * angles.abs()


GELU_TANH = lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))  # noqa: E731
# The activations a config's ``hidden_act`` names, in float64 (transformers' ACT2FN names; its tanh GELUs are one
# function): what an MLP's act_fn is judged against, whatever module the model put there.
SILU = lambda x: x * torch.sigmoid(x)  # noqa: E731
GELU_ERF = lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))  # noqa: E731
CONFIG_ACTIVATIONS = {
    "silu": SILU,
    "swish": SILU,
    "gelu": GELU_ERF,
    "gelu_python": GELU_ERF,
    "gelu_new": GELU_TANH,
    "gelu_fast": GELU_TANH,
    "gelu_pytorch_tanh": GELU_TANH,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": torch.relu,
    "relu2": lambda x: torch.relu(x) ** 2,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}


def config_activation(config: Any, path: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The float64 activation an MLP's ``act_fn`` (``path`` ending in ``.act_fn``) must compute: the one its config's
    ``hidden_act`` names (``CONFIG_ACTIVATIONS``); None where the module is no MLP's act_fn or the config names none of
    those (the module's own then)."""
    name = getattr(config, "hidden_act", None)
    if not path.endswith(".act_fn") or not isinstance(name, str):
        return None
    return CONFIG_ACTIVATIONS.get(name)


def activation_reference(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                         function: Callable[[torch.Tensor], torch.Tensor] | None = None):  # fmt: skip
    """y = act(x) elementwise: ``function`` (the config's activation, ``config_activation``), else the same module, in
    float64, and the bound of its evaluation in fp32 (a few transcendental and arithmetic ops: 16 u_fp32 of
    |x| + |y|), its result rounded once to y's dtype."""
    y64 = (function or module)(x.double())
    slack = 16 * FP32_UNIT_ROUNDOFF * (x.double().abs() + y64.abs())
    return y64, slack + half_ulp(y64.abs() + slack, y.dtype)


def softmax_reference(x: torch.Tensor, dim: int, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p = softmax(x) along ``dim`` in float64 on the scores the softmax received, the bound of evaluating it in
    fp32 (n exps of a few ulps, the sum of n terms, the division: gamma_{n+8} relative), its result rounded once to
    p's dtype; and which rows count (a row with no finite score, all masked, has no softmax to judge)."""
    x64 = x.double()
    p64 = torch.softmax(x64, dim)
    slack = gamma(x.shape[dim] + 8) * p64
    rows = torch.isfinite(x64).any(dim, keepdim=True).expand_as(p64)
    return p64, slack + half_ulp(p64 + slack, y.dtype), rows


def config_scaling(config: Any, head_dim: int) -> float:
    """The scale of attention's scores that a model's config implies: its ``query_pre_attn_scalar`` ** -0.5 (Gemma),
    its ``attention_multiplier`` (Granite), else 1 / sqrt(head_dim) of the query (Llama, Qwen3 and most others)."""
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if scalar is not None:
        return float(scalar) ** -0.5
    multiplier = getattr(config, "attention_multiplier", None)
    return float(multiplier) if multiplier is not None else head_dim**-0.5


def attention_reference(module: torch.nn.Module, args: tuple, kwargs: dict, output: torch.Tensor, config: Any,
                        layout: torch.Tensor | None = None):  # fmt: skip
    """o = softmax(scaling q k^T + mask) v of one attention function call (query [B, Hq, L, D], key and value
    [B, Hkv, S, D] repeated over the query heads they serve, the mask 4D bool (True: attend) or additive, or none:
    causal), in float64 on the inputs it was given, against its output [B, L, Hq, D]; the bound and the rows that
    count (a query row with no key to attend, padding, has no attention to judge). The scaling is the one the
    model's config implies (``config_scaling``), not the one the call was given: as for RoPE's base, a model that
    scales its scores otherwise is the bug judged here.

    The bound admits what attention kernels do in practice: the scores q k^T summed in fp32 and rounded to the input
    dtype, and scaled in it (eager; a fused kernel keeps them in fp32); the softmax in fp32, its probabilities rounded
    to the input dtype (before the matmul with v); p v summed in fp32; the output rounded once. A score off by e_j
    moves p_j by at most p_j (exp(e_j + E) - 1), E = log sum_k p_k exp(e_k) (the normaliser moves by at most E).

    ``layout`` ([B, 1, L, S] bool, ``rlsweep.model_cells.layout_allowed``): what the cell's layout lets each query
    attend to. The reference attends to the keys both it and the mask allow: a mask or kernel that lets a query see
    another sequence's tokens, padding or its own future (a leaked padding mask) is judged here, in any cell, while a
    mask narrower than the layout (a sliding window) is the model's own."""
    query, key, value, mask = attention_inputs(args, kwargs)
    scaling = config_scaling(config, query.shape[-1])
    groups = query.shape[1] // key.shape[1]
    q64 = query.double()
    k64, v64 = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    length, keys = query.shape[2], key.shape[2]
    if mask is None:  # causal, the last query row seeing every key (a query block continuing a cache)
        allowed = torch.ones(length, keys, dtype=torch.bool, device=query.device).tril(keys - length)
        additive = torch.zeros((), dtype=torch.float64, device=query.device)
    else:
        mask = mask[..., :keys]
        if mask.dtype == torch.bool:
            allowed, additive = mask, torch.zeros((), dtype=torch.float64, device=query.device)
        else:
            allowed = mask > torch.finfo(mask.dtype).min / 2
            additive = mask.double().masked_fill(~allowed, 0)
    if layout is not None:
        allowed = allowed & layout.to(allowed.device)
    magnitude = abs(scaling) * (q64.abs() @ k64.abs().transpose(-1, -2))
    scores = (scaling * (q64 @ k64.transpose(-1, -2)) + additive).masked_fill(~allowed, -math.inf)
    p64 = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    dtype = query.dtype
    carried = gamma(query.shape[-1] + 2) * magnitude
    score_error = (carried + 3 * half_ulp(magnitude + carried, dtype)).masked_fill(~allowed, 0)
    normaliser = torch.log((p64 * torch.exp(score_error)).sum(-1, keepdim=True).clamp(min=1))
    moved = p64 * torch.expm1(score_error + normaliser) + gamma(keys + 8) * p64
    rounded = moved + half_ulp(p64 + moved, dtype)
    summed = rounded + gamma(keys + 1) * (p64 + rounded)
    o64 = (p64 @ v64).transpose(1, 2)
    carried_out = (summed @ v64.abs()).transpose(1, 2)
    bound = carried_out + half_ulp(o64.abs() + carried_out, output.dtype)
    rows = allowed.expand(p64.shape).any(-1)[..., None].expand((*p64.shape[:-1], value.shape[-1])).transpose(1, 2)
    # d o / d ln(scaling): how the output moves as the scores' scale does (the mask's additive part does not scale).
    scaled = (scaling * (q64 @ k64.transpose(-1, -2))).masked_fill(~allowed, 0)
    centred = scaled - (p64 * scaled).sum(-1, keepdim=True)
    slope = ((p64 * centred) @ v64).transpose(1, 2)
    return o64, bound, rows, slope


def scale_error(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> tuple[float, float]:
    """An attention module's effective score scale relative to the config's, less 1 (beta), and the share of its
    tolerance it uses, from ``parts``: per query row of each call, (sum of error * slope, sum of slope^2) over the
    row's outputs (error = output - float64, slope = d o / d ln(scaling): ``attention_reference``). beta is the least
    squares fit of the errors along the slope; rounding scatters them with no preferred direction, a scale off by
    beta moves every row along its slope. The tolerance: the unit roundoff of ``dtype`` (a kernel may round its scale
    to the input dtype once), a few fp32 roundings, plus SCALE_SIGMAS standard errors of beta (rows as the independent
    units: a row's outputs share its probabilities' roundings). A worst-case bound cannot see this bug: a scale off
    by 1 % moves attention's output by less than the bf16 scores and probabilities its bound admits
    (docs/contract.md#whole-model-modules)."""
    along, norm = (torch.cat(part) for part in zip(*parts, strict=True))
    total = float(norm.sum())
    if total <= 0 or not bool(torch.isfinite(along).all()):
        return math.nan, 0.0  # no row whose output the scale moves, or a non-finite output (judged by its bound)
    beta = float(along.sum()) / total
    sigma = float((along - beta * norm).pow(2).sum().sqrt()) / total
    rounded = half_ulp(torch.ones((), dtype=torch.float64), dtype).item() + SCALE_FP32_ROUNDINGS * FP32_UNIT_ROUNDOFF
    return beta, abs(beta) / (rounded + SCALE_SIGMAS * sigma)


def judge_call(built: BuiltModel, call: Call) -> tuple[str, int, float, float, tuple | None]:
    """(op class, elements, max |error|, the largest error / bound, and for an attention function's call its rows'
    parts of ``scale_error``) of one recorded call."""
    kind = call.kind or op_class(call.module)
    rows, scale = None, None
    if kind == "attention":
        output = call.output[0] if isinstance(call.output, tuple) else call.output
        if "dim" in call.kwargs:  # a softmax inside the attention function, on the scores it received
            y64, bound, rows = softmax_reference(call.args[0], call.kwargs["dim"], output)
        else:
            config = built.model.config
            y64, bound, rows, slope = attention_reference(call.module, call.args, call.kwargs, output, config,
                                                          call.layout)  # fmt: skip
            signed, slope = (torch.where(rows, t, torch.zeros_like(t)) for t in (output.double() - y64, slope))
            scale = ((signed * slope).sum(-1).flatten(), slope.pow(2).sum(-1).flatten())
        errors = (output.double() - y64).abs()
    elif kind == "activation":
        x, y = row_io(call, kind)
        y64, bound = activation_reference(call.module, x, y, config_activation(built.model.config, call.path))
        errors = (y.double() - y64).abs()
    elif kind == "linear":
        x, y = row_io(call, kind)
        y64, bound = linear_reference(call.module, x, y)
        errors = (y.double() - y64).abs()
    elif kind == "rmsnorm":
        x, y = row_io(call, kind)
        # The epsilon the config names, as for RoPE's base: a module that adds another one is the bug judged here.
        eps = getattr(built.model.config, "rms_norm_eps", None)
        y64, bound = rmsnorm_reference(call.module, x, y, call.module.variance_epsilon if eps is None else eps)
        errors = (y.double() - y64).abs()
    else:
        config = built.model.config
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        position_ids = call.kwargs.get("position_ids", call.args[1] if len(call.args) > 1 else None)
        if call.positions is not None:  # each token at the position its layout gives it: its own sequence's count
            expected = call.positions.to(position_ids.device)
            position_ids = torch.where(expected >= 0, expected, position_ids)
        cos, sin = call.output
        angles, angle_bound = rotary_angles(position_ids, theta, dim)
        scaling = abs(float(getattr(call.module, "attention_scaling", 1.0)))
        errors, bound = [], []
        # cos and sin move by at most the angle's error; their fp32 evaluation and the scaling add a few u_fp32; the
        # result is rounded once to the output's dtype.
        for got, exact in ((cos, torch.cos(angles) * scaling), (sin, torch.sin(angles) * scaling)):
            errors.append((got.double() - exact).abs().flatten())
            slack = (angle_bound + 4 * FP32_UNIT_ROUNDOFF) * scaling
            bound.append((slack + half_ulp(exact.abs() + slack, got.dtype)).flatten())
        errors, bound = torch.cat(errors), torch.cat(bound)
    if rows is not None:  # rows with nothing to judge (all masked) count as exact
        errors = torch.where(rows, errors, torch.zeros_like(errors))
    used = errors / bound.clamp(min=torch.finfo(torch.float64).tiny)
    used = torch.where(errors == 0, torch.zeros_like(used), used)
    # A NaN or infinite output (or a NaN error) uses all of any bound: it never passes, and max() never drops it.
    used = torch.where(torch.isfinite(errors), used, torch.full_like(used, math.inf))
    return kind, errors.numel(), float(errors.nan_to_num(nan=math.inf).max()), float(used.max()), scale


def row_io(call: Call, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of a call of a row-local op class (``ROW_LOCAL_OP_CLASSES``), positional or by keyword."""
    keyword = {"linear": "input", "rmsnorm": "hidden_states"}.get(kind, "input")
    return (call.args or (call.kwargs.get(keyword),))[0], call.output


def merged_rows(calls: list[Call]) -> list[Call]:
    """``calls`` with every call of one module of a row-local op class (``ROW_LOCAL_OP_CLASSES``) made one: their input
    and output rows concatenated ([rows, features]), so a cell of hundreds of calls (a decode, a chunked prefill)
    computes each module's float64 reference once. Each output row depends on its input row alone, so every element's
    error and bound are the ones its own call gives; calls whose rows differ in features or dtype stay apart."""
    order: list[Call | tuple] = []
    groups: dict[tuple, list[Call]] = {}
    for call in calls:
        kind = call.kind or op_class(call.module)
        x, y = row_io(call, kind) if kind in ROW_LOCAL_OP_CLASSES else (None, None)
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or x.dim() == 0 or y.dim() == 0:
            order.append(call)
            continue
        key = (call.path, kind, x.shape[-1], x.dtype, y.shape[-1], y.dtype)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(call)
    return [item if isinstance(item, Call) else concatenated(groups[item], item[1]) for item in order]


def concatenated(group: list[Call], kind: str) -> Call:
    """One call of a row-local module holding the rows of every call in ``group`` ([rows, features])."""
    xs, ys = zip(*(row_io(call, kind) for call in group), strict=True)
    x, y = (torch.cat([t.reshape(-1, t.shape[-1]) for t in ts]) for ts in (xs, ys))
    return Call(group[0].path, group[0].module, (x,), {}, y, kind=kind)


def module_accuracy(built: BuiltModel, workload: TokenWorkload, cell: str = TRAINER_CELL) -> pd.DataFrame:
    """One row per judged module of the body in ``cell``: its op class, elements judged, largest |error| against
    float64 of the module on its own inputs, an attention function's ``scale_error`` (NaN for the others), and the
    largest share of its bound used (passed: at most 1), over all of its calls in the cell; an attention function's
    share of its scale tolerance counts as a share of its bound."""
    with recording_calls(built) as calls:
        cell_hidden(built, workload, cell)
    return accuracy_table(built, calls)


def accuracy_table(built: BuiltModel, calls: list[Call]) -> pd.DataFrame:
    """``module_accuracy``'s table of recorded ``calls``."""
    rows: dict[str, dict] = {}
    scales: dict[str, tuple[list, torch.dtype]] = {}
    for call in merged_rows(calls):
        kind, elements, max_error, used, scale = judge_call(built, call)
        first = {"module": call.path, "module_class": type(call.module).__name__, "op_class": kind, "elements": 0,
                 "max_abs_error": 0.0, "scale_error": math.nan, "bound_used": 0.0}  # fmt: skip
        row = rows.setdefault(call.path, first)
        row["elements"] += elements
        row["max_abs_error"] = max(row["max_abs_error"], max_error)
        row["bound_used"] = max(row["bound_used"], used)
        if scale is not None:
            scales.setdefault(call.path, ([], call.args[0].dtype))[0].append(scale)
    for path, (parts, dtype) in scales.items():
        beta, used = scale_error(parts, dtype)
        rows[path]["scale_error"] = beta
        rows[path]["bound_used"] = max(rows[path]["bound_used"], used)
    table = pd.DataFrame(list(rows.values()), columns=list(ACCURACY_COLUMNS[:-1]))
    table["passed"] = table.bound_used <= 1.0  # a non-finite output's row holds inf (judge_call)
    return table


def end_to_end_error(built: BuiltModel, workload: TokenWorkload, logp: torch.Tensor) -> dict | str:
    """The judged tokens' ``logp`` [N] (any cell's, from any head) against a float64 forward of the same weights,
    body and head, each sequence alone (no mask: the truth does not depend on the layout, and a float64 mask's
    lowest value can overflow to -inf in a fully masked padding row). Reported, not judged: no bound is proven for
    the whole forward. Where that forward has an op with no float64 kernel, why it was not computed."""
    import copy
    from dataclasses import replace

    from rlsweep.invariant_body import uninstall

    model64 = copy.deepcopy(built.model).to(torch.float64)
    uninstall(model64)  # the truth is the stock forward's, in float64
    try:
        hidden = torch.cat(cell_hidden(replace(built, model=model64), workload, "B1/full"))
    except RuntimeError as err:  # an op with no float64 kernel (an MoE's grouped matmul): its error subclasses this
        return f"the model's forward in float64 raised {type(err).__name__}: {str(err).splitlines()[0]}"
    logits = hidden @ model64.get_output_embeddings().weight.double().T
    targets = torch.cat(workload.targets()).to(hidden.device)
    active = targets >= 0
    reference = torch.log_softmax(logits[active], dim=-1).gather(1, targets[active, None])[:, 0]
    error = (logp.double().to(reference.device) - reference).abs()
    return {"tokens": int(error.numel()), "max_abs_error": float(error.max()),
            "mean_abs_error": float(error.mean())}  # fmt: skip
