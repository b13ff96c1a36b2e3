"""One run: config -> workload -> layout cells -> kernel calls -> judgments -> tables (the manifest: rlsweep.job)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
import torch

import kernels
from rlsweep.arithmetic import ArithmeticCollector, ComparandCache, judges_logits
from rlsweep.environment import available_memory, environment
from rlsweep.errors import ConfigError, RlsweepError
from rlsweep.execute import CellResult, Filler, check_fits, peak_bytes, run_cell, run_reference
from rlsweep.exitcodes import ExitCode
from rlsweep.judgments import (
    CellGold,
    Standard,
    apply_expected,
    contract_verdict,
    declaration_rows,
    judge_cells,
    judge_gradients,
    not_run_verdicts,
    planned_verdicts,
    provenance_verdict,
    weight_gradient_accuracy,
    weight_pin_verdict,
)
from rlsweep.layouts import filler_rows_needed, plan_cells
from rlsweep.manifest import RunIdentity
from rlsweep.model import build_lm_head, check_weight_file, config_fingerprint
from rlsweep.model_cells import replayed_workload
from rlsweep.model_judgments import naming_first_modules
from rlsweep.model_run import compute_whole_model
from rlsweep.planned import plan_problems
from rlsweep.records import checks_table, divergence_table, tokens_table
from rlsweep.sensitivity import refuse_blind_inputs
from rlsweep.spec import EXECUTION_DTYPES, ProfileSpec, RunSpec, interpret_triton_on_cpu, runs_triton_on_cpu
from rlsweep.tables import (
    CHECKS_TABLE,
    DIVERGENCE_TABLE,
    TOKENS_TABLE,
    RunLocation,
    check_writable,
    publish_tables,
    with_metadata,
)
from rlsweep.verdicts import Judgment, Tensor, Verdict, stopped_by_provenance
from rlsweep.workload import build_workload, workload_shape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunOutcome:
    location: RunLocation
    run_id: str
    verdicts: list[Verdict]
    files: dict[str, Path]  # the published table files, by table

    @property
    def unexpected(self) -> list[Verdict]:
        return [verdict for verdict in self.verdicts if not verdict.as_expected]

    @property
    def exit_code(self) -> ExitCode:
        """GREEN when every verdict is as expected, RED otherwise."""
        return ExitCode.RED if self.unexpected else ExitCode.GREEN


def check_distributed_devices(spec: RunSpec) -> None:
    gpus = torch.cuda.device_count()
    if spec.tp_mode == "distributed" and spec.profile.device == "cuda" and gpus < spec.tp:
        raise ConfigError(
            f"tp_mode=distributed with tp={spec.tp} needs {spec.tp} GPUs (one rank each); this machine has {gpus}"
        )


def choose_triton_mode() -> None:
    """Without CUDA, Triton can only run in its interpreter, and that is decided when triton is first imported.

    Called before anything imports triton (``python -m rlsweep`` does it at start), so a multirun that mixes
    profiles in one process gets the interpreter for every Triton job, not only for those after the first.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def prepare_backend(profile: ProfileSpec) -> None:
    """Triton on the CPU runs in its interpreter, on a GPU machine too when nothing has imported triton yet.

    Where triton was already imported in the other mode (a sweep mixing CPU and CUDA Triton profiles in one
    process on a GPU machine), the backend says so and the run's provenance is red, never a silent fallback.
    """
    interpret_triton_on_cpu(profile.backend_family, profile.device)
    if runs_triton_on_cpu(profile.backend_family, profile.device):
        # The interpreter evaluates masked (-inf) lanes too and warns about them; the kernel masks the results.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")


def preflight(spec: RunSpec) -> None:
    """What a valid RunSpec still needs from outside the config: readable input files and room on the device.

    A sweep runs it for each of its jobs before the first one starts (``rlsweep.callbacks``).
    """
    check_weight_file(spec.model)
    if spec.model.body is not None and spec.workload.source == "replay":
        replayed_workload(spec.workload.path, spec.model.vocab_size)  # the head's replay shape reads no token file
    else:
        footprint = peak_bytes(spec, workload_shape(spec.workload, spec.model))
        check_fits(footprint, spec.profile.device, available_memory(spec.profile.device))
    if spec.profile.device != "cuda" or torch.cuda.is_available():  # without CUDA: a red provenance verdict
        check_distributed_devices(spec)


