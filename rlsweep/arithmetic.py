"""The kernel's own arithmetic, judged apart from its inputs' rounding (docs/contract.md#the-kernels-own-arithmetic).

``forward_accuracy`` holds a candidate to float64 of the bf16 inputs, so its bound is mostly the logits' rounding to
bf16 (~0.06 on logp) and a kernel's own error of a few percent of it passes. Here each call's reduction is compared
with float64 on the logits that call stored (``keep_logits``), within ``kernels.reduction_bound``; the stored logits
with float64 products of the same operands, element by element, within ``kernels.logit_errors``; and both for bias,
a one-signed error over many tokens that every per-token bound would let through. A fused head stores no logits: its
reduction is compared with float64 of the float64 products, its fp32 logits' error in the bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

import kernels
from rlsweep.layouts import NONE, Call
from rlsweep.spec import RunSpec
from rlsweep.verdicts import FORWARD_TENSORS, Judgment, Tensor, Verdict

KERNEL_JUDGMENTS = (Judgment.KERNEL_ACCURACY, Judgment.KERNEL_BIAS)
# The matmul's statistics per token over its V logits: max |error| / bound, elements past the bound, and the sums
# of error / bound unsigned and signed by the logit (a shift, and a scale, of every logit).
LOGIT_STATS = ("max_ratio", "exceeding", "shift", "scale")
BIAS_STATISTICS = 3  # the logits row tests two sums, logp and lse one each: the failure probability is split


@dataclass(frozen=True)
class KernelArithmetic:
    """One cell's comparands in logical order [T] (float64, CPU): ``kernels.ArithmeticBound``'s fields restored from
    its calls, what they were computed on (``source``), and per-token logit statistics where judged (else None)."""

    bound: kernels.ArithmeticBound
    source: str
    logits: dict[str, torch.Tensor] | None
    vocab: int  # logits per token


def unfilled(names: Sequence[str], num_tokens: int) -> dict[str, torch.Tensor]:
    """One float64 [T] column per name, NaN until a call fills it: a token no call computed never passes."""
    return {name: torch.full((num_tokens,), math.nan, dtype=torch.float64) for name in names}


COMPARANDS = tuple(field.name for field in fields(kernels.ArithmeticBound))
STORED = "the logits each call stored"
PRODUCTS = "float64 products, the logits' own rounding in the bound"


class ComparandCache:
    """A run's per-token comparands and the stored logits [T, V] they were computed from (None where the kernel
    stores none: then they depend on the token's inputs alone). Layout-invariant kernels store the same bits in
    every cell, so each token is reduced in float64 once rather than once per cell."""

    def __init__(self, num_tokens: int):
        self.values = unfilled(COMPARANDS, num_tokens)
        self.filled = torch.zeros(num_tokens, dtype=torch.bool)
        self.logits: torch.Tensor | None = None

    def known(self, index: torch.Tensor, stored: torch.Tensor | None) -> torch.Tensor:
        """[rows] bool: the tokens ``index`` whose comparands were computed from these very logits (bitwise)."""
        known = self.filled[index].clone()
        if stored is not None and bool(known.any()):
            if self.logits is None or self.logits.dtype != stored.dtype or self.logits.shape[1] != stored.shape[1]:
                return torch.zeros_like(known)
            cached = self.logits[index.to(self.logits.device)]
            same = (kernels.bit_view(cached) == kernels.bit_view(stored)).all(dim=1).cpu()
            known &= same
        return known

    def remember(self, index: torch.Tensor, stored: torch.Tensor | None, bound: kernels.ArithmeticBound) -> None:
        for name, column in self.values.items():
            column[index] = getattr(bound, name)
        self.filled[index] = True
        if stored is not None:
            if self.logits is None:
                self.logits = stored.new_zeros((self.filled.shape[0], stored.shape[1]))
            self.logits[index.to(self.logits.device)] = stored


class ArithmeticCollector:
    """Gathers a cell's comparands call by call, each call's logical rows as that call computed them.

    ``shared``: the run's cache of per-token comparands (``ComparandCache``): a row whose stored logits are bitwise
    those the cache computed from (every row, where the kernel stores none) is not computed again."""

    def __init__(
        self,
        weight: torch.Tensor,
        num_tokens: int,
        *,
        tokens: int,
        vocab_tile: int,
        logits_dtype: torch.dtype,
        failure_probability: float,
        judge_logits: bool,
        shared: ComparandCache,
    ):
        self.weight, self.tokens = weight, tokens
        self.vocab_tile, self.logits_dtype, self.failure_probability = vocab_tile, logits_dtype, failure_probability
        self.judge_logits, self.shared = judge_logits, shared
        self.values = unfilled(COMPARANDS, num_tokens)
        self.stats = unfilled(LOGIT_STATS, num_tokens)
        self.gathered = torch.zeros(num_tokens, dtype=torch.bool)
        self.sources: set[str] = set()

    def add(self, call: Call, hidden: torch.Tensor, targets: torch.Tensor, logits: torch.Tensor | None) -> None:
        """One call: hidden [rows, H], targets [rows] as given to the kernel, the logits it stored [rows, V] or None."""
        keep = call.logical != NONE
        index = call.logical[keep]
        rows = keep.to(hidden.device)
        h, t = hidden[rows], targets[rows]
        stored = None if logits is None else logits.detach()[rows]
        self.sources.add(STORED if stored is not None else PRODUCTS)
        if stored is not None and self.judge_logits:
            self.add_logit_stats(index, h, stored)
        known = self.shared.known(index, stored)
        todo = ~known
        if bool(todo.any()):
            if stored is not None:
                bound = kernels.reduction_bound(stored[todo.to(stored.device)], t[todo.to(t.device)],
                                                failure_probability=self.failure_probability, tokens=self.tokens,
                                                vocab_tile=self.vocab_tile)  # fmt: skip
            else:
                products, errors = kernels.logit_errors(h[todo.to(h.device)], self.weight, self.logits_dtype)
                bound = kernels.reduction_bound(products, t[todo.to(t.device)],
                                                failure_probability=self.failure_probability, tokens=self.tokens,
                                                vocab_tile=self.vocab_tile, errors=errors)  # fmt: skip
            self.shared.remember(index[todo], None if stored is None else stored[todo.to(stored.device)], bound)
        for name, column in self.values.items():
            column[index] = self.shared.values[name][index]
        self.gathered[index] = True

    def add_logit_stats(self, index: torch.Tensor, hidden: torch.Tensor, stored: torch.Tensor) -> None:
        """Stored logits against float64 products of the same operands, within the bound of one fp32-accumulated dot
        product rounded once to the stored dtype."""
        products, errors = kernels.logit_errors(hidden, self.weight, stored.dtype)
        ratio = ((stored.double() - products) / errors).cpu()
        self.stats["max_ratio"][index] = ratio.abs().nan_to_num(nan=math.inf, posinf=math.inf).max(dim=1).values
        self.stats["exceeding"][index] = (~(ratio.abs() <= 1)).sum(dim=1).double()
        self.stats["shift"][index] = ratio.sum(dim=1)
        self.stats["scale"][index] = (ratio * torch.sign(products).cpu()).sum(dim=1)

    def finish(self) -> KernelArithmetic:
        """The cell's comparands; every token must have come from one of its calls, else the harness lost a call and
        its rows would judge nothing (a RuntimeError: exit 1, never a verdict)."""
        if not bool(self.gathered.all()):
            missing = int((~self.gathered).sum())
            raise RuntimeError(f"the kernel_* comparands of {missing} token(s) were never gathered from a call")
        bound = kernels.ArithmeticBound(**self.values)
        logits = dict(self.stats) if self.judge_logits else None
        return KernelArithmetic(bound, " and ".join(sorted(self.sources)), logits, self.weight.shape[0])


def kernel_verdicts(
    candidate: dict[str, torch.Tensor],
    arithmetic: KernelArithmetic,
    cell: str,
    active: torch.Tensor,
    keys: tuple[torch.Tensor, torch.Tensor],
    roles: tuple[str, str],
    failure_probability: float,
) -> list[Verdict]:
    """kernel_accuracy and kernel_bias rows of one cell: each tensor of ``candidate`` (the reduction), and logits where
    judged.

    ``candidate``: "logp" and, where the backend computes it, "lse" [T] in logical order; ``active`` [T] bool, the
    judged tokens; ``keys``: their (sample_id, position) [T]."""
    rows = torch.nonzero(active)[:, 0]
    where = (keys[0][rows], keys[1][rows])
    bound = arithmetic.bound
    verdicts = []
    for tensor in candidate:
        lhs, rhs = candidate[tensor][rows].double(), getattr(bound, tensor)[rows]
        allowed = getattr(bound, f"{tensor}_bound")[rows]
        verdicts.append(accuracy_row(tensor, lhs, rhs, allowed, where, cell, roles, arithmetic.source))
        systematic, variance = (getattr(bound, f"{tensor}_{part}")[rows] for part in ("systematic", "variance"))
        error = lhs - rhs
        allowance = kernels.bias_allowance(systematic, variance, failure_probability / BIAS_STATISTICS)
        total, count = float(error.sum()), max(rows.numel(), 1)
        about = (f"sum of (candidate - reference) over the judged tokens {total:.4g}; mean {total / count:.3g}, "
                 f"allowed mean {allowance / count:.3g}")  # fmt: skip
        verdicts.append(bias_row(tensor, cell, roles, abs(total), allowance, rows.numel(), about))
    if arithmetic.logits is not None:
        verdicts += logit_rows(arithmetic.logits, rows, where, cell, roles, failure_probability, arithmetic.vocab)
    return verdicts


def accuracy_row(
    tensor: str,
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    allowed: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor],
    cell: str,
    roles: tuple[str, str],
    source: str,
) -> Verdict:
    """|lhs - rhs| <= allowed on every token; NaN (a token never computed, or a non-finite output) never passes."""
    error = (lhs - rhs).abs()
    ratio = (error / allowed).nan_to_num(nan=math.inf, posinf=math.inf)
    bad = ~(error <= allowed)
    largest = float(error.nan_to_num(nan=math.inf, posinf=math.inf).max()) if error.numel() else 0.0
    what = f"|{tensor} - float64 on {source}| <= the reduction's bound"
    return token_row(Judgment.KERNEL_ACCURACY, tensor, cell, roles, ratio, bad, where, what, largest)


def token_row(
    judgment: str,
    tensor: str,
    cell: str,
    roles: tuple[str, str],
    ratio: torch.Tensor,
    bad: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor],
    what: str,
    largest: float,
) -> Verdict:
    count = int(bad.sum())
    if ratio.numel() == 0:
        return Verdict(judgment, tensor, *roles, cell, cell, metric="active_tokens", value=0.0, threshold=1.0,
                       passed=False, detail="no active token to judge")  # fmt: skip
    value = float(ratio.max())
    first = int(bad.nonzero()[0, 0]) if count else None
    detail = f"{what}: used {value:.3g} of it; {count} of {ratio.numel()} active tokens exceed"
    if first is not None:
        detail += (
            f"; first at (sample_id={int(where[0][first])}, position={int(where[1][first])}); max |diff| {largest:.3g}"
        )
    return Verdict(judgment, tensor, *roles, cell, cell, metric="max_error_over_bound", value=value, threshold=1.0,
                   passed=count == 0, first_sample_id=None if first is None else int(where[0][first]),
                   first_position=None if first is None else int(where[1][first]), detail=detail)  # fmt: skip


def bias_row(
    tensor: str, cell: str, roles: tuple[str, str], deviation: float, allowance: float, count: int, about: str
) -> Verdict:
    """|sum of errors| within the model's allowance for that many tokens; nothing to sum, or NaN, fails."""
    value = deviation / allowance if allowance > 0 else math.inf
    passed = count > 0 and math.isfinite(value) and value <= 1
    detail = f"|sum of errors| <= the error model's allowance: {about}" if count else "no active token to judge"
    return Verdict(Judgment.KERNEL_BIAS, tensor, *roles, cell, cell, metric="bias_over_allowance",
                   value=value if math.isfinite(value) else math.inf, threshold=1.0, passed=passed,
                   detail=detail)  # fmt: skip


