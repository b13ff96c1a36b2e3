"""Verdicts within one run (docs/index.md): accuracy, layout invariance, chain aggregates, smoke, provenance, contract.

Also the rules every verdict obeys: expected-red declarations (strict both ways: a declared row that passes
is red, and a declaration that matches no row is a red row of its own) and rows for judgments that
provenance prevented, so what did not run is judged red rather than missing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

import kernels
from rlsweep.arithmetic import kernel_verdicts, planned_kernel_rows
from rlsweep.contract import ROUNDING_MODEL, Contract, Tolerance
from rlsweep.execute import CellResult
from rlsweep.mismatch import METRICS, ActiveTokens
from rlsweep.model_judgments import DATAFLOW, MODULE_OP_CLASSES, MODULES, ROW_LOCAL
from rlsweep.spec import CHAIN_ROLES, DECODE_CELL, DECODE_PARITY_ROLES, ExpectedRed, RunSpec
from rlsweep.verdicts import (
    FORWARD_TENSORS,
    GRAD_ONLY,
    GRADIENT_TENSORS,
    NO_CELL,
    NOT_RUN_DETAIL,
    REPORTED_ONLY,
    RUN_JUDGMENTS,
    WHOLE_MODEL_ONLY,
    Judgment,
    Tensor,
    Verdict,
)
from rlsweep.workload import Workload

NOT_RUN = "not_run"  # the metric of a row whose judgment provenance prevented
PER_METRIC = (
    Judgment.CHAIN_AGGREGATES,
    Judgment.SMOKE,
    Judgment.TRAINER_ROLLOUT,
)  # judgments with one row per metric rather than per cell


def smoke_rows(tensors: Sequence[str]) -> list[tuple[str, str]]:
    """(tensor, metric) of each smoke row: NaN/Inf among every forward tensor the run computes, the rest on logp."""
    return [(",".join(tensors), "nonfinite_values"), ("logp", "max_logp"), ("logp", "active_tokens")]


def compare_tokens(
    judgment: str,
    tensor: str,
    roles: tuple[str, str],
    cells: tuple[str, str],
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    tolerance: Tolerance,
    keys: tuple[torch.Tensor, torch.Tensor],
    bound: torch.Tensor | None = None,
) -> Verdict:
    """One contract row on lhs[N] vs rhs[N], the judged tokens in logical order; keys: (sample_id[N], position[N]).

    ``bound`` [N]: the rounding model's allowance per token, for rounding_model rows.
    """
    if lhs.numel() == 0:
        return Verdict(judgment, tensor, *roles, *cells, metric="active_tokens", value=0.0, threshold=1.0,
                       passed=False, detail="no active token to judge")  # fmt: skip
    result = tolerance.check(lhs, rhs, bound)
    first = result.first_index
    sample_id, position = (None, None) if first is None else (int(keys[0][first]), int(keys[1][first]))
    count = lhs.numel()
    if tolerance.mode == "bitwise":
        metric, value = "mismatched_tokens", float(result.mismatches)
        detail = f"bitwise {tensor}: {result.mismatches} of {count} active tokens differ"
    elif tolerance.mode == ROUNDING_MODEL:
        metric, value = "max_error_over_bound", result.max_ratio
        detail = (f"|{tensor} diff| <= rounding-model bound: used {result.max_ratio:.3g} of it; {result.mismatches} "
                  f"of {count} active tokens exceed")  # fmt: skip
    else:
        metric, value = "max_abs_diff", result.max_abs_diff
        bound = f"{tolerance.atol:g} + {tolerance.rtol:g}*|rhs|"
        detail = f"|{tensor} diff| <= {bound}: {result.mismatches} of {count} active tokens exceed"
    if first is not None:
        detail += f"; first at (sample_id={sample_id}, position={position}); max |diff| {result.max_abs_diff:.3g}"
    return Verdict(judgment, tensor, *roles, *cells, metric=metric, value=value, threshold=tolerance.threshold,
                   passed=result.passed, first_sample_id=sample_id, first_position=position,
                   detail=detail)  # fmt: skip


def compare(
    judgment: str,
    tensor: str,
    roles: tuple[str, str],
    cells: tuple[str, str],
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    tolerance: Tolerance,
    workload: Workload,
    bound: torch.Tensor | None = None,
) -> Verdict:
    """One contract row on the active tokens of two logical-order tensors lhs[T], rhs[T] (and bound[T])."""
    rows = torch.nonzero(workload.active)[:, 0]
    keys = (workload.sample_ids[rows], workload.positions[rows])
    return compare_tokens(judgment, tensor, roles, cells, lhs[rows], rhs[rows], tolerance, keys,
                          None if bound is None else bound[rows])  # fmt: skip


@dataclass(frozen=True)
class Standard:
    """What a run is judged by: the contract, its execution dtype and op class, the rounding bounds and the forward
    tensors its backend computes (``ProfileSpec.tensors``).

    ``bound`` maps "logp" and "lse" to the rounding model's per-token allowance [T] (logical order, float64).
    """

    contract: Contract
    dtype: str
    op: str
    bound: Mapping[str, torch.Tensor]
    tensors: tuple[str, ...] = FORWARD_TENSORS

    @classmethod
    def of(cls, spec: RunSpec, bound: Mapping[str, torch.Tensor]) -> Standard:
        """What a run of ``spec`` is judged by, with the bounds it computed ({} where nothing ran)."""
        return cls(spec.contract, spec.profile.execution_dtype, spec.profile.op_class, bound, spec.profile.tensors)

    def row(self, judgment: str, tensor: str, scope: str | None = None) -> Tolerance:
        return self.contract.tolerance(judgment, tensor, self.dtype, op=self.op, scope=scope)


def forward_accuracy(
    result: CellResult, reference: CellResult, workload: Workload, standard: Standard
) -> list[Verdict]:
    roles = standard.contract.roles_for(Judgment.FORWARD_ACCURACY)
    return [
        compare(
            Judgment.FORWARD_ACCURACY,
            tensor,
            roles,
            (result.cell.name, reference.cell.name),
            getattr(result, tensor),
            getattr(reference, tensor),
            standard.row(Judgment.FORWARD_ACCURACY, tensor),
            workload,
            standard.bound[tensor],
        )
        for tensor in standard.tensors
    ]


def forward_invariance(
    result: CellResult, canonical: CellResult, workload: Workload, standard: Standard
) -> list[Verdict]:
    """Bitwise on logp and lse; the decode cell is the rollout-vs-training parity of the contract's roles."""
    contract = standard.contract
    roles = contract.roles_for(invariance_roles(result.cell.name))
    verdicts = []
    for tensor in standard.tensors:
        verdict = compare(
            Judgment.FORWARD_INVARIANCE,
            tensor,
            roles,
            (result.cell.name, canonical.cell.name),
            getattr(result, tensor),
            getattr(canonical, tensor),
            standard.row(Judgment.FORWARD_INVARIANCE, tensor),
            workload,
        )
        rows = f"call rows {list(result.cell.call_rows)} vs {list(canonical.cell.call_rows)}"
        verdicts.append(replace(verdict, detail=f"{verdict.detail}; {rows}"))
    return verdicts


