"""The typed run: what one run computes and judges, parsed and checked once from the resolved config.

``parse_run_spec`` is the one way in (``rlsweep.config.run_spec`` calls it with what Hydra composed). Every
part checks itself when built, and ``RunSpec`` checks what needs several parts (tp against the vocab, the
contract's rows against the cells), so code below takes a ``RunSpec`` and trusts it. What needs more than
the config (a file's header, the machine's memory) is checked by ``rlsweep.run.preflight``. docs/design.md
describes the flow; docs/index.md the config groups these mirror.
"""

from __future__ import annotations

import fnmatch
import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

import kernels
from rlsweep.contract import (
    DETERMINISM_SCOPES,
    Contract,
    RowKey,
    check_pin,
    contract_from_mapping,
    op_class,
    reject_unknown,
)
from rlsweep.errors import ConfigError
from rlsweep.exitcodes import exit_site
from rlsweep.hf_model import ATTENTION, BITWISE_BODIES, GEOMETRY, PACKING, WholeModelSpec, body_attention
from rlsweep.synthetic import check_seed
from rlsweep.verdicts import DECLARABLE, FORWARD_TENSORS, GRADIENT_TENSORS, Judgment, Tensor

# Bounds that only reject typos (real heads: hidden 2**11-2**14, vocab 3e4-3e5, tiles 256-1024); whether a head
# that passes them fits is the memory estimate's call (rlsweep.execute.peak_bytes).
MAX_HIDDEN_SIZE = 1 << 16
MAX_VOCAB_SIZE = 1 << 24
MAX_VOCAB_TILE = 1 << 14
MAX_TP = 256  # the most ranks one run emulates or launches
POSITION_BITS = 24  # counter key of a token: sample_id << POSITION_BITS | position
MAX_SEQ_LEN = 1 << POSITION_BITS  # a longer sample's positions would spill into the next sample's keys
# Scales of the synthetic inputs: a synthetic head's logits have std logit_std * hidden_scale (real heads: 3-5),
# so at both upper bounds 64 * 64 = 4096, still far inside bf16's range. At both lower bounds the std is 2**-12,
# where the negative control still fails every cell it should; 0, or 1e-300 (0 in bf16), makes an all-zero tensor,
# and far below the bound every token's logp rounds to -log(V) whatever the kernel did: no verdict could fail.
MAX_HIDDEN_SCALE = 64.0
MAX_LOGIT_STD = 64.0
MIN_HIDDEN_SCALE = 1 / 64
MIN_LOGIT_STD = 1 / 64
MAX_NEEDLE_ROWS = 1 << 24  # filler rows of one needle call: only rejects typos, the memory estimate decides the rest
WEIGHT_SOURCES = ("synthetic", "file")
WORKLOAD_SOURCES = ("synthetic", "replay")
EXECUTION_DTYPES = {kernels.dtype_name(dtype): dtype for dtype in kernels.EXECUTION_DTYPES}
MERGE_ORDERS = tuple(order.value for order in kernels.MergeOrder)
# Role groups of the contract's comparison_roles beside the judgments' own (docs/contract.md).
DECODE_PARITY_ROLES = "decode_parity"  # the decode cell against the canonical cell: rollout vs training
CHAIN_ROLES = "chain_logprob_aggregates"
CANONICAL_CELL = "BN/packed"
DECODE_CELL = "decode"
CONFIG_KEY = "config_key"  # a field's metadata: the config key it is parsed from (default its name; None: none)
NEEDLE = "needle"  # a cell kind that names one cell per layout.needles entry
CHUNKED_CELLS = ("BN/chunked", "B1/chunked")  # the cell kinds that read layout.chunk_size
CELL_KINDS = (
    CANONICAL_CELL,
    "BN/pad_right",
    "BN/pad_left",
    "BN/permuted",
    CHUNKED_CELLS[0],
    "B1/full",
    CHUNKED_CELLS[1],
    DECODE_CELL,
    NEEDLE,
)


