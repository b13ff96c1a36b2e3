"""What a logprob backend declares it can honour, and why a given contract is out of its reach.

A backend declares its capability where it is registered (``kernels.backend.register_backend``); dispatch
reads it from there (docs/dispatch.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

from kernels.contract import (
    EXECUTION_DTYPE_NAMES,
    FLOAT_RESULT_DTYPE_NAMES,
    PLATFORMS,
    TP_MODES,
    DeterminismScope,
    LogprobContract,
    LogprobContractError,
    MaskMode,
    MergeOrder,
    check_bool,
    parse_choice,
    parse_name,
)
from kernels.validation import IGNORE_INDEX


class ImplementationKind(StrEnum):
    """What a backend is for; only PRODUCTION backends are ever chosen without being named."""

    REFERENCE = "reference"  # the gold the others are judged against
    PRODUCTION = "production"  # a kernel meant to run in training or rollout
    NEGATIVE_CONTROL = "negative_control"  # deliberately wrong in a known way, to prove the harness sees it
    OBSERVED_STACK = "observed_stack"  # a trainer's or library's own code, judged as it is (docs/stacks.md)


class DispatchPolicy(StrEnum):
    """How the backend was chosen; ``requested_backend="auto"`` is AUTO, a backend id is EXPLICIT.

    Its values are reserved: no backend may be registered under them.
    """

    EXPLICIT = "explicit"
    AUTO = "auto"


def _choices(field_name: str, values: Iterable[Any], parse) -> frozenset:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise LogprobContractError(f"{field_name} must be a collection; got {values!r}")
    parsed = frozenset(parse(field_name, v) for v in values)
    if not parsed:
        raise LogprobContractError(f"{field_name} must name at least one value; got {values!r}")
    return parsed


@dataclass(frozen=True)
class LogprobBackendCapability:
    """The contracts one backend honours; ``tp_sizes`` None means every TP degree the geometry allows.

    ``platforms`` (default: every one of ``PLATFORMS``) are where it runs; ``tp_modes`` (default: both of
    ``TP_MODES``) are how its ranks may run. A claim must be one the backend keeps; layout (row-count)
    invariance is never claimed, because that is what sweeps measure.
    """

    implementation_kind: ImplementationKind
    dtypes: frozenset[str]
    determinism_scopes: frozenset[DeterminismScope]
    merge_orders: frozenset[MergeOrder]
    platforms: frozenset[str] = frozenset(PLATFORMS)
    tp_modes: frozenset[str] = frozenset(TP_MODES)
    mask_modes: frozenset[MaskMode] = frozenset({MaskMode.IGNORE_INDEX})
    ignore_index: int | None = IGNORE_INDEX
    tp_sizes: frozenset[int] | None = None
    partial_dtype: str = "float32"
    output_dtype: str = "float32"
    supports_vocab_padding: bool = True
    exports_lse: bool = True

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        kind = parse_choice("capability.implementation_kind", self.implementation_kind, ImplementationKind)
        setattr_(self, "implementation_kind", kind)
        setattr_(self, "platforms", _choices("capability.platforms", self.platforms, _platform))
        setattr_(self, "tp_modes", _choices("capability.tp_modes", self.tp_modes, _tp_mode))
        setattr_(self, "dtypes", _choices("capability.dtypes", self.dtypes, _dtype_name))
        setattr_(
            self,
            "determinism_scopes",
            _choices("capability.determinism_scopes", self.determinism_scopes, _scope),
        )
        setattr_(self, "merge_orders", _choices("capability.merge_orders", self.merge_orders, _merge_order))
        setattr_(self, "mask_modes", _choices("capability.mask_modes", self.mask_modes, _mask_mode))
        if self.tp_sizes is not None:
            setattr_(self, "tp_sizes", _choices("capability.tp_sizes", self.tp_sizes, _tp_size))
        for name in ("partial_dtype", "output_dtype"):
            setattr_(self, name, parse_name(f"capability.{name}", getattr(self, name), FLOAT_RESULT_DTYPE_NAMES))
        check_bool("capability.supports_vocab_padding", self.supports_vocab_padding)
        check_bool("capability.exports_lse", self.exports_lse)
        if self.ignore_index is not None and (
            not isinstance(self.ignore_index, int) or isinstance(self.ignore_index, bool)
        ):
            raise LogprobContractError(f"capability.ignore_index must be an int or None; got {self.ignore_index!r}")

    def incompatibilities(self, contract: LogprobContract, *, tp_mode: str | None = None) -> list[str]:
        """One line per contract field (and ``tp_mode``, when given) this backend cannot honour; empty when none."""
        reasons = []
        sharding, reduction, mask = contract.sharding, contract.reduction, contract.mask
        if contract.platform not in self.platforms:
            reasons.append(f"platform {contract.platform!r} unsupported (declared for {_listed(self.platforms)})")
        if tp_mode is not None and tp_mode not in self.tp_modes:
            reasons.append(f"tp_mode {tp_mode!r} unsupported (supports {_listed(self.tp_modes)})")
        if contract.dtype not in self.dtypes:
            reasons.append(f"dtype {contract.dtype!r} unsupported (supports {_listed(self.dtypes)})")
        if self.tp_sizes is not None and sharding.world_size not in self.tp_sizes:
            reasons.append(f"tp={sharding.world_size} unsupported (supports {_listed(self.tp_sizes)})")
        if mask.mode not in self.mask_modes:
            reasons.append(f"mask mode {mask.mode.value!r} unsupported (supports {_listed(self.mask_modes)})")
        elif mask.mode is MaskMode.IGNORE_INDEX and mask.ignore_index != self.ignore_index:
            reasons.append(f"ignore_index={mask.ignore_index} unsupported (the backend uses {self.ignore_index})")
        if reduction.determinism_scope not in self.determinism_scopes:
            reasons.append(
                f"determinism scope {reduction.determinism_scope.value!r} not guaranteed "
                f"(guarantees {_listed(self.determinism_scopes)})"
            )
        if reduction.merge_order not in self.merge_orders:
            reasons.append(
                f"merge order {reduction.merge_order.value!r} unsupported (merges {_listed(self.merge_orders)})"
            )
        if reduction.partial_dtype != self.partial_dtype:
            reasons.append(f"partial dtype {reduction.partial_dtype!r} unsupported (computes {self.partial_dtype!r})")
        if contract.output.dtype != self.output_dtype:
            reasons.append(f"output dtype {contract.output.dtype!r} unsupported (returns {self.output_dtype!r})")
        if sharding.padded_vocab_size != sharding.vocab_size and not self.supports_vocab_padding:
            reasons.append(f"vocab padding ({sharding.vocab_size} -> {sharding.padded_vocab_size} columns) unsupported")
        if contract.output.export_lse and not self.exports_lse:
            reasons.append("lse export requested but the backend does not export lse")
        return reasons

    def to_dict(self) -> dict[str, Any]:
        """Plain sorted values, for provenance records and docs."""
        return {
            "implementation_kind": self.implementation_kind.value,
            "platforms": sorted(self.platforms),
            "tp_modes": sorted(self.tp_modes),
            "dtypes": sorted(self.dtypes),
            "tp_sizes": None if self.tp_sizes is None else sorted(self.tp_sizes),
            "mask_modes": sorted(m.value for m in self.mask_modes),
            "ignore_index": self.ignore_index,
            "determinism_scopes": sorted(s.value for s in self.determinism_scopes),
            "merge_orders": sorted(o.value for o in self.merge_orders),
            "partial_dtype": self.partial_dtype,
            "output_dtype": self.output_dtype,
            "supports_vocab_padding": self.supports_vocab_padding,
            "exports_lse": self.exports_lse,
        }


def _platform(field_name: str, value: Any) -> str:
    return parse_name(field_name, value, PLATFORMS)


def _tp_mode(field_name: str, value: Any) -> str:
    return parse_name(field_name, value, TP_MODES)


def _dtype_name(field_name: str, value: Any) -> str:
    return parse_name(field_name, value, EXECUTION_DTYPE_NAMES)


def _scope(field_name: str, value: Any) -> DeterminismScope:
    return parse_choice(field_name, value, DeterminismScope)


def _merge_order(field_name: str, value: Any) -> MergeOrder:
    return parse_choice(field_name, value, MergeOrder)


def _mask_mode(field_name: str, value: Any) -> MaskMode:
    return parse_choice(field_name, value, MaskMode)


def _tp_size(field_name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LogprobContractError(f"{field_name} must hold integers >= 1; got {value!r}")
    return value


def _listed(values: Iterable[Any]) -> str:
    return ", ".join(sorted(str(v.value if isinstance(v, Enum) else v) for v in values))
