"""The tolerance contract: one versioned document, the only place thresholds come from (docs/contract.md).

``load_contract()`` reads the packaged ``conf/contract/v1.yaml``; ``contract_from_mapping`` takes the
same document as Hydra composed it. Both validate it and return a frozen :class:`Contract`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from omegaconf import OmegaConf

import kernels
from rlsweep.errors import ContractError
from rlsweep.manifest import canonical_sha256

CONTRACT_JUDGMENTS = (
    "forward_accuracy",
    "forward_invariance",
    "tp_invariance",
    "backend_parity",
    "gradient_accuracy",
    "gradient_invariance",
)
# Judgments whose every row must be bitwise; tp_invariance's cross_tp_bitwise scope is checked too.
BITWISE_JUDGMENTS = ("forward_invariance", "gradient_invariance")
DETERMINISM_SCOPES = tuple(scope.value for scope in kernels.DeterminismScope)
BITWISE_SCOPE = kernels.DeterminismScope.CROSS_TP_BITWISE.value
COMPARISON_MODES = ("bitwise", "tolerance")
CONTRACT_DTYPES = kernels.EXECUTION_DTYPE_NAMES
CHAIN_METRICS = ("max_abs_dlogp", "approx_kl0", "clipfrac0")
FORWARD_TENSORS = ("logp", "lse")
GRADIENT_TENSORS = ("grad_hidden", "grad_weight")
CONTRACT_TENSORS = FORWARD_TENSORS + GRADIENT_TENSORS
PIN_KEY = "expected_sha256"
DEFAULT_CONTRACT = "v1"
# Every key the loader knows, per section: anything else is a typo that would silently weaken a row.
TOP_KEYS = ("version", PIN_KEY, "dtype_policy", "comparison_roles", "judgments", "chain_logprob_aggregates")
DTYPE_POLICY_KEYS = ("execution_dtype", "accumulation_dtype", "reference_dtype", "tf32", "fp8")
ROLES_KEYS = ("roles", "judgments", "forbidden")
ROW_KEYS = ("atol", "rtol", "mode")
CHAIN_KEYS = ("over", "clip_interval", "require_all", "nonfinite", "empty_active_set", "thresholds")
RowKey = tuple[str, str, str, str]  # (judgment, scope or "", tensor, dtype)


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing lhs[N] with rhs[N] under one tolerance row."""

    passed: bool
    max_abs_diff: float
    mismatches: int
    first_index: int | None  # first mismatching element, None when all match