def choice(where: str, value: Any, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ConfigError(f"{where}={value!r} is not one of {', '.join(valid)}")


def check_name(key: str, value: Any, valid: str = "a name that is not blank (its option's file name, say)") -> None:
    """A name key (``model.name``, ``layout.name``, ...) must name something: tables, the gate and declarations know a
    run's parts by their names, and an empty one (a quoted unset variable) names nothing."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}={value!r} is blank; valid: {valid}")


def check_tables_dir(value: str) -> None:
    """``tables_dir``, where set, names a directory: an empty one (a quoted unset variable) is never the current one."""
    if not value.strip():
        raise ConfigError(f"tables_dir={value!r} is empty: name the run's dataset root, or leave it null (the run dir)")


def check_scale(key: str, value: float, low: float, high: float) -> None:
    """A scale of synthetic values must be in [low, high]."""
    if not low <= value <= high:  # NaN fails both comparisons
        raise ConfigError(
            f"{key}={value!r} must be in [{low:g}, {high:g}] (a smaller scale makes the logits so flat that every "
            "kernel gives the same logp and no verdict can fail)"
        )


@dataclass(frozen=True)
class WeightSource:
    """Where the lm_head weight comes from: counter-based synthetic values or a safetensors file."""

    kind: str = "synthetic"
    seed: int = 0  # synthetic: the weight stream's seed
    logit_std: float = 4.0  # synthetic: std of logits for unit-std hidden states
    path: str | None = None  # file: a local safetensors file
    tensor: str = "lm_head.weight"  # file: the head's tensor name

    def __post_init__(self) -> None:
        choice("model.weights.kind", self.kind, WEIGHT_SOURCES)
        check_seed(self.seed, "model.weights.seed")
        if self.kind == "synthetic":
            check_scale("model.weights.logit_std", self.logit_std, MIN_LOGIT_STD, MAX_LOGIT_STD)
        if self.kind == "file" and not self.path:
            raise ConfigError("model.weights.kind=file needs model.weights.path (a local .safetensors file)")
        if self.kind == "file":
            check_name("model.weights.tensor", self.tensor, "the head's tensor name in the file (lm_head.weight, say)")


@dataclass(frozen=True)
class ModelSpec:
    """The pinned identity of the lm_head under test."""

    name: str
    hidden_size: int
    vocab_size: int
    padded_vocab_size: int | None = None  # the checkpoint's padded embedding rows, if it pads
    tie_word_embeddings: bool = False
    weights: WeightSource = field(default_factory=WeightSource)
    weight_sha256: str | None = None  # pin: a different weight hash is a red verdict
    body: WholeModelSpec | None = None  # a whole model: its body makes the hidden states (docs/whole_model.md)

    def __post_init__(self) -> None:
        check_name("model.name", self.name)
        # A vocab of one token gives every kernel logp 0: its logp verdicts could not fail.
        for key, least, limit in (("hidden_size", 1, MAX_HIDDEN_SIZE), ("vocab_size", 2, MAX_VOCAB_SIZE)):
            value = getattr(self, key)
            if not least <= value <= limit:
                raise ConfigError(f"model.{key}={value!r} is outside [{least}, {limit}] (model {self.name!r})")
        padded = self.padded_vocab_size
        if padded is not None and not self.vocab_size <= padded <= MAX_VOCAB_SIZE:
            raise ConfigError(
                f"model.padded_vocab_size={padded!r} is outside [vocab_size={self.vocab_size}, {MAX_VOCAB_SIZE}]"
            )
        check_pin(self.weight_sha256, "model.weight_sha256", ConfigError)


@dataclass(frozen=True)
class ExpectedRed:
    """Verdict rows expected to be red; docs/sweeps.md#expected-verdicts-in-a-sweep. Strict (the default): a row it
    covers that passes is itself red. Not strict: a row it covers may pass or fail, for a stock stack whose bits there
    follow the machine's kernels (the CPU's instruction set) and the workload's lengths, measured red on some machines
    and green on others; it still must cover some judged row."""

    judgment: str
    reason: str
    profiles: tuple[str, ...] = ("*",)  # fnmatch patterns over profile names
    tp: tuple[int, ...] | None = None  # the tp degrees it applies to; None (the key left out): every tp
    cells: tuple[str, ...] = ("*",)  # fnmatch patterns over cell names
    tensors: tuple[str, ...] = ("*",)
    strict: bool = True

    def __post_init__(self) -> None:
        choice("expected_red judgment", self.judgment, DECLARABLE)
        if not isinstance(self.strict, bool):
            raise ConfigError(
                f"expected_red {{judgment: {self.judgment}, reason: {self.reason}}}: strict={self.strict!r} is not a "
                "boolean; use true (a covered row that passes is red) or false (it may pass or fail)"
            )
        # An empty list would select nothing; leaving the key out is how a declaration says "every".
        for selector in ("profiles", "tp", "cells", "tensors"):
            if getattr(self, selector) is not None and not getattr(self, selector):
                raise ConfigError(
                    f"expected_red {{judgment: {self.judgment}, reason: {self.reason}}}: {selector}=[] selects "
                    f"nothing; list at least one, or leave {selector} out for every {selector.removesuffix('s')}"
                )
        # A degree no run can have selects nothing, like an empty list: refused before the run, not red after it.
        for degree in self.tp or ():
            if not 1 <= degree <= MAX_TP:
                raise ConfigError(
                    f"expected_red {{judgment: {self.judgment}, reason: {self.reason}}}: tp={degree!r} is no tp "
                    f"degree a run can have; use 1 <= tp <= {MAX_TP}"
                )

    def applies(self, profile: str, tp: int) -> bool:
        """Whether its profile patterns and tp list select a run of ``profile`` at ``tp``."""
        return any(fnmatch.fnmatchcase(profile, p) for p in self.profiles) and (self.tp is None or tp in self.tp)

    def declares(self, judgment: str, cell: str, tensor: str) -> bool:
        """Whether it covers a verdict row: its judgment, and a cell and tensor among its patterns."""
        return (
            self.judgment == judgment
            and any(fnmatch.fnmatchcase(cell, pattern) for pattern in self.cells)
            and any(fnmatch.fnmatchcase(tensor, pattern) for pattern in self.tensors)
        )

    def describe(self) -> str:
        tp = f" tp={list(self.tp)}" if self.tp is not None else ""
        return (f"expected_red {{judgment: {self.judgment}, profiles: {list(self.profiles)}{tp}, "
                f"cells: {list(self.cells)}, tensors: {list(self.tensors)}{'' if self.strict else ', strict: false'}}} "
                f"({self.reason})")  # fmt: skip


@dataclass(frozen=True)
class ProfileSpec:
    """A backend on a device: dtypes, tile, determinism scope and the op nodes that must run on it."""

    name: str
    backend_family: str  # a registered kernels backend id
    device: str = "cpu"
    execution_dtype: str = "bfloat16"
    logits_dtype: str | None = None  # where the logits are rounded (the op class); None: the execution dtype
    vocab_tile: int = 256
    determinism_scope: str = "fixed_topology"
    merge_order: str = "rank_shard"  # how the TP partials are merged
    required_nodes: Mapping[str, str] = field(default_factory=dict)  # op node -> backend id
    backend_module: str | None = None  # a module to import first: it registers backend_family (docs/extending.md)
    # A whole-model profile's attention implementation (hf_model.ATTENTION); None: a head profile, behind which a
    # whole model's body runs hf_model.DEFAULT_ATTENTION (parse_run_spec resolves it by hf_model.body_attention, and
    # refuses a body for a head alone).
    body_attention: str | None = None
    body_packing: str = "confined"  # how BN/packed confines attention (unconfined: the packing negative control)
    tensors: tuple[str, ...] = FORWARD_TENSORS  # the forward tensors the backend computes, each judged
    expected_red: tuple[ExpectedRed, ...] = ()

    def __post_init__(self) -> None:
        where = f"profile {self.name!r}: "
        check_tensors(f"{where}tensors", self.tensors)
        choice(f"{where}device", self.device, kernels.PLATFORMS)
        choice(f"{where}execution_dtype", self.execution_dtype, tuple(EXECUTION_DTYPES))
        choice(f"{where}logits_dtype", self.logits_name, tuple(EXECUTION_DTYPES))
        choice(f"{where}determinism_scope", self.determinism_scope, DETERMINISM_SCOPES)
        choice(f"{where}merge_order", self.merge_order, MERGE_ORDERS)
        if self.body_attention is not None:
            choice(f"{where}body_attention", self.body_attention, ATTENTION)
        choice(f"{where}body_packing", self.body_packing, PACKING)
        unknown = sorted(set(self.required_nodes) - set(kernels.OP_NODES))
        if unknown or not self.required_nodes:
            raise ConfigError(
                f"{where}required_nodes {dict(self.required_nodes)} must name a backend for op nodes among "
                f"{list(kernels.OP_NODES)}"
            )
        if self.vocab_tile > MAX_VOCAB_TILE:
            raise ConfigError(
                f"profile.vocab_tile={self.vocab_tile!r} is above {MAX_VOCAB_TILE} "
                f"(a power of two in [{kernels.MIN_VOCAB_TILE}, {MAX_VOCAB_TILE}])"
            )

    @property
    def dtype(self) -> torch.dtype:
        return EXECUTION_DTYPES[self.execution_dtype]

    @property
    def logits_name(self) -> str:
        return self.logits_dtype or self.execution_dtype

    @property
    def op_class(self) -> str:
        """Contract rows are keyed by where the logits are rounded (docs/contract.md)."""
        return op_class(self.execution_dtype, self.logits_dtype)


@dataclass(frozen=True)
class WorkloadSpec:
    """The logical samples: synthetic (seq/prompt lengths) or replayed from a safetensors file."""

    name: str
    source: str = "synthetic"
    seq_lens: tuple[int, ...] = ()
    prompt_lens: tuple[int, ...] = ()
    hidden_scale: float = 1.0  # synthetic: std of the hidden states
    sample_scales: tuple[float, ...] = ()  # synthetic: per sample, a multiple of hidden_scale; () = all 1.0
    probe_samples: tuple[int, ...] = ()  # synthetic: samples whose active tokens target boundary columns
    path: str | None = None  # replay: hidden_states, target_ids, seq_lens, optional active_mask

    def __post_init__(self) -> None:
        check_name("workload.name", self.name)
        choice("workload.source", self.source, WORKLOAD_SOURCES)
        if self.source == "replay":
            if not self.path:
                raise ConfigError("workload=replay needs workload.path (a local .safetensors file)")
            return  # the file gives the hidden states and lengths (a synthetic key set here: rlsweep.unread)
        self.check_lengths()
        check_scale("workload.hidden_scale", self.hidden_scale, MIN_HIDDEN_SCALE, MAX_HIDDEN_SCALE)
        self.check_sample_scales()
        self.check_probe_samples()

    def check_lengths(self) -> None:
        seq, prompt = list(self.seq_lens), list(self.prompt_lens)
        if not seq:
            raise ConfigError(
                f"workload {self.name!r} has no token (T = 0): workload.seq_lens is empty; give at least one "
                "sample, e.g. workload.seq_lens=[16] workload.prompt_lens=[8]"
            )
        if len(seq) != len(prompt):
            raise ConfigError(
                f"workload {self.name!r}: seq_lens {seq} and prompt_lens {prompt} must have one entry per sample "
                f"({len(seq)} vs {len(prompt)})"
            )
        for sample, (n, p) in enumerate(zip(seq, prompt, strict=True)):
            if not 1 <= n <= MAX_SEQ_LEN or not 0 <= p < n:
                raise ConfigError(
                    f"workload {self.name!r}: sample {sample} has seq_len={n}, prompt_len={p}; need 1 <= seq_len "
                    f"<= {MAX_SEQ_LEN} and 0 <= prompt_len < seq_len (at least one active completion token)"
                )

    @property
    def scales(self) -> tuple[float, ...]:
        """Each sample's hidden-state std: hidden_scale times its sample_scales entry (1.0 where none is given)."""
        return tuple(self.hidden_scale * s for s in self.sample_scales or [1.0] * len(self.seq_lens))

    def check_sample_scales(self) -> None:
        scales, samples = list(self.sample_scales), len(self.seq_lens)
        if scales and len(scales) != samples:
            raise ConfigError(
                f"workload.sample_scales={scales} has {len(scales)} entries for the {samples} samples of workload "
                f"{self.name!r}; give one per sample, or [] for 1.0 each"
            )
        for sample, scale in enumerate(scales):
            # the product is the std the sample's hidden states get, so it meets hidden_scale's bound
            key = f"workload.hidden_scale * workload.sample_scales[{sample}] ({self.hidden_scale!r} * {scale!r})"
            check_scale(key, self.scales[sample], MIN_HIDDEN_SCALE, MAX_HIDDEN_SCALE)

    def check_probe_samples(self) -> None:
        probes, samples = list(self.probe_samples), len(self.seq_lens)
        bad = [index for index in probes if isinstance(index, bool) or not 0 <= index < samples]
        if bad:
            raise ConfigError(
                f"workload.probe_samples={probes}: {bad} are no sample index of workload {self.name!r}; valid: "
                f"0 to {samples - 1}"
            )
        repeated = sorted({index for index in probes if probes.count(index) > 1})
        if repeated:
            raise ConfigError(
                f"workload.probe_samples={probes} lists samples {repeated} more than once; list each once"
            )
        if len(set(probes)) == samples:  # the chain metrics judge sequences of sampled targets
            raise ConfigError(
                f"workload.probe_samples={probes} makes every sample of workload {self.name!r} a probe: leave at "
                f"least one of samples 0 to {samples - 1} out, so some targets are sampled from the model"
            )


