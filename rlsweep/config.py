"""The config layer: Hydra's schema for a run config, the one parse into a RunSpec, and a sweep's job list.

Only this module, ``rlsweep.callbacks`` and ``rlsweep.__main__`` import Hydra or OmegaConf (docs/design.md):
everything below takes the typed ``rlsweep.spec.RunSpec`` that ``run_spec`` returns. The schema types the keys
Hydra composes; ``rlsweep.spec`` checks their values.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra.core.config_loader import ConfigLoader
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import MISSING, DictConfig, OmegaConf

from rlsweep import CONF_DIR
from rlsweep.discovery import check_distinct_jobs
from rlsweep.errors import ConfigError, RlsweepError
from rlsweep.manifest import config_text_sha256, plain_yaml
from rlsweep.spec import RunSpec, parse_run_spec
from rlsweep.unread import ABSENT, CONDITIONAL_KEYS, refuse_unread, value_at

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


@dataclass
class WeightSourceConfig:
    """Where the lm_head weight comes from: counter-based synthetic values or a safetensors file."""

    kind: str = "synthetic"  # synthetic | file
    seed: int = 0  # synthetic: the weight stream's seed
    logit_std: float = 4.0  # synthetic: logits std for unit-std hidden (real LMs: 3-5; in [1/64, 64], spec.py)
    path: str | None = None  # file: local safetensors file
    tensor: str = "lm_head.weight"  # file: HF name of the head


@dataclass
class BodyConfig:
    """A whole model's body (docs/whole_model.md): a Hugging Face causal LM built from a config or read from a local
    checkpoint dir; its hidden states feed the head."""

    source: str = "config"  # config | checkpoint
    seed: int = 0  # config: the synthetic weights' seed
    hf_config: dict[str, Any] | None = None  # config: a transformers config's fields, with its model_type
    path: str | None = None  # checkpoint: a local dir with config.json and *.safetensors


@dataclass
class ModelConfig:
    """The pinned identity of the lm_head under test, and of the body before it where a whole model is swept."""

    name: str = MISSING
    hidden_size: int | None = MISSING  # null: a whole model's, read from its config (model.body)
    vocab_size: int | None = MISSING
    padded_vocab_size: int | None = None  # the checkpoint's padded embedding rows, if it pads
    tie_word_embeddings: bool = False
    weights: WeightSourceConfig = field(default_factory=WeightSourceConfig)
    weight_sha256: str | None = None  # pin: a different weight_hash is a red verdict
    body: BodyConfig | None = None  # a whole model: its body makes the hidden states (null: the head alone)


@dataclass
class ExpectedVerdictConfig:
    """Verdict rows expected to be red (``strict``, the default: one that passes is itself red; false: it may pass).

    Declared in a profile (``profile.expected_red``) or at the top level by a sweep config
    (``expected_red``), where ``profiles`` picks the profiles it applies to.
    """

    judgment: str = MISSING
    profiles: list[str] = field(default_factory=lambda: ["*"])  # fnmatch patterns over profile names
    tp: list[int] | None = None  # the tp degrees it applies to; null (the key left out): every tp
    cells: list[str] = field(default_factory=lambda: ["*"])  # fnmatch patterns over cell names
    tensors: list[str] = field(default_factory=lambda: ["*"])
    reason: str = MISSING
    # Any, not bool: OmegaConf would turn strict=0, 2 or "yes" into a bool on its way in; rlsweep.spec refuses them.
    strict: Any = True


@dataclass
class ProfileConfig:
    """A backend on a device: dtypes, tile, determinism scope and the nodes that must run."""

    name: str = MISSING
    backend_family: str = MISSING  # a kernels backend id: aten | triton | control
    device: str = "cpu"  # cpu | cuda
    execution_dtype: str = "bfloat16"
    logits_dtype: str | None = None  # where the logits are rounded (the op class); null: the execution dtype
    vocab_tile: int = 256
    determinism_scope: str = "fixed_topology"  # cross_tp_bitwise | fixed_topology
    merge_order: str = "rank_shard"  # global_tile | rank_shard: how the TP partials are merged
    required_nodes: dict[str, str] = field(default_factory=dict)  # op node -> backend id
    backend_module: str | None = None  # imported first: a module that registers backend_family (docs/extending.md)
    # A whole-model profile's attention: eager | sdpa (transformers' stock) | invariant; null: a head profile (a whole
    # model's body then runs sdpa; a profile that names a body is refused for a head alone)
    body_attention: str | None = None
    body_packing: str = "confined"  # confined | unconfined: BN/packed without its per-sequence mask (a control)
    tensors: list[str] = field(default_factory=lambda: ["logp", "lse"])  # what the backend computes: [logp] for one
    # that exports no lse (a fused head such as liger); every forward verdict is judged on each of these
    expected_red: list[ExpectedVerdictConfig] = field(default_factory=list)


@dataclass
class WorkloadConfig:
    """The logical samples: synthetic (seq/prompt lengths) or replayed from a safetensors file."""

    name: str = MISSING
    source: str = "synthetic"  # synthetic | replay
    seq_lens: list[int] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    hidden_scale: float = 1.0  # synthetic: std of the hidden states, in [1/64, 64] (spec.py; 8: peaked)
    sample_scales: list[float] = field(default_factory=list)  # synthetic: per sample, times hidden_scale; []: 1.0
    probe_samples: list[int] = field(default_factory=list)  # synthetic: samples whose targets are boundary columns
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
    error_model: dict[str, Any] | None = None  # v3 on: the kernel_* judgments' failure probability


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
    grad: bool = False  # also differentiate the logprob and judge the gradients (gradient_* verdicts)
    expected_red: list[ExpectedVerdictConfig] = field(default_factory=list)  # sweep-level declarations
    tables_dir: str | None = None  # default: the Hydra run's output dir


# The config groups whose options are files of keys (conf/<group>/<option>.yaml), each with its schema.
GROUPS = {"model": ModelConfig, "profile": ProfileConfig, "workload": WorkloadConfig, "layout": LayoutConfig}


def check_complete(cfg: DictConfig) -> None:
    """Every mandatory value (``???``, e.g. model=replay's sizes) is set; all unset keys are named at once."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"mandatory config values are not set: {', '.join(missing)}; give each on the command line "
            f"(e.g. {missing[0]}=...)"
        )


