"""A whole model's run (docs/whole_model.md): its body in every layout cell, each cell's hidden states through the
profile's head, and the verdicts only a whole model has; ``rlsweep.run.execute`` judges and writes the rest.

Each cell feeds the head its own hidden states, so each has its own float64 reference of the head and its own
bounds (``CellGold``): the head's accuracy is judged on what it was given, and the whole model's logp bitwise across
cells (``forward_invariance``). A cell whose logp or lse bits differ from the canonical cell's gets the divergence
rows of every module of the body (``rlsweep.divergence``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import pandas as pd
import torch

import kernels
from rlsweep.arithmetic import ArithmeticCollector, ComparandCache, judges_logits
from rlsweep.environment import available_memory
from rlsweep.errors import ConfigError
from rlsweep.execute import CellResult, Filler, run_cell, run_reference
from rlsweep.hf_model import BuiltModel, build_model
from rlsweep.judgments import CellGold, Standard, invariance_roles, provenance_verdict, weight_pin_verdict
from rlsweep.layouts import Cell, logical_call
from rlsweep.model_cells import (
    TokenWorkload,
    cell_hidden,
    observing_body,
    replayed_workload,
    token_workload,
)
from rlsweep.model_judgments import (
    body_provenance_verdict,
    end_to_end_verdict,
    module_accuracy_verdicts,
    module_invariance_verdict,
    row_local_verdict,
    trainer_rollout_verdicts,
)
from rlsweep.module_accuracy import (
    accuracy_table,
    end_to_end_error,
    layout_calls,
    module_accuracy,
    recorded_calls,
    unrecorded_paths,
)
from rlsweep.spec import DECODE_PARITY_ROLES, EXECUTION_DTYPES, RunSpec
from rlsweep.tables import DIVERGENCE_COLUMNS
from rlsweep.verdicts import Judgment, Verdict
from rlsweep.workload import Workload

log = logging.getLogger(__name__)
FLOAT64_COPIES = 4  # the end-to-end reference holds the model in float64 (8 bytes a parameter) and its activations


def build(spec: RunSpec) -> BuiltModel:
    """The profile's model on its device, its head's geometry checked against the model config's."""
    profile, model = spec.profile, spec.model
    built = build_model(model.body, dtype=profile.dtype, attention=profile.body_attention, device=profile.device,
                        packing=profile.body_packing)  # fmt: skip
    vocab, hidden = built.head_weight.shape
    if (vocab, hidden) != (model.vocab_size, model.hidden_size):
        raise ConfigError(
            f"model {model.name!r}: model.vocab_size={model.vocab_size} and model.hidden_size={model.hidden_size}, "
            f"but its lm_head.weight is [{vocab}, {hidden}]; set them to the model's"
        )
    return built


def tokens_of(spec: RunSpec, built: BuiltModel) -> TokenWorkload:
    """The run's token workload: prompts from the seed and responses sampled from the model, or a replayed file."""
    workload = spec.workload
    if workload.source == "replay":
        return replayed_workload(workload.path, spec.model.vocab_size)
    responses = [n - p for n, p in zip(workload.seq_lens, workload.prompt_lens, strict=True)]
    return token_workload(built, spec.seed, list(workload.prompt_lens), responses)


def head_workload(spec: RunSpec, tokens: TokenWorkload, hidden: torch.Tensor) -> Workload:
    """The head's inputs of one cell: its hidden states [T, H] in logical order and the next-token targets."""
    sample_ids = torch.cat([torch.full((n,), s, dtype=torch.int64) for s, n in enumerate(tokens.seq_lens)])
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in tokens.seq_lens])
    targets = torch.cat(tokens.targets())
    active = targets != kernels.IGNORE_INDEX
    return Workload(spec.workload.name, spec.seed, sample_ids, positions, hidden, targets.to(hidden.device), active,
                    active.clone(), tokens.seq_lens)  # fmt: skip


