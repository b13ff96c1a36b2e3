"""How far a logprob kernel may be from the float64 reference because of where it rounds (docs/contract.md).

A kernel that computes logits from hidden[T, H] and weight[V, H] with fp32 accumulation, stores them in
``logits_dtype`` with round-to-nearest-even, and reduces them in fp32, is within ``rounding_bound`` of
the float64 logp and lse of the same inputs, token by token. The derivation is in docs/contract.md:

    e_j    = gamma(H) * (|h| @ |W|.T)_j  (+ half an ulp of logits_dtype at |x_j| + that, if it is narrower)
    lse    : |lse~ - lse| <= lse(x + e) - lse(x) + a          (lse(x + e) - lse(x) = log sum_j p_j exp(e_j))
    logp   : |logp~ - logp| <= e_t + lse(x + e) - lse(x) + a
    a      = gamma(V + 8) + 4 u (|lse| + |x_t| + log V)       (the fp32 exp-sum, log and subtractions)

with u = 2**-24 (fp32) and gamma(n) = n u / (1 - n u).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.errors import DtypeMismatchError, ShapeMismatchError
from kernels.validation import (
    IGNORE_INDEX,
    ValueChecks,
    check_lm_head_inputs,
    check_target_range,
    check_tensor,
    dtype_name,
)

FP32_UNIT_ROUNDOFF = 2.0**-24
# Significand bits (with the implicit one) and the smallest normal exponent of each logits dtype.
SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
MIN_NORMAL_EXPONENT = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126}
BOUND_CHUNK_ELEMENTS = 1 << 24  # float64 working set per chunk of rows: a few of [rows, V]


@dataclass(frozen=True)
class RoundingBound:
    """Per-row float64 bounds [T] on |candidate - reference| for logp (0 on inactive rows) and lse, and the spread of
    each row's logits: a logp within the spread of -log(V) is what a kernel that ignored the row would give."""

    logp: torch.Tensor
    lse: torch.Tensor
    spread: torch.Tensor  # [T] float64: max - min of the row's float64 logits, the most any logp can tell apart


def gamma(n: int | float) -> float:
    """Higham's gamma_n for fp32: the relative error bound of n roundings."""
    nu = n * FP32_UNIT_ROUNDOFF
    if nu >= 1:
        raise ValueError(f"gamma({n}) is unbounded in fp32 (n * u >= 1)")
    return nu / (1 - nu)


def half_ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``dtype`` around ``magnitude`` >= 0 (float64): round-to-nearest's largest error."""
    if dtype not in SIGNIFICAND_BITS:
        raise ValueError(f"no rounding model for logits dtype {dtype}; known: {list(SIGNIFICAND_BITS)}")
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2**exponent, 0.5 <= m < 1 (0 for 0)
    # Zero and the subnormals share the smallest normal binade's spacing.
    binade = torch.where(magnitude == 0, MIN_NORMAL_EXPONENT[dtype], exponent - 1)
    binade = torch.clamp(binade, min=MIN_NORMAL_EXPONENT[dtype])
    return torch.ldexp(torch.ones_like(magnitude), binade - SIGNIFICAND_BITS[dtype])


