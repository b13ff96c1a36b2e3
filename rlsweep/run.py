"""One run: config -> workload -> layout cells -> kernel calls -> judgments -> tables (the manifest: rlsweep.job)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

import kernels
from rlsweep.config import DEVICES, check_complete
from rlsweep.contract import DETERMINISM_SCOPES, Contract, contract_from_mapping, op_class
from rlsweep.environment import available_memory, environment
from rlsweep.errors import ConfigError
from rlsweep.execute import CellResult, Filler, check_fits, peak_bytes, run_cell, run_reference
from rlsweep.exitcodes import ExitCode
from rlsweep.judgments import (
    Standard,
    Verdict,
    apply_expected,
    chain_aggregates,
    check_expected,
    contract_needs,
    contract_verdict,
    declaration_rows,
    expectations_for,
    forward_accuracy,
    forward_invariance,
    not_run_verdicts,
    planned_verdicts,
    provenance_verdict,
    smoke,
    weight_pin_verdict,
)
from rlsweep.layouts import cell_names, filler_rows_needed, plan_cells
from rlsweep.manifest import RunIdentity
from rlsweep.model import build_lm_head, check_geometry, check_vocab_tile, config_fingerprint
from rlsweep.synthetic import check_seed
from rlsweep.tables import (
    CHECKS_SCHEMA,
    CHECKS_TABLE,
    TOKENS_SCHEMA,
    TOKENS_TABLE,
    RunLocation,
    build_table,
    check_writable,
    publish_tables,
    with_metadata,
)
from rlsweep.workload import build_workload, workload_shape

log = logging.getLogger(__name__)
EXECUTION_DTYPES = {kernels.dtype_name(dtype): dtype for dtype in kernels.EXECUTION_DTYPES}
MAX_TP = 256  # the most ranks one run emulates or launches


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


def validate(cfg: DictConfig) -> None:
    """Everything that can be rejected before any tensor is made, with the offending value named."""
    check_complete(cfg)
    profile = cfg.profile
    if cfg.tp < 1:
        raise ConfigError(f"tp must be an integer >= 1, got {cfg.tp!r}")
    if cfg.tp_mode not in kernels.TP_MODES:
        raise ConfigError(f"tp_mode={cfg.tp_mode!r} is not one of {', '.join(kernels.TP_MODES)}")
    if profile.backend_family not in kernels.BACKENDS or profile.backend_family == "reference":
        families = sorted(set(kernels.BACKENDS) - {"reference"})
        raise ConfigError(
            f"profile {profile.name!r}: backend_family={profile.backend_family!r} is not one of {families}"
        )
    checks = {
        "device": (profile.device, DEVICES),
        "execution_dtype": (profile.execution_dtype, tuple(EXECUTION_DTYPES)),
        "logits_dtype": (profile.logits_dtype or profile.execution_dtype, tuple(EXECUTION_DTYPES)),
        "determinism_scope": (profile.determinism_scope, DETERMINISM_SCOPES),
    }
    for key, (value, valid) in checks.items():
        if value not in valid:
            raise ConfigError(f"profile {profile.name!r}: {key}={value!r} is not one of {', '.join(valid)}")
    unknown_nodes = sorted(set(profile.required_nodes) - set(kernels.OP_NODES))
    if unknown_nodes or not profile.required_nodes:
        raise ConfigError(
            f"profile {profile.name!r}: required_nodes {dict(profile.required_nodes)} must name a backend for "
            f"op nodes among {list(kernels.OP_NODES)}"
        )
    check_expected([*profile.expected_red, *cfg.expected_red])
    check_seed(cfg.seed, "seed")
    check_seed(cfg.model.weights.seed, "model.weights.seed")
    check_geometry(cfg.model)
    check_vocab_tile(profile.vocab_tile)
    check_tp_geometry(cfg.model.vocab_size, profile.vocab_tile, cfg.tp)
    shape = workload_shape(cfg.workload, cfg.model)
    footprint = peak_bytes(
        cfg.model,
        cfg.layout,
        shape,
        dtype=EXECUTION_DTYPES[profile.execution_dtype],
        vocab_tile=profile.vocab_tile,
        tp=cfg.tp,
        tp_mode=cfg.tp_mode,
        synthetic_workload=cfg.workload.source == "synthetic",
    )
    check_fits(footprint, profile.device, available_memory(profile.device))


def check_tp_geometry(vocab_size: int, vocab_tile: int, tp: int) -> None:
    """Every tp up to MAX_TP is served: ranks past the real vocab own whole tiles of padding only.

    Padding to a multiple of ``vocab_tile * tp`` keeps every shard a run of whole tiles, so the global
    tile sequence differs across tp only by trailing all-padding tiles, which merge as the identity.
    """
    if tp > MAX_TP:
        raise ConfigError(f"tp={tp} is above {MAX_TP}, the largest tp rlsweep runs; use 1 <= tp <= {MAX_TP}")
    kernels.padded_vocab_size(vocab_size, vocab_tile, tp)  # MAX_TP x MAX_VOCAB_TILE: padding adds < 2**22 columns


def check_distributed_devices(cfg: DictConfig) -> None:
    if cfg.tp_mode == "distributed" and cfg.profile.device == "cuda" and torch.cuda.device_count() < cfg.tp:
        raise ConfigError(
            f"tp_mode=distributed with tp={cfg.tp} needs {cfg.tp} GPUs (one rank each); "
            f"this machine has {torch.cuda.device_count()}"
        )


def choose_triton_mode() -> None:
    """Without CUDA, Triton can only run in its interpreter, and that is decided when triton is first imported.

    Called before anything imports triton (``python -m rlsweep`` does it at start), so a multirun that mixes
    profiles in one process gets the interpreter for every Triton job, not only for those after the first.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def prepare_backend(profile: DictConfig) -> None:
    """Triton on the CPU runs in its interpreter, on a GPU machine too when nothing has imported triton yet.

    Where triton was already imported in the other mode (a sweep mixing CPU and CUDA Triton profiles in one
    process on a GPU machine), the backend says so and the run's provenance is red, never a silent fallback.
    """
    if profile.backend_family == "triton" and profile.device == "cpu":
        if "triton" not in sys.modules:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        # The interpreter evaluates masked (-inf) lanes too and warns about them; the kernel masks the results.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")


