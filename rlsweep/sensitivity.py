"""Inputs on which some verdict could fail: one rule for weight files, captures and synthetic values alike.

A logp is the row's target logit minus its log-sum-exp, so it lies within the spread of the row's logits (max - min)
of -log(V), the answer of a kernel that ignored its inputs. A token can be judged only where that spread exceeds the
smallest difference one of its verdicts can see: what forward_accuracy allows its logp, or, where the run compares
cells bitwise, one fp32 ulp of the logp (docs/contract.md#inputs-on-which-a-verdict-can-fail). Inputs on which no
active token can be judged (all-zero or identical head rows, zero hidden states, values scaled far down) are refused
before any kernel runs.
"""

from __future__ import annotations

import torch

from rlsweep.contract import Tolerance
from rlsweep.errors import ReplayInputError
from rlsweep.spec import RunSpec
from rlsweep.workload import Workload

OUTPUT_DTYPE = torch.float32  # what the kernels return logp and lse in


def inputs_named(spec: RunSpec) -> str:
    """The run's inputs as a user set them: the head's weight source and the workload's."""
    weights, workload = spec.model.weights, spec.workload
    head = f"model.weights.path={weights.path}" if weights.path else f"model.weights.logit_std={weights.logit_std:g}"
    tokens = f"workload.path={workload.path}" if workload.path else f"workload.hidden_scale={workload.hidden_scale:g}"
    return f"{head}, {tokens}"


def smallest_visible(row: Tolerance, reference: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """reference[T] -> float64 [T]: the smallest |candidate - reference| that ``row`` fails; for a bitwise row one ulp
    of the value in the kernels' output dtype, the least by which two outputs can differ."""
    if row.mode == "bitwise":
        value = reference.to(OUTPUT_DTYPE).abs()
        return (torch.nextafter(value, torch.full_like(value, torch.inf)) - value).double()
    return row.allowance(reference, bound)


def refuse_blind_inputs(
    spec: RunSpec, workload: Workload, spread: torch.Tensor, reference_logp: torch.Tensor, rows: list[Tolerance],
    bound: torch.Tensor,
) -> None:  # fmt: skip
    """Raise where no active token's logit spread[T] exceeds the smallest difference one of ``rows`` (the run's logp
    rows) can see, given the reference logp[T] and the rounding model's bound[T] (logical order, on the CPU)."""
    reference, spread, bound = reference_logp.double().cpu(), spread.double().cpu(), bound.double().cpu()
    visible = torch.stack([smallest_visible(row, reference, bound) for row in rows]).amin(dim=0)
    active = workload.active.cpu()
    if bool((spread > visible)[active].any()):
        return
    widest = int(torch.where(active, spread, -1.0).argmax())
    raise ReplayInputError(
        f"{inputs_named(spec)}: no verdict could fail on these inputs: on every active token the spread of the "
        f"float64 logits is within the smallest difference a verdict can see (widest {float(spread[widest]):.3g} "
        f"at sample_id={int(workload.sample_ids[widest])}, position={int(workload.positions[widest])}, where "
        f"{float(visible[widest]):.3g} goes unseen), so a kernel that ignored them and gave logp = "
        f"-log({spec.model.vocab_size}) would pass: use inputs whose logits differ more (an all-zero or repeated "
        "head, zero hidden states or values scaled far down give this)"
    )