@dataclass(frozen=True)
class Needle:
    """A needle cell: the packed logical rows at row ``pos`` of a call with ``m`` unrelated filler rows."""

    m: int
    pos: int

    @property
    def cell_name(self) -> str:
        return f"needle/M={self.m}/pos={self.pos}"


@dataclass(frozen=True)
class LayoutSpec:
    """Which layout cells one run computes; the first is the canonical cell."""

    name: str
    cells: tuple[str, ...] = ()  # cell kinds, CELL_KINDS
    chunk_size: int = 5
    needles: tuple[Needle, ...] = ()

    def __post_init__(self) -> None:
        check_name("layout.name", self.name)
        unknown = [kind for kind in self.cells if kind not in CELL_KINDS]
        if unknown:
            raise ConfigError(f"layout {self.name!r}: unknown cell kinds {unknown}; valid: {', '.join(CELL_KINDS)}")
        if not self.cells or self.cells[0] != CANONICAL_CELL:
            raise ConfigError(
                f"layout {self.name!r}: the first cell must be the canonical {CANONICAL_CELL!r}, got {list(self.cells)}"
            )
        if self.chunk_size < 1:
            raise ConfigError(f"layout.chunk_size must be >= 1, got {self.chunk_size!r} (valid: 1 to {MAX_SEQ_LEN})")
        if self.chunk_size > MAX_SEQ_LEN:
            raise ConfigError(
                f"layout.chunk_size must be at most {MAX_SEQ_LEN} (the longest sample), got {self.chunk_size!r}"
            )
        if NEEDLE in self.cells and not self.needles:
            raise ConfigError(f"layout {self.name!r} lists 'needle' cells but layout.needles is empty")
        for needle in self.needles:
            if not 1 <= needle.m <= MAX_NEEDLE_ROWS or not 0 <= needle.pos <= needle.m:
                raise ConfigError(
                    f"layout.needles entry m={needle.m!r} pos={needle.pos!r}: need 1 <= m <= {MAX_NEEDLE_ROWS} "
                    "and 0 <= pos <= m"
                )
        names = self.cell_names
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ConfigError(f"layout {self.name!r}: cells {repeated} appear more than once; each must be unique")
        if self.needles and NEEDLE not in self.cells:
            declared = ", ".join(needle.cell_name for needle in self.needles)
            raise ConfigError(
                f"layout {self.name!r}: layout.needles [{declared}] are read by no cell: layout.cells "
                f"{list(self.cells)} has no {NEEDLE!r}; add it to layout.cells, or set layout.needles=[]"
            )

    @property
    def cell_names(self) -> list[str]:
        """The names of the cells this layout computes, canonical first."""
        return [
            name
            for kind in self.cells
            for name in ([needle.cell_name for needle in self.needles] if kind == NEEDLE else [kind])
        ]

    @property
    def filler_rows(self) -> int:
        """Unrelated rows the needle cells take, at most."""
        return max((needle.m for needle in self.needles), default=0)