def preflight(cfg: DictConfig) -> Contract:
    """Every check that needs only the config, the contract's rows included; returns the run's contract.

    A sweep runs it for each of its jobs before the first one starts (``rlsweep.callbacks``).
    """
    contract = contract_from_mapping(
        OmegaConf.to_container(cfg.contract, resolve=True), source=f"contract {cfg.contract.version}"
    )
    validate(cfg)
    profile = cfg.profile
    op_name = op_class(profile.execution_dtype, profile.logits_dtype)
    cells = cell_names(cfg.layout)
    contract.require(*contract_needs(cells, profile.execution_dtype, op_name, profile.determinism_scope))
    if profile.device != "cuda" or torch.cuda.is_available():  # without CUDA a CUDA profile is a red provenance verdict
        check_distributed_devices(cfg)
    return contract


def execute(cfg: DictConfig, location: RunLocation, identity: RunIdentity, *, standalone: bool) -> RunOutcome:
    """Run every cell of the layout, judge, write both tables; bad input raises RlsweepError/KernelInputError.

    Everything that needs only the config (the contract's rows included) is checked before any kernel runs.
    ``standalone``: the run is not a sweep's job, so it judges every declaration itself.
    """
    started = datetime.now(timezone.utc).isoformat()
    config = OmegaConf.to_container(cfg, resolve=True)
    contract = preflight(cfg)
    profile = cfg.profile
    cells = cell_names(cfg.layout)
    op_name = op_class(profile.execution_dtype, profile.logits_dtype)
    check_writable(location.root)
    required = dict(profile.required_nodes)
    run = {
        "run_id": identity.run_id,
        "profile": profile.name,
        "backend_family": profile.backend_family,
        "device": profile.device,
        "tp": cfg.tp,
        "tp_mode": cfg.tp_mode,
        "model": cfg.model.name,
        "config_fingerprint": config_fingerprint(cfg.model),
        "weight_hash": "",
        "workload": cfg.workload.name,
        "seed": cfg.seed,
        "contract_version": contract.version,
        "contract_sha256": contract.sha256,
    }
    verdicts = [contract_verdict(contract)]
    observed: dict[str, Any] = {}
    computed = Computed()
    if profile.device == "cuda" and not torch.cuda.is_available():
        computed.stopped = (
            f"profile {profile.name!r} requires device 'cuda' but torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}); observed device: cpu; nothing ran, no fallback"
        )
        verdicts.append(provenance_verdict("", required, [], profile.backend_family, error=computed.stopped))
    else:
        prepare_backend(profile)
        try:
            op = dispatch(cfg)
        except kernels.LogprobDispatchError as err:
            computed.stopped = str(err)
            verdicts.append(provenance_verdict("", required, [], profile.backend_family, error=computed.stopped))
        else:
            observed["dispatch"] = op.to_dict()
            computed = compute(cfg, op, run, verdicts, observed)
    judged = judge(computed, Standard(contract, profile.execution_dtype, op_name, computed.bound))
    verdicts += judged
    if computed.stopped:
        verdicts += not_run_verdicts(judged, planned_verdicts(cells, contract), "provenance stopped the kernels")
    verdicts = apply_expected(verdicts, expectations_for(config))
    verdicts += declaration_rows(verdicts, config, standalone=standalone)
    metadata = {
        "config": config,
        "contract": dict(contract.document),
        "observed_provenance": observed,
        "environment": environment(profile.device),
        "identity": {"content_sha256": identity.content_sha256, "inputs": dict(identity.inputs)},
        "started": started,
        "finished": datetime.now(timezone.utc).isoformat(),
    }
    tokens = tokens_table(run, computed)
    checks = build_table(CHECKS_SCHEMA, run, checks_columns(verdicts), len(verdicts))
    files = publish_tables(
        location, {TOKENS_TABLE: with_metadata(tokens, metadata), CHECKS_TABLE: with_metadata(checks, metadata)}
    )
    return RunOutcome(location, run["run_id"], verdicts, files)