def execute(spec: RunSpec, location: RunLocation, identity: RunIdentity, *, standalone: bool) -> RunOutcome:
    """Run every cell of the layout, judge, write both tables; bad input raises RlsweepError/KernelInputError.

    Everything that needs only the config and the machine is checked before any kernel runs.
    ``standalone``: the run is not a sweep's job, so it judges every declaration itself.
    """
    started = datetime.now(UTC).isoformat()
    preflight(spec)
    contract, profile = spec.contract, spec.profile
    check_writable(location.root)
    required = dict(profile.required_nodes)
    run = {
        "run_id": identity.run_id,
        "profile": profile.name,
        "backend_family": profile.backend_family,
        "device": profile.device,
        "tp": spec.tp,
        "tp_mode": spec.tp_mode,
        "model": spec.model.name,
        "config_fingerprint": config_fingerprint(spec.model),
        "weight_hash": "",
        "workload": spec.workload.name,
        "workload_hash": "",
        "seed": spec.seed,
        "contract_version": contract.version,
        "contract_sha256": contract.sha256,
    }
    verdicts = [contract_verdict(contract)]
    observed: dict[str, Any] = {}
    computed = Computed()
    if profile.device == "cuda" and not torch.cuda.is_available():
        why = (
            f"profile {profile.name!r} requires device 'cuda' but torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}); observed device: cpu; nothing ran, no fallback"
        )
        verdicts.append(computed.stop(provenance_verdict("", required, [], profile.backend_family, error=why)))
    else:
        prepare_backend(profile)
        try:
            op = dispatch(spec)
        except kernels.LogprobDispatchError as err:
            verdicts.append(computed.stop(provenance_verdict("", required, [], profile.backend_family, error=str(err))))
        else:
            observed["dispatch"] = op.to_dict()
            computed = (compute_whole_model if spec.model.body else compute)(spec, op, run, verdicts, observed)
    standard = Standard.of(spec, computed.bound)
    golds = computed.golds or [CellGold(computed.reference, computed.workload, standard)] * len(computed.results)
    judged = judge_cells(computed.results, golds)
    if spec.model.body is not None:
        judged = naming_first_modules(judged, computed.divergence)
    if computed.gradient is not None:
        judged += judge_gradients(computed.results, computed.workload, computed.gradient, standard)
        judged += computed.weight_verdicts
    verdicts += judged
    if computed.stopped:
        planned = planned_verdicts(spec.layout.cell_names, contract, grad=spec.grad, logits=judges_logits(spec),
                                   tensors=profile.tensors, whole_model=spec.model.body is not None,
                                   bitwise_body=spec.bitwise_body)  # fmt: skip
        verdicts += not_run_verdicts(verdicts, planned, stopped_by_provenance(computed.stopped))  # judged: not again
    verdicts = apply_expected(verdicts, spec.expectations)
    verdicts += declaration_rows(verdicts, spec.declarations, profile.name, spec.tp, standalone=standalone)
    metadata = {
        "config": dict(spec.config),
        "contract": dict(contract.document),
        "observed_provenance": observed,
        "environment": environment(profile.device),
        "identity": {"content_sha256": identity.content_sha256, "inputs": dict(identity.inputs)},
        "started": started,
        "finished": datetime.now(UTC).isoformat(),
    }
    tokens = tokens_table(run, computed.results, golds, computed.gradient)
    checks = checks_table(run, verdicts)
    # What the gate will hold the table to, held to before it is written: a verdict the harness lost is its fault.
    problems = plan_problems(spec.config, contract, checks.to_pandas(), standalone=standalone)
    if problems:
        raise RlsweepError(f"the run's verdicts are not the ones its config plans (a harness fault): {problems[0]}")
    divergence = divergence_table(run, computed.divergence)
    files = publish_tables(location, {TOKENS_TABLE: with_metadata(tokens, metadata),
                                      CHECKS_TABLE: with_metadata(checks, metadata),
                                      DIVERGENCE_TABLE: with_metadata(divergence, metadata)})  # fmt: skip
    return RunOutcome(location, run["run_id"], verdicts, files)


def dispatch(spec: RunSpec) -> kernels.LogprobOp:
    """The profile's backend bound to the logprob contract the profile declares; its capability gates it."""
    profile = spec.profile
    reduction = kernels.ReductionSpec(spec.sharding.vocab_tile, profile.determinism_scope, profile.merge_order)
    output = kernels.LogprobOutputSpec(export_lse=Tensor.LSE in profile.tensors)
    contract = kernels.LogprobContract(spec.sharding, reduction, profile.execution_dtype, profile.device, output=output)
    return kernels.get_logprob_op(contract, profile.backend_family, tp_mode=spec.tp_mode)


@dataclass
class Computed:
    """What the kernels produced: every cell's results (logical order), the float64 reference, the workload,
    the rounding model's bounds {"logp", "lse"} -> [T], and why provenance stopped the cells ("" if not)."""

    results: list[CellResult] = field(default_factory=list)
    reference: CellResult | None = None
    workload: Any = None
    bound: dict[str, torch.Tensor] = field(default_factory=dict)
    stopped: str = ""
    upstream: torch.Tensor | None = None  # grad=true: the gradient sent back to each token's logp [T]
    gradient: kernels.GradientBound | None = None  # grad=true: float64 gradients and their bounds
    weight_verdicts: list[Verdict] = field(default_factory=list)  # grad=true: each cell's d weight, judged as it ends
    golds: list[CellGold] = field(default_factory=list)  # a whole model's: each cell's own (else one for every cell)
    divergence: pd.DataFrame | None = None  # a whole model's modules in the cells that broke invariance

    def stop(self, verdict: Verdict) -> Verdict:
        """Provenance stopped the kernels: the red provenance ``verdict`` says why, and so does every verdict that was
        not run (``stopped_by_provenance``), in the same words, so that a reader groups them as one cause."""
        self.stopped = verdict.detail
        return verdict