@dataclass(frozen=True)
class RunSpec:
    """One run, typed and checked: its parts, the contract it is judged by and the vocab sharding it runs."""

    model: ModelSpec
    profile: ProfileSpec
    workload: WorkloadSpec
    layout: LayoutSpec
    contract: Contract
    # the whole vocab over every rank, as every kernel call of the run splits it
    sharding: kernels.ShardingSpec = field(metadata={CONFIG_KEY: "tp"})
    tp_mode: str = "emulated"
    seed: int = 0
    grad: bool = False  # differentiate every kernel call and judge the gradients
    expected_red: tuple[ExpectedRed, ...] = ()  # a sweep config's declarations
    tables_dir: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict, metadata={CONFIG_KEY: None})  # the resolved config

    def __post_init__(self) -> None:
        if self.tables_dir is not None:
            check_tables_dir(self.tables_dir)
        choice("tp_mode", self.tp_mode, kernels.TP_MODES)
        check_seed(self.seed, "seed")
        tile, vocab = self.sharding.vocab_tile, self.model.vocab_size
        if self.tp > 1 and tile >= vocab:  # shards are whole tiles: one tile holds the whole vocab, on rank 0
            raise ConfigError(
                f"tp={self.tp} with profile.vocab_tile={tile} >= model.vocab_size={vocab}: rank 0 holds the whole "
                "vocab and every other rank padding only, so nothing is split and no tp verdict can fail; use tp=1"
                + (
                    f", or a vocab_tile below {vocab} (a power of two >= {kernels.MIN_VOCAB_TILE})"
                    if vocab > kernels.MIN_VOCAB_TILE
                    else ""
                )
            )
        if self.profile.backend_family not in kernels.BACKENDS or self.profile.backend_family == "reference":
            families = sorted(set(kernels.BACKENDS) - {"reference"})
            raise ConfigError(
                f"profile {self.profile.name!r}: backend_family={self.profile.backend_family!r} is not one of "
                f"{families}"
                + ("" if self.profile.backend_module else " (a backend of your own: see profile.backend_module)")
            )
        # The run binds every op node to backend_family, so a node required on any other backend (or on a typo)
        # could never pass: the run would compute everything and end red on provenance alone.
        family, required = self.profile.backend_family, self.profile.required_nodes
        other = {node: backend for node, backend in required.items() if backend != family}
        if other:
            raise ConfigError(
                f"profile {self.profile.name!r}: required_nodes {other} name a backend other than "
                f"backend_family={family!r}, which the run binds every op node to; valid: "
                f"{dict.fromkeys(required, family)}"
            )
        backend = kernels.BACKENDS[family]
        self.check_backend_reach(backend.capability)
        if self.model.body is not None and self.grad and self.profile.body_attention == "invariant":
            raise ConfigError(
                f"grad=true with profile {self.profile.name!r}: the invariant body is forward-only (no backward); "
                "leave grad unset"
            )
        if self.model.body is not None and self.grad:
            raise ConfigError(
                f"grad=true with model {self.model.name!r}, a whole model: its backward is not judged; leave grad "
                "unset, or choose a head model (model=tiny, say) to judge the head's gradients"
            )
        if self.grad and self.tp_mode == "distributed" and not kernels.has_tiled_backward(backend):
            tiled = [name for name, impl in kernels.BACKENDS.items() if kernels.has_tiled_backward(impl)]
            raise ConfigError(
                f"grad=true with tp_mode=distributed: profile {self.profile.name!r} runs backend "
                f"{self.profile.backend_family!r}, whose ranks' autograd graphs stay in their processes; use "
                f"tp_mode=emulated, or a profile whose backend has a tiled backward ({', '.join(tiled)})"
            )
        self.contract.require(*self.contract_needs())

    def check_backend_reach(self, capability: kernels.LogprobBackendCapability) -> None:
        """ConfigError where the backend cannot run this tp, or computes other forward tensors than the profile's."""
        profile, family = self.profile.name, self.profile.backend_family
        if capability.tp_sizes is not None and self.tp not in capability.tp_sizes:
            raise ConfigError(
                f"tp={self.tp}: profile {profile!r} runs backend {family!r}, which runs at tp "
                f"{' or '.join(map(str, sorted(capability.tp_sizes)))} only; sweep it at that tp"
            )
        computes = [str(tensor) for tensor in (FORWARD_TENSORS if capability.exports_lse else (Tensor.LOGP,))]
        if list(self.profile.tensors) != computes:
            raise ConfigError(
                f"profile {profile!r}: tensors={list(self.profile.tensors)}, but backend {family!r} computes "
                f"{computes}: set profile.tensors={computes}"
            )

    @property
    def tp(self) -> int:
        return self.sharding.world_size

    @property
    def bitwise_body(self) -> bool:
        """A whole model whose body claims every module bitwise in every cell (``hf_model.BITWISE_BODIES``)."""
        return self.model.body is not None and self.profile.body_attention in BITWISE_BODIES

    def contract_needs(self) -> tuple[list[RowKey], list[str], list[str]]:
        """(tolerance rows, role groups, chain dtypes) that this run and the sweeps it joins will judge."""
        cells, dtype, op = self.layout.cell_names, self.profile.execution_dtype, self.profile.op_class
        judgments = [Judgment.FORWARD_ACCURACY, Judgment.BACKEND_PARITY]
        judgments += [Judgment.FORWARD_INVARIANCE] if len(cells) > 1 else []
        tensors = self.profile.tensors
        rows = [(judgment, "", tensor, dtype, op) for judgment in judgments for tensor in tensors]
        rows += [(Judgment.TP_INVARIANCE, self.profile.determinism_scope, t, dtype, op) for t in tensors]
        roles = [*judgments, Judgment.TP_INVARIANCE, CHAIN_ROLES]
        roles += [DECODE_PARITY_ROLES] if DECODE_CELL in cells[1:] else []
        if self.grad:
            # gradient_invariance: d hidden across cells, and both gradients across tp (the gate, cell by cell).
            gradient = [Judgment.GRADIENT_ACCURACY, Judgment.GRADIENT_INVARIANCE]
            rows += [(judgment, "", t, dtype, op) for judgment in gradient for t in GRADIENT_TENSORS]
            roles += gradient
        return rows, roles, [dtype]

    @property
    def declarations(self) -> tuple[ExpectedRed, ...]:
        """Every expected-red declaration the run carries: its profile's, then the sweep's."""
        return (*self.profile.expected_red, *self.expected_red)

    @property
    def expectations(self) -> list[ExpectedRed]:
        """The declarations that select this run."""
        return [d for d in self.declarations if d.applies(self.profile.name, self.tp)]


