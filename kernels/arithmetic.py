"""How far a kernel's own fp32 arithmetic may take logp and lse from float64 on the logits it read (docs/contract.md).

``kernels.rounding_bound`` judges a call end to end: its bound is dominated by the rounding of the logits to bf16,
and its allowance for the fp32 reduction is the worst case of any summation order, gamma(V), loose at large V. Here
the logits are given (the very values the kernel stored, or float64 products within a bound ``errors`` of the fp32
values a fused kernel kept), so what is left is the reduction's own arithmetic, bounded under a stated error model:

- every elementary fp32 rounding (add, multiply, subtract, convert) errs by a factor (1 + d), |d| <= u, the d
  independent with mean zero (Higham & Mary, "A new approach to probabilistic rounding error analysis", 2019): the
  sum of n positive terms errs by at most gamma~(n) = exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1 of itself, except
  with probability 2 n exp(-lam^2 (1 - u)^2 / 2), and lam is chosen so that this, over every term of every judged
  token, is at most the contract's failure probability;
- exp and log approximations, the rounding of the exponent's argument and fixed-point or truncated merges are
  systematic, bounded in the worst case: per term 3u |y - max| (the argument, telescoped over the tile and merge
  levels) + 16u (two exps of up to 4 ulps each), per tile 2**-32 of a sum >= 1, and 8u max(|log s|, 1) for the log.

The bias test sums the errors of many tokens: their systematic parts add up in the worst case, their random parts
are sub-Gaussian (Hoeffding) with the variance proxy each token carries (``*_variance``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.errors import KernelInputError, ShapeMismatchError
from kernels.rounding import BOUND_CHUNK_ELEMENTS, FP32_UNIT_ROUNDOFF
from kernels.sharding import MIN_VOCAB_TILE
from kernels.validation import IGNORE_INDEX

EXP_ULPS = 16  # two exp evaluations (a tile's and its rescale at the merge), up to 4 ulps (8u) each
LOG_ULPS = 8  # the log of the sum: up to 4 ulps of max(|log s|, 1) (approximate log2 has an absolute floor near 1)
FIXED_POINT_UNIT = 2.0**-32  # a fixed-point or truncating merge loses at most one unit per tile of a sum >= 1
FINAL_ROUNDINGS = 2  # lse = max + log s and logp = y_t - lse, each at most two fp32 roundings in any arrangement


@dataclass(frozen=True)
class ArithmeticBound:
    """Per row, float64 [R] on the CPU: the reference on the given logits, the bound on |candidate - reference|, its
    systematic part (worst case, one-signed at most) and the variance proxy of its random part, for logp (0 on
    inactive rows) and lse."""

    logp: torch.Tensor
    lse: torch.Tensor
    logp_bound: torch.Tensor
    lse_bound: torch.Tensor
    logp_systematic: torch.Tensor
    lse_systematic: torch.Tensor
    logp_variance: torch.Tensor
    lse_variance: torch.Tensor


def rounding_terms(vocab: int) -> int:
    """The most fp32 roundings on one term's way into the sum: V - 1 additions and a rescale per narrowest tile."""
    return vocab + math.ceil(vocab / MIN_VOCAB_TILE) + 8


def check_failure_probability(failure_probability: float) -> None:
    if not 0 < failure_probability < 1:  # NaN fails it too
        raise KernelInputError(f"failure_probability must be in (0, 1), got {failure_probability!r}")


def probabilistic_gamma(n: int, failure_probability: float, trials: int) -> float:
    """gamma~(n) at the lam that keeps 2 n trials exp(-lam^2 (1 - u)^2 / 2) <= failure_probability."""
    check_failure_probability(failure_probability)
    u = FP32_UNIT_ROUNDOFF
    lam = math.sqrt(2 * math.log(2 * n * max(trials, 1) / failure_probability)) / (1 - u)
    return math.expm1(lam * math.sqrt(n) * u + n * u * u / (1 - u))