def dispatch(cfg: DictConfig) -> kernels.LogprobOp:
    """The profile's backend bound to the logprob contract the profile declares; its capability gates it."""
    profile = cfg.profile
    contract = kernels.LogprobContract.even(
        cfg.model.vocab_size,
        profile.vocab_tile,
        cfg.tp,
        dtype=profile.execution_dtype,
        platform=profile.device,
        determinism_scope=profile.determinism_scope,
        merge_order=profile.merge_order,
    )
    return kernels.get_logprob_op(contract, profile.backend_family)


@dataclass
class Computed:
    """What the kernels produced: every cell's results (logical order), the float64 reference, the workload,
    the rounding model's bounds {"logp", "lse"} -> [T], and why provenance stopped the cells ("" if not)."""

    results: list[CellResult] = field(default_factory=list)
    reference: CellResult | None = None
    workload: Any = None
    bound: dict[str, torch.Tensor] = field(default_factory=dict)
    stopped: str = ""


def compute(
    cfg: DictConfig, op: kernels.LogprobOp, run: dict[str, Any], verdicts: list[Verdict], observed: dict[str, Any]
) -> Computed:
    """Head, workload, the reference, the bounds and every cell through ``op``; provenance verdicts as they come."""
    profile = cfg.profile
    required = dict(profile.required_nodes)
    dtype = EXECUTION_DTYPES[profile.execution_dtype]
    head = build_lm_head(cfg.model, dtype=dtype, device=torch.device(profile.device))
    run["weight_hash"] = head.weight_hash
    verdicts.append(weight_pin_verdict(cfg.model.weight_sha256, head.weight_hash))
    workload = build_workload(cfg.workload, cfg.model, head.weight, seed=cfg.seed, dtype=dtype)
    cells = plan_cells(cfg.layout, workload)
    filler = Filler(*workload.filler(filler_rows_needed(cells), cfg.model.vocab_size))
    computed = Computed(workload=workload)
    computed.reference = run_reference(cells[0], workload, head.weight, filler, profile.vocab_tile)
    observed["reference"] = unique_provenance(computed.reference)
    logits_dtype = EXECUTION_DTYPES[profile.logits_dtype or profile.execution_dtype]
    bound = kernels.rounding_bound(workload.hidden, head.weight, workload.targets, logits_dtype=logits_dtype)
    computed.bound = {"logp": bound.logp, "lse": bound.lse}
    candidate = partial(op, tp_mode=cfg.tp_mode)
    # Distributed ranks are spawned once per run and serve every call of every cell.
    ranks = (
        kernels.distributed_ranks(profile.backend_family, cfg.tp, profile.vocab_tile, profile.device)
        if cfg.tp_mode == "distributed"
        else contextlib.nullcontext()
    )
    with ranks:
        for number, cell in enumerate(cells, start=1):
            log.info("cell %d/%d %s: %d kernel calls", number, len(cells), cell.name, len(cell.calls))
            try:
                computed.results.append(run_cell(cell, workload, head.weight, filler, candidate))
            except kernels.BackendUnavailableError as err:
                computed.stopped = str(err)
                verdicts.append(provenance_verdict(cell.name, required, [], profile.backend_family, error=str(err)))
                break
            except kernels.ProvenanceMismatchError as err:
                computed.stopped = str(err)
                verdicts.append(
                    provenance_verdict(cell.name, required, [err.observed], profile.backend_family, error=str(err))
                )
                break
    for result in computed.results:
        observed[result.cell.name] = unique_provenance(result)
        verdicts.append(provenance_verdict(result.cell.name, required, result.provenance, profile.backend_family))
    return computed