@dataclass(frozen=True)
class Tolerance:
    """One contract row: |lhs - rhs| <= atol + rtol * |rhs| (tolerance) or identical bits (bitwise)."""

    atol: float
    rtol: float
    mode: str

    def mismatched(self, lhs: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        """lhs[N], rhs[N] -> bool[N], true where the pair violates this row (NaN always does)."""
        if lhs.shape != rhs.shape:
            raise ContractError(f"cannot compare shapes {tuple(lhs.shape)} and {tuple(rhs.shape)}")
        if self.mode == "bitwise":
            if lhs.dtype != rhs.dtype:
                raise ContractError(f"bitwise comparison needs one dtype, got {lhs.dtype} and {rhs.dtype}")
            # Bit patterns, so -0.0 vs 0.0 and NaN payloads count as differences.
            return kernels.bit_pattern(lhs) != kernels.bit_pattern(rhs)
        diff = (lhs.double() - rhs.double()).abs()
        within = diff <= self.atol + self.rtol * rhs.double().abs()
        return ~within

    def check(self, lhs: torch.Tensor, rhs: torch.Tensor) -> Comparison:
        bad = self.mismatched(lhs, rhs)
        diff = (lhs.double() - rhs.double()).abs()
        max_diff = float(diff.nan_to_num(nan=math.inf).max()) if diff.numel() else 0.0
        count = int(bad.sum())
        first = int(bad.nonzero()[0, 0]) if count else None
        return Comparison(passed=count == 0, max_abs_diff=max_diff, mismatches=count, first_index=first)

    @property
    def threshold(self) -> float:
        """The number a verdict row shows: mismatching elements allowed (0) or atol."""
        return 0.0 if self.mode == "bitwise" else self.atol


@dataclass(frozen=True)
class ChainThresholds:
    """Upper bounds of the chain logprob aggregates for one dtype."""

    max_abs_dlogp: float
    approx_kl0: float
    clipfrac0: float

    def of(self, metric: str) -> float:
        if metric not in CHAIN_METRICS:
            raise ContractError(f"unknown chain metric {metric!r}; known: {', '.join(CHAIN_METRICS)}")
        return getattr(self, metric)


@dataclass(frozen=True)
class Contract:
    """A validated contract; ``sha256`` is of the canonical resolved document without the pin."""

    version: str
    sha256: str
    expected_sha256: str | None
    document: Mapping[str, Any]
    roles: Mapping[str, tuple[str, str]]
    rows: Mapping[tuple[str, str, str, str], Tolerance]  # (judgment, scope or "", tensor, dtype)
    clip_interval: tuple[float, float]
    chain: Mapping[str, ChainThresholds]

    def tolerance(self, judgment: str, tensor: str, dtype: str, *, scope: str | None = None) -> Tolerance:
        """The row for ``judgment`` on ``tensor`` ("logp", "lse", ...) at execution ``dtype``.

        ``scope`` selects the tp_invariance row ("cross_tp_bitwise" when omitted, the strict one).
        """
        if judgment not in CONTRACT_JUDGMENTS:
            raise ContractError(f"unknown judgment {judgment!r}; the contract has: {', '.join(CONTRACT_JUDGMENTS)}")
        if judgment == "tp_invariance":
            scope = BITWISE_SCOPE if scope is None else scope
            if scope not in DETERMINISM_SCOPES:
                raise ContractError(f"unknown determinism scope {scope!r}; valid: {', '.join(DETERMINISM_SCOPES)}")
        else:
            scope = ""
        key = (judgment, scope, tensor, dtype)
        if key not in self.rows:
            known = sorted({(t, d) for j, s, t, d in self.rows if j == judgment and s == scope})
            raise ContractError(
                f"contract {self.version} has no {judgment} row for tensor={tensor!r} dtype={dtype!r}; "
                f"rows exist for (tensor, dtype) in {known}"
            )
        return self.rows[key]

    def roles_for(self, name: str) -> tuple[str, str]:
        """(lhs_role, rhs_role) of a judgment or role pair named in ``comparison_roles``."""
        if name not in self.roles:
            raise ContractError(f"the contract declares no comparison roles for {name!r}; known: {sorted(self.roles)}")
        return self.roles[name]

    def require(self, rows: list[RowKey], roles: list[str], chain_dtypes: list[str]) -> None:
        """Raise ContractError naming every row, role pair and chain dtype a run needs that this contract lacks."""
        missing = [
            f"judgments.{j}{'.' + s if s else ''}.rows.{t}.{d}" for j, s, t, d in rows if (j, s, t, d) not in self.rows
        ]
        missing += [f"comparison_roles.judgments.{name}" for name in roles if name not in self.roles]
        missing += [f"chain_logprob_aggregates.thresholds.{d}" for d in chain_dtypes if d not in self.chain]
        if missing:
            raise ContractError(f"contract {self.version} lacks what this run judges: {', '.join(missing)}")

    def chain_thresholds(self, dtype: str) -> ChainThresholds:
        if dtype not in self.chain:
            known = sorted(self.chain)
            raise ContractError(f"no chain_logprob_aggregates thresholds for dtype {dtype!r}; known: {known}")
        return self.chain[dtype]


def default_contract_path(name: str = DEFAULT_CONTRACT) -> Path:
    """The packaged ``conf/contract/<name>.yaml``."""
    return Path(str(resources.files("conf").joinpath("contract", f"{name}.yaml")))


def load_contract(path: str | Path | None = None) -> Contract:
    """Read and validate a contract file (default: the packaged v1)."""
    path = default_contract_path() if path is None else Path(path)
    if not path.is_file():
        raise ContractError(f"contract file {str(path)!r} does not exist")
    document = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return contract_from_mapping(document, source=str(path))


def contract_sha256(document: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of the document without the pin; ints count as floats."""
    return canonical_sha256({key: value for key, value in document.items() if key != PIN_KEY})


def reject_unknown(section: Any, known: tuple[str, ...], where: str) -> None:
    """A section must be a mapping of known keys only."""
    if not isinstance(section, Mapping):
        raise ContractError(f"{where} must be a mapping, got {section!r}")
    unknown = sorted(set(map(str, section)) - set(known))
    if unknown:
        raise ContractError(f"{where}: unknown key(s) {unknown}; valid: {', '.join(known)}")


def contract_from_mapping(document: Mapping[str, Any], *, source: str = "contract") -> Contract:
    """Validate a contract document (plain containers) and freeze it."""
    document = dict(document)
    reject_unknown(document, TOP_KEYS, source)
    for key in TOP_KEYS:
        if key not in document and key != PIN_KEY:
            raise ContractError(f"{source}: missing top-level key {key!r}")
    reject_unknown(document["dtype_policy"], DTYPE_POLICY_KEYS, f"{source}: dtype_policy")
    roles = parse_roles(document["comparison_roles"], source)
    rows = parse_judgments(document["judgments"], source)
    clip, chain = parse_chain(document["chain_logprob_aggregates"], source)
    pin = document.get(PIN_KEY)
    if pin is not None and not isinstance(pin, str):
        raise ContractError(f"{source}: {PIN_KEY} must be a sha256 hex string or null, got {pin!r}")
    return Contract(
        version=str(document["version"]),
        sha256=contract_sha256(document),
        expected_sha256=pin,
        document=MappingProxyType(document),
        roles=MappingProxyType(roles),
        rows=MappingProxyType(rows),
        clip_interval=clip,
        chain=MappingProxyType(chain),
    )


def parse_roles(section: Mapping[str, Any], source: str) -> dict[str, tuple[str, str]]:
    reject_unknown(section, ROLES_KEYS, f"{source}: comparison_roles")
    known = set(section.get("roles", []))
    forbidden = {(pair["lhs"], pair["rhs"]) for pair in section.get("forbidden", [])}
    roles = {}
    for name, pair in section.get("judgments", {}).items():
        lhs, rhs = pair.get("lhs"), pair.get("rhs")
        for side, role in (("lhs", lhs), ("rhs", rhs)):
            if role not in known:
                raise ContractError(f"{source}: comparison_roles.{name}.{side}={role!r} is not one of {sorted(known)}")
        if (lhs, rhs) in forbidden:
            raise ContractError(f"{source}: comparison_roles.{name} compares {lhs!r} with {rhs!r}, a forbidden pair")
        roles[name] = (lhs, rhs)
    return roles


def parse_judgments(section: Mapping[str, Any], source: str) -> dict[tuple[str, str, str, str], Tolerance]:
    rows: dict[tuple[str, str, str, str], Tolerance] = {}
    reject_unknown(section, CONTRACT_JUDGMENTS, f"{source}: judgments")
    for judgment, block in section.items():
        if judgment not in CONTRACT_JUDGMENTS:
            raise ContractError(f"{source}: unknown judgment {judgment!r}; valid: {', '.join(CONTRACT_JUDGMENTS)}")
        if judgment == "tp_invariance":
            reject_unknown(block, ("scopes",), f"{source}: judgments.{judgment}")
            scopes = block.get("scopes", {})
            if set(scopes) != set(DETERMINISM_SCOPES):
                raise ContractError(
                    f"{source}: tp_invariance.scopes must be exactly {list(DETERMINISM_SCOPES)}, got {sorted(scopes)}"
                )
            for scope, scoped in scopes.items():
                bitwise = scope == BITWISE_SCOPE
                rows.update(parse_rows(f"{judgment}.{scope}", judgment, scope, scoped, bitwise, source))
        else:
            rows.update(parse_rows(judgment, judgment, "", block, judgment in BITWISE_JUDGMENTS, source))
    missing = set(CONTRACT_JUDGMENTS) - set(section)
    if missing:
        raise ContractError(f"{source}: judgments missing {sorted(missing)}")
    return rows


def parse_rows(
    label: str, judgment: str, scope: str, block: Mapping[str, Any], bitwise: bool, source: str
) -> dict[tuple[str, str, str, str], Tolerance]:
    reject_unknown(block, ("rows",), f"{source}: judgments.{label}")
    if "rows" not in block:
        raise ContractError(f"{source}: judgments.{label} has no 'rows'")
    rows = {}
    reject_unknown(block["rows"], CONTRACT_TENSORS, f"{source}: judgments.{label}.rows")
    for tensor, by_dtype in block["rows"].items():
        reject_unknown(by_dtype, CONTRACT_DTYPES, f"{source}: judgments.{label}.rows.{tensor}")
        for dtype, row in by_dtype.items():
            where = f"{source}: judgments.{label}.rows.{tensor}.{dtype}"
            if dtype not in CONTRACT_DTYPES:
                raise ContractError(f"{where}: unknown dtype {dtype!r}; valid: {', '.join(CONTRACT_DTYPES)}")
            tolerance = parse_tolerance(row, where)
            if bitwise and (tolerance.mode != "bitwise" or tolerance.atol != 0 or tolerance.rtol != 0):
                raise ContractError(
                    f"{where}: invariance rows must be bitwise (mode: bitwise, atol: 0, rtol: 0), got "
                    f"mode={tolerance.mode!r} atol={tolerance.atol!r} rtol={tolerance.rtol!r}"
                )
            rows[(judgment, scope, tensor, dtype)] = tolerance
    return rows


def parse_tolerance(row: Mapping[str, Any], where: str) -> Tolerance:
    reject_unknown(row, ROW_KEYS, where)
    mode = row.get("mode")
    if mode not in COMPARISON_MODES:
        raise ContractError(f"{where}: mode must be one of {COMPARISON_MODES}, got {mode!r}")
    values = {}
    for key in ("atol", "rtol"):
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ContractError(f"{where}: {key} must be a finite number >= 0, got {value!r}")
        values[key] = float(value)
    if mode == "bitwise" and (values["atol"] or values["rtol"]):
        raise ContractError(f"{where}: a bitwise row must have atol = rtol = 0, got {values}")
    return Tolerance(atol=values["atol"], rtol=values["rtol"], mode=mode)


def parse_chain(section: Mapping[str, Any], source: str) -> tuple[tuple[float, float], dict[str, ChainThresholds]]:
    where = f"{source}: chain_logprob_aggregates"
    reject_unknown(section, CHAIN_KEYS, where)
    if section.get("require_all") is not True:
        raise ContractError(
            f"{where}.require_all must be true (every aggregate must pass), got {section.get('require_all')!r}"
        )
    for key in ("nonfinite", "empty_active_set"):
        if section.get(key) != "hard_failure":
            raise ContractError(f"{where}.{key} must be 'hard_failure', got {section.get(key)!r}")
    clip = section.get("clip_interval")
    if not isinstance(clip, (list, tuple)) or len(clip) != 2 or not 0 < clip[0] < 1 < clip[1]:
        raise ContractError(f"{where}.clip_interval must be [low, high] with 0 < low < 1 < high, got {clip!r}")
    chain = {}
    reject_unknown(section.get("thresholds", {}), CONTRACT_DTYPES, f"{where}.thresholds")
    for dtype, thresholds in section.get("thresholds", {}).items():
        if not isinstance(thresholds, Mapping) or set(thresholds) != set(CHAIN_METRICS):
            raise ContractError(
                f"{where}.thresholds.{dtype}: need dtype in {CONTRACT_DTYPES} and exactly the metrics "
                f"{list(CHAIN_METRICS)}, got {sorted(thresholds)}"
            )
        values = {metric: thresholds[metric] for metric in CHAIN_METRICS}
        for metric, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ContractError(f"{where}.thresholds.{dtype}.{metric} must be a finite number >= 0, got {value!r}")
        chain[dtype] = ChainThresholds(**{metric: float(value) for metric, value in values.items()})
    return (float(clip[0]), float(clip[1])), chain