def chain_aggregates(
    canonical: CellResult, reference: CellResult, workload: Workload, standard: Standard
) -> list[Verdict]:
    """One row per name of rlsweep.mismatch.METRICS: dlogp = canonical - reference over the active tokens.

    Every metric the contract judges must pass (require_all); NaN/Inf dlogp, an empty active set or a non-finite
    value fails it. The others are reported (REPORTED_ONLY), never judged.
    """
    contract = standard.contract
    roles = contract.roles_for(CHAIN_ROLES)
    cells = (canonical.cell.name, reference.cell.name)
    thresholds = contract.chain_thresholds(standard.dtype)
    source = "rounding-model limits" if thresholds.mode == ROUNDING_MODEL else "contract figures"
    # Sampled targets only: the metrics' premise is tokens drawn from the rhs distribution, which a probe is not.
    rows = torch.nonzero(workload.sampled)[:, 0]
    dlogp = canonical.logp[rows].double() - reference.logp[rows].double()
    tokens = ActiveTokens.of(workload.sample_ids[rows], reference.logp[rows], contract.clip_interval)
    failure = ""
    if rows.numel() == 0:
        failure = "empty active set (hard failure)"
    elif not bool(torch.isfinite(dlogp).all()):
        failure = f"non-finite dlogp at active token {int((~torch.isfinite(dlogp)).nonzero()[0, 0])} (hard failure)"
    verdicts = []
    for metric in METRICS:
        value = math.nan if failure else metric.value(dlogp, tokens)
        about = failure or metric.describe(tokens)
        row = Verdict(Judgment.CHAIN_AGGREGATES, "logp", *roles, *cells, metric=metric.name, value=value,
                      threshold=math.nan, passed=True,
                      detail=f"{REPORTED_ONLY}: contract {contract.version} has no row for it; {about}")  # fmt: skip
        if metric.name in contract.chain_metrics:
            lower, upper = thresholds.limits(metric.name, standard.bound["logp"][rows], tokens)
            passed = not failure and math.isfinite(value) and lower <= value <= upper
            within = f"{lower:.4g} <= value <= {upper:.4g}" if metric.signed else f"value <= {upper:.4g}"
            row = replace(row, threshold=upper, passed=passed, detail=f"{within} ({source}); {about}")
        verdicts += [replace(row, metric=name) for name in metric.names]
    return verdicts


