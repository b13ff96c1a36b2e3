"""Replay files judged against float64 answers, and every single-run bad input (docs/index.md, "Input bounds")."""

from __future__ import annotations

import re
from dataclasses import fields
from importlib import resources
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from rlsweep_fixtures import WITHOUT_CUDA, compose_run, execute_run, run_rlsweep, tables_left, write_replay
from safetensors.torch import save_file

import rlsweep.model
from rlsweep.config import (
    LayoutConfig,
    ModelConfig,
    ProfileConfig,
    RunConfig,
    WeightSourceConfig,
    WorkloadConfig,
    run_spec,
)
from rlsweep.contract import load_contract, op_class
from rlsweep.errors import ConfigError, ContractError, OutputDirError, ReplayInputError, RlsweepError
from rlsweep.model import build_lm_head, weight_header
from rlsweep.spec import MAX_TP
from rlsweep.tables import TOKENS_TABLE
from rlsweep.workload import replay_workload, workload_shape

HIDDEN, VOCAB, SEQ_LENS = 32, 1500, [6, 9, 5]


def replay_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = sum(SEQ_LENS)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 4.0 / HIDDEN**0.5).to(torch.bfloat16)
    hidden = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16)
    return {
        "weight": weight,
        "hidden_states": hidden,
        "target_ids": torch.randint(0, VOCAB, (rows,), generator=gen),
        "seq_lens": torch.tensor(SEQ_LENS, dtype=torch.int64),
        "active_mask": torch.arange(rows) % 3 != 0,
    }


def replay_run(directory, tensors: dict[str, torch.Tensor]) -> list[str]:
    return write_replay(directory, tensors, HIDDEN, VOCAB)