def judge(computed: Computed, standard: Standard) -> list[Verdict]:
    results, reference, workload = computed.results, computed.reference, computed.workload
    if not results:
        return []
    canonical = results[0]
    verdicts = []
    for result in results:
        verdicts += forward_accuracy(result, reference, workload, standard)
    for result in results[1:]:
        verdicts += forward_invariance(result, canonical, workload, standard)
    verdicts += chain_aggregates(canonical, reference, workload, standard)
    verdicts += smoke(canonical, workload, (standard.contract.roles_for("forward_accuracy")[0], "invariants"))
    return verdicts


def unique_provenance(result: CellResult) -> list[dict[str, Any]]:
    """The distinct provenance records of a cell's calls (usually one)."""
    seen: dict[str, dict[str, Any]] = {}
    for provenance in result.provenance:
        record = provenance.to_dict()
        seen.setdefault(json.dumps(record, sort_keys=True, default=str), record)
    return list(seen.values())


def tokens_table(run, computed: Computed):
    """One row per (cell, sample_id, position)."""
    workload, reference = computed.workload, computed.reference
    columns: dict[str, list] = {name: [] for name in TOKENS_SCHEMA.names}
    for result in computed.results:
        count = workload.num_tokens
        columns["cell"] += [result.cell.name] * count
        columns["sample_id"] += workload.sample_ids.tolist()
        columns["position"] += workload.positions.tolist()
        columns["target_id"] += workload.targets.cpu().tolist()
        columns["active"] += workload.active.tolist()
        columns["logp"] += result.logp.float().tolist()
        columns["lse"] += result.lse.float().tolist()
        columns["ref_logp"] += reference.logp.double().tolist()
        columns["ref_lse"] += reference.lse.double().tolist()
        columns["logp_bound"] += computed.bound["logp"].tolist()
        columns["lse_bound"] += computed.bound["lse"].tolist()
        columns["owner_rank"] += result.owner_rank.tolist()
    return build_table(TOKENS_SCHEMA, run, columns, len(columns["cell"]))


def checks_columns(verdicts: list[Verdict]) -> dict[str, list]:
    names = [name for name in CHECKS_SCHEMA.names if name in Verdict.__dataclass_fields__]
    return {name: [getattr(verdict, name) for verdict in verdicts] for name in names}
