"""The verdicts only a whole model's run writes (docs/whole_model.md): what its body ran, each module's accuracy
against float64, the end-to-end error (reported) and the trainer's logprobs against the rollout's (reported)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import pandas as pd
import torch

from rlsweep.divergence import innermost
from rlsweep.mismatch import METRICS
from rlsweep.model_cells import ROLLOUT_CELLS, TRAINER_CELL, mismatch_values
from rlsweep.verdicts import FORWARD_TENSORS, NO_CELL, REPORTED_ONLY, Judgment, Verdict

BODY = "body"  # the tensor column of a whole model's body provenance rows (the head's have "")
MODULES = "modules"  # the tensor column of a bitwise body's per-cell module invariance rows
ROW_LOCAL = "row_local"  # the tensor column of every body's per-cell row-local module invariance rows
END_TO_END = "end_to_end"  # the tensor column of the reported end-to-end error row
DATAFLOW = "dataflow"  # the tensor column of each cell's row on the glue between modules (rlsweep.dataflow)
# rlsweep.module_accuracy's op classes: one verdict each, in every cell
MODULE_OP_CLASSES = ("linear", "rmsnorm", "rotary", "activation", "attention")
# A profile's body_attention -> the attention function transformers must call, and the ops (any one of them) it must
# reach: a dispatcher op, or the invariant body's Triton kernel (compiled, or its interpreter form).
ATTENTION_RAN = {
    "eager": ("eager_attention_forward", ("aten::softmax",)),
    "sdpa": ("sdpa_attention_forward", ("aten::scaled_dot_product_attention",)),
    "invariant": ("invariant_attention", ("kernels.body_kernels.attention_kernel",
                                          "kernels.body_kernels.attention_heads_kernel")),
}  # fmt: skip
SDPA_OP = ATTENTION_RAN["sdpa"][1][0]
# The aten ops the invariant body may run: integer bookkeeping of its attention tiles (kernels.body.key_ranges,
# attention_tiles) and of the rotary table's position check. Any other matmul or reduction the dispatcher saw is a
# module the invariant ops did not replace (a stock linear's mm, an RMSNorm's mean, sdpa): red.
INVARIANT_INDEX_OPS = frozenset({
    "aten::sum", "aten::argmax", "aten::cummax", "aten::cumsum", "aten::scatter_reduce_", "aten::index_add_",
    "aten::min", "aten::max",
})  # fmt: skip


def body_provenance_verdict(cell: str, declared: str, attention: Sequence[str], ops: Sequence[str]) -> Verdict:
    """What the body ran in ``cell`` against the profile's ``body_attention``: transformers may fall back to another
    implementation without a word, so the function it called (``model_cells.watching_attention``) and the ops the
    dispatcher saw decide, not the config."""
    function, needed = ATTENTION_RAN[declared]
    ran = list(dict.fromkeys(attention))
    problems = []
    if not ran:
        problems.append("no attention function of transformers' registry was called (another path ran attention)")
    other = [name for name in ran if name.rsplit(".", 1)[-1] != function]
    if other:
        problems.append(f"attention ran {other}, not {function}")
    if not any(op in ops for op in needed):
        problems.append(f"{' or '.join(needed)} never ran")
    if declared != "sdpa" and SDPA_OP in ops:
        problems.append(f"{SDPA_OP} ran")
    stock = [op for op in ops if op.startswith("aten::") and op not in INVARIANT_INDEX_OPS]
    if declared == "invariant" and stock:
        problems.append(f"the invariant body ran stock ops {stock} (a module its ops did not replace)")
    detail = f"body_attention={declared}: attention ran {ran or 'nothing'}; ops {', '.join(ops) or 'none'}"
    return Verdict(Judgment.PROVENANCE, BODY, "candidate", "body_attention", cell, NO_CELL, metric="mismatches",
                   value=float(len(problems)), threshold=0.0, passed=not problems,
                   detail="; ".join([*problems, detail]))  # fmt: skip


def module_accuracy_verdicts(table: pd.DataFrame, cell: str, roles: tuple[str, str]) -> list[Verdict]:
    """One verdict per op class of ``MODULE_OP_CLASSES`` over the modules ``rlsweep.module_accuracy`` judged in
    ``cell``: the largest share of its bound any module used (at most 1 passes); an op class of which no module ran
    is red (nothing was judged)."""
    verdicts = []
    for kind in MODULE_OP_CLASSES:
        rows = table[table.op_class == kind]
        verdict = Verdict(Judgment.MODULE_ACCURACY, kind, *roles, cell, cell, metric="bound_used", value=math.nan,
                          threshold=1.0, passed=False,
                          detail=f"no module of op class {kind} ran in {cell}: nothing was judged")  # fmt: skip
        if len(rows):
            worst = rows.loc[rows.bound_used.idxmax()]
            failing = int((~rows.passed).sum())
            detail = (
                f"{len(rows)} module(s), {failing} over their bound; worst {worst.module} ({worst.module_class}): "
                f"max |error| {worst.max_abs_error:.3g} against float64 of the module, {worst.bound_used:.3g} of its "
                "bound (docs/contract.md#whole-model-modules)"
            )
            if math.isfinite(worst.get("scale_error", math.nan)):  # an attention function's (its bound includes it)
                detail += f"; its scores' scale off by {worst.scale_error:+.2e} relative to the config's"
            verdict = Verdict(Judgment.MODULE_ACCURACY, kind, *roles, cell, cell, metric="bound_used",
                              value=float(worst.bound_used), threshold=1.0, passed=failing == 0,
                              detail=detail)  # fmt: skip
        verdicts.append(verdict)
    return verdicts


def end_to_end_verdict(error: Mapping[str, float] | str, cell: str, roles: tuple[str, str]) -> Verdict:
    """The reported end-to-end error of ``cell``'s logp against a float64 forward of the same weights (``error``:
    ``rlsweep.module_accuracy.end_to_end_error``'s, or why it was not computed): no bound is proven for it."""
    if isinstance(error, str):
        value, about = math.nan, f"not computed: {error}"
    else:
        value = error["max_abs_error"]
        about = f"over {error['tokens']} judged tokens, mean |error| {error['mean_abs_error']:.3g}"
    return Verdict(Judgment.MODULE_ACCURACY, END_TO_END, *roles, cell, cell, metric="max_abs_error", value=value,
                   threshold=math.nan, passed=True,
                   detail=f"{REPORTED_ONLY}: no bound is proven for the whole forward; logp against a float64 forward "
                          f"of the same weights, each sequence alone, {about}")  # fmt: skip


