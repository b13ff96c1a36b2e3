"""Structured configs: the schema Hydra validates every composed run config against (docs/index.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

import kernels
from rlsweep.errors import ConfigError

WEIGHT_SOURCES = ("synthetic", "file")
DEVICES = kernels.PLATFORMS
WORKLOAD_SOURCES = ("synthetic", "replay")


@dataclass
class WeightSourceConfig:
    """Where the lm_head weight comes from: counter-based synthetic values or a safetensors file."""

    kind: str = "synthetic"  # synthetic | file
    seed: int = 0  # synthetic: the weight stream's seed
    logit_std: float = 4.0  # synthetic: std of logits for unit-std hidden states (real LMs: 3-5)
    path: str | None = None  # file: local safetensors file
    tensor: str = "lm_head.weight"  # file: HF name of the head


@dataclass
class ModelConfig:
    """The pinned identity of the lm_head under test."""

    name: str = MISSING
    hidden_size: int = MISSING
    vocab_size: int = MISSING
    padded_vocab_size: int | None = None  # the checkpoint's padded embedding rows, if it pads
    tie_word_embeddings: bool = False
    weights: WeightSourceConfig = field(default_factory=WeightSourceConfig)
    weight_sha256: str | None = None  # pin: a different weight_hash is a red verdict


@dataclass
class ExpectedVerdictConfig:
    """Verdict rows expected to be red (strict: one that passes is itself red).

    Declared in a profile (``profile.expected_red``) or at the top level by a sweep config
    (``expected_red``), where ``profiles`` picks the profiles it applies to.
    """

    judgment: str = MISSING
    profiles: list[str] = field(default_factory=lambda: ["*"])  # fnmatch patterns over profile names
    tp: list[int] = field(default_factory=list)  # the tp degrees it applies to; empty: every tp
    cells: list[str] = field(default_factory=lambda: ["*"])  # fnmatch patterns over cell names
    tensors: list[str] = field(default_factory=lambda: ["*"])
    reason: str = MISSING


@dataclass
class ProfileConfig:
    """A backend on a device: dtypes, tile, determinism scope and the nodes that must run."""

    name: str = MISSING
    backend_family: str = MISSING  # a kernels backend id: aten | triton | control
    device: str = "cpu"  # cpu | cuda
    execution_dtype: str = "bfloat16"
    logits_dtype: str | None = None  # where the logits are rounded (the op class); null: the execution dtype
    accumulation_dtype: str = "float32"
    tf32: bool = False
    vocab_tile: int = 256
    determinism_scope: str = "fixed_topology"  # cross_tp_bitwise | fixed_topology
    merge_order: str = "rank_shard"  # global_tile | rank_shard: how the TP partials are merged
    required_nodes: dict[str, str] = field(default_factory=dict)  # op node -> backend id
    expected_red: list[ExpectedVerdictConfig] = field(default_factory=list)


@dataclass
class WorkloadConfig:
    """The logical samples: synthetic (seq/prompt lengths) or replayed from a safetensors file."""

    name: str = MISSING
    source: str = "synthetic"  # synthetic | replay
    seq_lens: list[int] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    hidden_scale: float = 1.0  # synthetic: std of the hidden states; 8 makes logits 8x larger and softmax peaked
    path: str | None = None  # replay: hidden_states, target_ids, seq_lens, optional active_mask


@dataclass
class NeedleConfig:
    """A needle cell: the packed logical rows at row ``pos`` of a call with ``m`` unrelated filler rows."""

    m: int = MISSING
    pos: int = MISSING


@dataclass
class LayoutConfig:
    """Which layout cells one run computes; the first is the canonical cell."""

    name: str = MISSING
    cells: list[str] = field(default_factory=list)  # cell kinds from rlsweep.layouts.CELL_KINDS
    chunk_size: int = 5
    needles: list[NeedleConfig] = field(default_factory=list)


@dataclass
class ContractConfig:
    """The tolerance contract document; rlsweep.contract validates its inside."""

    version: str = MISSING
    expected_sha256: str | None = None
    dtype_policy: dict[str, Any] = field(default_factory=dict)
    comparison_roles: dict[str, Any] = field(default_factory=dict)
    judgments: dict[str, Any] = field(default_factory=dict)
    chain_logprob_aggregates: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig:
    model: ModelConfig = MISSING
    profile: ProfileConfig = MISSING
    workload: WorkloadConfig = MISSING
    layout: LayoutConfig = MISSING
    contract: ContractConfig = MISSING
    tp: int = 1
    tp_mode: str = "emulated"  # emulated | distributed
    seed: int = 0
    expected_red: list[ExpectedVerdictConfig] = field(default_factory=list)  # sweep-level declarations
    tables_dir: str | None = None  # default: the Hydra run's output dir


def check_complete(cfg: DictConfig) -> None:
    """Every mandatory value (``???``, e.g. model=replay's sizes) is set; all unset keys are named at once."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"mandatory config values are not set: {', '.join(missing)}; give each on the command line "
            f"(e.g. {missing[0]}=...)"
        )


def register_configs() -> None:
    """Make the schema available to Hydra as ``run_schema`` (first entry of conf/config.yaml's defaults)."""
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
