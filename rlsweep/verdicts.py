"""The vocabulary of the checks table: judgment and tensor names, the verdict row, and "as expected" (docs/tables.md).

Every module that writes, counts or reads verdicts takes its names and its rule from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Judgment(StrEnum):
    """The ``judgment`` column; docs/index.md says what each judges."""

    FORWARD_ACCURACY = "forward_accuracy"
    FORWARD_INVARIANCE = "forward_invariance"
    CHAIN_AGGREGATES = "chain_aggregates"
    SMOKE = "smoke"
    PROVENANCE = "provenance"
    CONTRACT = "contract"
    TP_INVARIANCE = "tp_invariance"
    BACKEND_PARITY = "backend_parity"
    GRADIENT_ACCURACY = "gradient_accuracy"
    GRADIENT_INVARIANCE = "gradient_invariance"
    KERNEL_ACCURACY = "kernel_accuracy"  # the kernel's own arithmetic, on the logits it read (rlsweep.arithmetic)
    KERNEL_BIAS = "kernel_bias"  # a one-signed error over many tokens, inside every per-token bound
    MODULE_ACCURACY = "module_accuracy"  # a whole model's body, module by module against float64 (docs/contract.md)
    TRAINER_ROLLOUT = "trainer_rollout"  # a whole model's rollout cells against its trainer's (verl's metrics)
    EXPECTED_RED = "expected_red"  # a row about a declaration that matched nothing


class Tensor(StrEnum):
    """The ``tensor`` column of kernel verdicts (contract rows are keyed by these too)."""

    LOGP = "logp"
    LSE = "lse"
    GRAD_HIDDEN = "grad_hidden"
    GRAD_WEIGHT = "grad_weight"
    LOGITS = "logits"  # the matmul's stored logits, judged element by element (kernel_* rows)


FORWARD_TENSORS = (Tensor.LOGP, Tensor.LSE)
GRADIENT_TENSORS = (Tensor.GRAD_HIDDEN, Tensor.GRAD_WEIGHT)
RUN_JUDGMENTS = (
    Judgment.FORWARD_ACCURACY,
    Judgment.FORWARD_INVARIANCE,
    Judgment.CHAIN_AGGREGATES,
    Judgment.SMOKE,
    Judgment.PROVENANCE,
    Judgment.CONTRACT,
    Judgment.GRADIENT_ACCURACY,
    Judgment.KERNEL_ACCURACY,
    Judgment.KERNEL_BIAS,
    Judgment.MODULE_ACCURACY,
    Judgment.TRAINER_ROLLOUT,
)
SWEEP_JUDGMENTS = (Judgment.TP_INVARIANCE, Judgment.BACKEND_PARITY)
BOTH_LEVELS = (Judgment.GRADIENT_INVARIANCE,)  # judged within a run (across cells) and by the gate (across tp)
DECLARABLE = RUN_JUDGMENTS + SWEEP_JUDGMENTS + BOTH_LEVELS  # what an expected_red declaration may name
GRAD_ONLY = (Judgment.GRADIENT_ACCURACY,)  # run judgments that only a grad=true run judges
WHOLE_MODEL_ONLY = (Judgment.MODULE_ACCURACY, Judgment.TRAINER_ROLLOUT)  # run judgments only a whole model's run has
NO_CELL = ""  # lhs_cell/rhs_cell of verdicts that are not about a cell (contract, weight pin)
# The detail's start of a chain row the contract has no row for: threshold NaN, passed and expected_pass true.
REPORTED_ONLY = "reported, not judged"
# The detail's start of a verdict that was never computed (provenance stopped the kernels): value NaN, passed false.
NOT_RUN_DETAIL = "not run: "
# Why verdicts were not run where the provenance check refused the backend: it, then the provenance verdict's detail.
STOPPED_BY_PROVENANCE = "provenance stopped the kernels"


def stopped_by_provenance(why: str) -> str:
    """The reason a not-run row gives when the provenance check stopped the kernels for ``why``."""
    return f"{STOPPED_BY_PROVENANCE} ({why})"


def provenance_stopped(detail: str) -> str | None:
    """The ``why`` of a not-run row's detail that ``stopped_by_provenance`` wrote; None for any other detail."""
    stopped = f"{NOT_RUN_DETAIL}{STOPPED_BY_PROVENANCE} ("
    return detail.removeprefix(stopped)[:-1] if detail.startswith(stopped) and detail.endswith(")") else None


def judged(detail: str) -> bool:
    """Whether a row's verdict was computed and compared with its threshold, by its detail: not a reported-only row,
    not one that never ran. Only such a verdict can fail as declared (docs/sweeps.md#expected-verdicts-in-a-sweep)."""
    return not (detail.startswith(REPORTED_ONLY) or detail.startswith(NOT_RUN_DETAIL))


def as_expected(passed: Any, expected_pass: Any) -> Any:
    """Whether a verdict came out as declared: one row (bools) or a column of rows (pandas Series) alike.

    A row that passes where it was declared red is as wrong as one that fails where it should pass.
    """
    return passed == expected_pass


@dataclass(frozen=True)
class Verdict:
    """One row of the checks table without the run columns."""

    judgment: str
    tensor: str
    lhs_role: str
    rhs_role: str
    lhs_cell: str
    rhs_cell: str
    metric: str
    value: float
    threshold: float
    passed: bool
    expected_pass: bool = True
    first_sample_id: int | None = None
    first_position: int | None = None
    detail: str = ""

    @property
    def judged(self) -> bool:
        return judged(self.detail)

    @property
    def as_expected(self) -> bool:
        return bool(as_expected(self.passed, self.expected_pass))

    @property
    def expectation(self) -> str:
        return expectation(self.expected_pass)


def expectation(expected_pass: bool) -> str:
    """How a listing of verdicts not as expected says what was expected of one."""
    return "expected pass" if expected_pass else "expected red, passed"


class Outcome(StrEnum):
    """How a verdict came out against its declaration, the worst first (the report's plots take their hue from it)."""

    NOT_AS_EXPECTED = "not as expected"  # failed though expected to pass, or passed though declared red
    FAILED_AS_DECLARED = "failed as declared"
    PASSED = "passed"


def outcome(passed: bool, expected_pass: bool) -> Outcome:
    """The ``Outcome`` of one verdict."""
    if not as_expected(bool(passed), bool(expected_pass)):
        return Outcome.NOT_AS_EXPECTED
    return Outcome.PASSED if passed else Outcome.FAILED_AS_DECLARED