def smoke(
    canonical: CellResult, workload: Workload, roles: tuple[str, str], tensors: Sequence[str] = FORWARD_TENSORS
) -> list[Verdict]:
    """Finite outputs (every one of ``tensors``, the forward tensors the backend computes), logp <= 0 on active
    tokens, and something to judge (one row per ``smoke_rows`` entry)."""
    rows = torch.nonzero(workload.active)[:, 0]
    logp = canonical.logp[rows]
    nonfinite_of = [~torch.isfinite(getattr(canonical, tensor)[rows]) for tensor in tensors]
    broken = torch.stack(nonfinite_of).any(dim=0)
    nonfinite = int(sum(int(bad.sum()) for bad in nonfinite_of))
    where = ""
    if nonfinite:  # finite inputs (checked before any kernel), so the backend computed it: name the first token
        first = rows[int(broken.nonzero()[0, 0])]
        key = f"sample_id={int(workload.sample_ids[first])}, position={int(workload.positions[first])}"
        values = ", ".join(f"{tensor} {float(getattr(canonical, tensor)[first])}" for tensor in tensors)
        where = f"; first at ({key}): {values}"
    max_logp = float(logp.max()) if rows.numel() else math.nan
    outcomes = {  # metric -> (value, threshold, passed, detail)
        "nonfinite_values": (
            float(nonfinite),
            0.0,
            nonfinite == 0,
            f"NaN/Inf among active {' and '.join(tensors)}{where}",
        ),
        "max_logp": (max_logp, 0.0, rows.numel() > 0 and max_logp <= 0.0, "a log-probability is never positive"),
        "active_tokens": (float(rows.numel()), 1.0, rows.numel() >= 1, "the active set must not be empty"),
    }
    verdicts = []
    for tensor, metric in smoke_rows(tensors):
        value, threshold, passed, detail = outcomes[metric]
        verdicts.append(Verdict(Judgment.SMOKE, tensor, *roles, canonical.cell.name, NO_CELL, metric=metric,
                                value=value, threshold=threshold, passed=passed, detail=detail))  # fmt: skip
    return verdicts


@dataclass(frozen=True)
class CellGold:
    """What one cell's results are judged against: the float64 reference of its calls' inputs, its workload and its
    standard (bounds). Every cell of a head run shares one; a whole model's cells each feed the head their own
    hidden states, so each has its own (``rlsweep.model_run``)."""

    reference: CellResult
    workload: Workload
    standard: Standard