def parse_run_spec(config: Mapping[str, Any], *, contract_file: str, profile_file: str) -> RunSpec:
    """The RunSpec of a resolved config (plain mappings and lists, as Hydra composed it against its schema).

    ``contract_file``: the name of the contract file composed as ``config["contract"]`` (``contract=v2``), which
    its version must be. ``profile_file``: the profile file's (``profile=cpu_bf16``), which its name must be.
    """
    profile = dict(config["profile"])
    check_name("profile.name", profile.get("name"))
    if profile.get("name") != profile_file:  # tables, the gate and declarations know a profile by its name
        raise ConfigError(
            f"profile.name={profile.get('name')!r} is not its file's name (profile={profile_file}): tables, the gate "
            f"and declarations know a profile by its name, so another profile's would mix the two; name it "
            f"{profile_file!r}"
        )
    if profile.get("backend_module") is not None:
        check_name("profile.backend_module", profile["backend_module"], "null, or the module that registers it")
        interpret_triton_on_cpu(profile.get("backend_family"), profile.get("device"))  # the module may import triton
        import_backend(profile["name"], profile["backend_module"])
    tp = config.get("tp", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp must be an integer >= 1, got {tp!r}")
    if tp > MAX_TP:
        raise ConfigError(f"tp={tp} is above {MAX_TP}, the largest tp rlsweep runs; use 1 <= tp <= {MAX_TP}")
    weights = build(WeightSource, config["model"].get("weights", {}), "model.weights")
    body = config["model"].get("body")
    body = None if body is None else WholeModelSpec.parse({"name": config["model"].get("name"), **body})
    model = build(ModelSpec, config["model"], "model", weights=weights, body=body, **model_geometry(config, body))
    declared = expected_reds(profile.get("expected_red", ()), "profile.expected_red")
    profile_spec = build(ProfileSpec, profile, "profile", expected_red=declared)
    claims_body = profile_spec.body_attention is not None or profile_spec.body_packing != PACKING[0]
    if body is None and claims_body:
        raise ConfigError(
            f"profile {profile_spec.name!r} judges a whole model's body (body_attention="
            f"{profile_spec.body_attention}, body_packing={profile_spec.body_packing}), and model "
            f"{model.name!r} is a head alone (no model.body): nothing would run that body; choose a whole model "
            "(model=qwen3_tiny, say), or a profile that names no body (profile=cpu_bf16, say)"
        )
    if body is not None:
        profile_spec = replace(profile_spec, body_attention=body_attention(profile_spec.body_attention))
    # Every shard a run of whole tiles: ranks past the real vocab own padding only, which merges as the identity.
    sharding = kernels.ShardingSpec.even(model.vocab_size, profile_spec.vocab_tile, tp)
    contract_document = config["contract"]
    return build(
        RunSpec,
        config,
        "run config",
        model=model,
        profile=profile_spec,
        workload=workload_of(config["workload"], whole_model=body is not None),
        layout=layout_of(config),
        contract=contract_from_mapping(contract_document, source=f"contract={contract_file}", file_name=contract_file),
        sharding=sharding,
        expected_red=expected_reds(config.get("expected_red", ()), "expected_red"),
        config=config,
    )


# What a whole model's run never reads of a workload (its hidden states come from the body, its targets are the
# next tokens): the head-only keys' defaults, so a default workload's per-sample lists need not match new lengths.
HEAD_ONLY_WORKLOAD = {"sample_scales": [], "probe_samples": []}


def workload_of(workload: Mapping[str, Any], *, whole_model: bool) -> WorkloadSpec:
    """The run's workload; a whole model's without the head-only per-sample lists (``HEAD_ONLY_WORKLOAD``), which
    ``rlsweep.unread`` refuses when a user sets them."""
    return build(WorkloadSpec, {**workload, **(HEAD_ONLY_WORKLOAD if whole_model else {})}, "workload")


def model_geometry(config: Mapping[str, Any], body: WholeModelSpec | None) -> dict[str, int]:
    """model.hidden_size and model.vocab_size: as given for a head; for a whole model, its config's, which a value
    given must equal (null takes the config's)."""
    given = {key: config["model"].get(key) for key in GEOMETRY}
    if body is None:
        for key, value in given.items():
            if value is None:
                raise ConfigError(f"model.{key}=null: a head alone needs its size (null is for a whole model's body)")
        return given
    for key, value in body.geometry().items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"model {body.name!r}: its config's {key}={value!r} is not an integer")
        if given[key] is not None and given[key] != value:
            raise ConfigError(
                f"model.{key}={given[key]!r} is not the whole model's own {key}={value} (its config's); leave it "
                "null to take the config's"
            )
        given[key] = value
    return given


