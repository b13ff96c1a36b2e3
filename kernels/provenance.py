"""Observed provenance: what actually ran for each op node of a logprob call."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# The op nodes a logprob call is made of; profiles name a required backend for each.
OP_NODES = ("matmul", "logprob", "tp_merge")


@dataclass(frozen=True)
class NodeProvenance:
    """One op node as it ran: backend id, kernel id, its configuration, output dtype, device."""

    node: str
    backend: str
    kernel: str
    out_dtype: str
    device: str
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; the one dtype-name normalizer of the project."""
    return str(dtype).removeprefix("torch.")


def device_name(tensor: torch.Tensor) -> str:
    """``cpu`` or ``cuda:0 (NVIDIA H200)``: where a tensor actually lives."""
    if tensor.device.type == "cuda":
        return f"{tensor.device} ({torch.cuda.get_device_name(tensor.device)})"
    return str(tensor.device)


def observe(node: str, backend: str, kernel: str, out: torch.Tensor, **config: Any) -> NodeProvenance:
    """Record a node from the tensor it produced, so dtype and device are what ran."""
    return NodeProvenance(node, backend, kernel, dtype_name(out.dtype), device_name(out), config)


def provenance_mismatches(required: dict[str, str], observed: Provenance) -> list[str]:
    """One line per required node whose observed backend differs (or that never ran); empty when all match."""
    problems = []
    for node, backend in required.items():
        ran = observed.nodes.get(node)
        if ran is None:
            problems.append(f"node {node!r}: required backend {backend!r}, observed nothing (the node did not run)")
        elif ran.backend != backend:
            problems.append(
                f"node {node!r}: required backend {backend!r}, observed {ran.backend!r} (kernel {ran.kernel})"
            )
    return problems


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