def judge_cells(results: Sequence[CellResult], golds: Sequence[CellGold]) -> list[Verdict]:
    """Every kernel verdict of a run's cells (canonical first) against their golds (``golds[i]`` is ``results[i]``'s)
    and each other."""
    if not results:
        return []
    canonical, gold = results[0], golds[0]
    verdicts = []
    for result, cell_gold in zip(results, golds, strict=True):
        verdicts += forward_accuracy(result, cell_gold.reference, cell_gold.workload, cell_gold.standard)
    for result in results[1:]:
        verdicts += forward_invariance(result, canonical, gold.workload, gold.standard)
    contract = gold.standard.contract
    for result, cell_gold in zip(results, golds, strict=True):
        if result.arithmetic is not None:
            workload = cell_gold.workload
            candidate = {tensor: getattr(result, tensor) for tensor in gold.standard.tensors}
            verdicts += kernel_verdicts(
                candidate, result.arithmetic, result.cell.name, workload.active,
                (workload.sample_ids, workload.positions), contract.roles_for(Judgment.KERNEL_ACCURACY),
                contract.failure_probability,
            )  # fmt: skip
    verdicts += chain_aggregates(canonical, gold.reference, gold.workload, gold.standard)
    roles = (contract.roles_for(Judgment.FORWARD_ACCURACY)[0], "invariants")
    verdicts += smoke(canonical, gold.workload, roles, gold.standard.tensors)
    return verdicts


def judge_gradients(
    results: Sequence[CellResult], workload: Workload, gold: kernels.GradientBound, standard: Standard
) -> list[Verdict]:
    """grad=true: every cell's d hidden against float64 within the model's bound and, bitwise, against the
    canonical cell's (docs/index.md, "Gradients"). Each cell's d weight is judged as the cell ends, by
    ``weight_gradient_accuracy``. Every token's d hidden, prompt tokens' too: their logp is the constant 0, so theirs
    must be 0, and a backward that writes anything else there sends it into the model; so must the pad and filler
    rows' of each call (``CellResult.stray_grad_rows``), which get an upstream of 0."""
    if not results:
        return []
    canonical = results[0]
    rows = torch.arange(workload.num_tokens)
    width = gold.reference_hidden.shape[1]
    keys = (workload.sample_ids[rows].repeat_interleave(width), workload.positions[rows].repeat_interleave(width))

    def token_rows(t: torch.Tensor) -> torch.Tensor:
        return t[rows].reshape(-1)

    verdicts = []
    for result in results:
        cells = (result.cell.name, result.cell.name)
        verdict = elements(compare_tokens(
            Judgment.GRADIENT_ACCURACY, Tensor.GRAD_HIDDEN, standard.contract.roles_for(Judgment.GRADIENT_ACCURACY),
            cells, token_rows(result.grad_hidden.double()), token_rows(gold.reference_hidden),
            standard.row(Judgment.GRADIENT_ACCURACY, Tensor.GRAD_HIDDEN), keys, token_rows(gold.hidden),
        ))  # fmt: skip
        if result.stray_grad_rows:  # rows of no token: their d hidden must be 0, as their upstream is
            stray = f"{result.stray_grad_rows} pad or filler row(s) of its calls got a d hidden other than 0"
            verdict = replace(verdict, passed=False, detail=f"{verdict.detail}; and {stray} from an upstream of 0")
        verdicts.append(verdict)
    for result in results[1:]:
        verdicts.append(elements(compare_tokens(
            Judgment.GRADIENT_INVARIANCE, Tensor.GRAD_HIDDEN, standard.contract.roles_for(Judgment.GRADIENT_INVARIANCE),
            (result.cell.name, canonical.cell.name), token_rows(result.grad_hidden), token_rows(canonical.grad_hidden),
            standard.row(Judgment.GRADIENT_INVARIANCE, Tensor.GRAD_HIDDEN), keys,
        )))  # fmt: skip
    return verdicts


