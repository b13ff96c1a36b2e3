"""The tolerance contract: one versioned document, the only place thresholds come from (docs/contract.md).

``load_contract()`` reads the packaged ``conf/contract/v1.yaml``; ``contract_from_mapping`` takes the
same document as Hydra composed it. Both validate it and return a frozen :class:`Contract`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import yaml

import kernels
from rlsweep import CONF_DIR
from rlsweep.errors import ContractError, RlsweepError
from rlsweep.manifest import SAFE_LOADER, canonical_sha256
from rlsweep.mismatch import ALIAS_OF, BY_NAME, METRIC_NAMES, ActiveTokens
from rlsweep.verdicts import FORWARD_TENSORS, GRADIENT_TENSORS, Judgment, Tensor

CONTRACT_JUDGMENTS = (
    Judgment.FORWARD_ACCURACY,
    Judgment.FORWARD_INVARIANCE,
    Judgment.TP_INVARIANCE,
    Judgment.BACKEND_PARITY,
    Judgment.GRADIENT_ACCURACY,
    Judgment.GRADIENT_INVARIANCE,
    Judgment.KERNEL_ACCURACY,
    Judgment.KERNEL_BIAS,
)
# A contract from v3 on judges the kernel's own arithmetic; earlier ones lack these rows and judge none of them.
KERNEL_JUDGMENTS = (Judgment.KERNEL_ACCURACY, Judgment.KERNEL_BIAS)
# Judgments whose every row must be bitwise; tp_invariance's cross_tp_bitwise scope is checked too.
BITWISE_JUDGMENTS = (Judgment.FORWARD_INVARIANCE, Judgment.GRADIENT_INVARIANCE)
DETERMINISM_SCOPES = tuple(scope.value for scope in kernels.DeterminismScope)
BITWISE_SCOPE = kernels.DeterminismScope.CROSS_TP_BITWISE.value
COMPARISON_MODES = ("bitwise", "tolerance", "rounding_model")
ROUNDING_MODEL = "rounding_model"  # |lhs - rhs| <= the per-token bound of kernels.rounding_bound (docs/contract.md)
CONTRACT_DTYPES = kernels.EXECUTION_DTYPE_NAMES
# Every contract judges these chain metrics (v1's three); `judged_metrics` may add any of rlsweep.mismatch.METRICS.
REQUIRED_CHAIN_METRICS = ("max_abs_dlogp", "approx_kl0", "clipfrac0")
CONTRACT_TENSORS = (*FORWARD_TENSORS, *GRADIENT_TENSORS, Tensor.LOGITS)
PIN_KEY = "expected_sha256"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # a sha256 as hashlib's hexdigest writes it
DEFAULT_CONTRACT = "v3"
# Op classes key rows beside the dtype: where the logits are rounded decides most of the error budget.
OP_CLASSES = tuple(f"logits_{dtype}" for dtype in CONTRACT_DTYPES)
ANY_OP_CLASS = "*"  # a row written directly under its dtype (v1) serves every op class
# Every key the loader knows, per section: anything else is a typo that would silently weaken a row.
TOP_KEYS = ("version", PIN_KEY, "dtype_policy", "comparison_roles", "judgments", "chain_logprob_aggregates",
            "error_model")  # fmt: skip
OPTIONAL_TOP_KEYS = (PIN_KEY, "error_model")
ERROR_MODEL_KEYS = ("failure_probability",)
# The most a probabilistic verdict may fail a correct kernel: above it, a red row would be a coin toss.
MAX_FAILURE_PROBABILITY = 1e-6
DTYPE_POLICY_KEYS = ("execution_dtype", "accumulation_dtype", "reference_dtype", "tf32", "fp8")
# What every run does, whatever its contract says: a policy that said otherwise would record one it did not follow.
IMPLEMENTED_POLICY = {
    "accumulation_dtype": "float32",
    "reference_dtype": "float64",
    "tf32": "disabled",
    "fp8": "out_of_scope",
}
ROLES_KEYS = ("roles", "judgments", "forbidden")
ROW_KEYS = ("atol", "rtol", "mode")
ROLE_PAIR_KEYS = ("lhs", "rhs")
CHAIN_KEYS = ("over", "clip_interval", "require_all", "nonfinite", "empty_active_set", "judged_metrics", "thresholds")
CHAIN_TOKENS = "active_tokens"  # the chain metrics aggregate dlogp over these
RowKey = tuple[str, str, str, str, str]  # (judgment, scope or "", tensor, dtype, op class or ANY_OP_CLASS)


def op_class(execution_dtype: str, logits_dtype: str | None) -> str:
    """The op class of a profile: logits materialized in ``logits_dtype`` (default: the execution dtype)."""
    return f"logits_{logits_dtype or execution_dtype}"


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing lhs[N] with rhs[N] under one tolerance row."""

    passed: bool
    max_abs_diff: float
    mismatches: int
    first_index: int | None  # first mismatching element, None when all match
    max_ratio: float = math.nan  # rounding_model rows: the largest |lhs - rhs| / bound (1 uses the whole bound)