def compute_whole_model(spec: RunSpec, op: kernels.LogprobOp, run: dict[str, Any], verdicts: list[Verdict],
                        observed: dict[str, Any]):  # fmt: skip
    """The model, its workload and every cell through ``op``; provenance, module and trainer-rollout verdicts as
    they come. Returns ``rlsweep.run.Computed`` with a gold per cell and the divergence rows."""
    from rlsweep.dataflow import dataflow_verdict
    from rlsweep.divergence import divergence, equalities, row_local_mismatches
    from rlsweep.recording import recording
    from rlsweep.run import Computed, unique_provenance

    profile, contract = spec.profile, spec.contract
    required = dict(profile.required_nodes)
    built = build(spec)
    run["config_fingerprint"], run["weight_hash"] = built.config_fingerprint, built.weights_hash
    verdicts.append(weight_pin_verdict(spec.model.weight_sha256, built.weights_hash))
    tokens = tokens_of(spec, built)
    run["workload_hash"] = tokens.sha256
    weight, cells = built.head_weight, spec.layout.cell_names
    nothing = Filler(weight.new_zeros((0, weight.shape[1])), torch.zeros(0, dtype=torch.int64, device=weight.device))
    logits_dtype = EXECUTION_DTYPES[profile.logits_name]
    computed = Computed()
    observed["body"] = {}
    canonical_records, unrecorded, tables, known = None, frozenset(), [], None
    token_ids, accuracy_roles = torch.cat(tokens.sequences), contract.roles_for(Judgment.FORWARD_ACCURACY)
    for number, name in enumerate(cells, start=1):
        log.info("cell %d/%d %s: the body, then the head", number, len(cells), name)
        # Every module is recorded in the same pass (its copies left out of the provenance), for the divergence rows
        # of a cell that moves, or of every cell for a body that claims every module bitwise, and judged against
        # float64 in a cell after the first; so are the attention and RoPE calls of such a cell, judged against what
        # its layout says (the canonical cell's modules are judged below in a pass of their own, with the softmaxes
        # inside attention).
        laid_out = layout_calls(built, unrecorded) if number > 1 else contextlib.nullcontext([])
        # The recording inside the body's observation: the attention function it wraps is the one observed.
        with observing_body(built) as seen, recording(built) as records, laid_out as layout:
            hidden = torch.cat(cell_hidden(built, tokens, name, chunk_size=spec.layout.chunk_size))
        observed["body"][name] = seen
        verdicts.append(body_provenance_verdict(name, profile.body_attention, seen["attention"], seen["kernels"]))
        verdicts.append(dataflow_verdict(built, records, token_ids, name, accuracy_roles))
        workload = head_workload(spec, tokens, hidden)
        cell = Cell(name, (logical_call([torch.arange(workload.num_tokens)]),))
        arithmetic = None
        if contract.judges_kernel_arithmetic:
            arithmetic = ArithmeticCollector(
                weight, workload.num_tokens, tokens=int(workload.active.sum()), vocab_tile=spec.sharding.vocab_tile,
                logits_dtype=logits_dtype, failure_probability=contract.failure_probability,
                shared=ComparandCache(workload.num_tokens), judge_logits=number == 1 and judges_logits(spec),
            )  # fmt: skip
        try:
            result = run_cell(cell, workload, weight, nothing, op, None, arithmetic)
        except (kernels.BackendUnavailableError, kernels.ProvenanceMismatchError) as err:
            ran = [err.observed] if isinstance(err, kernels.ProvenanceMismatchError) else []
            verdicts.append(computed.stop(provenance_verdict(name, required, ran, profile.backend_family,
                                                             error=str(err))))  # fmt: skip
            break
        bound = head_bound(hidden, weight, workload.targets, logits_dtype, known)
        standard = Standard.of(spec, {"logp": bound.logp, "lse": bound.lse})
        reference = run_reference(cell, workload, weight, nothing, spec.sharding.vocab_tile)
        computed.results.append(result)
        computed.golds.append(CellGold(reference, workload, standard))
        if number > 1:
            judged = [*layout, *recorded_calls(built, records)]
            verdicts += module_accuracy_verdicts(accuracy_table(built, judged), name, accuracy_roles)
            # Whatever the logprobs did: a row-local module owes an equal input row its bits in every layout.
            equality = equalities(canonical_records, records)  # the row_local verdict's and the divergence table's
            mismatches = row_local_mismatches(canonical_records, records, equality=equality)
            verdicts.append(row_local_verdict(name, *mismatches, cells[0],
                                              contract.roles_for(invariance_roles(name))))  # fmt: skip
        del layout
        if number == 1:
            canonical_records, unrecorded = records, unrecorded_paths(built, records)
            known = (hidden, workload.targets, bound)
        elif spec.bitwise_body or differs(result, computed.results[0]):
            tables.append(divergence(canonical_records, records, cell=name, canonical_cell=cells[0],
                                     equality=equality))  # fmt: skip
        del records  # freed before the next cell records its own
        equality = None  # and the rows its comparison with the canonical cell kept
    if computed.stopped:
        return computed
    for result in computed.results:
        observed[result.cell.name] = unique_provenance(result)
        verdicts.append(provenance_verdict(result.cell.name, required, result.provenance, profile.backend_family))
    canonical, gold = computed.results[0], computed.golds[0]
    computed.workload, computed.reference, computed.bound = gold.workload, gold.reference, gold.standard.bound
    verdicts += module_accuracy_verdicts(module_accuracy(built, tokens, cells[0]), cells[0], accuracy_roles)
    active = gold.workload.active
    verdicts.append(end_to_end_verdict(reported_error(spec, built, tokens, canonical.logp[active]), cells[0],
                                       accuracy_roles))  # fmt: skip
    logp = {result.cell.name: result.logp for result in computed.results}
    verdicts += trainer_rollout_verdicts(logp, active, gold.workload.sample_ids, contract.clip_interval,
                                         contract.roles_for(DECODE_PARITY_ROLES))  # fmt: skip
    if tables:
        computed.divergence = pd.concat(tables, ignore_index=True)
    if spec.bitwise_body:
        table = (
            computed.divergence if computed.divergence is not None else pd.DataFrame(columns=list(DIVERGENCE_COLUMNS))
        )
        verdicts += [module_invariance_verdict(name, table[table.cell == name], cells[0],
                                               contract.roles_for(invariance_roles(name)))
                     for name in cells[1:]]  # fmt: skip
    return computed