def weight_gradient_accuracy(result: CellResult, gold: kernels.GradientBound, standard: Standard) -> Verdict:
    """One cell's d weight [V, H] against float64 within the model's bound, element by element.

    Not against the canonical cell's: d weight sums over a call's rows, so each layout groups that sum its own way
    and the bits differ between cells; across tp the gate compares each cell's bits (``grad_weight_bits``).
    """
    vocab, width = gold.reference_weight.shape
    # Each element's (vocab row, column), in int32: two index arrays [V * H] at half the bytes of int64.
    rows = torch.arange(vocab, dtype=torch.int32).repeat_interleave(width)
    columns = torch.arange(width, dtype=torch.int32).repeat(vocab)
    verdict = elements(compare_tokens(
        Judgment.GRADIENT_ACCURACY, Tensor.GRAD_WEIGHT, standard.contract.roles_for(Judgment.GRADIENT_ACCURACY),
        (result.cell.name, result.cell.name), result.grad_weight.double().reshape(-1),
        gold.reference_weight.reshape(-1), standard.row(Judgment.GRADIENT_ACCURACY, Tensor.GRAD_WEIGHT),
        (rows, columns), gold.weight.reshape(-1),
    ))  # fmt: skip
    # The first difference is a (vocab row, column), not a token: say so in the detail, not in the token columns.
    detail = verdict.detail.replace("(sample_id=", "(vocab row=").replace(", position=", ", column=")
    return replace(verdict, detail=detail, first_sample_id=None, first_position=None)


def elements(verdict: Verdict) -> Verdict:
    """compare_tokens counts what it compares: for a gradient, elements rather than tokens."""
    return replace(verdict, detail=verdict.detail.replace("active tokens", "elements"))


def provenance_verdict(
    cell: str, required: dict[str, str], observed: Sequence[kernels.Provenance], role: str, error: str = ""
) -> Verdict:
    """Observed backends of every call of a cell vs the profile's required nodes; ``error``: why nothing ran."""
    problems = [error] if error else []
    for call, provenance in enumerate(observed):
        problems += [f"call {call}: {line}" for line in kernels.provenance_mismatches(required, provenance)]
    if not observed and not error:
        problems.append("no kernel call was observed")
    detail = "; ".join(problems[:5]) + (f"; ... {len(problems) - 5} more" if len(problems) > 5 else "")
    return Verdict(
        Judgment.PROVENANCE,
        "",
        role,
        "required_nodes",
        cell,
        NO_CELL,
        metric="mismatched_nodes",
        value=float(len(problems)),
        threshold=0.0,
        passed=not problems,
        detail=detail or f"every call ran {observed_kernels(required, observed)}",
    )


def observed_kernels(required: dict[str, str], observed: Sequence[kernels.Provenance]) -> str:
    """``matmul: aten (aten::mm); logprob: ...``: each required node's backend and every kernel any call of the cell
    was seen to launch there, in first-launch order."""
    ran = {
        node: ", ".join(dict.fromkeys(k for p in observed if node in p.nodes for k in p.nodes[node].kernels))
        for node in required
    }
    return "; ".join(f"{node}: {backend} ({ran[node]})" for node, backend in required.items())


def weight_pin_verdict(pinned: str | None, observed: str) -> Verdict:
    passed = pinned is None or pinned == observed
    detail = "no weight_sha256 pin" if pinned is None else f"pinned weight_sha256 {pinned}, observed {observed}"
    return Verdict(
        Judgment.PROVENANCE,
        "weight",
        "candidate",
        "model_pin",
        NO_CELL,
        NO_CELL,
        metric="weight_sha256_match",
        value=float(passed),
        threshold=1.0,
        passed=passed,
        detail=detail,
    )