def expected_reds(entries: Sequence[Mapping[str, Any]], where: str) -> tuple[ExpectedRed, ...]:
    return tuple(build(ExpectedRed, entry, f"{where}[{i}]") for i, entry in enumerate(entries))


def layout_of(config: Mapping[str, Any]) -> LayoutSpec:
    """The layout a resolved run config computes (the gate plans a run's verdicts from it, without its backend).

    Needles of a layout without a needle cell (``layout=full layout.cells=[BN/packed]``) are its shipped default, which
    those cells make moot: none is computed (set by the user, they are refused: ``rlsweep.unread``)."""
    entries = config["layout"]["needles"] if NEEDLE in config["layout"].get("cells", ()) else []
    needles = tuple(build(Needle, n, f"layout.needles[{i}]") for i, n in enumerate(entries))
    return build(LayoutSpec, config["layout"], "layout", needles=needles)


# What a backend computes (``ProfileSpec.tensors``): logp and lse, or logp only (``capability.exports_lse`` false).
COMPUTED_TENSORS = (FORWARD_TENSORS, (Tensor.LOGP,))


def check_tensors(where: str, tensors: Sequence[str]) -> None:
    if tuple(tensors) not in COMPUTED_TENSORS:
        raise ConfigError(
            f"{where}={list(tensors)} is not one of {[str(t) for t in FORWARD_TENSORS]} (a backend that computes lse) "
            f"or {[str(Tensor.LOGP)]} (one that computes logp only)"
        )