def head_bound(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    logits_dtype: torch.dtype,
    known: tuple[torch.Tensor, torch.Tensor, kernels.RoundingBound] | None,
) -> kernels.RoundingBound:
    """The head's rounding bound of each row of ``hidden`` (``kernels.rounding_bound``, a function of the row and its
    target alone): a row bitwise equal to the canonical cell's, with the same target, takes that cell's bound
    (``known``: its hidden, targets and bound); the others are computed. A body whose every cell gives the canonical
    cell's bits computes it once."""
    if known is None or known[0].shape != hidden.shape or known[0].dtype != hidden.dtype:
        return kernels.rounding_bound(hidden, weight, targets, logits_dtype=logits_dtype)
    canonical_hidden, canonical_targets, canonical = known
    same = ~(kernels.bit_view(hidden) != kernels.bit_view(canonical_hidden)).any(dim=1) & (targets == canonical_targets)
    if bool(same.all()):
        return canonical
    moved = (~same).nonzero()[:, 0]
    part = kernels.rounding_bound(hidden[moved], weight, targets[moved], logits_dtype=logits_dtype)
    rows, merged = moved.cpu(), {}
    for field in ("logp", "lse", "spread"):
        merged[field] = getattr(canonical, field).clone()
        merged[field][rows] = getattr(part, field)
    return kernels.RoundingBound(**merged)


def differs(result: CellResult, canonical: CellResult) -> bool:
    """Whether any token's logp or lse bits differ between two cells (NaNs of equal bits are equal)."""
    return any(
        not torch.equal(kernels.bit_view(getattr(result, t)), kernels.bit_view(getattr(canonical, t)))
        for t in ("logp", "lse")
    )


def reported_error(spec: RunSpec, built: BuiltModel, tokens: TokenWorkload, logp: torch.Tensor) -> dict | str:
    """``end_to_end_error`` of the canonical cell's judged ``logp``, or why it was not computed: its float64 copy of
    the model would not fit beside the run, or the model's forward has an op with no float64 kernel (an MoE's grouped
    matmul). The row is reported, never judged, so the run's verdicts stand either way."""
    parameters = sum(p.numel() for p in built.model.parameters())
    needed = FLOAT64_COPIES * 8 * parameters
    available = available_memory(spec.profile.device)
    if available is not None and needed > available[0] // 2:
        return (
            f"a float64 copy of {parameters} parameters needs about {needed >> 20} MiB, over half of the {available[1]}"
        )
    return end_to_end_error(built, tokens, logp)