def contract_verdict(contract: Contract) -> Verdict:
    pin = contract.expected_sha256
    passed = pin is None or pin == contract.sha256
    detail = "no contract.expected_sha256 pin" if pin is None else f"pinned {pin}, resolved {contract.sha256}"
    return Verdict(
        Judgment.CONTRACT,
        "",
        "resolved_contract",
        "pinned_contract",
        NO_CELL,
        NO_CELL,
        metric="sha256_match",
        value=float(passed),
        threshold=1.0,
        passed=passed,
        detail=detail,
    )


def declaration_rows(
    verdicts: Sequence[Verdict], declarations: Sequence[ExpectedRed], profile: str, tp: int, *, standalone: bool
) -> list[Verdict]:
    """Red rows for the declarations a run of ``profile`` at ``tp`` can judge and that match none of its verdicts.

    In a sweep the run judges the declarations of run judgments that select it, but not those of ``GRAD_ONLY``
    judgments where it judged none (a ``grad=false`` job of a sweep over ``grad``); the gate judges the rest.
    A run on its own is its whole sweep: every declaration must select it and match one of its verdicts.
    """
    scope = "this run"
    judged = {verdict.judgment for verdict in verdicts} | (set(RUN_JUDGMENTS) - set(GRAD_ONLY) - set(WHOLE_MODEL_ONLY))
    rows = []
    for declaration in declarations:
        selects = declaration.applies(profile, tp)
        if not selects and standalone:
            rows.append(replace(declaration_verdict(declaration, 0, scope), detail=f"{declaration.describe()} "
                                "selects no run: its profiles/tp exclude this one"))  # fmt: skip
        elif selects and (standalone or (declaration.judgment in RUN_JUDGMENTS and declaration.judgment in judged)):
            rows += unmatched_declarations(verdicts, [declaration], scope)
    return rows


def apply_expected(verdicts: list[Verdict], declarations: Sequence[ExpectedRed]) -> list[Verdict]:
    """expected_pass = False where a declaration matches judgment, cell and tensor (per row) of a verdict that was
    judged, and for a declaration that is not strict only where the verdict failed (one that passed is as expected
    too): one never computed stays expected to pass, so it is red as not run, never "as expected"."""
    out = []
    for verdict in verdicts:
        expected_red = verdict.judged and any(
            d.declares(verdict.judgment, verdict.lhs_cell, verdict.tensor) and (d.strict or not verdict.passed)
            for d in declarations
        )
        out.append(replace(verdict, expected_pass=not expected_red))
    return out


def declaration_verdict(declaration: ExpectedRed, matched: int, scope: str) -> Verdict:
    """A row about one declaration: red when it matched no verdict in ``scope`` (a negative control gone blind)."""
    return Verdict(
        Judgment.EXPECTED_RED,
        declaration.judgment,
        "declaration",
        "verdicts",
        NO_CELL,
        NO_CELL,
        metric="matched_verdicts",
        value=float(matched),
        threshold=1.0,
        passed=matched >= 1,
        detail=f"{declaration.describe()} matched {matched} verdict(s) of {scope}",
    )


def unmatched_declarations(
    verdicts: Sequence[Verdict], declarations: Sequence[ExpectedRed], scope: str
) -> list[Verdict]:
    """One red row per declaration that matches none of ``verdicts``."""
    rows = []
    for declaration in declarations:
        matched = sum(v.judged and declaration.declares(v.judgment, v.lhs_cell, v.tensor) for v in verdicts)
        if not matched:
            rows.append(declaration_verdict(declaration, 0, scope))
    return rows