def tensors_of(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The forward tensors a resolved run config judges (its profile's ``tensors``; a config saved before profiles
    had the key judged both)."""
    tensors = tuple(config["profile"].get("tensors", FORWARD_TENSORS))
    check_tensors("profile.tensors", tensors)
    return tensors


def declarations_of(config: Mapping[str, Any]) -> tuple[ExpectedRed, ...]:
    """The expected-red declarations recorded in a run's resolved config (its profile's, then the sweep's)."""
    return (
        *expected_reds(config["profile"].get("expected_red", ()), "profile.expected_red"),
        *expected_reds(config.get("expected_red", ()), "expected_red"),
    )


def config_keys(cls: type) -> list[str]:
    """The config keys ``cls`` reads: one per field, its name unless its metadata names another (or none)."""
    keys = [f.metadata.get(CONFIG_KEY, f.name) for f in fields(cls)]
    return [key for key in keys if key is not None]


def build(cls: type, values: Mapping[str, Any], where: str, **parsed: Any) -> Any:
    """``cls`` from a config mapping (``where`` names it); lists become tuples; ``parsed`` overrides keys.

    A key that ``cls`` does not read (a ``+key=value`` override passes Hydra's schema) is refused by name.
    """
    reject_unknown(values, config_keys(cls), where, ConfigError)
    names = [f.name for f in fields(cls)]
    kwargs = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items() if name in names}
    return cls(**(kwargs | parsed))


