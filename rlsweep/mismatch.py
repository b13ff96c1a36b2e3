"""Rollout-vs-training mismatch metrics of dlogp = lhs - rhs over the active tokens (docs/contract.md).

The rhs is the sampling ("rollout") distribution and rho = exp(dlogp) = p_lhs / p_rhs the importance ratio
(verl's pi_train / pi_rollout). Each metric is defined once, in ``METRICS``: a term of a per-token or
per-sequence argument x, reduced by mean or max. The same term evaluated at x = +-r, r the rounding model's
allowance aggregated like x, gives the metric's limits (``MismatchMetric.limits``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

TOKEN = "token"  # x = dlogp of one active token
SEQUENCE_SUM = "sequence_sum"  # x = summed dlogp of one sample's active tokens: the log sequence ratio
SEQUENCE_MEAN = "sequence_mean"  # x = mean dlogp of one sample's active tokens
LEVEL_WORDS = {
    TOKEN: ("active tokens", "x = dlogp"),
    SEQUENCE_SUM: ("sequences (samples with an active token)", "x = the sequence's summed dlogp"),
    SEQUENCE_MEAN: ("sequences (samples with an active token)", "x = the sequence's mean dlogp"),
}
REDUCTIONS = {"mean": torch.mean, "max": torch.max}


@dataclass(frozen=True)
class ActiveTokens:
    """What the metrics aggregate besides dlogp: each active token's sequence [N] (0..S-1, sample order), the
    rhs probability [N] (float64) and the PPO clip interval."""

    sequence: torch.Tensor
    rhs_prob: torch.Tensor
    clip: tuple[float, float]

    @classmethod
    def of(cls, sample_ids: torch.Tensor, rhs_logp: torch.Tensor, clip: tuple[float, float]) -> ActiveTokens:
        """From the active tokens' sample_ids [N] and rhs logp [N]."""
        _, sequence = torch.unique(sample_ids.cpu(), return_inverse=True)
        return cls(sequence, torch.exp(rhs_logp.double().cpu()), clip)

    @property
    def count(self) -> int:
        return int(self.sequence.numel())

    @property
    def num_sequences(self) -> int:
        return int(self.sequence.max()) + 1 if self.count else 0

    def argument(self, level: str, per_token: torch.Tensor) -> torch.Tensor:
        """per_token [N] float64 -> x [N] (TOKEN) or [S] (the sequence levels)."""
        if level == TOKEN:
            return per_token
        sums = per_token.new_zeros(self.num_sequences).index_add_(0, self.sequence, per_token)
        if level == SEQUENCE_SUM:
            return sums
        return sums / torch.bincount(self.sequence, minlength=self.num_sequences).double()


Term = Callable[[torch.Tensor, ActiveTokens], torch.Tensor]


def k1(x: torch.Tensor, _: ActiveTokens) -> torch.Tensor:
    return -x


def k2(x: torch.Tensor, _: ActiveTokens) -> torch.Tensor:
    return x.square() / 2


def k3(x: torch.Tensor, _: ActiveTokens) -> torch.Tensor:
    return torch.expm1(x) - x  # rho - 1 - log rho; expm1 keeps its digits for small x


def chi2(x: torch.Tensor, _: ActiveTokens) -> torch.Tensor:
    return torch.expm1(2 * x)  # rho^2 - 1


def ppl_ratio(x: torch.Tensor, _: ActiveTokens) -> torch.Tensor:
    return torch.exp(-x)  # ppl_lhs / ppl_rhs of a sequence whose mean dlogp is x


def abs_dlogp(x: torch.Tensor, _: ActiveTokens) -> torch.Tensor:
    return x.abs()


def clipped(x: torch.Tensor, tokens: ActiveTokens) -> torch.Tensor:
    ratio = torch.exp(x)
    return ((ratio < tokens.clip[0]) | (ratio > tokens.clip[1])).double()


def abs_dp(x: torch.Tensor, tokens: ActiveTokens) -> torch.Tensor:
    return (tokens.rhs_prob * torch.expm1(x)).abs()  # |exp(logp_lhs) - exp(logp_rhs)|