def test_replay_logp_matches_float64_answers_within_the_contract(tmp_path):
    tensors = replay_tensors()
    overrides = replay_run(tmp_path, tensors)
    done = run_rlsweep(tmp_path / "run", *overrides, "layout=smoke")
    assert done.returncode == 0, done.stdout + done.stderr
    logits = tensors["hidden_states"].double() @ tensors["weight"].double().T
    answers = logits.gather(1, tensors["target_ids"][:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    tokens = pd.read_parquet(tmp_path / "run" / TOKENS_TABLE)
    dtype = compose_run().profile.execution_dtype
    row = load_contract().tolerance("forward_accuracy", "logp", dtype, op=op_class(dtype, None))
    for _, cell in tokens.groupby("cell"):
        cell = cell.sort_values(["sample_id", "position"])
        active = torch.tensor(cell.active.to_numpy())
        assert torch.equal(active, tensors["active_mask"])
        logp = torch.tensor(cell.logp.to_numpy(), dtype=torch.float64)
        bound = torch.tensor(cell.logp_bound.to_numpy())
        assert row.check(logp[active], answers[active], bound[active]).passed
        assert torch.allclose(torch.tensor(cell.ref_logp.to_numpy())[active], answers[active], rtol=0, atol=1e-9)


def mutate(name: str, value) -> dict[str, torch.Tensor]:
    tensors = replay_tensors()
    if value is None:
        del tensors[name]
    elif callable(value):
        tensors[name] = value(tensors[name])
    return tensors


def poke(index, value):
    def edit(tensor):
        tensor = tensor.clone()
        tensor[index] = value
        return tensor

    return edit


REPLAY_BAD_INPUTS = {
    "missing tensor": (mutate("target_ids", None), "missing ['target_ids']"),
    "wrong hidden shape": (mutate("hidden_states", lambda t: t[:, :-1].contiguous()), "hidden_states must be"),
    "wrong target dtype": (mutate("target_ids", lambda t: t.to(torch.int32)), "target_ids must be a 1-D int64"),
    "target >= vocab": (mutate("target_ids", poke(4, VOCAB)), f"target_ids[4] = {VOCAB}"),
    "target < 0": (mutate("target_ids", poke(2, -7)), "target_ids[2] = -7"),
    "seq_lens do not sum": (mutate("seq_lens", poke(0, 1)), "must be >= 1 and sum to"),
    "-100 on an active token": (mutate("target_ids", poke(1, -100)), "-100 may mark only a token active_mask leaves"),
    # Inputs whose logits are all equal: every kernel gives logp = -log V, so no verdict could fail.
    "zero weight": (mutate("weight", torch.zeros_like), "(model.weights.path): every row of the head is the same in"),
    "one weight row repeated": (
        mutate("weight", lambda t: t[:1].expand_as(t).contiguous()),
        "(model.weights.path): every row of the head is the same in bfloat16 (row 0 is repeated)",
    ),
    "zero hidden": (mutate("hidden_states", torch.zeros_like), "hidden_states are zero on every active token"),
    "NaN hidden": (mutate("hidden_states", poke((3, 5), float("nan"))), "hidden_states[3, 5] = nan is not finite"),
    "Inf weight": (mutate("weight", poke((7, 1), float("inf"))), "lm_head.weight[7, 1] = inf is not finite"),
}
# Finite as stored in float32, past the execution dtype's largest value: the cast would make it inf.
EXECUTION_DTYPE = compose_run().profile.execution_dtype
OVERFLOW = 3.4e38
for name, index in (("hidden_states", (2, 3)), ("weight", (7, 1))):
    stored = float(torch.tensor(OVERFLOW, dtype=torch.float32))
    REPLAY_BAD_INPUTS[f"{name} overflows {EXECUTION_DTYPE}"] = (
        mutate(name, lambda t, index=index: poke(index, OVERFLOW)(t.float())),
        f"{'lm_head.weight' if name == 'weight' else name}[{index[0]}, {index[1]}] = {stored} overflows the "
        f"execution dtype {EXECUTION_DTYPE}",
    )


@pytest.mark.parametrize("case", sorted(REPLAY_BAD_INPUTS))
def test_bad_replay_input_names_the_value_and_leaves_no_table(tmp_path, case):
    tensors, message = REPLAY_BAD_INPUTS[case]
    cfg = compose_run(*replay_run(tmp_path, tensors), "layout=smoke")
    with pytest.raises(ReplayInputError, match=re.escape(message)) as caught:
        execute_run(cfg, tmp_path / "run")
    assert str(tmp_path / ("head" if "weight" in message else "capture")) + ".safetensors" in str(caught.value)
    assert tables_left(tmp_path / "run") == []


def test_the_ignore_index_on_tokens_the_active_mask_leaves_out_is_read_as_theirs(tmp_path):
    """Captures label the tokens they leave out with -100: those targets are never read, so they run as any other."""
    tensors = replay_tensors()
    labelled = tensors | {"target_ids": tensors["target_ids"].where(tensors["active_mask"], -100)}
    runs = []
    for name, capture in (("ids", tensors), ("labels", labelled)):
        (tmp_path / name).mkdir()
        runs.append(execute_run(compose_run(*replay_run(tmp_path / name, capture), "layout=smoke"), tmp_path / name))
    assert not runs[1].unexpected and len(runs[1].verdicts)
    logp = [pd.read_parquet(tmp_path / name / TOKENS_TABLE).logp for name in ("ids", "labels")]
    assert (logp[0].to_numpy().view("u4") == logp[1].to_numpy().view("u4")).all()


FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_a_float8_head_is_checked_and_judged_as_any_other_dtype(tmp_path, dtype):
    # torch has no isfinite (nor equal) for float8: the finiteness check of the head crashed on an accepted dtype.
    tensors = replay_tensors() | {"weight": replay_tensors()["weight"].to(dtype)}
    cfg = compose_run(*replay_run(tmp_path, tensors), "layout=smoke", "layout.cells=[BN/packed]", "layout.needles=[]")
    spec = run_spec(cfg)
    head = build_lm_head(spec.model, dtype=spec.profile.dtype, device=torch.device("cpu"))
    assert torch.equal(head.weight, tensors["weight"].to(spec.profile.dtype))  # every float8 value is a bf16 one
    assert execute_run(cfg, tmp_path / "run").exit_code == 0
    spoiled = tensors["weight"].clone()
    spoiled[7, 3] = float("nan")  # e4m3fn has no inf: NaN is its one value that is not finite
    save_file({"lm_head.weight": spoiled}, tmp_path / "head.safetensors")
    with pytest.raises(ReplayInputError, match=re.escape("lm_head.weight[7, 3] = nan is not finite")):
        build_lm_head(spec.model, dtype=spec.profile.dtype, device=torch.device("cpu"))
    save_file({"lm_head.weight": torch.zeros_like(spoiled)}, tmp_path / "head.safetensors")
    with pytest.raises(ReplayInputError, match="every row of the head is the same"):
        build_lm_head(spec.model, dtype=spec.profile.dtype, device=torch.device("cpu"))


def test_a_weight_file_rewritten_after_its_header_was_checked_is_refused_naming_it(tmp_path, monkeypatch):
    spec = run_spec(compose_run(*replay_run(tmp_path, replay_tensors())))
    path = tmp_path / "head.safetensors"

    def checked_then_rewritten(model):  # the header is checked, then the file loses a row before the load
        header = weight_header(model)
        save_file({"lm_head.weight": replay_tensors()["weight"][:-1].contiguous()}, path)
        return header

    monkeypatch.setattr(rlsweep.model, "weight_header", checked_then_rewritten)
    with pytest.raises(ReplayInputError, match=re.escape(f"lm_head.weight in weight file '{path}'")):
        build_lm_head(spec.model, dtype=spec.profile.dtype, device=torch.device("cpu"))


def grown(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The capture with one more token at the end of its last sample."""
    extra = {"hidden_states": tensors["hidden_states"][:1], "target_ids": tensors["target_ids"][:1],
             "active_mask": tensors["active_mask"][:1]}  # fmt: skip
    return (
        tensors
        | {name: torch.cat([tensors[name], row]) for name, row in extra.items()}
        | {"seq_lens": tensors["seq_lens"] + torch.tensor([0, 0, 1])}
    )


# Counted (preflight, the memory estimate) and then read: a file rewritten in between is refused, not mixed.
@pytest.mark.parametrize("rewrite", [grown, lambda t: t | {"seq_lens": torch.tensor([10, 5, 5])}], ids=["T", "lens"])
def test_a_replay_file_rewritten_after_its_tokens_were_counted_is_refused(tmp_path, rewrite):
    spec = run_spec(compose_run(*replay_run(tmp_path, replay_tensors())))
    shape = workload_shape(spec.workload, spec.model)
    replay_run(tmp_path, rewrite(replay_tensors()))
    with pytest.raises(ReplayInputError, match=re.escape(f"changed while the run read it: it held samples of lengths "
                                                         f"{SEQ_LENS}")):  # fmt: skip
        replay_workload(spec.workload, spec.model, shape, device=torch.device("cpu"), seed=0, dtype=spec.profile.dtype)


CONFIG_BAD_INPUTS = {
    "tp < 1": (["tp=0"], ConfigError, "tp must be an integer >= 1, got 0"),
    "tp above the largest served": (["tp=100000"], ConfigError, "tp=100000 is above 256"),
    "chunk_size < 1": (["layout.chunk_size=0"], ConfigError, "layout.chunk_size must be >= 1, got 0"),
    "needle outside its call": (["layout.needles=[{m: 4, pos: 9}]"], ConfigError, "m=4 pos=9"),
    "needles no cell reads": (
        ["layout.cells=[BN/packed]", "layout.needles=[{m: 3, pos: 1}]"],
        ConfigError,
        "layout.needles=[{'m': 3, 'pos': 1}] are read by no cell: layout.cells ['BN/packed'] has no 'needle'",
    ),
    "require_all false": (["contract.chain_logprob_aggregates.require_all=false"], ContractError, "require_all"),
    "clip_interval not numbers": (
        ["contract=v1", "contract.chain_logprob_aggregates.clip_interval=[.nan,1.2]"],
        ContractError,
        "chain_logprob_aggregates.clip_interval[0] must be a finite number, got '.nan'",
    ),
    # The version names the contract file composed (contract=v1): a table must not record another document's.
    "contract version not its file's": (["contract=v1", "contract.version=v9"], ContractError, "version='v9' is not"),
    "contract version of another file": (["contract=v1", "contract.version=v2"], ContractError, "version='v2' is not"),
    "non-bitwise invariance row": (
        ["contract.judgments.forward_invariance.rows.lse.bfloat16.atol=0.01"],
        ContractError,
        "forward_invariance.rows.lse.bfloat16",
    ),
    # Tables, the gate and declarations know a profile by its name: it must be its file's, not another's.
    "profile named as another": (["profile.name=triton_cpu_bf16"], ConfigError,
                                 "profile.name='triton_cpu_bf16' is not its file's name (profile=cpu_bf16)"),
    "weight file missing": (["model.weights.kind=file", "model.weights.path=/nonexistent.st"], ReplayInputError,
                            "/nonexistent.st"),
    # A name key names a run's part in tables and declarations; an empty one (a quoted unset variable) names nothing.
    **{f"blank {key}": ([f"{key}=''"], ConfigError, f"{key}='' is blank")
       for key in ("model.name", "workload.name", "layout.name", "profile.name", "profile.backend_module")},
    "blank head tensor name": (["model.weights.kind=file", "model.weights.path=/x.st", "model.weights.tensor=' '"],
                               ConfigError, "model.weights.tensor=' ' is blank"),
    "empty tables_dir": (["tables_dir=''"], ConfigError, "tables_dir='' is empty"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CONFIG_BAD_INPUTS))
def test_bad_config_names_the_value_and_leaves_no_table(tmp_path, case):
    overrides, error, message = CONFIG_BAD_INPUTS[case]
    with pytest.raises(error, match=re.escape(message)):
        execute_run(compose_run("layout=smoke", *overrides), tmp_path)
    assert tables_left(tmp_path) == []


# A `+key=value` override adds a key past Hydra's schema; nothing reads it, so the RunSpec refuses it by name.
UNKNOWN_KEYS = {
    "model": ("+model.vocab_sise=7", "vocab_sise", ModelConfig),
    "model.weights": ("+model.weights.logit_sd=2", "logit_sd", WeightSourceConfig),
    "profile": ("+profile.expected_reds=[1]", "expected_reds", ProfileConfig),
    "workload": ("+workload.hidden_scal=2", "hidden_scal", WorkloadConfig),
    "layout": ("+layout.chunksize=3", "chunksize", LayoutConfig),
    "run config": ("+tpp=2", "tpp", RunConfig),
}


@pytest.mark.parametrize("group", sorted(UNKNOWN_KEYS))
def test_a_key_nothing_reads_is_refused_naming_the_valid_keys(group):
    override, key, schema = UNKNOWN_KEYS[group]
    with pytest.raises(ConfigError, match=re.escape(f"{group}: unknown key(s) {[key]}; valid: ")) as caught:
        run_spec(compose_run("layout=smoke", override))
    valid = str(caught.value).split("valid: ")[1]
    assert valid.split(", ") == [field.name for field in fields(schema)]


# A replay's file gives its hidden states and lengths: a synthetic key set beside it is refused, not ignored.
@pytest.mark.parametrize("override", ["workload.hidden_scale=2", "workload.seq_lens=[4]", "workload.prompt_lens=[1]"])
def test_a_synthetic_workload_key_of_a_replay_is_refused(tmp_path, override):
    replay = replay_run(tmp_path, replay_tensors())
    with pytest.raises(ConfigError, match=re.escape(f"workload.{override.split('.')[1].split('=')[0]}=")):
        run_spec(compose_run(*replay, override))
    run_spec(compose_run(*replay))


# A key the chosen options leave unread changes nothing: set by the user, a sweep over it would run one job several
# times. Each with the options that leave it unread (a replay's files are never opened by the parse).
UNREAD_KEYS = {
    "model.weights.seed": ["model=replay", "model.hidden_size=64", "model.vocab_size=3001", "model.weights.path=h.st"],
    "model.weights.logit_std": ["model=replay", "model.hidden_size=64", "model.vocab_size=3001",
                                "model.weights.path=h.st"],
    "model.padded_vocab_size": [],  # model=tiny: synthetic weights of model.vocab_size rows
    "model.tie_word_embeddings": [],
    "layout.chunk_size": ["layout=smoke"],  # no chunked cell
    "layout.needles": ["layout.cells=[BN/packed,B1/full]"],
    "seed": ["workload=replay", "workload.path=c.st", "layout.cells=[BN/packed,B1/full]"],  # nothing drawn from it
    "workload.hidden_scale": ["workload=replay", "workload.path=c.st"],
}  # fmt: skip
USER_VALUES = {"model.weights.seed": "8", "model.weights.logit_std": "4.0", "model.padded_vocab_size": "4000",
               "model.tie_word_embeddings": "true", "layout.chunk_size": "5", "layout.needles": "[{m: 3, pos: 1}]",
               "seed": "3", "workload.hidden_scale": "2"}  # fmt: skip


@pytest.mark.parametrize("key", sorted(UNREAD_KEYS))
def test_a_key_the_chosen_options_leave_unread_is_refused_when_the_user_sets_it(key):
    # Some values equal what the shipped files give (layout=smoke ships chunk_size 5): set on the command line, they
    # are the user's all the same, and a sweep over them would begin with that value.
    with pytest.raises(ConfigError, match=re.escape(f"{key}=")) as caught:
        run_spec(compose_run(*UNREAD_KEYS[key], f"{key}={USER_VALUES[key]}"))
    assert f"leave {key} unset, or " in str(caught.value)
    run_spec(compose_run(*UNREAD_KEYS[key]))  # the same options with the key as shipped


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=qwen3_8b", "model.weights.kind=file", "model.weights.path=h.st"],  # its synthetic seed 8, logit_std 4
        ["layout=full", "layout.cells=[BN/packed]"],  # full's needles
        ["layout=smoke"],  # smoke's chunk_size, no chunked cell
        ["layout.cells=[BN/packed]", "layout.needles=[]", "model.padded_vocab_size=null"],  # set to unset
    ],
    ids=lambda overrides: " ".join(overrides),
)
def test_shipped_defaults_the_chosen_options_leave_unread_are_ignored(overrides):
    spec = run_spec(compose_run(*overrides))
    assert not spec.layout.needles or "needle" in spec.layout.cells  # no needle is computed that no cell reads


def test_a_key_a_users_own_config_sets_that_the_run_leaves_unread_is_refused(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text(
        "name: mine\nhidden_size: 64\nvocab_size: 3001\npadded_vocab_size: 4096\nweights: {kind: synthetic}\n"
    )
    with pytest.raises(ConfigError, match=re.escape("model.padded_vocab_size=4096 applies to weight files only")):
        run_spec(compose_run(f"hydra.searchpath=[file://{tmp_path}]", "model=mine"))


# A file named for a synthetic source would go unread: the run would judge synthetic inputs and say nothing.
@pytest.mark.parametrize(
    "override", ["workload.path=capture.st", "model.weights.path=head.st", "model.weights.tensor=embed.weight"]
)
def test_a_file_key_of_a_synthetic_source_is_refused(override):
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=re.escape(f"{key}={value!r} applies to ")) as caught:
        run_spec(compose_run(override))
    assert f"leave {key} unset" in str(caught.value)


# An empty selector list selects nothing; omitting the key is how a declaration says "every" (docs/sweeps.md).
SELECTORS = ("profiles", "tp", "cells", "tensors")


@pytest.mark.parametrize("where", ["expected_red", "profile.expected_red"])
@pytest.mark.parametrize("selector", SELECTORS)
def test_an_empty_selector_of_a_declaration_is_refused(where, selector):
    declaration = f"{where}=[{{judgment: forward_invariance, {selector}: [], reason: x}}]"
    with pytest.raises(ConfigError, match=re.escape(f"{selector}=[] selects nothing")):
        run_spec(compose_run("profile=negative_control_cpu", "layout=smoke", declaration))


# strict takes a boolean alone: OmegaConf turned 0, 1, 2 and "yes" into one, and strict=0 loosened a declaration.
@pytest.mark.parametrize("where", ["expected_red", "profile.expected_red"])
@pytest.mark.parametrize(("value", "shown"), [("0", "0"), ("2", "2"), ("yes", "'yes'"), ("'true'", "'true'")])
def test_a_declaration_whose_strict_is_not_a_boolean_is_refused(where, value, shown):
    declaration = f"{where}=[{{judgment: forward_invariance, reason: x, strict: {value}}}]"
    with pytest.raises(ConfigError, match=re.escape(f"strict={shown} is not a boolean; use true")):
        run_spec(compose_run("profile=negative_control_cpu", "layout=smoke", declaration))
    for flag in (True, False):
        loose = declaration.replace(f"strict: {value}", f"strict: {str(flag).lower()}")
        spec = run_spec(compose_run("profile=negative_control_cpu", "layout=smoke", loose))
        assert [d.strict for d in spec.expectations] == [flag]


# A tp degree no run can have selects nothing too: refused before any kernel, not a red row after the sweep.
@pytest.mark.parametrize("where", ["expected_red", "profile.expected_red"])
@pytest.mark.parametrize("degree", [0, -1, MAX_TP + 1])
def test_a_declaration_of_a_tp_no_run_can_have_is_refused(where, degree):
    declaration = f"{where}=[{{judgment: tp_invariance, tp: [1, {degree}], reason: x}}]"
    with pytest.raises(ConfigError, match=re.escape(f"tp={degree} is no tp degree a run can have; use 1 <= tp <= ")):
        run_spec(compose_run("layout=smoke", declaration))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_declaration_without_tp_selects_every_tp(tp):
    declaration = "expected_red=[{judgment: forward_invariance, reason: x}]"
    spec = run_spec(compose_run("profile=negative_control_cpu", "layout=smoke", f"tp={tp}", declaration))
    assert spec.expectations == list(spec.expected_red)


CONF = Path(str(resources.files("conf")))
# Every checked-in option of every group, with what a replay option cannot run without.
CHECKED_IN = [
    [f"{path.parent.name}={path.stem}"]
    + (
        ["model.hidden_size=8", "model.vocab_size=64", "model.weights.path=head.st"]
        if path.parent.name == "model" and path.stem == "replay"
        else []
    )
    + (["workload.path=capture.st"] if path.parent.name == "workload" and path.stem == "replay" else [])
    + (["model.body.path={checkpoint}"] if path.parent.name == "model" and path.stem == "checkpoint" else [])
    # A profile that names a body runs on a whole model only (a head alone is refused).
    + (["model=qwen3_tiny"] if path.parent.name == "profile" and "body_attention:" in path.read_text() else [])
    for path in sorted(CONF.glob("*/*.yaml"))
]


@pytest.mark.parametrize("overrides", CHECKED_IN, ids=lambda overrides: overrides[0])
def test_every_checked_in_config_parses(overrides, tmp_path):
    # A checkpoint dir as model=checkpoint reads it at parse time: config.json (the head's sizes) beside weights.
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 64, "vocab_size": 300}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    spec = run_spec(compose_run(*(o.format(checkpoint=tmp_path) for o in overrides)))
    if spec.model.body is not None:  # a whole model's head has its config's sizes
        fields = spec.model.body.config_fields()
        assert (spec.model.hidden_size, spec.model.vocab_size) == (fields["hidden_size"], fields["vocab_size"])


@pytest.mark.skipif(not yaml.__with_libyaml__, reason="PyYAML without libyaml: OmegaConf's own loader is kept")
def test_hydra_reads_every_config_file_with_libyaml_as_omegaconfs_own_loader_reads_it():
    from omegaconf import _utils

    fast, own = _utils.get_yaml_loader(), _utils.get_yaml_loader.replaced()
    assert issubclass(fast, yaml.cyaml.CParser) and own.__name__ in [base.__name__ for base in fast.__mro__]
    files = sorted(CONF.rglob("*.yaml")) + sorted((Path(__file__).parent / "toy_conf").rglob("*.yaml"))
    assert len(files) > 40
    for path in files:
        text = path.read_text()
        assert yaml.load(text, Loader=fast) == yaml.load(text, Loader=own), path
    for text in ("a: 1\nb: 2\na: 3\n", "x: {y: 1, y: 2}\n"):  # OmegaConf refuses a repeated key; so does this
        for loader in (fast, own):
            with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key"):
                yaml.load(text, Loader=loader)
    assert yaml.load("x: 1e-5\nwhen: 2021-01-01\n", Loader=fast) == {"x": 1e-05, "when": "2021-01-01"}


def test_unwritable_tables_dir_is_a_usage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OutputDirError, match="cannot be written"):
        execute_run(compose_run("layout=smoke"), blocker / "run")


@pytest.mark.parametrize(
    ("overrides", "pinned"),
    [
        ([f"model.weight_sha256={'0' * 64}"], f"pinned weight_sha256 {'0' * 64}"),
        ([f"contract.expected_sha256={'0' * 64}"], f"pinned {'0' * 64}"),
    ],
)
def test_pinned_hash_mismatch_is_red(tmp_path, overrides, pinned):
    outcome = execute_run(compose_run("layout=smoke", *overrides), tmp_path)
    assert outcome.exit_code == 2
    assert [v.detail.startswith(pinned) for v in outcome.unexpected] == [True]


@pytest.mark.parametrize("key", ["model.weight_sha256", "contract.expected_sha256"])
@pytest.mark.parametrize("pin", ["0000", "''", "A" * 64, "0" * 63 + "g", "0" * 65])
def test_a_pin_that_could_never_match_is_refused_before_the_run(key, pin):
    """A pin not spelled as the tables record a sha256 (64 lowercase hex digits) could only end red, after the run."""
    name = key.split(".")[-1]  # a contract's messages name the file first: "contract=v2: expected_sha256 ..."
    with pytest.raises(RlsweepError, match=re.escape(f"{name} must be null or a sha256 of 64 lowercase hex digits")):
        run_spec(compose_run("layout=smoke", f"{key}={pin}"))


def test_distributed_tp_needs_a_gpu_per_rank(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = compose_run("profile=triton_cuda_bf16", "tp=2", "tp_mode=distributed", "layout=smoke")
    with pytest.raises(ConfigError, match="needs 2 GPUs"):
        execute_run(cfg, tmp_path)
    assert tables_left(tmp_path) == []


CLI_BAD_INPUTS = {
    "unknown group option": (["profile=nope"], 1, "Available options in 'profile'"),
    "wrong type": (["tp=two"], 1, "Value 'two' of type 'str' could not be converted to Integer"),
    "tp < 1": (["tp=0"], 1, "tp must be an integer >= 1, got 0"),
    "CUDA profile without CUDA": (["profile=cuda_bf16"], 2, "requires device 'cuda'"),
    "unwritable run dir": (["hydra.run.dir=/dev/null/run"], 1, "'/dev/null' is a file, not a directory"),
}


@pytest.mark.parametrize("case", sorted(CLI_BAD_INPUTS))
def test_cli_bad_input_exit_code_and_one_paragraph(tmp_path, case):
    overrides, code, message = CLI_BAD_INPUTS[case]
    done = run_rlsweep(tmp_path, "layout=smoke", *overrides, env=WITHOUT_CUDA)
    assert done.returncode == code
    assert message in done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    if code == 1:
        assert tables_left(tmp_path) == []