def reduction_bound(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    failure_probability: float,
    tokens: int,
    vocab_tile: int,
    errors: torch.Tensor | None = None,
) -> ArithmeticBound:
    """logits[R, V] (any float dtype: the values a kernel reduced) and targets[R] (IGNORE_INDEX: inactive) -> the
    float64 logp/lse of those logits and the bound of an fp32 reduction of them (module docstring).

    ``tokens``: how many tokens one verdict judges with these bounds (the union bound's count). ``errors`` [R, V]:
    the logits are float64 products and the kernel reduced fp32 values within ``errors`` of them (a fused head,
    which stores none): their effect on lse, lse(y + e) - lse(y), and the target's own error join the bound as
    systematic parts.
    """
    if logits.dim() != 2 or targets.shape != (logits.shape[0],):
        raise ShapeMismatchError(
            f"logits must be [R, V] and targets [R]; got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if errors is not None and errors.shape != logits.shape:
        raise ShapeMismatchError(f"errors must match logits {tuple(logits.shape)}, got {tuple(errors.shape)}")
    u = FP32_UNIT_ROUNDOFF
    vocab = logits.shape[1]
    n = rounding_terms(vocab)
    random_part = probabilistic_gamma(n, failure_probability, tokens)
    tiles = math.ceil(vocab / vocab_tile)
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in ArithmeticBound.__dataclass_fields__}
    chunk = max(1, BOUND_CHUNK_ELEMENTS // max(vocab, 1))
    for rows in torch.split(torch.arange(logits.shape[0], device=logits.device), chunk):
        y = logits[rows].double()
        top = y.max(dim=1).values
        z = y - top[:, None]
        w = torch.exp(z)
        s = w.sum(dim=1)
        p = w / s[:, None]
        log_s = torch.log(s)
        lse = top + log_s
        row_targets = targets[rows]
        active = row_targets != IGNORE_INDEX
        index = torch.where(active, row_targets, 0)[:, None]
        y_t = y.gather(1, index)[:, 0]
        logp = torch.where(active, y_t - lse, torch.zeros_like(lse))
        # The argument of each exp errs relative to its distance from the max: 3u |y - max| per term, p-weighted.
        systematic_rel = 3 * u * (p * z.abs()).sum(dim=1) + EXP_ULPS * u + tiles * FIXED_POINT_UNIT / s
        eta = systematic_rel + random_part + systematic_rel * random_part
        logged = LOG_ULPS * u * torch.clamp(log_s.abs(), min=1.0)
        final = FINAL_ROUNDINGS * u * lse.abs()
        lse_systematic = -torch.log1p(-systematic_rel) + logged
        lse_bound = -torch.log1p(-eta) + logged + final
        # First order, the random part of log s is sum_k d_k S_k / s with |S_k / s| <= 1 over at most n roundings.
        lse_variance = u * u * (n * (1 + eta) ** 2 + FINAL_ROUNDINGS * lse**2)
        target_final = FINAL_ROUNDINGS * u * (logp.abs() + y_t.abs())
        logp_systematic = lse_systematic.clone()
        if errors is not None:
            e = errors[rows].double()
            spread = torch.logsumexp(y + e, dim=1) - lse  # bounds |lse(y + d) - lse(y)| for |d| <= e
            e_t = e.gather(1, index)[:, 0]
            lse_systematic, lse_bound = lse_systematic + spread, lse_bound + spread
            logp_systematic = lse_systematic + e_t
        logp_bound = lse_bound + target_final + (logp_systematic - lse_systematic)
        logp_variance = lse_variance + FINAL_ROUNDINGS * (u * (logp.abs() + y_t.abs())) ** 2
        zero = torch.zeros_like(lse)
        values = {
            "logp": logp,
            "lse": lse,
            "logp_bound": torch.where(active, logp_bound, zero),
            "lse_bound": lse_bound,
            "logp_systematic": torch.where(active, logp_systematic, zero),
            "lse_systematic": lse_systematic,
            "logp_variance": torch.where(active, logp_variance, zero),
            "lse_variance": lse_variance,
        }
        for name, value in values.items():
            parts[name].append(value.cpu())
    return ArithmeticBound(**{name: torch.cat(chunks) for name, chunks in parts.items()})


def bias_allowance(systematic: torch.Tensor, variance: torch.Tensor, failure_probability: float) -> float:
    """How far sum(candidate - reference) over tokens may stray from 0 under the model: every systematic part one way,
    plus Hoeffding's deviation of the random parts (sub-Gaussian with the summed proxies) at the failure probability."""
    check_failure_probability(failure_probability)
    spread = math.sqrt(2 * math.log(2 / failure_probability) * float(variance.double().sum()))
    return float(systematic.double().sum()) + spread