@dataclass(frozen=True)
class MismatchMetric:
    """reduce(term(x)) over the active tokens or sequences; ``signed``: the term is monotone in x, so the value
    is bounded on both sides. Every term is quasi-convex in x (its maximum over an interval sits at an end)."""

    name: str
    level: str
    reduce: str
    term: Term
    formula: str  # the term in words, for a verdict's detail
    signed: bool = False
    aliases: tuple[str, ...] = ()  # other names of the same value: one row each, bitwise equal
    ceiling: float = math.inf  # the largest value it can take: a fixed figure at or above it could never fail

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def aggregate(self, per_token: torch.Tensor, tokens: ActiveTokens, sign: float = 1.0) -> torch.Tensor:
        """term(sign * x) [N] or [S], x aggregated from per_token [N] at this metric's level."""
        return self.term(sign * tokens.argument(self.level, per_token), tokens)

    def value(self, dlogp: torch.Tensor, tokens: ActiveTokens) -> float:
        """The metric of dlogp [N] float64 (N >= 1, finite)."""
        return float(REDUCTIONS[self.reduce](self.aggregate(dlogp, tokens)))

    def limits(self, bound: torch.Tensor, tokens: ActiveTokens) -> tuple[float, float]:
        """(lower, upper): the metric's range over every dlogp with |dlogp| <= bound [N] token by token.

        |x| <= r for r the bound aggregated like x (triangle inequality), the term's maximum over [-r, r] sits at
        an end and the reductions are monotone, so the upper limit is attained; a signed metric's lower one too.
        """
        if not bound.numel():
            return math.nan, math.nan  # nothing to judge: the empty active set is a hard failure of its own
        up, down = self.aggregate(bound.double(), tokens), self.aggregate(bound.double(), tokens, -1.0)
        reduce = REDUCTIONS[self.reduce]
        lower = float(reduce(torch.minimum(up, down))) if self.signed else -math.inf
        return lower, float(reduce(torch.maximum(up, down)))

    def describe(self, tokens: ActiveTokens) -> str:
        unit, argument = LEVEL_WORDS[self.level]
        count = tokens.count if self.level == TOKEN else tokens.num_sequences
        formula = self.formula.format(low=tokens.clip[0], high=tokens.clip[1])
        return f"{self.reduce} over {count} {unit} of {formula}, {argument}; dlogp = lhs - rhs, tokens sampled from rhs"


METRICS = (
    MismatchMetric("max_abs_dlogp", TOKEN, "max", abs_dlogp, "|x|"),
    MismatchMetric("approx_kl0", TOKEN, "mean", k3, "k3 = exp(x) - 1 - x", aliases=("k3_kl",)),
    MismatchMetric("clipfrac0", TOKEN, "mean", clipped, "[exp(x) outside [{low}, {high}]]", ceiling=1.0),
    MismatchMetric("k1_kl", TOKEN, "mean", k1, "k1 = -x", signed=True),
    MismatchMetric("k2_kl", TOKEN, "mean", k2, "k2 = x^2 / 2"),
    MismatchMetric("k1_kl_seq", SEQUENCE_SUM, "mean", k1, "k1 = -x", signed=True),
    MismatchMetric("k2_kl_seq", SEQUENCE_SUM, "mean", k2, "k2 = x^2 / 2"),
    MismatchMetric("k3_kl_seq", SEQUENCE_SUM, "mean", k3, "k3 = exp(x) - 1 - x"),
    MismatchMetric("chi2_token", TOKEN, "mean", chi2, "exp(2x) - 1", signed=True),
    MismatchMetric("chi2_seq", SEQUENCE_SUM, "mean", chi2, "exp(2x) - 1", signed=True),
    MismatchMetric("ppl_ratio", SEQUENCE_MEAN, "mean", ppl_ratio, "ppl_lhs / ppl_rhs = exp(-x)", signed=True),
    MismatchMetric("rollout_probs_diff_max", TOKEN, "max", abs_dp, "|dp| = p_rhs * |exp(x) - 1|", ceiling=1.0),
    MismatchMetric("rollout_probs_diff_mean", TOKEN, "mean", abs_dp, "|dp| = p_rhs * |exp(x) - 1|", ceiling=1.0),
)
METRIC_NAMES = tuple(metric.name for metric in METRICS)  # what a contract row may be keyed by
REPORTED_NAMES = tuple(name for metric in METRICS for name in metric.names)  # one checks row each
BY_NAME = {metric.name: metric for metric in METRICS}
ALIAS_OF = {alias: metric.name for metric in METRICS for alias in metric.aliases}