def trainer_rollout_verdicts(
    logp: Mapping[str, torch.Tensor], active: torch.Tensor, sample_ids: torch.Tensor, clip: tuple[float, float],
    roles: tuple[str, str],
) -> list[Verdict]:  # fmt: skip
    """verl's mismatch metrics of the trainer's cell against each rollout cell the run computed (``logp`` by cell,
    every token in logical order; the judged ones are ``active``): one reported row per (rollout cell, metric name)."""
    trainer = logp[TRAINER_CELL][active]
    verdicts = []
    for cell in rollout_cells(logp):
        values, count = mismatch_values(trainer, logp[cell][active], sample_ids[active], clip)
        about = f"{REPORTED_ONLY}: {TRAINER_CELL} (trainer) against {cell} (rollout) over {count} judged tokens"
        verdicts += [Verdict(Judgment.TRAINER_ROLLOUT, "logp", *roles, cell, TRAINER_CELL, metric=name, value=value,
                             threshold=math.nan, passed=True, detail=about) for name, value in values]  # fmt: skip
    return verdicts


def module_invariance_verdict(cell: str, table: pd.DataFrame, canonical: str, roles: tuple[str, str]) -> Verdict:
    """``forward_invariance`` of tensor ``modules`` for a body that claims every module bitwise: in ``table`` (the
    divergence rows of ``cell`` against ``canonical``), every module gave every token both cells computed the bits it
    gave it in ``canonical``. No module recorded is red: nothing was compared."""
    moved = table[table.tokens_differing > 0]
    first = table[table.first_diverging]
    if not len(table):
        detail = f"no module of the body was recorded in both {cell} and {canonical}: nothing was compared"
    elif not len(moved):
        detail = f"all {len(table)} modules' outputs bitwise equal to {canonical}'s on the tokens both computed"
    else:
        named = first.iloc[0] if len(first) else moved.iloc[0]
        detail = (
            f"{len(moved)} of {len(table)} modules' outputs differ from {canonical}'s; first diverging module "
            f"{named.module} ({named.module_class}): {named.tokens_differing} of {named.tokens} tokens, max |diff| "
            f"{named.max_abs_diff:.3g} (divergence table)"
        )
    return Verdict(Judgment.FORWARD_INVARIANCE, MODULES, *roles, cell, canonical, metric="modules_differing",
                   value=float(len(moved)), threshold=0.0, passed=bool(len(table)) and not len(moved),
                   detail=detail)  # fmt: skip