def runs_triton_on_cpu(backend_family: Any, device: Any) -> bool:
    """Whether a registered backend runs Triton kernels and the profile puts them on the CPU. A backend module not yet
    imported is not known to run Triton."""
    backend = kernels.BACKENDS.get(backend_family) if isinstance(backend_family, str) else None
    return bool(getattr(backend, "runs_triton", False)) and device == "cpu"


def interpret_triton_on_cpu(backend_family: Any, device: Any) -> None:
    """Triton runs on CPU tensors only in its interpreter, which is chosen when triton is first imported: for a
    backend that runs Triton on the CPU (``runs_triton_on_cpu``), turn it on while nothing has imported triton yet
    (on a GPU machine too). Otherwise the backend is judged when its kernels run."""
    if runs_triton_on_cpu(backend_family, device) and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def import_backend(profile: str, module: str) -> None:
    """Import the module that registers a profile's backend; any failure is a config error naming it."""
    try:
        importlib.import_module(module)
    except SystemExit as stop:  # not an Exception: it would end a sweep's checks with "error: 0", or GREEN
        raise ConfigError(backend_exit(profile, module, stop, "being imported")) from None
    except Exception as err:
        raise ConfigError(
            f"profile {profile!r}: backend_module={module!r} cannot be imported ({type(err).__name__}: {err}); "
            "it must be importable from this Python (on sys.path or PYTHONPATH)"
        ) from err


def backend_exit(profile: str, module: str, stop: SystemExit, during: str) -> str:
    """The error line of a profile's backend module that ended the process (``sys.exit()``) ``during`` its import or
    the run: the exit's code, even 0, is no verdict, so the run or sweep ends with exit 1 and names the module."""
    site = exit_site(stop)
    elsewhere = f" in module {site!r}" if site and site != module else ""
    return (
        f"profile {profile!r}: its backend module {module!r} (profile.backend_module) exited, through "
        f"sys.exit({stop.code!r}){elsewhere}, while {during}; a backend module registers its backend and its kernels "
        "return or raise: neither may end the process"
    )
