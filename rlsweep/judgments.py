"""Verdicts within one run (SPEC §4.9): accuracy, layout invariance, chain aggregates, smoke, provenance, contract."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

import kernels
from rlsweep.config import ExpectedVerdictConfig
from rlsweep.contract import CHAIN_METRICS, Contract, Tolerance
from rlsweep.errors import ConfigError
from rlsweep.execute import CellResult
from rlsweep.layouts import DECODE_CELL
from rlsweep.workload import Workload

RUN_JUDGMENTS = ("forward_accuracy", "forward_invariance", "chain_aggregates", "smoke", "provenance", "contract")
SWEEP_JUDGMENTS = ("tp_invariance", "backend_parity")
JUDGMENTS = RUN_JUDGMENTS + SWEEP_JUDGMENTS
FORWARD_TENSORS = ("logp", "lse")
NO_CELL = ""  # lhs_cell/rhs_cell of verdicts that are not about a cell (contract, weight pin)


@dataclass(frozen=True)
class Verdict:
    """One row of checks.parquet without the run columns."""

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
    def as_expected(self) -> bool:
        return self.passed == self.expected_pass


def compare_tokens(
    judgment: str,
    tensor: str,
    roles: tuple[str, str],
    cells: tuple[str, str],
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    tolerance: Tolerance,
    keys: tuple[torch.Tensor, torch.Tensor],
) -> Verdict:
    """One contract row on lhs[N] vs rhs[N], the judged tokens in logical order; keys: (sample_id[N], position[N])."""
    if lhs.numel() == 0:
        return Verdict(judgment, tensor, *roles, *cells, metric="active_tokens", value=0.0, threshold=1.0,
                       passed=False, detail="no active token to judge")  # fmt: skip
    result = tolerance.check(lhs, rhs)
    first = result.first_index
    sample_id, position = (None, None) if first is None else (int(keys[0][first]), int(keys[1][first]))
    count = lhs.numel()
    if tolerance.mode == "bitwise":
        metric, value = "mismatched_tokens", float(result.mismatches)
        detail = f"bitwise {tensor}: {result.mismatches} of {count} active tokens differ"
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
) -> Verdict:
    """One contract row on the active tokens of two logical-order tensors lhs[T], rhs[T]."""
    rows = torch.nonzero(workload.active)[:, 0]
    keys = (workload.sample_ids[rows], workload.positions[rows])
    return compare_tokens(judgment, tensor, roles, cells, lhs[rows], rhs[rows], tolerance, keys)


def forward_accuracy(
    result: CellResult, reference: CellResult, workload: Workload, contract: Contract, dtype: str
) -> list[Verdict]:
    roles = contract.roles_for("forward_accuracy")
    return [
        compare(
            "forward_accuracy",
            tensor,
            roles,
            (result.cell.name, reference.cell.name),
            getattr(result, tensor),
            getattr(reference, tensor),
            contract.tolerance("forward_accuracy", tensor, dtype),
            workload,
        )
        for tensor in FORWARD_TENSORS
    ]


def forward_invariance(
    result: CellResult, canonical: CellResult, workload: Workload, contract: Contract, dtype: str
) -> list[Verdict]:
    """Bitwise on logp and lse; the decode cell is the rollout-vs-training parity of the contract's roles."""
    roles = contract.roles_for("decode_parity" if result.cell.name == DECODE_CELL else "forward_invariance")
    verdicts = []
    for tensor in FORWARD_TENSORS:
        verdict = compare(
            "forward_invariance",
            tensor,
            roles,
            (result.cell.name, canonical.cell.name),
            getattr(result, tensor),
            getattr(canonical, tensor),
            contract.tolerance("forward_invariance", tensor, dtype),
            workload,
        )
        rows = f"call rows {list(result.cell.call_rows)} vs {list(canonical.cell.call_rows)}"
        verdicts.append(replace(verdict, detail=f"{verdict.detail}; {rows}"))
    return verdicts


def chain_metrics(dlogp: torch.Tensor, clip: tuple[float, float]) -> dict[str, float]:
    """dlogp [N] float64 -> max_abs_dlogp, approx_kl0 = mean(exp(d) - 1 - d), clipfrac0."""
    ratio = torch.exp(dlogp)
    return {
        "max_abs_dlogp": float(dlogp.abs().max()),
        "approx_kl0": float((ratio - 1 - dlogp).mean()),
        "clipfrac0": float(((ratio < clip[0]) | (ratio > clip[1])).double().mean()),
    }


