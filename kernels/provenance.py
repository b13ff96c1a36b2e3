"""Observed provenance: what actually ran for each op node of a logprob call."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kernels.backend import declared_kernels
from kernels.launches import KernelLaunch, distinct_launches, observing, observing_dispatcher, recording_launches
from kernels.validation import dtype_name


@dataclass(frozen=True)
class NodeProvenance:
    """One op node as it ran: backend id, output dtype, device, the backend's configuration and the kernels launched.

    ``launches`` is recorded by the launch helpers while the node ran (``call_node``), each distinct launch once.
    """

    node: str
    backend: str
    out_dtype: str
    device: str
    config: dict[str, Any] = field(default_factory=dict)
    launches: tuple[KernelLaunch, ...] = ()
    observed: bool = True  # False: run outside observed_provenance(), so torch ops it ran are not in ``launches``

    @property
    def kernels(self) -> tuple[str, ...]:
        """The names of the kernels launched, in first-launch order."""
        return tuple(dict.fromkeys(launch.kernel for launch in self.launches))

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "backend": self.backend,
            "out_dtype": self.out_dtype,
            "device": self.device,
            "config": dict(self.config),
            "launches": [launch.to_dict() for launch in self.launches],
            "observed": self.observed,
        }


@dataclass(frozen=True)
class Provenance:
    """Every node of one call, plus the TP layout it ran with."""

    nodes: dict[str, NodeProvenance]
    tp: int
    tp_mode: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "tp_mode": self.tp_mode,
            "nodes": {name: node.to_dict() for name, node in self.nodes.items()},
        }


def device_name(tensor: torch.Tensor) -> str:
    """``cpu`` or ``cuda:0 (NVIDIA H200)``: where a tensor actually lives."""
    return named_device(tensor.device)


@functools.cache
def named_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def observe(node: str, backend: str, out: torch.Tensor, **config: Any) -> NodeProvenance:
    """Record a node from the tensor it produced, so dtype and device are what ran; ``call_node`` adds the launches."""
    return NodeProvenance(node, backend, dtype_name(out.dtype), device_name(out), config)


def call_node(method: Callable[..., tuple], *args: Any) -> tuple:
    """Call one node method of a backend (it returns ``(*outputs, NodeProvenance)``) and add what it launched, as
    the dispatcher and the Triton launcher saw it (``kernels.launches``)."""
    with recording_launches() as launches, observing_dispatcher():
        *outputs, provenance = method(*args)
    return (*outputs, replace(provenance, launches=distinct_launches(launches), observed=observing()))


def across_ranks(records: Sequence[NodeProvenance]) -> NodeProvenance:
    """Rank 0's record of a node, carrying every rank's launches, so a fallback on one rank shows."""
    launches = distinct_launches(launch for r in records for launch in r.launches)
    return replace(records[0], launches=launches, observed=all(r.observed for r in records))


def provenance_mismatches(required: dict[str, str], observed: Provenance) -> list[str]:
    """One line per difference from ``required`` and per kernel a node's backend does not declare; empty when none.

    A required node that did not run or ran on another backend, then, for every node that ran: each launched
    kernel its backend does not declare for that node, or that it launched no kernel at all.
    """
    problems = []
    for node, backend in required.items():
        ran = observed.nodes.get(node)
        if ran is None:
            problems.append(f"node {node!r}: required backend {backend!r}, observed nothing (the node did not run)")
        elif ran.backend != backend:
            launched = ", ".join(ran.kernels) or "nothing"
            problems.append(f"node {node!r}: required backend {backend!r}, observed {ran.backend!r} (ran {launched})")
    for ran in observed.nodes.values():
        problems += undeclared_launches(ran)
    return problems


def undeclared_launches(ran: NodeProvenance) -> list[str]:
    """One line per kernel ``ran`` launched that its backend does not declare for its node, or for launching none; one
    line for a record made without observing the dispatcher, whose launches are not all there to compare."""
    if not ran.observed:
        return [
            f"node {ran.node!r}: backend {ran.backend!r} ran outside kernels.observed_provenance(), so what it "
            "launched was not observed"
        ]
    if not ran.launches:
        return [f"node {ran.node!r}: backend {ran.backend!r} launched no kernel"]
    declared = declared_kernels(ran.backend, ran.node)
    listed = ", ".join(sorted(declared)) or f"nothing; {ran.backend!r} has no declaration in kernels.BACKENDS"
    return [
        f"node {ran.node!r}: backend {ran.backend!r} launched {kernel!r}, which it does not declare for the node "
        f"(declared: {listed})"
        for kernel in ran.kernels
        if kernel not in declared
    ]


class ProvenanceMismatchError(RuntimeError):
    """What ran is not what was required; ``mismatches`` holds one line per difference."""

    def __init__(self, mismatches: list[str], observed: Provenance):
        super().__init__("observed provenance differs from the required one:\n  " + "\n  ".join(mismatches))
        self.mismatches = mismatches
        self.observed = observed


def require_provenance(required: dict[str, str], observed: Provenance) -> None:
    """Raise ProvenanceMismatchError unless every required node ran on its required backend."""
    problems = provenance_mismatches(required, observed)
    if problems:
        raise ProvenanceMismatchError(problems, observed)