def logit_errors(hidden: torch.Tensor, weight: torch.Tensor, logits_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """float64 logits x[rows, V] and the bound e[rows, V] on |stored logit - x| (fp32 accumulation, then storage)."""
    h, w = hidden.double(), weight.double()
    x = h @ w.T
    errors = gamma(h.shape[1]) * (h.abs() @ w.abs().T)
    if SIGNIFICAND_BITS[logits_dtype] < SIGNIFICAND_BITS[torch.float32]:
        errors = errors + half_ulp(x.abs() + errors, logits_dtype)
    return x, errors


def rounding_bound(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, logits_dtype: torch.dtype
) -> RoundingBound:
    """Bounds [T] (float64, on the CPU) for hidden[T, H], weight[V, H], targets[T] (IGNORE_INDEX rows: logp 0).

    Computed where the inputs live, a chunk of rows at a time, so the float64 working set stays small.
    """
    check_bound_inputs(hidden, weight, targets, logits_dtype)
    vocab = weight.shape[0]
    chunk = max(1, BOUND_CHUNK_ELEMENTS // max(vocab, 1))
    logp_parts, lse_parts, spread_parts = [], [], []
    for rows in torch.split(torch.arange(hidden.shape[0]), chunk):
        rows = rows.to(hidden.device)
        x, e = logit_errors(hidden[rows], weight, logits_dtype)
        lse = torch.logsumexp(x, dim=1)
        # log sum_j softmax(x)_j exp(e_j): bounds the lse error in both directions, first order and beyond.
        spread = torch.logsumexp(x + e, dim=1) - lse
        row_targets = targets[rows]
        active = row_targets != IGNORE_INDEX
        index = torch.where(active, row_targets, 0)[:, None]
        x_t, e_t = x.gather(1, index)[:, 0], e.gather(1, index)[:, 0]
        arithmetic = gamma(vocab + 8) + 4 * FP32_UNIT_ROUNDOFF * (lse.abs() + x_t.abs() + math.log(max(vocab, 2)))
        lse_parts.append((spread + arithmetic).cpu())
        spread_parts.append((x.amax(dim=1) - x.amin(dim=1)).cpu())
        logp_parts.append(torch.where(active, e_t + spread + arithmetic, torch.zeros_like(spread)).cpu())
    return RoundingBound(torch.cat(logp_parts), torch.cat(lse_parts), torch.cat(spread_parts))


def check_bound_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, logits_dtype: torch.dtype
) -> None:
    """The inputs ``lm_head_logprob`` takes, checked as it checks them (the values at once), and a logits dtype the
    model knows: a bound of other inputs would be a bound of nothing the kernels compute."""
    if not isinstance(logits_dtype, torch.dtype) or logits_dtype not in SIGNIFICAND_BITS:
        known = ", ".join(dtype_name(dtype) for dtype in SIGNIFICAND_BITS)
        raise DtypeMismatchError(f"logits_dtype must be a torch dtype of {known}; got {logits_dtype!r}")
    checks = ValueChecks()
    check_lm_head_inputs(hidden, weight, targets, checks)
    check_target_range(targets, weight.shape[0], checks)
    checks.raise_first()


def call_rows(rows: object, device: torch.device) -> torch.Tensor:
    """One call's row indices of ``gradient_bound(calls=...)`` as int64: a 1-D sequence of integers only, as a float
    or bool would be truncated to other rows."""
    try:
        indices = torch.as_tensor(rows, device=device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise DtypeMismatchError(f"calls must hold sequences of integer row indices; got a call {rows!r}") from err
    if indices.dim() != 1:
        raise ShapeMismatchError(
            f"calls must be a sequence of calls, each a 1-D sequence of row indices; got a call of shape "
            f"{tuple(indices.shape)}: {rows!r}"
        )
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise DtypeMismatchError(f"calls must hold integer row indices; got a call of dtype {indices.dtype}: {rows!r}")
    return indices.long()


@dataclass(frozen=True)
class GradientBound:
    """Float64 bounds on |candidate - reference| of d hidden [T, H] and d weight [V, H], and the float64
    reference gradients themselves (all on the CPU)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    reference_hidden: torch.Tensor
    reference_weight: torch.Tensor


def gradient_bound(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    g_logp: torch.Tensor,
    g_lse: torch.Tensor,
    *,
    logits_dtype: torch.dtype,
    lse_bound: torch.Tensor | None = None,
    calls: Sequence[torch.Tensor] | None = None,
) -> GradientBound:
    """How far the gradient of sum(g_logp * logp + g_lse * lse) may be from float64 (docs/contract.md).

    d logits_v = g_logp * [v = target] + (g_lse - g_logp) * p_v, then d hidden = d logits @ W and d weight =
    d logits.T @ h. With the logit errors e_v (``logit_errors``) and the lse bound b (``rounding_bound``):

        |p~_v - p_v|        <= p_v (exp(e_v + b + 4u (|x_v| + |lse| + e_v + b)) (1 + 16u) - 1)     =: dp_v
        |dlogits~_v - ...|  <= (1 + 2u) |c| dp_v + 3u |c| (p_v + dp_v) + u |g_logp| [v = t]         =: D_v
                               (+ half an ulp where d logits are rounded to a narrower dtype: the narrower of
                               logits_dtype and the inputs', as products on tensor cores take operands in the latter)
        d hidden_j          <= sum_v D_v |W_vj| + gamma(V + 1) sum_v (|dlogits_v| + D_v) |W_vj|
        d weight_vj         <= sum_t D_tv |h_tj| + gamma(T + 1) sum_t (|dlogits_tv| + D_tv) |h_tj|

    plus half an ulp of the gradient's own dtype (the inputs') at the value. u = 2**-24, c = g_lse - g_logp.
    ``lse_bound``: ``rounding_bound(...).lse`` of the same inputs where the caller has it already.
    ``calls``: the rows of each kernel call, a partition of the rows (None: one call of them all). Each call's d
    weight is rounded to the inputs' dtype on its own, with T its own rows, and the caller sums the calls' d weight
    in fp32 (gamma(calls) of their magnitudes more); d hidden does not change, as each row is in one call.
    """
    check_bound_inputs(hidden, weight, targets, logits_dtype)
    for name, upstream in (("g_logp", g_logp), ("g_lse", g_lse)):
        check_tensor(name, upstream)
        if upstream.shape != targets.shape or upstream.device != targets.device:
            raise ShapeMismatchError(
                f"{name} must be [T] with T={targets.shape[0]} on {targets.device}, got shape "
                f"{tuple(upstream.shape)} on {upstream.device}"
            )
    if lse_bound is not None:
        check_tensor("lse_bound", lse_bound)
        if lse_bound.shape != targets.shape:
            raise ShapeMismatchError(f"lse_bound must be [T] with T={targets.shape[0]}, got {tuple(lse_bound.shape)}")
    u = FP32_UNIT_ROUNDOFF
    h, w = hidden.double(), weight.double()
    rows, vocab = h.shape[0], w.shape[0]
    active = targets != IGNORE_INDEX
    g_logp = torch.where(active, g_logp.double(), 0.0)
    scale = g_lse.double() - g_logp
    if lse_bound is None:
        lse_bound = rounding_bound(hidden, weight, targets, logits_dtype=logits_dtype).lse
    lse_bound = lse_bound.double().to(h.device)
    gradient_dtype = min((logits_dtype, hidden.dtype), key=SIGNIFICAND_BITS.__getitem__)
    every_row = torch.arange(rows, device=h.device)
    calls = [every_row] if calls is None else [call_rows(c, h.device) for c in calls]
    covered = torch.sort(torch.cat(calls)).values if calls else every_row[:0]
    if covered.shape != every_row.shape or not bool((covered == every_row).all()):
        raise ShapeMismatchError(f"calls must partition the {rows} rows, each row in exactly one call")
    summed = gamma(len(calls)) if len(calls) > 1 else 0.0  # the caller's fp32 sum of the calls' d weight
    d_hidden = torch.zeros_like(h)
    bound_hidden = torch.zeros_like(h)
    d_weight = torch.zeros_like(w)
    bound_weight = torch.zeros_like(w)
    chunk = max(1, BOUND_CHUNK_ELEMENTS // max(vocab, 1))
    for call in calls:
        call_weight = torch.zeros_like(w) if len(calls) > 1 else d_weight
        call_bound = torch.zeros_like(w) if len(calls) > 1 else bound_weight
        for part in torch.split(call, chunk):
            x, e = logit_errors(hidden[part], weight, logits_dtype)
            lse = torch.logsumexp(x, dim=1, keepdim=True)
            p = torch.exp(x - lse)
            b = lse_bound[part][:, None]
            exponent = e + b + 4 * u * (x.abs() + lse.abs() + e + b)
            dp = p * (torch.exp(exponent) * (1 + 16 * u) - 1)
            c = scale[part][:, None]
            onehot = torch.zeros_like(x)
            owned = active[part]
            onehot[owned, targets[part][owned]] = 1.0
            d_logits = g_logp[part][:, None] * onehot + c * p
            spread = (1 + 2 * u) * c.abs() * dp + 3 * u * c.abs() * (p + dp)
            spread = spread + u * g_logp[part].abs()[:, None] * onehot
            if SIGNIFICAND_BITS[gradient_dtype] < SIGNIFICAND_BITS[torch.float32]:
                spread = spread + half_ulp(d_logits.abs() + spread, gradient_dtype)
            magnitude = d_logits.abs() + spread
            d_hidden[part] = d_logits @ w
            bound_hidden[part] = spread @ w.abs() + gamma(vocab + 1) * (magnitude @ w.abs())
            call_weight += d_logits.T @ h[part]
            call_bound += spread.T @ h[part].abs() + gamma(call.numel() + 1) * (magnitude.T @ h[part].abs())
        call_bound += half_ulp(call_weight.abs() + call_bound, weight.dtype)
        if len(calls) > 1:
            d_weight += call_weight
            bound_weight += call_bound + summed * (call_weight.abs() + call_bound)
    bound_hidden = bound_hidden + half_ulp(d_hidden.abs() + bound_hidden, hidden.dtype)
    return GradientBound(bound_hidden.cpu(), bound_weight.cpu(), d_hidden.cpu(), d_weight.cpu())