def row_local_verdict(cell: str, compared: int, mismatches: Sequence[Mapping], canonical: str,
                      roles: tuple[str, str]) -> Verdict:  # fmt: skip
    """``forward_invariance`` of tensor ``row_local``: what acts row by row in the body (its row-local modules, and the
    glue of the modules around its attention: ``rlsweep.divergence.row_local_mismatches``) gave each token whose inputs
    are bitwise equal in ``cell`` and ``canonical`` equal bits. Judged whatever the logprobs did: a profile whose
    attention is declared to move every cell still owes it of its linear layers, norms, MLPs and the residual adds
    between them. ``compared``: the modules compared on some token; none is red."""
    if not compared:
        detail = f"no module of the body got an input row bitwise equal in {cell} and {canonical}: nothing was compared"
    elif not mismatches:
        detail = f"all {compared} modules that act row by row gave equal input rows the bits they gave in {canonical}"
    else:  # named: the first to run of those with no other inside them (an MLP's act_fn, not the MLP around it)
        leaves = innermost([m["module"] for m in mismatches])
        first = next(m for m in mismatches if m["module"] in leaves)
        size = "" if math.isnan(first["max_abs_diff"]) else f", max |diff| {first['max_abs_diff']:.3g}"
        part = "its output" if first["part"] == "output" else f"the {first['part']}"
        detail = (
            f"{len(mismatches)} of {compared} modules that act row by row gave equal input rows other bits than in "
            f"{canonical}; first {first['module']} ({first['module_class']}), {part}: {first['tokens_differing']} of "
            f"{first['tokens_equal_inputs']} tokens with equal inputs{size}"
        )
    return Verdict(Judgment.FORWARD_INVARIANCE, ROW_LOCAL, *roles, cell, canonical, metric="modules_differing",
                   value=float(len(mismatches)), threshold=0.0, passed=bool(compared) and not mismatches,
                   detail=detail)  # fmt: skip


def naming_first_modules(verdicts: Sequence[Verdict], divergence: pd.DataFrame | None) -> list[Verdict]:
    """``verdicts`` with each failed forward_invariance row of a cell the divergence table covers naming, in its
    detail, that cell's first diverging module: the row a user reads says where the bits first moved."""
    if divergence is None or not len(divergence):
        return list(verdicts)
    first = divergence[divergence.first_diverging].set_index("cell")
    named = []
    for verdict in verdicts:
        if verdict.judgment == Judgment.FORWARD_INVARIANCE and not verdict.passed and verdict.tensor in FORWARD_TENSORS:
            if verdict.lhs_cell in first.index:
                module = first.loc[verdict.lhs_cell]
                where = (
                    f"first diverging module {module.module} ({module.module_class}): {module.tokens_differing} of "
                    f"{module.tokens} tokens, max |diff| {module.max_abs_diff:.3g} (divergence table)"
                )
            else:
                where = (
                    "the divergence table names no first diverging module (no module with equal inputs and a "
                    "differing output)"
                )
            verdict = replace(verdict, detail=f"{verdict.detail}; {where}")
        named.append(verdict)
    return named


def rollout_cells(cells: Sequence[str] | Mapping[str, object]) -> list[str]:
    """The rollout cells among ``cells``, in ``ROLLOUT_CELLS``' order."""
    return [cell for cell in ROLLOUT_CELLS if cell in cells]


def reported_keys(cells: Sequence[str]) -> set[tuple[str, str, str, str]]:
    """The plan keys (``judgments.plan_key``) of the reported rows a whole model's run over ``cells`` writes."""
    keys = {(Judgment.MODULE_ACCURACY, END_TO_END, cells[0], "")}
    return keys | {(Judgment.TRAINER_ROLLOUT, "logp", cell, name) for cell in rollout_cells(cells)
                   for metric in METRICS for name in metric.names}  # fmt: skip