@dataclass(frozen=True)
class Tolerance:
    """One contract row: |lhs - rhs| <= atol + rtol * |rhs| (tolerance), identical bits (bitwise), or
    |lhs - rhs| <= a per-token bound from the rounding-error model (rounding_model)."""

    atol: float
    rtol: float
    mode: str

    def mismatched(self, lhs: torch.Tensor, rhs: torch.Tensor, bound: torch.Tensor | None = None) -> torch.Tensor:
        """lhs[N], rhs[N] (and bound[N] for rounding_model) -> bool[N], true where a pair violates the row."""
        if lhs.shape != rhs.shape:
            raise ContractError(f"cannot compare shapes {tuple(lhs.shape)} and {tuple(rhs.shape)}")
        if self.mode == "bitwise":
            if lhs.dtype != rhs.dtype:
                raise ContractError(f"bitwise comparison needs one dtype, got {lhs.dtype} and {rhs.dtype}")
            # Bit patterns, so -0.0 vs 0.0 and NaN payloads count as differences.
            return kernels.bit_pattern(lhs) != kernels.bit_pattern(rhs)
        return ~((lhs.double() - rhs.double()).abs() <= self.allowance(rhs, bound))

    def allowance(self, rhs: torch.Tensor, bound: torch.Tensor | None = None) -> torch.Tensor:
        """rhs[N] (and bound[N] for rounding_model) -> float64 [N]: the most |lhs - rhs| a pair may differ by (0 for
        bitwise rows, which allow no bit to differ)."""
        if self.mode == "bitwise":
            return torch.zeros_like(rhs, dtype=torch.float64)
        if self.mode == ROUNDING_MODEL:
            if bound is None or bound.shape != rhs.shape:
                raise ContractError(f"a rounding_model row needs a bound of shape {tuple(rhs.shape)}, got "
                                    f"{None if bound is None else tuple(bound.shape)}")  # fmt: skip
            return bound.double()
        return self.atol + self.rtol * rhs.double().abs()

    def check(self, lhs: torch.Tensor, rhs: torch.Tensor, bound: torch.Tensor | None = None) -> Comparison:
        bad = self.mismatched(lhs, rhs, bound)
        diff = (lhs.double() - rhs.double()).abs().nan_to_num(nan=math.inf)
        max_diff = float(diff.max()) if diff.numel() else 0.0
        ratio = float((diff / bound.double()).max()) if self.mode == ROUNDING_MODEL and diff.numel() else math.nan
        count = int(bad.sum())
        first = int(bad.nonzero()[0, 0]) if count else None
        return Comparison(count == 0, max_diff, count, first, ratio)

    @property
    def threshold(self) -> float:
        """The number a verdict row shows: mismatching elements allowed (0), atol, or the bound's share (1)."""
        return {"bitwise": 0.0, ROUNDING_MODEL: 1.0}.get(self.mode, self.atol)