def run_spec(cfg: DictConfig) -> RunSpec:
    """The typed, checked run of a composed config: the only way in.

    ``cfg`` carries its ``hydra`` node (a sweep job's config, ``compose(..., return_hydra_config=True)``), or
    comes without it from inside the app, where ``HydraConfig`` holds it: its ``runtime.choices`` name the
    contract and profile files composed, whose names the contract's version and the profile's name must be.
    """
    if "hydra" in cfg:
        hydra_cfg = cfg.hydra
        cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    elif HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
    else:
        raise RlsweepError("run_spec needs a config as Hydra composed it: with its hydra node, or inside the app")
    choices = hydra_cfg.runtime.choices
    check_complete(cfg)
    config = OmegaConf.to_container(cfg, resolve=True)
    spec = parse_run_spec(config, contract_file=choices.contract, profile_file=choices.profile)
    refuse_unread(config, user_set_keys(config, list(hydra_cfg.overrides.task), dict(choices)))
    return spec


def override_key(override: str) -> str | None:
    """The key a command-line override sets (``+model.weights.seed=3`` sets ``model.weights.seed``); None for a
    deletion (``~key``), which sets nothing."""
    key = override.split("=", 1)[0].strip()
    return None if key.startswith("~") else key.lstrip("+").split("@", 1)[0]


@functools.cache
def shipped_file(path: Path) -> dict[str, Any]:
    """A shipped config file's keys (its defaults list and hydra node aside); {} where there is no such file."""
    if not path.is_file():
        return {}
    document = plain_yaml(path.read_text()) or {}
    return {key: value for key, value in document.items() if key not in ("defaults", "hydra")}


@functools.cache
def schema_defaults() -> dict[str, Any]:
    """Every key's value as the schema gives it (``???`` where it gives none), the groups' included."""
    defaults = OmegaConf.to_container(OmegaConf.structured(RunConfig))
    return defaults | {group: OmegaConf.to_container(OmegaConf.structured(schema)) for group, schema in GROUPS.items()}


def shipped_value(key: str, choices: Mapping[str, Any]) -> Any:
    """``key``'s value as the shipped configs give it for the chosen options: the schema's, then the chosen option file
    of its group in conf/, then conf/config.yaml, then the chosen shipped sweep (``@package _global_``)."""
    group = key.split(".")[0]
    layers = [schema_defaults()]
    if group in GROUPS and choices.get(group):
        layers.append({group: shipped_file(CONF_DIR / group / f"{choices[group]}.yaml")})
    layers.append(shipped_file(CONF_DIR / "config.yaml"))
    if choices.get("sweep"):
        layers.append(shipped_file(CONF_DIR / "sweep" / f"{choices['sweep']}.yaml"))
    values = [value for value in (value_at(layer, key) for layer in layers) if value is not ABSENT]
    return values[-1]