def compute(
    spec: RunSpec, op: kernels.LogprobOp, run: dict[str, Any], verdicts: list[Verdict], observed: dict[str, Any]
) -> Computed:
    """Head, workload, the reference, the bounds and every cell through ``op``; provenance verdicts as they come."""
    profile = spec.profile
    required = dict(profile.required_nodes)
    head = build_lm_head(spec.model, dtype=profile.dtype, device=torch.device(profile.device))
    run["weight_hash"] = head.weight_hash
    verdicts.append(weight_pin_verdict(spec.model.weight_sha256, head.weight_hash))
    workload = build_workload(spec.workload, spec.model, head.weight, seed=spec.seed, dtype=profile.dtype)
    run["workload_hash"] = workload.sha256
    cells = plan_cells(spec.layout, workload)
    filler = Filler(*workload.filler(filler_rows_needed(cells), spec.model.vocab_size))
    computed = Computed(workload=workload)
    computed.reference = run_reference(cells[0], workload, head.weight, filler, spec.sharding.vocab_tile)
    observed["reference"] = unique_provenance(computed.reference)
    bound = kernels.rounding_bound(
        workload.hidden, head.weight, workload.targets, logits_dtype=EXECUTION_DTYPES[profile.logits_name]
    )
    computed.bound = {"logp": bound.logp, "lse": bound.lse}
    standard = Standard.of(spec, computed.bound)
    judged = [Judgment.FORWARD_ACCURACY] + [Judgment.FORWARD_INVARIANCE] * (len(cells) > 1)
    logp_rows = [standard.row(judgment, Tensor.LOGP) for judgment in judged]
    refuse_blind_inputs(spec, workload, bound.spread, computed.reference.logp, logp_rows, bound.logp)
    if spec.grad:
        computed.upstream = workload.upstream()
        g = computed.upstream.to(workload.hidden.device)
        gradient_bound = partial(
            kernels.gradient_bound, workload.hidden, head.weight, workload.targets, g, torch.zeros_like(g),
            logits_dtype=EXECUTION_DTYPES[profile.logits_name], lse_bound=bound.lse,
        )  # fmt: skip
        computed.gradient = gradient_bound()
    # Distributed ranks are spawned once per run and serve every call of every cell.
    ranks = (
        kernels.distributed_ranks(profile.backend_family, spec.sharding, profile.device)
        if spec.tp_mode == "distributed"
        else contextlib.nullcontext()
    )
    collect = partial(
        ArithmeticCollector, head.weight, workload.num_tokens, tokens=int(workload.active.sum()),
        vocab_tile=spec.sharding.vocab_tile, logits_dtype=EXECUTION_DTYPES[profile.logits_name],
        failure_probability=spec.contract.failure_probability, shared=ComparandCache(workload.num_tokens),
    )  # fmt: skip
    with ranks:
        for number, cell in enumerate(cells, start=1):
            log.info("cell %d/%d %s: %d kernel calls", number, len(cells), cell.name, len(cell.calls))
            # The matmul is judged on the canonical cell: another cell's logits differ only where forward_invariance
            # is red. The reduction is judged in every cell, on the logits each call stored.
            arithmetic = (
                collect(judge_logits=number == 1 and judges_logits(spec))
                if spec.contract.judges_kernel_arithmetic
                else None
            )
            try:
                result = run_cell(cell, workload, head.weight, filler, op, computed.upstream, arithmetic)
            except kernels.BackendUnavailableError as err:
                verdict = provenance_verdict(cell.name, required, [], profile.backend_family, error=str(err))
                verdicts.append(computed.stop(verdict))
                break
            except kernels.ProvenanceMismatchError as err:
                ran = [err.observed]
                verdict = provenance_verdict(cell.name, required, ran, profile.backend_family, error=str(err))
                verdicts.append(computed.stop(verdict))
                break
            if computed.gradient is not None:
                # A cell of several calls rounds each call's d weight on its own and sums them: a bound of its own.
                gold = computed.gradient if len(cell.calls) == 1 else gradient_bound(calls=cell.call_tokens)
                # Judged now and dropped: a run holds one cell's d weight [V, H] at a time, and keeps its digest.
                computed.weight_verdicts.append(weight_gradient_accuracy(result, gold, standard))
                result = replace(result, grad_weight=None)
            computed.results.append(result)
    for result in computed.results:
        observed[result.cell.name] = unique_provenance(result)
        verdicts.append(provenance_verdict(result.cell.name, required, result.provenance, profile.backend_family))
    return computed


def unique_provenance(result: CellResult) -> list[dict[str, Any]]:
    """The distinct provenance records of a cell's calls (usually one)."""
    seen: dict[str, dict[str, Any]] = {}
    for provenance in result.provenance:
        record = provenance.to_dict()
        seen.setdefault(json.dumps(record, sort_keys=True, default=str), record)
    return list(seen.values())