def chain_aggregates(
    canonical: CellResult, reference: CellResult, workload: Workload, contract: Contract, dtype: str
) -> list[Verdict]:
    """Every aggregate must pass (require_all); NaN/Inf or an empty active set fails every metric."""
    roles = contract.roles_for("chain_logprob_aggregates")
    cells = (canonical.cell.name, reference.cell.name)
    thresholds = contract.chain_thresholds(dtype)
    rows = torch.nonzero(workload.active)[:, 0]
    dlogp = canonical.logp[rows].double() - reference.logp[rows].double()
    if rows.numel() == 0:
        values, failure = dict.fromkeys(CHAIN_METRICS, math.nan), "empty active set (hard failure)"
    elif not bool(torch.isfinite(dlogp).all()):
        bad = int((~torch.isfinite(dlogp)).nonzero()[0, 0])
        values, failure = (
            dict.fromkeys(CHAIN_METRICS, math.nan),
            f"non-finite dlogp at active token {bad} (hard failure)",
        )
    else:
        values, failure = chain_metrics(dlogp, contract.clip_interval), ""
    verdicts = []
    for metric in CHAIN_METRICS:
        limit = thresholds.of(metric)
        passed = not failure and values[metric] <= limit
        detail = failure or f"{metric} over {len(rows)} active tokens, dlogp = lhs - rhs, clip {contract.clip_interval}"
        verdicts.append(
            Verdict(
                "chain_aggregates",
                "logp",
                *roles,
                *cells,
                metric=metric,
                value=values[metric],
                threshold=limit,
                passed=passed,
                detail=detail,
            )
        )
    return verdicts


def smoke(canonical: CellResult, workload: Workload, roles: tuple[str, str]) -> list[Verdict]:
    """Finite outputs, logp <= 0 on active tokens, and something to judge."""
    rows = torch.nonzero(workload.active)[:, 0]
    logp, lse = canonical.logp[rows], canonical.lse[rows]
    nonfinite = int((~torch.isfinite(logp)).sum() + (~torch.isfinite(lse)).sum())
    max_logp = float(logp.max()) if rows.numel() else math.nan
    cells = (canonical.cell.name, NO_CELL)
    return [
        Verdict(
            "smoke",
            "logp,lse",
            *roles,
            *cells,
            metric="nonfinite_values",
            value=float(nonfinite),
            threshold=0.0,
            passed=nonfinite == 0,
            detail="NaN/Inf among active logp and lse",
        ),
        Verdict(
            "smoke",
            "logp",
            *roles,
            *cells,
            metric="max_logp",
            value=max_logp,
            threshold=0.0,
            passed=rows.numel() > 0 and max_logp <= 0.0,
            detail="a log-probability is never positive",
        ),
        Verdict(
            "smoke",
            "logp",
            *roles,
            *cells,
            metric="active_tokens",
            value=float(rows.numel()),
            threshold=1.0,
            passed=rows.numel() >= 1,
            detail="the active set must not be empty",
        ),
    ]


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
        "provenance",
        "",
        role,
        "required_nodes",
        cell,
        NO_CELL,
        metric="mismatched_nodes",
        value=float(len(problems)),
        threshold=0.0,
        passed=not problems,
        detail=detail or f"every call ran {required}",
    )


def weight_pin_verdict(pinned: str | None, observed: str) -> Verdict:
    passed = pinned is None or pinned == observed
    detail = "no weight_sha256 pin" if pinned is None else f"pinned weight_sha256 {pinned}, observed {observed}"
    return Verdict(
        "provenance",
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
        "contract",
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


def check_expected(declarations: Iterable[ExpectedVerdictConfig]) -> None:
    for declaration in declarations:
        if declaration.judgment not in JUDGMENTS:
            raise ConfigError(f"expected_red judgment {declaration.judgment!r} is not one of {', '.join(JUDGMENTS)}")


def expectations_for(config: Mapping[str, Any]) -> list[ExpectedVerdictConfig]:
    """The expected-red declarations that apply to a resolved run config: its profile's and the sweep's."""
    profile = config["profile"]
    declared = [*profile.get("expected_red", []), *config.get("expected_red", [])]
    out = []
    for declaration in declared:
        expected = (
            declaration if isinstance(declaration, ExpectedVerdictConfig) else ExpectedVerdictConfig(**declaration)
        )
        profile_matches = any(fnmatch.fnmatchcase(profile["name"], pattern) for pattern in expected.profiles)
        if profile_matches and (not expected.tp or config["tp"] in expected.tp):
            out.append(expected)
    return out


def apply_expected(verdicts: list[Verdict], declarations: Sequence[ExpectedVerdictConfig]) -> list[Verdict]:
    """expected_pass = False where a declaration matches judgment, cell and tensor (strict, per row)."""
    out = []
    for verdict in verdicts:
        expected_red = any(
            declaration.judgment == verdict.judgment
            and any(fnmatch.fnmatchcase(verdict.lhs_cell, pattern) for pattern in declaration.cells)
            and any(fnmatch.fnmatchcase(verdict.tensor, pattern) for pattern in declaration.tensors)
            for declaration in declarations
        )
        out.append(replace(verdict, expected_pass=not expected_red))
    return out