@dataclass(frozen=True)
class ChainThresholds:
    """Limits of the judged chain metrics for one dtype: fixed figures (metric -> figure), or the rounding model."""

    figures: Mapping[str, float]
    mode: str = "tolerance"

    def limits(self, metric: str, bound: torch.Tensor, tokens: ActiveTokens) -> tuple[float, float]:
        """(lower, upper) of a judged metric over the active tokens; bound [N]: their rounding-model allowance.

        A fixed figure f bounds the value by f; for a signed metric, its distance from its value at dlogp = 0.
        """
        if self.mode == ROUNDING_MODEL:
            return BY_NAME[metric].limits(bound, tokens)
        if metric not in self.figures:
            raise ContractError(f"no chain figure for {metric!r}; the contract has {sorted(self.figures)}")
        figure = self.figures[metric]
        if not BY_NAME[metric].signed:
            return -math.inf, figure
        if not tokens.count:
            return math.nan, math.nan
        neutral = BY_NAME[metric].value(torch.zeros(tokens.count, dtype=torch.float64), tokens)
        return neutral - figure, neutral + figure


@dataclass(frozen=True)
class Contract:
    """A validated contract; ``sha256`` is of the canonical resolved document without the pin."""

    version: str
    sha256: str
    expected_sha256: str | None
    document: Mapping[str, Any]
    roles: Mapping[str, tuple[str, str]]
    rows: Mapping[RowKey, Tolerance]
    clip_interval: tuple[float, float]
    chain: Mapping[str, ChainThresholds]
    chain_metrics: tuple[str, ...]  # the judged ones, by their own names (rlsweep.mismatch.METRICS)
    failure_probability: float | None = None  # error_model: a probabilistic verdict's chance to fail a correct kernel

    @property
    def judges_kernel_arithmetic(self) -> bool:
        """Whether this contract has the kernel_* judgments (v3 on)."""
        return any(key[0] in KERNEL_JUDGMENTS for key in self.rows)

    def row_key(self, judgment: str, tensor: str, dtype: str, op: str, scope: str | None = None) -> RowKey:
        """The key of the row serving ``op`` (its own row, else one written for every op class)."""
        if judgment not in CONTRACT_JUDGMENTS:
            raise ContractError(f"unknown judgment {judgment!r}; the contract has: {', '.join(CONTRACT_JUDGMENTS)}")
        if judgment == Judgment.TP_INVARIANCE:
            scope = BITWISE_SCOPE if scope is None else scope
            if scope not in DETERMINISM_SCOPES:
                raise ContractError(f"unknown determinism scope {scope!r}; valid: {', '.join(DETERMINISM_SCOPES)}")
        else:
            scope = ""
        own = (judgment, scope, tensor, dtype, op)
        return own if own in self.rows else (judgment, scope, tensor, dtype, ANY_OP_CLASS)

    def tolerance(self, judgment: str, tensor: str, dtype: str, *, op: str, scope: str | None = None) -> Tolerance:
        """The row for ``judgment`` on ``tensor`` ("logp", "lse", ...) at execution ``dtype`` for op class ``op``.

        ``scope`` selects the tp_invariance row ("cross_tp_bitwise" when omitted, the strict one).
        """
        key = self.row_key(judgment, tensor, dtype, op, scope)
        if key not in self.rows:
            known = sorted({(t, d, o) for j, s, t, d, o in self.rows if j == judgment and s == key[1]})
            raise ContractError(
                f"contract {self.version} has no {judgment} row for tensor={tensor!r} dtype={dtype!r} op class "
                f"{op!r}; rows exist for (tensor, dtype, op class) in {known}"
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
            f"judgments.{j}{'.' + s if s else ''}.rows.{t}.{d}[.{o}]"
            for j, s, t, d, o in rows
            if self.row_key(j, t, d, o, s or None) not in self.rows
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
    return CONF_DIR / "contract" / f"{name}.yaml"


class ContractLoader(SAFE_LOADER):
    """YAML as the contract's readers write it: ``5e-5`` is a float, as when Hydra composes the same file."""


ContractLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|\.(?:inf|Inf|INF|nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def load_contract(path: str | Path | None = None) -> Contract:
    """Read and validate a contract file (default: the packaged DEFAULT_CONTRACT)."""
    path = default_contract_path() if path is None else Path(path)
    if not path.is_file():
        raise ContractError(f"contract file {str(path)!r} does not exist")
    try:
        document = yaml.load(path.read_text(), Loader=ContractLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ContractError(
            f"contract file {str(path)!r} cannot be read as YAML: {' '.join(str(err).split())}"
        ) from err
    if not isinstance(document, Mapping):
        raise ContractError(f"contract file {str(path)!r} must hold a mapping, got {type(document).__name__}")
    return contract_from_mapping(document, source=str(path), file_name=path.stem)


def contract_sha256(document: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of the document without the pin; ints count as floats."""
    return canonical_sha256({key: value for key, value in document.items() if key != PIN_KEY})


def reject_unknown(section: Any, known: Sequence[str], where: str, error: type[RlsweepError] = ContractError) -> None:
    """A section must be a mapping of known keys only (a contract's, or a run config's with ``error`` ConfigError)."""
    if not isinstance(section, Mapping):
        raise error(f"{where} must be a mapping, got {section!r}")
    unknown = sorted(set(map(str, section)) - set(known))
    if unknown:
        raise error(f"{where}: unknown key(s) {unknown}; valid: {', '.join(known)}")


def check_dtype_policy(policy: Any, where: str) -> None:
    """The policy states what runs do (IMPLEMENTED_POLICY) and an execution dtype a profile can run in."""
    reject_unknown(policy, DTYPE_POLICY_KEYS, where)
    execution = policy.get("execution_dtype")
    if execution is not None and execution not in CONTRACT_DTYPES:
        raise ContractError(f"{where}: execution_dtype={execution!r}; valid: {', '.join(CONTRACT_DTYPES)}")
    for key, done in IMPLEMENTED_POLICY.items():
        if key in policy and policy[key] != done:
            raise ContractError(
                f"{where}: {key}={policy[key]!r}, but every run uses {key}={done!r}: a contract states what runs do"
            )


def contract_from_mapping(
    document: Mapping[str, Any], *, source: str = "contract", file_name: str | None = None
) -> Contract:
    """Validate a contract document (plain containers) and freeze it.

    ``file_name``: the name (without ``.yaml``) of the contract file it was read or composed from, which is its
    version; None for a document already checked so (one recorded in a run's tables).
    """
    document = dict(document)
    if "error_model" in document and document["error_model"] is None:  # the schema's default: a contract without it
        del document["error_model"]
    reject_unknown(document, TOP_KEYS, source)
    for key in TOP_KEYS:
        if key not in document and key not in OPTIONAL_TOP_KEYS:
            raise ContractError(f"{source}: missing top-level key {key!r}")
    if file_name is not None:
        check_version(document["version"], file_name, source)
    check_dtype_policy(document["dtype_policy"], f"{source}: dtype_policy")
    roles = parse_roles(document["comparison_roles"], source)
    rows = parse_judgments(document["judgments"], source)
    clip, judged, chain = parse_chain(document["chain_logprob_aggregates"], source)
    pin = document.get(PIN_KEY)
    check_pin(pin, f"{source}: {PIN_KEY}")
    failure_probability = parse_error_model(document, rows, source)
    return Contract(
        version=str(document["version"]),
        sha256=contract_sha256(document),
        expected_sha256=pin,
        document=MappingProxyType(document),
        roles=MappingProxyType(roles),
        rows=MappingProxyType(rows),
        clip_interval=clip,
        chain=MappingProxyType(chain),
        chain_metrics=judged,
        failure_probability=failure_probability,
    )


def parse_error_model(document: Mapping[str, Any], rows: Mapping[RowKey, Tolerance], source: str) -> float | None:
    """``error_model.failure_probability``: required with the kernel_* judgments (their bounds hold but with that
    probability), refused without them (it would judge nothing)."""
    kernel = sorted({key[0] for key in rows if key[0] in KERNEL_JUDGMENTS})
    if "error_model" not in document:
        if kernel:
            raise ContractError(f"{source}: judgments {kernel} need error_model.failure_probability")
        return None
    where = f"{source}: error_model"
    section = document["error_model"]
    reject_unknown(section, ERROR_MODEL_KEYS, where)
    if not kernel:
        raise ContractError(f"{where} applies to the judgments {list(KERNEL_JUDGMENTS)}, which this contract lacks")
    value = finite_number(section.get("failure_probability"), f"{where}.failure_probability")
    if not 0 < value <= MAX_FAILURE_PROBABILITY:
        raise ContractError(
            f"{where}.failure_probability={value!r}: valid is 0 < p <= {MAX_FAILURE_PROBABILITY:g} (the chance that "
            "a correct kernel's verdict is red)"
        )
    if set(kernel) != set(KERNEL_JUDGMENTS):
        raise ContractError(f"{source}: judgments {list(KERNEL_JUDGMENTS)} come together; got only {kernel}")
    return value


def check_pin(pin: Any, where: str, error: type[RlsweepError] = ContractError) -> None:
    """A sha256 pin is null or 64 lowercase hex digits, as hashlib and the tables write one: any other string could
    never match, so the run would compute everything and end red on the pin alone."""
    if pin is not None and not (isinstance(pin, str) and SHA256_HEX.fullmatch(pin)):
        raise error(
            f"{where} must be null or a sha256 of 64 lowercase hex digits, as the tables record it; got {pin!r}"
        )


def check_version(version: Any, file_name: str, source: str) -> None:
    """A contract file is named by its version (``conf/contract/v2.yaml`` holds ``version: v2``), so the version a
    table records names the document that judged it; a version set to anything else is refused."""
    if str(version) != file_name:
        raise ContractError(
            f"{source}: version={version!r} is not the version of contract file {file_name}.yaml, which is "
            f"{file_name!r} (a contract's version is its file's name); valid: version={file_name}, or the contract "
            "file of the version wanted (contract=<version>)"
        )


def parse_roles(section: Mapping[str, Any], source: str) -> dict[str, tuple[str, str]]:
    where = f"{source}: comparison_roles"
    reject_unknown(section, ROLES_KEYS, where)
    known = distinct_names(section.get("roles", []), f"{where}.roles", "role names")
    forbidden_pairs = section.get("forbidden", [])
    if not isinstance(forbidden_pairs, (list, tuple)):
        raise ContractError(f"{where}.forbidden must be a list of {{lhs, rhs}} pairs, got {forbidden_pairs!r}")
    # A forbidden pair with an undeclared role would forbid nothing: checked like the judgments' pairs.
    forbidden = {role_pair(pair, known, f"{where}.forbidden[{i}]") for i, pair in enumerate(forbidden_pairs)}
    pairs = section.get("judgments", {})
    if not isinstance(pairs, Mapping):
        raise ContractError(f"{where}.judgments must be a mapping of name -> {{lhs, rhs}}, got {pairs!r}")
    roles = {}
    for name, pair in pairs.items():
        lhs, rhs = role_pair(pair, known, f"{where}.{name}")
        if (lhs, rhs) in forbidden:
            raise ContractError(f"{where}.{name} compares {lhs!r} with {rhs!r}, a forbidden pair")
        roles[name] = (lhs, rhs)
    return roles


def role_pair(pair: Any, known: Sequence[str], where: str) -> tuple[str, str]:
    """``{lhs: role, rhs: role}``, both among the declared roles ``known``."""
    reject_unknown(pair, ROLE_PAIR_KEYS, where)
    for side in ROLE_PAIR_KEYS:
        if pair.get(side) not in known:
            raise ContractError(f"{where}.{side}={pair.get(side)!r} is not one of {sorted(known)}")
    return pair["lhs"], pair["rhs"]


def distinct_names(names: Any, where: str, what: str) -> tuple[str, ...]:
    """A list of distinct strings (roles, metric names): anything else is refused, naming ``where``."""
    if (
        not isinstance(names, (list, tuple))
        or not all(isinstance(name, str) for name in names)
        or len(set(names)) != len(names)
    ):
        raise ContractError(f"{where} must be a list of distinct {what}, got {names!r}")
    return tuple(names)


def parse_judgments(section: Mapping[str, Any], source: str) -> dict[RowKey, Tolerance]:
    rows: dict[RowKey, Tolerance] = {}
    reject_unknown(section, CONTRACT_JUDGMENTS, f"{source}: judgments")
    for judgment, block in section.items():
        if judgment not in CONTRACT_JUDGMENTS:
            raise ContractError(f"{source}: unknown judgment {judgment!r}; valid: {', '.join(CONTRACT_JUDGMENTS)}")
        if judgment == Judgment.TP_INVARIANCE:
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
    missing = set(CONTRACT_JUDGMENTS) - set(section) - set(KERNEL_JUDGMENTS)
    if missing:
        raise ContractError(f"{source}: judgments missing {sorted(missing)}")
    return rows


def parse_rows(
    label: str, judgment: str, scope: str, block: Mapping[str, Any], bitwise: bool, source: str
) -> dict[RowKey, Tolerance]:
    """rows.<tensor>.<dtype> is a row for every op class, or a mapping op class -> row."""
    reject_unknown(block, ("rows",), f"{source}: judgments.{label}")
    if "rows" not in block:
        raise ContractError(f"{source}: judgments.{label} has no 'rows'")
    rows = {}
    reject_unknown(block["rows"], CONTRACT_TENSORS, f"{source}: judgments.{label}.rows")
    for tensor, by_dtype in block["rows"].items():
        reject_unknown(by_dtype, CONTRACT_DTYPES, f"{source}: judgments.{label}.rows.{tensor}")
        for dtype, entry in by_dtype.items():
            where = f"{source}: judgments.{label}.rows.{tensor}.{dtype}"
            by_op = {ANY_OP_CLASS: entry} if isinstance(entry, Mapping) and "mode" in entry else entry
            reject_unknown(by_op, (ANY_OP_CLASS, *OP_CLASSES), where)
            for op, row in by_op.items():
                tolerance = parse_tolerance(row, where if op == ANY_OP_CLASS else f"{where}.{op}")
                if bitwise and (tolerance.mode != "bitwise" or tolerance.atol != 0 or tolerance.rtol != 0):
                    raise ContractError(
                        f"{where}: invariance rows must be bitwise (mode: bitwise, atol: 0, rtol: 0), got "
                        f"mode={tolerance.mode!r} atol={tolerance.atol!r} rtol={tolerance.rtol!r}"
                    )
                rows[(judgment, scope, tensor, dtype, op)] = tolerance
    return rows


def parse_tolerance(row: Mapping[str, Any], where: str) -> Tolerance:
    reject_unknown(row, ROW_KEYS, where)
    mode = row.get("mode")
    if mode not in COMPARISON_MODES:
        raise ContractError(f"{where}: mode must be one of {COMPARISON_MODES}, got {mode!r}")
    if mode == ROUNDING_MODEL:  # the bound comes from the model, so a row carries no figure of its own
        if set(row) != {"mode"}:
            raise ContractError(f"{where}: a rounding_model row has only 'mode', got {sorted(row)}")
        return Tolerance(atol=0.0, rtol=0.0, mode=mode)
    values = {key: finite_number(row.get(key), f"{where}: {key}", at_least=0) for key in ("atol", "rtol")}
    if values["rtol"] >= 1:  # |0 - rhs| <= rtol * |rhs|: a kernel that returns 0 for every token would pass
        raise ContractError(
            f"{where}: rtol={values['rtol']!r} passes a kernel that returns 0 for every token (|0 - rhs| <= rtol * "
            "|rhs|); valid: rtol in [0, 1)"
        )
    if mode == "bitwise" and (values["atol"] or values["rtol"]):
        raise ContractError(f"{where}: a bitwise row must have atol = rtol = 0, got {values}")
    return Tolerance(atol=values["atol"], rtol=values["rtol"], mode=mode)


def parse_chain(
    section: Mapping[str, Any], source: str
) -> tuple[tuple[float, float], tuple[str, ...], dict[str, ChainThresholds]]:
    """(clip interval, judged metrics, thresholds by dtype); every dtype block covers exactly the judged metrics."""
    where = f"{source}: chain_logprob_aggregates"
    reject_unknown(section, CHAIN_KEYS, where)
    if section.get("require_all") is not True:
        raise ContractError(
            f"{where}.require_all must be true (every aggregate must pass), got {section.get('require_all')!r}"
        )
    for key in ("nonfinite", "empty_active_set"):
        if section.get(key) != "hard_failure":
            raise ContractError(f"{where}.{key} must be 'hard_failure', got {section.get(key)!r}")
    if section.get("over") != CHAIN_TOKENS:  # the metrics are computed over the active tokens, whatever it says
        raise ContractError(f"{where}.over must be {CHAIN_TOKENS!r} (what the metrics are computed over), got "
                            f"{section.get('over')!r}")  # fmt: skip
    clip = section.get("clip_interval")
    interval = f"{where}.clip_interval must be [low, high] with 0 < low < 1 < high, got {clip!r}"
    if not isinstance(clip, (list, tuple)) or len(clip) != 2:
        raise ContractError(interval)
    low, high = (finite_number(end, f"{where}.clip_interval[{i}]") for i, end in enumerate(clip))
    if not 0 < low < 1 < high:
        raise ContractError(interval)
    judged = parse_judged_metrics(section.get("judged_metrics", list(REQUIRED_CHAIN_METRICS)), where)
    chain = {}
    reject_unknown(section.get("thresholds", {}), CONTRACT_DTYPES, f"{where}.thresholds")
    for dtype, thresholds in section.get("thresholds", {}).items():
        at = f"{where}.thresholds.{dtype}"
        if isinstance(thresholds, Mapping) and dict(thresholds) == {"mode": ROUNDING_MODEL}:
            chain[dtype] = ChainThresholds(figures={}, mode=ROUNDING_MODEL)
            continue
        if not isinstance(thresholds, Mapping):
            raise ContractError(
                f"{at}: need {{mode: {ROUNDING_MODEL}}} or a figure per judged metric, got {thresholds!r}"
            )
        check_metric_names(thresholds, at)
        undeclared = sorted(set(thresholds) - set(judged))
        missing = [f"{at}.{metric}" for metric in judged if metric not in thresholds]
        if undeclared or missing:
            raise ContractError(
                f"{at}: need {{mode: {ROUNDING_MODEL}}} or exactly the judged metrics {list(judged)}; "
                f"missing {missing or 'none'}, not in judged_metrics {undeclared or 'none'}"
            )
        figures = {metric: finite_number(value, f"{at}.{metric}", at_least=0) for metric, value in thresholds.items()}
        for metric, figure in figures.items():
            if figure >= BY_NAME[metric].ceiling:  # a fraction, or a difference of probabilities, is at most 1
                raise ContractError(
                    f"{at}.{metric}={figure!r} can never fail: {metric} is at most {BY_NAME[metric].ceiling:g}; "
                    f"valid: a figure in [0, {BY_NAME[metric].ceiling:g})"
                )
        chain[dtype] = ChainThresholds(figures=MappingProxyType(figures))
    return (low, high), judged, chain


def finite_number(value: Any, where: str, *, at_least: float | None = None) -> float:
    """A number the contract reads: an int or a float (not a bool), finite, at least ``at_least`` when given."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (at_least is not None and value < at_least)
    ):
        bound = "" if at_least is None else f" >= {at_least:g}"
        raise ContractError(f"{where} must be a finite number{bound}, got {value!r}")
    return float(value)


def parse_judged_metrics(names: Any, where: str) -> tuple[str, ...]:
    """A list of distinct metric names of rlsweep.mismatch.METRICS that holds REQUIRED_CHAIN_METRICS."""
    distinct_names(names, f"{where}.judged_metrics", "metric names")
    check_metric_names(names, f"{where}.judged_metrics")
    dropped = [metric for metric in REQUIRED_CHAIN_METRICS if metric not in names]
    if dropped:
        raise ContractError(f"{where}.judged_metrics must keep {list(REQUIRED_CHAIN_METRICS)}; it lacks {dropped}")
    return tuple(names)


def check_metric_names(names: Any, where: str) -> None:
    """Contract rows are keyed by a metric's own name: an alias is judged with its twin, anything else is a typo."""
    aliases = {name: ALIAS_OF[name] for name in names if name in ALIAS_OF}
    if aliases:
        raise ContractError(f"{where}: {aliases} are aliases (name: its metric); key the row by the metric's name")
    unknown = sorted(str(name) for name in names if name not in METRIC_NAMES)
    if unknown:
        raise ContractError(f"{where}: unknown chain metric(s) {unknown}; known: {', '.join(METRIC_NAMES)}")
