"""Whether a run's checks table holds exactly the verdicts its config implies (docs/sweeps.md#complete).

A table's sha256 in the manifest shows that the file is the one the run wrote, not that the run wrote what its config
asks for: a table rewritten together with its manifest (failing rows dropped, expectations flipped) would pass it.
The gate plans a run's verdicts from its saved config with the run's own planner (``planned_verdicts``), then
compares: a planned row missing, a row no plan has, a row twice, an ``expected_pass`` that the declarations do not
give, or a declaration row that the verdicts do not imply, each makes the run incomplete.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import pandas as pd

import kernels
from rlsweep.contract import Contract
from rlsweep.errors import ConfigError
from rlsweep.hf_model import BITWISE_BODIES
from rlsweep.judgments import apply_expected, declaration_rows, plan_key, planned_verdicts
from rlsweep.mismatch import METRICS
from rlsweep.model_judgments import BODY, reported_keys
from rlsweep.spec import declarations_of, layout_of, tensors_of
from rlsweep.verdicts import NO_CELL, NOT_RUN_DETAIL, REPORTED_ONLY, Judgment, Verdict

WEIGHT_PIN = (Judgment.PROVENANCE, "weight")  # (judgment, tensor) of the weight pin row
MAX_NAMED = 3


def verdicts_of(checks: pd.DataFrame) -> list[Verdict]:
    """The rows of a checks table as verdicts (what planning and declarations read of them)."""
    keep = ("judgment", "tensor", "lhs_role", "rhs_role", "lhs_cell", "rhs_cell", "metric", "value", "threshold",
            "passed", "expected_pass", "detail")  # fmt: skip
    return [Verdict(**{key: row[key] for key in keep}) for row in checks[list(keep)].to_dict("records")]


def logits_options(config: Mapping[str, Any], contract: Contract) -> tuple[bool, ...]:
    """Whether the run judged the matmul's stored logits (``rlsweep.arithmetic.judges_logits``), from its config: both
    answers where the backend is a user's module, which the gate does not import to ask."""
    if not contract.judges_kernel_arithmetic or config.get("tp_mode", "emulated") != "emulated":
        return (False,)
    try:
        return (kernels.stores_logits(config["profile"]["backend_family"]),)
    except kernels.BackendUnavailableError:
        return (False, True)