def planned_verdicts(
    cells: Sequence[str],
    contract: Contract,
    *,
    grad: bool = False,
    logits: bool = False,
    tensors: Sequence[str] = FORWARD_TENSORS,
    whole_model: bool = False,
    bitwise_body: bool = False,
) -> list[Verdict]:
    """The kernel verdicts a run over ``cells`` (canonical first) judges, as red placeholders without values.
    ``logits``: the run judges the matmul's stored logits (``rlsweep.arithmetic.judges_logits``); ``tensors``: the
    forward tensors its backend computes (``ProfileSpec.tensors``); ``whole_model``: a whole model's run, which also
    judges its body's modules (each op class in every cell, and its row-local modules' bits in every cell after the
    first); ``bitwise_body``: its body claims every module bitwise (``hf_model.BITWISE_BODIES``), so each cell's
    modules are judged against the canonical cell's."""
    canonical = cells[0]

    def row(judgment: str, tensor: str, roles: str, cell: str, rhs: str, metric: str = NOT_RUN) -> Verdict:
        return Verdict(judgment, tensor, *contract.roles_for(roles), cell, rhs, metric=metric, value=math.nan,
                       threshold=math.nan, passed=False)  # fmt: skip

    planned = [
        row(Judgment.FORWARD_ACCURACY, t, Judgment.FORWARD_ACCURACY, cell, canonical) for cell in cells for t in tensors
    ]
    planned += [
        row(
            Judgment.FORWARD_INVARIANCE,
            t,
            invariance_roles(cell),
            cell,
            canonical,
        )
        for cell in cells[1:]
        for t in tensors
    ]
    planned += [
        row(Judgment.CHAIN_AGGREGATES, "logp", CHAIN_ROLES, canonical, canonical, name)
        for metric in METRICS
        if metric.name in contract.chain_metrics
        for name in metric.names
    ]
    planned += [
        row(Judgment.SMOKE, t, Judgment.FORWARD_ACCURACY, canonical, NO_CELL, m) for t, m in smoke_rows(tensors)
    ]
    if contract.judges_kernel_arithmetic:
        planned += [row(j, t, j, cell, cell) for j, t, cell in planned_kernel_rows(cells, logits, tensors)]
    if grad:
        accuracy = Judgment.GRADIENT_ACCURACY
        planned += [row(accuracy, tensor, accuracy, cell, cell) for cell in cells for tensor in GRADIENT_TENSORS]
        invariance = Judgment.GRADIENT_INVARIANCE
        planned += [row(invariance, Tensor.GRAD_HIDDEN, invariance, cell, canonical) for cell in cells[1:]]
    if whole_model:
        accuracy = Judgment.FORWARD_ACCURACY
        planned += [row(Judgment.MODULE_ACCURACY, kind, accuracy, cell, cell) for cell in cells
                    for kind in (*MODULE_OP_CLASSES, DATAFLOW)]  # fmt: skip
        planned += [row(Judgment.FORWARD_INVARIANCE, ROW_LOCAL, invariance_roles(cell), cell, canonical)
                    for cell in cells[1:]]  # fmt: skip
        if bitwise_body:
            planned += [
                row(Judgment.FORWARD_INVARIANCE, MODULES, invariance_roles(cell), cell, canonical) for cell in cells[1:]
            ]
    return planned


def invariance_roles(cell: str) -> str:
    """The contract roles of a cell's invariance verdicts: decode's own (``DECODE_PARITY_ROLES``), else forward's."""
    return DECODE_PARITY_ROLES if cell == DECODE_CELL else Judgment.FORWARD_INVARIANCE


def plan_key(verdict: Verdict) -> tuple[str, str, str, str]:
    """What identifies a planned verdict: chain and smoke rows are one per metric, the others one per cell."""
    return (
        verdict.judgment,
        verdict.tensor,
        verdict.lhs_cell,
        verdict.metric if verdict.judgment in PER_METRIC else "",
    )


def not_run_verdicts(judged: Sequence[Verdict], planned: Sequence[Verdict], reason: str) -> list[Verdict]:
    """Red rows for the planned verdicts that were not judged because ``reason`` stopped the kernels."""
    done = {plan_key(verdict) for verdict in judged}
    reason = " ".join(reason.split())  # a detail is one line
    return [
        replace(plan, metric=plan.metric if plan.judgment in PER_METRIC else NOT_RUN, detail=NOT_RUN_DETAIL + reason)
        for plan in planned
        if plan_key(plan) not in done
    ]