def logit_rows(
    stats: dict[str, torch.Tensor],
    rows: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor],
    cell: str,
    roles: tuple[str, str],
    failure_probability: float,
    vocab: int,
) -> list[Verdict]:
    """The matmul's rows: every stored logit of the judged tokens within its bound, and no shift or scale bias.

    Each error / bound lies in [-1, 1] with mean 0 under the model (fp32 accumulation and one rounding to nearest),
    so by Hoeffding a sum over N elements stays within sqrt(2 N ln(2 / p)) but with probability p."""
    ratio = stats["max_ratio"][rows]
    exceeding = stats["exceeding"][rows]
    bad = ~(ratio <= 1)
    worst = ratio.nan_to_num(nan=math.inf, posinf=math.inf)
    what = "|stored logit - float64 product of the same operands| <= its bound"
    accuracy = token_row(Judgment.KERNEL_ACCURACY, Tensor.LOGITS, cell, roles, worst, bad, where, what, math.nan)
    outside = int(exceeding.nan_to_num(nan=vocab).sum())
    detail = accuracy.detail.replace("; max |diff| nan", "") + f"; {outside} of {rows.numel() * vocab} logits exceed"
    accuracy = replace(accuracy, detail=detail)
    elements = rows.numel() * vocab
    allowance = math.sqrt(2 * elements * math.log(2 * BIAS_STATISTICS / failure_probability))
    shift, scale = float(stats["shift"][rows].sum()), float(stats["scale"][rows].sum())
    deviation = max(abs(shift), abs(scale)) if math.isfinite(shift) and math.isfinite(scale) else math.inf
    bias = bias_row(Tensor.LOGITS, cell, roles, deviation, allowance, rows.numel(),
                    f"over {elements} logits, sum of error/bound {shift:.4g} (a shift) and of it signed by the logit "
                    f"{scale:.4g} (a scale), allowed {allowance:.4g} each")  # fmt: skip
    return [accuracy, bias]


def judges_logits(spec: RunSpec) -> bool:
    """Whether a run of ``spec`` judges the matmul's stored logits: where its backend stores them and its ranks run in
    this process (distributed ranks keep theirs). A backend that cannot be found is planned as storing them, so its
    rows are red as not run rather than missing."""
    if not spec.contract.judges_kernel_arithmetic or spec.tp_mode != "emulated":
        return False
    try:
        return kernels.stores_logits(spec.profile.backend_family)
    except kernels.BackendUnavailableError:
        return True


def planned_kernel_rows(
    cells: Sequence[str], judge_logits: bool, tensors: Sequence[str] = FORWARD_TENSORS
) -> list[tuple[str, str, str]]:
    """(judgment, tensor, cell) of every kernel row a run judges: each of ``tensors`` (logp, and lse where the backend
    computes it) per cell, logits on the canonical."""
    planned = [(judgment, tensor, cell) for cell in cells for judgment in KERNEL_JUDGMENTS for tensor in tensors]
    if judge_logits:
        planned += [(judgment, Tensor.LOGITS, cells[0]) for judgment in KERNEL_JUDGMENTS]
    return planned