def plan_problems(
    config: Mapping[str, Any], contract: Contract, checks: pd.DataFrame, *, standalone: bool
) -> list[str]:
    """What in ``checks`` differs from the verdicts a run of ``config`` writes; empty when nothing does.

    ``standalone``: the run is its whole sweep (not a sweep's job), so it judged every declaration itself.
    """
    try:
        cells = layout_of(config).cell_names
        declarations = declarations_of(config)
        tensors = tensors_of(config)
    except (ConfigError, KeyError, TypeError) as err:
        return [f"its saved config cannot be planned from: {' '.join(str(err).split())}"]
    verdicts = verdicts_of(checks)
    rows = [v for v in verdicts if v.judgment != Judgment.EXPECTED_RED]
    stopped = any(v.detail.startswith(NOT_RUN_DETAIL) for v in rows)
    grad = bool(config.get("grad", False))
    whole = whole_model(config)
    plans = [
        Counter(plan_key(v) for v in planned_verdicts(cells, contract, grad=grad, logits=logits, tensors=tensors,
                                                      whole_model=whole, bitwise_body=bitwise_body(config)))
        for logits in logits_options(config, contract)
    ]  # fmt: skip
    planned_judgments = {key[0] for plan in plans for key in plan}
    reported_only = {(Judgment.CHAIN_AGGREGATES, "logp", cells[0], name) for metric in METRICS for name in metric.names}
    reported_only |= reported_keys(cells) if whole else set()
    kernel = Counter(plan_key(v) for v in rows if v.judgment in planned_judgments and not is_reported(v))
    reported = Counter(plan_key(v) for v in rows if is_reported(v))
    contract_rows = sum(v.judgment == Judgment.CONTRACT for v in rows)
    pins = sum((v.judgment, v.tensor) == WEIGHT_PIN for v in rows)
    provenance = Counter(v.lhs_cell for v in rows if v.judgment == Judgment.PROVENANCE and v.tensor == "")
    body = Counter(v.lhs_cell for v in rows if v.judgment == Judgment.PROVENANCE and v.tensor == BODY)
    others = [
        v for v in rows
        if v.judgment not in planned_judgments and v.judgment not in (Judgment.CONTRACT, Judgment.PROVENANCE)
        and not is_reported(v)
    ]  # fmt: skip

    problems = []
    best = min(plans, key=lambda plan: sum(((plan - kernel) + (kernel - plan)).values()))
    problems += named("planned verdict(s) missing", best - kernel)
    problems += named("verdict(s) its config does not plan, or repeated", kernel - best)
    problems += named("reported-only row(s) of no chain metric, or repeated",
                      reported - Counter(reported_only - set(best)))  # fmt: skip
    if whole and not stopped:  # a whole model's reported rows are its run's only record of what they measure
        problems += named("reported row(s) of a whole model missing", Counter(reported_keys(cells)) - reported)
    problems += named("row(s) of no judgment a run writes", Counter(plan_key(v) for v in others))
    if contract_rows != 1:
        problems.append(f"{contract_rows} contract rows (a run writes one)")
    if pins > 1 or (pins == 0 and not stopped):
        problems.append(f"{pins} weight pin rows (a run whose kernels ran writes one)")
    unknown = Counter({cell: n for cell, n in provenance.items() if cell not in cells and cell != NO_CELL})
    problems += named("provenance row(s) of no cell of its layout", unknown)
    problems += named(
        "cell(s) with several provenance rows", Counter({c: n - 1 for c, n in provenance.items() if n > 1})
    )
    if not stopped and set(provenance) != set(cells):
        problems.append(f"provenance rows for cells {sorted(provenance)}, not for every cell {cells}")
    if not whole and body:
        problems.append(f"{sum(body.values())} body provenance row(s), yet its model is a head alone")
    problems += named(
        "cell(s) with several body provenance rows", Counter({c: n - 1 for c, n in body.items() if n > 1})
    )
    if whole and not stopped and set(body) != set(cells):
        problems.append(f"body provenance rows for cells {sorted(body)}, not for every cell {cells}")
    if stopped and not any(v.judgment == Judgment.PROVENANCE and not v.passed for v in rows):
        problems.append("rows not run, yet no provenance row says what stopped the kernels")

    profile, tp = checks["profile"].iloc[0], int(checks["tp"].iloc[0])
    selected = [d for d in declarations if d.applies(profile, tp)]
    expected = apply_expected(rows, selected)
    flipped = sum(v.expected_pass != e.expected_pass for v, e in zip(rows, expected, strict=True))
    if flipped:
        problems.append(f"{flipped} row(s) whose expected_pass is not what its config's declarations give")
    stated = Counter(declaration_key(v) for v in verdicts if v.judgment == Judgment.EXPECTED_RED)
    implied = declaration_rows(expected, declarations, profile, tp, standalone=standalone)
    implied = Counter(declaration_key(v) for v in implied)
    problems += named("declaration row(s) missing or not as its verdicts imply", implied - stated)
    problems += named("declaration row(s) its verdicts do not imply", stated - implied)
    return problems


def whole_model(config: Mapping[str, Any]) -> bool:
    """Whether a resolved run config sweeps a whole model (its model has a body)."""
    return config["model"].get("body") is not None


def bitwise_body(config: Mapping[str, Any]) -> bool:
    """Whether a resolved run config's whole model runs a body that claims every module bitwise (BITWISE_BODIES)."""
    return whole_model(config) and config["profile"].get("body_attention") in BITWISE_BODIES


def declaration_key(verdict: Verdict) -> tuple[str, str, bool, bool]:
    return verdict.tensor, verdict.detail, bool(verdict.passed), bool(verdict.expected_pass)


def is_reported(verdict: Verdict) -> bool:
    return verdict.detail.startswith(REPORTED_ONLY)


def named(what: str, keys: Counter) -> list[str]:
    """One problem naming the first few of ``keys`` (a Counter of row keys), or none when it is empty."""
    keys = +keys
    if not keys:
        return []
    first = ", ".join("/".join(str(part) for part in key if part != "") for key in list(keys)[:MAX_NAMED])
    more = f" and {sum(keys.values()) - MAX_NAMED} more" if sum(keys.values()) > MAX_NAMED else ""
    return [f"{sum(keys.values())} {what}: {first}{more}"]
