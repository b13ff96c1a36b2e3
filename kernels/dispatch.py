"""Capability-gated dispatch: a contract, a requested backend and a tp mode -> a bound op, or a typed refusal.

Backends declare their capability where they are registered (``kernels.backend.register_backend``);
dispatch reads it from that registry only. ``get_logprob_op`` never falls back: it returns the op of
the named backend, or (``"auto"``) of the first compatible production backend in registration order,
or raises ``LogprobDispatchError`` listing every candidate and why it was rejected. The op checks at
run time that what ran is what it was bound to (docs/dispatch.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.backend import BACKENDS, OP_NODES, registered_backends
from kernels.capability import DispatchPolicy, ImplementationKind, LogprobBackendCapability
from kernels.contract import TP_MODES, LogprobContract, LogprobContractError
from kernels.errors import DtypeMismatchError, KernelInputError, ShapeMismatchError
from kernels.launches import observed_provenance
from kernels.lm_head import sharded_lm_head_logprob
from kernels.provenance import ProvenanceMismatchError, provenance_mismatches
from kernels.ranks import LogprobResult
from kernels.sharding import ShardingSpec
from kernels.validation import check_tensor, dtype_name


class LogprobDispatchError(RuntimeError):
    """No backend may run the contract; ``rejections`` maps each candidate to its reasons."""

    def __init__(self, message: str, rejections: dict[str, list[str]]):
        lines = [message, *(f"  {backend}: {'; '.join(reasons)}" for backend, reasons in rejections.items())]
        super().__init__("\n".join(lines))
        self.rejections = rejections


@dataclass(frozen=True)
class RankAgreement:
    """What every rank all-gathered and found equal before a tp > 1 ``auto`` dispatch."""

    fingerprint: str
    backend_id: str


@dataclass(frozen=True)
class LogprobOp:
    """hidden[T, H], weight[V, H], targets[T] -> LogprobResult, run by one backend bound to one contract and tp mode."""

    contract: LogprobContract
    backend_id: str
    capability: LogprobBackendCapability
    policy: DispatchPolicy
    tp_mode: str

    @property
    def tp(self) -> int:
        return self.contract.sharding.world_size

    @property
    def vocab_tile(self) -> int:
        return self.contract.reduction.vocab_tile

    @property
    def required_nodes(self) -> dict[str, str]:
        """Every op node must run on the bound backend."""
        return dict.fromkeys(OP_NODES, self.backend_id)

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        *,
        keep_logits: bool = False,
        nonfinite: str = "raise",
    ) -> LogprobResult:
        """Run the bound backend in the bound tp mode; raise ProvenanceMismatchError if anything else ran.
        ``keep_logits`` and ``nonfinite`` as for ``kernels.lm_head.sharded_lm_head_logprob``."""
        self._check_binding()
        self._check_inputs(hidden, weight)
        with observed_provenance():  # what is checked below must have been observed
            result = sharded_lm_head_logprob(
                hidden, weight, targets, backend=self.backend_id, sharding=self.contract.sharding,
                tp_mode=self.tp_mode, keep_logits=keep_logits, nonfinite=nonfinite,
            )  # fmt: skip
        self.require_observed(result)
        return result

    def observed_mismatches(self, result: LogprobResult) -> list[str]:
        """One line per way the observed run differs from this op's binding; empty when it matches."""
        observed = result.provenance
        problems = provenance_mismatches(self.required_nodes, observed)
        if observed.tp != self.tp:
            problems.append(f"tp: required {self.tp}, observed {observed.tp}")
        if observed.tp_mode != self.tp_mode:
            problems.append(f"tp_mode: required {self.tp_mode!r}, observed {observed.tp_mode!r}")
        for name in ("logp", "lse"):
            ran = dtype_name(getattr(result, name).dtype)
            if ran != self.contract.output.dtype:
                problems.append(f"{name} dtype: required {self.contract.output.dtype!r}, observed {ran!r}")
        for node in observed.nodes.values():
            # device_name() appends the GPU model after a space: "cuda:0 (NVIDIA H200)".
            if torch.device(node.device.split(" ")[0]).type != self.contract.platform:
                problems.append(
                    f"node {node.node!r}: required platform {self.contract.platform!r}, observed device {node.device!r}"
                )
        return problems

    def require_observed(self, result: LogprobResult) -> None:
        """Raise ProvenanceMismatchError unless ``result`` was produced as this op is bound to produce it."""
        problems = self.observed_mismatches(result)
        if problems:
            raise ProvenanceMismatchError(problems, result.provenance)

    def to_dict(self) -> dict[str, Any]:
        """The dispatch decision, for run records: who was chosen, how, under which declaration."""
        return {
            "backend_id": self.backend_id,
            "policy": self.policy.value,
            "tp_mode": self.tp_mode,
            "capability": self.capability.to_dict(),
            "contract_fingerprint": self.contract.cross_rank_fingerprint(),
            "contract": self.contract.to_dict(),
        }

    def _check_binding(self) -> None:
        """LogprobDispatchError unless the backend id still names a backend that honours the contract: one
        unregistered, or replaced under a capability that no longer covers it, since the op was bound."""
        if getattr(BACKENDS.get(self.backend_id), "capability", None) is self.capability:
            return
        registered = registered_backends()
        reasons = _rejections(self.contract, registered, self.backend_id, self.policy, self.tp_mode)
        if reasons:
            raise LogprobDispatchError(
                f"the op bound to backend {self.backend_id!r} cannot run: the registry changed since it was bound",
                {self.backend_id: reasons},
            )

    def _check_inputs(self, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        contract = self.contract
        check_tensor("hidden", hidden)
        check_tensor("weight", weight)
        if hidden.device.type != contract.platform:
            raise KernelInputError(f"hidden is on {hidden.device}, but the contract runs on {contract.platform!r}")
        if dtype_name(hidden.dtype) != contract.dtype:
            raise DtypeMismatchError(f"hidden has dtype {hidden.dtype}, but the contract requires {contract.dtype!r}")
        if weight.dim() != 2 or weight.shape[0] != contract.sharding.vocab_size:
            raise ShapeMismatchError(
                f"weight must be [V, H] with V={contract.sharding.vocab_size} (the contract's vocab), "
                f"got shape {tuple(weight.shape)}"
            )


def get_logprob_op(
    contract: LogprobContract,
    requested_backend: str,
    *,
    tp_mode: str = "emulated",
    agreement: RankAgreement | None = None,
) -> LogprobOp:
    """The op of ``requested_backend`` (a backend id or ``"auto"``) bound to ``contract`` and ``tp_mode``."""
    _check_request(contract, tp_mode)
    policy = DispatchPolicy.AUTO if requested_backend == DispatchPolicy.AUTO.value else DispatchPolicy.EXPLICIT
    tp = contract.sharding.world_size
    if policy is DispatchPolicy.AUTO and tp > 1 and agreement is None:
        # Each rank resolves "auto" against its own registry and machine; unchecked, ranks may diverge.
        raise LogprobDispatchError(
            f"requested_backend='auto' is refused for tp={tp} without a RankAgreement: all-gather "
            "(contract.cross_rank_fingerprint(), resolve_logprob_backend(contract, 'auto', tp_mode=...)) across ranks, "
            "check they are equal, and pass agreement=RankAgreement(fingerprint, backend_id); or name the backend",
            {},
        )
    backend_id, capability = _resolve(contract, requested_backend, policy, tp_mode)
    if agreement is not None:
        _check_agreement(contract, backend_id, agreement)
    return LogprobOp(contract, backend_id, capability, policy, tp_mode)


def resolve_logprob_backend(contract: LogprobContract, requested_backend: str, *, tp_mode: str = "emulated") -> str:
    """The backend id ``get_logprob_op`` would bind on this rank, for the cross-rank preflight."""
    _check_request(contract, tp_mode)
    policy = DispatchPolicy.AUTO if requested_backend == DispatchPolicy.AUTO.value else DispatchPolicy.EXPLICIT
    return _resolve(contract, requested_backend, policy, tp_mode)[0]


def _check_request(contract: LogprobContract, tp_mode: str) -> None:
    if not isinstance(contract, LogprobContract):
        raise LogprobContractError(f"contract must be a LogprobContract; got {contract!r}")
    if tp_mode not in TP_MODES:
        raise LogprobContractError(f"tp_mode must be one of {', '.join(TP_MODES)}; got {tp_mode!r}")


def _resolve(
    contract: LogprobContract, requested_backend: str, policy: DispatchPolicy, tp_mode: str
) -> tuple[str, LogprobBackendCapability]:
    registered = registered_backends()  # every platform's, in registration order
    if not isinstance(requested_backend, str):
        raise LogprobDispatchError(
            f"requested_backend must be 'auto' or a backend id ({', '.join(registered) or 'none registered'}); "
            f"got {requested_backend!r}",
            {},
        )
    candidates = list(registered) if policy is DispatchPolicy.AUTO else [requested_backend]
    rejections = {backend: _rejections(contract, registered, backend, policy, tp_mode) for backend in candidates}
    for backend in candidates:
        if not rejections[backend]:
            return backend, registered[backend]
    summary = (
        f"no logprob backend for requested_backend={requested_backend!r} under contract "
        f"{contract.cross_rank_fingerprint()[:12]} (tp={contract.sharding.world_size}, tp_mode={tp_mode}, "
        f"dtype={contract.dtype}, platform={contract.platform}, "
        f"determinism_scope={contract.reduction.determinism_scope.value}, "
        f"merge_order={contract.reduction.merge_order.value}, mask={contract.mask.mode.value}); "
        f"candidates and why each was rejected:"
    )
    raise LogprobDispatchError(summary, rejections)


def _rejections(
    contract: LogprobContract,
    registered: dict[str, LogprobBackendCapability],
    backend: str,
    policy: DispatchPolicy,
    tp_mode: str,
) -> list[str]:
    capability = registered.get(backend)
    if capability is None:
        return [f"not registered (registered backends: {', '.join(registered) or 'none'})"]
    reasons = []
    if contract.platform == "cuda" and not torch.cuda.is_available():
        reasons.append("platform 'cuda' is unavailable on this machine (torch.cuda.is_available() is False)")
    sharding = contract.sharding
    even = ShardingSpec.even(sharding.vocab_size, sharding.vocab_tile, sharding.world_size, sharding.rank)
    if sharding != even:
        reasons.append(f"sharding bounds {sharding.bounds} are not the even split lm_head_logprob runs {even.bounds}")
    if policy is DispatchPolicy.AUTO and capability.implementation_kind is not ImplementationKind.PRODUCTION:
        reasons.append(f"implementation kind {capability.implementation_kind.value!r} is only run when named")
    return reasons + capability.incompatibilities(contract, tp_mode=tp_mode)


def _check_agreement(contract: LogprobContract, backend_id: str, agreement: RankAgreement) -> None:
    if not isinstance(agreement, RankAgreement):
        raise LogprobContractError(f"agreement must be a RankAgreement; got {agreement!r}")
    fingerprint = contract.cross_rank_fingerprint()
    if agreement.fingerprint != fingerprint:
        raise LogprobDispatchError(
            f"the ranks agreed on contract fingerprint {agreement.fingerprint!r}, but this rank's is {fingerprint!r}",
            {},
        )
    if agreement.backend_id != backend_id:
        raise LogprobDispatchError(
            f"the ranks agreed on backend {agreement.backend_id!r}, but this rank resolved {backend_id!r}",
            {backend_id: [f"differs from the agreed backend {agreement.backend_id!r}"]},
        )
