"""Each module of a whole model against float64 of that module on the same inputs, within a bound derived for its
op class (docs/contract.md#whole-model-modules).

The inputs are the ones the module received in the run (recorded by a forward hook), so an error upstream never
counts against a module downstream: each op is judged on its own arithmetic. Op classes so far: ``linear``
(``nn.Linear``), ``rmsnorm`` (any module whose class name ends in ``RMSNorm`` with a ``weight`` and a
``variance_epsilon``), ``rotary`` (a ``*RotaryEmbedding``'s cos and sin, against the config's RoPE base).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pandas as pd
import torch

from kernels.rounding import FP32_UNIT_ROUNDOFF, gamma, half_ulp
from rlsweep.hf_model import BuiltModel
from rlsweep.model_cells import TRAINER_CELL, TokenWorkload, cell_hidden

ACCURACY_COLUMNS = ("module", "module_class", "op_class", "elements", "max_abs_error", "bound_used", "passed")


def op_class(module: torch.nn.Module) -> str | None:
    name = type(module).__name__
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if name.endswith("RMSNorm") and hasattr(module, "weight") and hasattr(module, "variance_epsilon"):
        return "rmsnorm"
    if name.endswith("RotaryEmbedding"):
        return "rotary"
    return None


@dataclass
class Call:
    path: str
    module: torch.nn.Module
    args: tuple
    kwargs: dict
    output: object


@contextmanager
def recording_calls(built: BuiltModel) -> Iterator[list[Call]]:
    """Every call of a module of a judged op class, with its inputs and output, while the block runs."""
    calls: list[Call] = []

    def keep(path: str, module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        detach = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
        out = tuple(detach(o) for o in output) if isinstance(output, tuple) else detach(output)
        kept = {k: detach(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        calls.append(Call(path, module, tuple(detach(a) for a in args), kept, out))

    handles = [
        module.register_forward_hook(lambda m, a, k, o, path=path: keep(path, m, a, k, o), with_kwargs=True)
        for path, module in built.body.named_modules(prefix="model")
        if op_class(module) is not None
    ]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


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


def rmsnorm_reference(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y = w * (x / sqrt(mean(x^2) + eps)): float64 of it, and the bound of the normalisation in fp32 (H squares
    summed, the rsqrt and the product: gamma_{H+4} relative), its result rounded once to x's dtype, then the weight's
    product rounded once to y's dtype (half an ulp each)."""
    x64, w64 = x.double(), module.weight.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
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
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = position_ids.double()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles, (math.log(theta) + 8) * FP32_UNIT_ROUNDOFF * angles.abs()


def judge_call(built: BuiltModel, call: Call) -> tuple[str, int, float, float]:
    """(op class, elements, max |error|, the largest error / bound) of one recorded call."""
    kind = op_class(call.module)
    if kind in ("linear", "rmsnorm"):
        reference, argument = (linear_reference, "input") if kind == "linear" else (rmsnorm_reference, "hidden_states")
        x, y = (call.args or (call.kwargs.get(argument),))[0], call.output
        y64, bound = reference(call.module, x, y)
        errors = (y.double() - y64).abs()
    else:
        config = built.model.config
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        position_ids = call.kwargs.get("position_ids", call.args[1] if len(call.args) > 1 else None)
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
    used = errors / bound.clamp(min=torch.finfo(torch.float64).tiny)
    used = torch.where(errors == 0, torch.zeros_like(used), used)
    # A NaN or infinite output (or a NaN error) uses all of any bound: it never passes, and max() never drops it.
    used = torch.where(torch.isfinite(errors), used, torch.full_like(used, math.inf))
    return kind, errors.numel(), float(errors.nan_to_num(nan=math.inf).max()), float(used.max())


def module_accuracy(built: BuiltModel, workload: TokenWorkload, cell: str = TRAINER_CELL) -> pd.DataFrame:
    """One row per judged module of the body in ``cell``: its op class, elements judged, largest |error| against
    float64 of the module on its own inputs, and the largest share of its bound used (passed: at most 1), over all
    of its calls in the cell."""
    with recording_calls(built) as calls:
        cell_hidden(built, workload, cell)
    rows: dict[str, dict] = {}
    for call in calls:
        kind, elements, max_error, used = judge_call(built, call)
        first = {"module": call.path, "module_class": type(call.module).__name__, "op_class": kind, "elements": 0,
                 "max_abs_error": 0.0, "bound_used": 0.0}  # fmt: skip
        row = rows.setdefault(call.path, first)
        row["elements"] += elements
        row["max_abs_error"] = max(row["max_abs_error"], max_error)
        row["bound_used"] = max(row["bound_used"], used)
    table = pd.DataFrame(list(rows.values()), columns=list(ACCURACY_COLUMNS[:-1]))
    table["passed"] = table.bound_used <= 1.0  # a non-finite output's row holds inf (judge_call)
    return table


def end_to_end_error(built: BuiltModel, workload: TokenWorkload, logp: torch.Tensor) -> dict:
    """The judged tokens' ``logp`` [N] (any cell's, from any head) against a float64 forward of the same weights,
    body and head, each sequence alone (no mask: the truth does not depend on the layout, and a float64 mask's
    lowest value can overflow to -inf in a fully masked padding row). Reported, not judged: no bound is proven for
    the whole forward."""
    import copy
    from dataclasses import replace

    model64 = copy.deepcopy(built.model).to(torch.float64)
    hidden = torch.cat(cell_hidden(replace(built, model=model64), workload, "B1/full"))
    logits = hidden @ model64.get_output_embeddings().weight.double().T
    targets = torch.cat(workload.targets()).to(hidden.device)
    active = targets >= 0
    reference = torch.log_softmax(logits[active], dim=-1).gather(1, targets[active, None])[:, 0]
    error = (logp.double().to(reference.device) - reference).abs()
    return {"tokens": int(error.numel()), "max_abs_error": float(error.max()),
            "mean_abs_error": float(error.mean())}  # fmt: skip