def user_set_keys(config: Mapping[str, Any], overrides: list[str], choices: Mapping[str, Any]) -> frozenset[str]:
    """The keys some choice may leave unread (``rlsweep.unread.CONDITIONAL_KEYS``) that the user set: named by a
    command-line override (a sweep job's swept value is one), or composed to a value other than the shipped configs
    give it (the user's own config file). Set to nothing (null, [], {}: ``layout.needles=[]``), a key is unset."""
    named = {override_key(override) for override in overrides}
    keys = set()
    for key in CONDITIONAL_KEYS:
        value = value_at(config, key)
        if value is ABSENT or value in (None, [], {}):
            continue
        if key in named or value != shipped_value(key, choices):
            keys.add(key)
    return frozenset(keys)


def saved_config_sha256(cfg: DictConfig) -> str:
    """The hash of the text Hydra saves beside a run (``.hydra/config.yaml``), for the run's manifest to name."""
    return config_text_sha256(OmegaConf.to_yaml(cfg))


def sweep_record(hydra_cfg: DictConfig, where: str) -> dict[str, Any]:
    """What a sweep's jobs are expanded from, as Hydra records it in ``multirun.yaml``: the basic sweeper's
    ``params`` (None where unset) and the command line's overrides (``task``); ``where`` names the sweep."""
    try:
        sweeper = OmegaConf.select(hydra_cfg, "sweeper._target_")
        params_node = OmegaConf.select(hydra_cfg, "sweeper.params")
        params = OmegaConf.to_container(params_node, resolve=False) if params_node is not None else None
        task = OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)
    except Exception as err:
        raise ConfigError(f"{where} cannot be read as Hydra's sweep record: {' '.join(str(err).split())}") from err
    if sweeper != BASIC_SWEEPER:
        raise RlsweepError(f"{where}: cannot list the jobs of sweeper {sweeper!r}; rlsweep gates {BASIC_SWEEPER}")
    return {"params": params, "task": task}


def job_list(record: dict[str, Any], where: str, config_loader: ConfigLoader) -> list[tuple[str, ...]]:
    """Every job's overrides from a ``sweep_record``, in the basic sweeper's order; no two alike (``where`` names
    the sweep in errors). ``config_loader``: the sweep's, which lists a group's options for a ``glob(...)`` sweep."""
    arguments = [f"{key}={value}" for key, value in (record["params"] or {}).items()] + list(record["task"])
    choices: dict[str, list[str]] = {}  # key -> its "key=value" choices; a later override of a key replaces it
    for override in OverridesParser.create(config_loader=config_loader).parse_overrides(arguments):
        key = override.get_key_element()
        if not override.is_sweep_override():
            choices[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            choices[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise RlsweepError(f"{where}: the basic sweeper cannot expand {key!r} ({override.input_line})")
    jobs = list(itertools.product(*choices.values()))
    check_distinct_jobs(jobs, where)
    return jobs


def register_configs() -> None:
    """Make the schema available to Hydra as ``run_schema`` (first entry of conf/config.yaml's defaults), and have
    OmegaConf parse Hydra's config files with libyaml (``parse_with_libyaml``)."""
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
    parse_with_libyaml()


def parse_with_libyaml() -> None:
    """OmegaConf's YAML loader (``omegaconf._utils.get_yaml_loader``, which every ``OmegaConf.load`` of a Hydra
    composition asks for) on libyaml's parser, where PyYAML was built with it: the same loader class otherwise (its
    duplicate-key refusal, its float and timestamp resolution, which run after the parser), so the same configs: a
    run's composition took 107 ms instead of 138 on a 2-core CPU (docs/benchmarks.md#cpu-the-test-suite)."""
    from omegaconf import _utils

    parser = getattr(getattr(yaml, "cyaml", None), "CParser", None)
    if parser is None or getattr(_utils.get_yaml_loader, "libyaml", False):
        return
    omegaconf_loader = _utils.get_yaml_loader()

    class LibyamlLoader(parser, omegaconf_loader):
        def __init__(self, stream: Any) -> None:
            parser.__init__(self, stream)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

    def get_yaml_loader() -> type:
        return LibyamlLoader

    get_yaml_loader.libyaml = True
    get_yaml_loader.replaced = _utils.get_yaml_loader  # OmegaConf's own, which tests compare it with
    _utils.get_yaml_loader = get_yaml_loader
