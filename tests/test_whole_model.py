"""A whole Hugging Face causal LM: built without a hub, its weights and fingerprint, its token workload, and its
forward over the cells trainers and inference engines call it in (rlsweep/hf_model.py, rlsweep/model_cells.py)."""

from __future__ import annotations

import json
import math
import types

import pandas as pd
import pytest
import torch

transformers = pytest.importorskip("transformers")

import kernels  # noqa: E402
from rlsweep.dataflow import dataflow_verdict, pre_norm_residual_edges  # noqa: E402
from rlsweep.divergence import DIVERGENCE_COLUMNS, first_diverging, row_local_mismatches, row_mixing  # noqa: E402
from rlsweep.errors import ConfigError, ReplayInputError  # noqa: E402
from rlsweep.hf_model import WholeModelSpec, build_model, weights_hash  # noqa: E402
from rlsweep.model_cells import (  # noqa: E402
    body_provenance,
    cell_hidden,
    cell_logprobs,
    confinement_mask,
    replayed_workload,
    token_workload,
    trainer_vs_rollout,
)
from rlsweep.model_judgments import row_local_verdict  # noqa: E402
from rlsweep.model_run import head_bound  # noqa: E402
from rlsweep.module_accuracy import ACCURACY_COLUMNS, end_to_end_error, module_accuracy  # noqa: E402
from rlsweep.recording import record_cell  # noqa: E402

QWEN3_TINY = {
    "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 3001,
    "max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    "tie_word_embeddings": False,
}  # fmt: skip
CELLS = ["B1/full", "BN/pad_right", "BN/pad_left", "BN/permuted", "B1/chunked", "BN/chunked", "decode",
         "needle/M=3/pos=1"]  # fmt: skip


def spec(**changes) -> WholeModelSpec:
    fields = {**QWEN3_TINY, **changes.pop("hf_config", {})}
    return WholeModelSpec.parse({"name": "qwen3_tiny", "source": "config", "seed": 7, "hf_config": fields, **changes})


@pytest.fixture(scope="module")
def eager():
    return build_model(spec(), dtype=torch.bfloat16, attention="eager")


@pytest.fixture(scope="module")
def workload(eager):
    return token_workload(eager, 3, [5, 8, 6, 9], [6, 6, 11, 10])


def test_transformers_never_takes_this_projects_kernels_package_for_the_hubs():
    # transformers imports the hub's `kernels` when a package of that name has a version in its window.
    from transformers.utils import is_kernels_available

    assert not is_kernels_available()
    assert hasattr(kernels, "lm_head_logprob")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"source": "checkpoint", "path": "Qwen/Qwen3-1.7B"},
            "not a local directory: rlsweep never reaches a model hub",
        ),
        ({"source": "config", "hf_config": {**QWEN3_TINY, "auto_map": {"AutoModel": "x.Y"}}}, "trust_remote_code"),
        ({"source": "config", "hf_config": {"hidden_size": 8}}, "needs the transformers config's fields"),
        ({"source": "hub"}, "model.body.source='hub' is not one of"),
        ({"source": "config", "hf_config": QWEN3_TINY, "seed": -1}, "model.body.seed=-1"),
    ],
)
def test_a_model_that_would_reach_a_hub_or_run_remote_code_is_refused_in_one_line(raw, message):
    with pytest.raises(ConfigError, match=message) as err:
        WholeModelSpec.parse({"name": "m", **raw})
    assert "\n" not in str(err.value)


def test_a_checkpoint_dir_needs_config_and_safetensors_and_no_auto_map(tmp_path, eager):
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        WholeModelSpec.parse({"name": "m", "source": "checkpoint", "path": str(tmp_path)})
    eager.model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.bin")
    with pytest.raises(ConfigError, match=r"has no \*.safetensors"):
        WholeModelSpec.parse({"name": "m", "source": "checkpoint", "path": str(tmp_path)})
    (tmp_path / "weights.bin").rename(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "m.M"}}))
    remote = WholeModelSpec.parse({"name": "m", "source": "checkpoint", "path": str(tmp_path)})
    with pytest.raises(ConfigError, match="trust_remote_code"):
        build_model(remote, dtype=torch.bfloat16, attention="eager")


def test_synthetic_weights_are_a_function_of_name_and_seed_and_the_fingerprint_covers_config_and_bits(tmp_path, eager):
    again = build_model(spec(), dtype=torch.bfloat16, attention="sdpa")
    assert (again.config_fingerprint, again.weights_hash) == (eager.config_fingerprint, eager.weights_hash)
    one_layer = build_model(spec(hf_config={"num_hidden_layers": 1}), dtype=torch.bfloat16, attention="eager")
    shared = "model.layers.0.self_attn.q_proj.weight"  # the same name gets the same values, whatever else exists
    assert torch.equal(
        kernels.bit_view(one_layer.model.get_parameter(shared)), kernels.bit_view(eager.model.get_parameter(shared))
    )
    assert one_layer.config_fingerprint != eager.config_fingerprint
    norm = eager.model.get_parameter("model.norm.weight").float()
    assert 0.05 < norm.std() < 0.2 and abs(norm.mean() - 1) < 0.05  # near 1, not all 1: a wrong-dtype norm shows
    rope = build_model(spec(hf_config={"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
                       dtype=torch.bfloat16, attention="eager")  # fmt: skip
    assert rope.config_fingerprint != eager.config_fingerprint
    reseeded = build_model(spec(seed=8), dtype=torch.bfloat16, attention="eager")
    assert reseeded.weights_hash != eager.weights_hash and reseeded.config_fingerprint == eager.config_fingerprint
    # Saved and read back from a local dir: save_pretrained's own fields change neither fingerprint.
    eager.model.save_pretrained(tmp_path)
    loaded = build_model(WholeModelSpec.parse({"name": "m", "source": "checkpoint", "path": str(tmp_path)}),
                         dtype=torch.bfloat16, attention="eager")  # fmt: skip
    assert (loaded.config_fingerprint, loaded.weights_hash) == (eager.config_fingerprint, eager.weights_hash)
    with torch.no_grad():
        loaded.model.get_parameter("model.layers.1.mlp.down_proj.weight").view(-1).view(torch.int16)[5] ^= 1
    assert weights_hash(loaded.model) != eager.weights_hash


def test_responses_are_sampled_from_the_model_by_seed_and_the_targets_are_the_next_tokens(eager, workload):
    assert workload.seq_lens == (11, 14, 17, 19)
    again = token_workload(eager, 3, [5, 8, 6, 9], [6, 6, 11, 10])
    assert all(torch.equal(a, b) for a, b in zip(workload.sequences, again.sequences, strict=True))
    other = token_workload(eager, 4, [5, 8, 6, 9], [6, 6, 11, 10])
    assert not all(torch.equal(a, b) for a, b in zip(workload.sequences, other.sequences, strict=True))
    ids, target = workload.sequences[0], workload.targets()[0]
    assert torch.equal(target[4:10], ids[5:11]) and (target[:4] == kernels.IGNORE_INDEX).all() and target[10] < 0
    # Sampled from the model: its tokens are likelier under it than uniform ones would be.
    logp, _ = cell_logprobs(eager, workload, "BN/packed", backend="aten")
    assert logp.mean() > -torch.log(torch.tensor(3001.0)) + 1.0


def test_eager_attention_gives_the_same_bits_in_every_cell_on_this_cpu(eager, workload):
    packed, _ = cell_logprobs(eager, workload, "BN/packed", backend="aten")
    assert packed.numel() == 33
    for cell in CELLS:
        logp, _ = cell_logprobs(eager, workload, cell, backend="aten")
        assert torch.equal(kernels.bit_view(logp), kernels.bit_view(packed)), cell


def test_stock_sdpa_moves_logprobs_between_cells_on_this_cpu(workload):
    """A chunk against the KV cache and a decode step hold far fewer keys than the packed row: sdpa's blocks fall
    otherwise on every CPU measured. A padded batch moves on some CPUs only (docs/whole_model.md)."""
    sdpa = build_model(spec(), dtype=torch.bfloat16, attention="sdpa")
    packed, _ = cell_logprobs(sdpa, workload, "BN/packed", backend="aten")
    moved = {}
    for cell in ("decode", "B1/chunked"):
        logp, _ = cell_logprobs(sdpa, workload, cell, backend="aten")
        moved[cell] = int((kernels.bit_view(logp) != kernels.bit_view(packed)).sum())
    assert all(count > 0 for count in moved.values()), moved


def test_packed_cells_confine_attention_themselves(eager, workload):
    lengths = list(workload.seq_lens)
    mask = confinement_mask(lengths, "eager", torch.bfloat16)[0, 0]
    assert mask[11, 10] == torch.finfo(torch.bfloat16).min and mask[11, 11] == 0 and mask[12, 11] == 0
    assert confinement_mask(lengths, "sdpa", torch.bfloat16).dtype == torch.bool
    # Restarting position ids alone let every sequence attend to the ones before it.
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    row = eager.body(input_ids=torch.cat(workload.sequences)[None], position_ids=positions).last_hidden_state[0]
    unconfined = torch.cat(list(row.split(lengths)))
    confined = torch.cat(cell_hidden(eager, workload, "BN/packed"))
    alone = torch.cat(cell_hidden(eager, workload, "B1/full"))
    assert torch.equal(kernels.bit_view(confined), kernels.bit_view(alone))
    assert (unconfined.float() - alone.float()).abs().max() > 0.05


@pytest.mark.interpreter  # Triton on CPU tensors
def test_the_triton_head_is_as_invariant_behind_the_body_as_alone(eager, workload):
    packed, packed_lse = cell_logprobs(eager, workload, "BN/packed", backend="triton", tp=2)
    decode, decode_lse = cell_logprobs(eager, workload, "decode", backend="triton", tp=2)
    assert torch.equal(kernels.bit_view(packed), kernels.bit_view(decode)) and torch.equal(
        kernels.bit_view(packed_lse), kernels.bit_view(decode_lse)
    )
    # Beside stock PyTorch's head on the same hidden states: both round the logits to bf16 and reduce in fp32.
    stock, _ = cell_logprobs(eager, workload, "BN/packed", backend="aten")
    assert (packed - stock).abs().median() < 1e-5 and (packed - stock).abs().max() < 1e-5


@pytest.mark.parametrize(("others", "position"), [(1, 0), (3, 1), (5, 5)])
def test_a_needle_is_one_call_with_the_sequences_at_its_row_among_its_fillers(eager, workload, monkeypatch,
                                                                             others, position):  # fmt: skip
    """As the head's needle: the workload's sequences in order at rows ``pos`` onwards of one right-padded batch of
    ``m`` filler sequences more, and what comes back is those rows' hidden states."""
    import rlsweep.model_cells as model_cells

    calls, body_hidden = [], model_cells.body_hidden

    def recorded(built, slots, **inputs):
        calls.append((inputs["input_ids"].clone(), slots.clone()))
        return body_hidden(built, slots, **inputs)

    monkeypatch.setattr(model_cells, "body_hidden", recorded)
    hidden = cell_hidden(eager, workload, f"needle/M={others}/pos={position}")
    (ids, slots), count = calls[0], len(workload.sequences)
    assert len(calls) == 1 and ids.shape[0] == others + count
    for row, sequence in enumerate(workload.sequences):
        assert torch.equal(ids[position + row, : len(sequence)], sequence)
    fillers = torch.cat([slots[:position], slots[position + count :]])
    assert (fillers == -1).all() and (slots[position : position + count] >= 0).any(dim=1).all()
    monkeypatch.undo()
    alone = cell_hidden(eager, workload, "B1/full")  # eager is row-invariant on this CPU (above)
    assert all(torch.equal(a, b) for a, b in zip(hidden, alone, strict=True))


@pytest.mark.parametrize("cell", ["B1/chunked/3", "needle/M=2/pos=3", "stacked", "alone"])
def test_an_unknown_or_impossible_cell_is_refused_in_one_line(eager, workload, cell):
    with pytest.raises(ConfigError, match=r"model cell|needle position") as err:
        cell_hidden(eager, workload, cell)
    assert "\n" not in str(err.value)


def test_row_local_modules_are_those_around_no_attention_and_given_no_layout(workload):
    """Attention modules, modules given a mask or a KV cache, and every module around them may mix rows; the others
    (embedding, norms, linears, MLPs, activations, rotary) owe an equal input row the same bits in every layout:
    stock sdpa moves its attention in every cell and still gives them the same bits."""
    sdpa = build_model(spec(), dtype=torch.bfloat16, attention="sdpa")
    packed = record_cell(sdpa, workload, "BN/packed", 5)
    mixing = row_mixing(packed)
    assert {"model", "model.layers.0", "model.layers.0.self_attn", "model.layers.1.self_attn"} <= mixing
    assert not {path for path in mixing if path.endswith(("mlp", "proj", "norm", "embed_tokens", "rotary_emb"))}
    for cell in ("BN/pad_right", "decode", "B1/chunked"):
        compared, mismatches = row_local_mismatches(packed, record_cell(sdpa, workload, cell, 5))
        assert compared >= 10 and mismatches == [], (cell, mismatches)
    shuffled = record_cell(sdpa, workload, "BN/pad_right", 5)
    norm = shuffled["model.layers.0.input_layernorm"]
    norm.calls[0] = norm.calls[0]._replace(output=norm.calls[0].output.flip(0))  # rows handed to the wrong tokens
    norm.__dict__.pop("rows", None)
    for path in ("model.layers.0.mlp", "model.layers.0.mlp.act_fn"):  # an act_fn bug moves the MLP around it too
        record = shuffled[path]
        record.calls = [call._replace(output=call.output.flip(0)) for call in record.calls]
        record.__dict__.pop("rows", None)
    compared, mismatches = row_local_mismatches(packed, shuffled)
    assert [m["module"] for m in mismatches] == [
        "model.layers.0.input_layernorm",
        "model.layers.0.mlp",
        "model.layers.0.mlp.act_fn",
    ] and all(m["max_abs_diff"] > 0 for m in mismatches)
    verdict = row_local_verdict("BN/pad_right", compared, mismatches[1:], "BN/packed", ("a", "b"))
    assert "first model.layers.0.mlp.act_fn (" in verdict.detail and not verdict.passed  # the innermost is named


def test_the_first_diverging_op_of_stock_sdpa_is_its_first_attention(workload, tmp_path):
    sdpa = build_model(spec(), dtype=torch.bfloat16, attention="sdpa")
    for cell in ("BN/pad_right", "decode"):
        table = first_diverging(sdpa, workload, cell)
        (first,) = table[table.first_diverging].itertuples()
        assert (first.module, first.module_class) == ("model.layers.0.self_attn", "Qwen3Attention"), cell
        assert first.inputs_equal and first.tokens_differing > 0 and first.max_abs_diff > 0
        around = {module for module in table.module if first.module.startswith(module + ".")}
        before = table[(table.order < first.order) & ~table.module.isin(around)]
        assert len(before) == 3 and (before.tokens_differing == 0).all()  # all that ran before it, not around it
    table.to_parquet(tmp_path / "divergence.parquet")
    assert list(pd.read_parquet(tmp_path / "divergence.parquet").columns) == list(DIVERGENCE_COLUMNS)


def test_a_layout_dependent_bug_deep_in_the_body_is_named_and_an_invariant_body_names_none(eager, workload):
    table = first_diverging(eager, workload, "BN/pad_right")
    assert not table.first_diverging.any() and (table.tokens_differing == 0).all() and table.inputs_equal.all()
    down = eager.model.get_submodule("model.layers.1.mlp.down_proj")
    stock = down.forward
    # A bug that shows only when more than one sequence shares the call: a hair-wide scale on its output.
    down.forward = lambda x: stock(x) * (1.0 + 2.0**-6) if x.shape[0] > 1 else stock(x)
    try:
        table = first_diverging(eager, workload, "BN/pad_right")
    finally:
        del down.forward
    (first,) = table[table.first_diverging].itertuples()
    assert (first.module, first.module_class) == ("model.layers.1.mlp.down_proj", "Linear")
    assert first.tokens_differing > 0


def test_trainer_against_rollout_metrics_are_exactly_zero_only_where_the_bits_agree(eager, workload):
    invariant = trainer_vs_rollout(eager, workload, backend="aten")
    assert set(invariant.rollout_cell) == {"decode", "BN/pad_left", "B1/full"} and (invariant.tokens == 33).all()
    ratio = invariant.metric == "ppl_ratio"
    assert (invariant.value[ratio] == 1.0).all() and (invariant.value[~ratio] == 0.0).all()
    sdpa = build_model(spec(), dtype=torch.bfloat16, attention="sdpa")
    stock = trainer_vs_rollout(sdpa, workload, backend="aten").set_index(["rollout_cell", "metric"]).value
    trainer, _ = cell_logprobs(sdpa, workload, "BN/packed", backend="aten")
    rollout, _ = cell_logprobs(sdpa, workload, "decode", backend="aten")
    x = trainer.double() - rollout.double()  # verl's k3 of pi_train / pi_rollout, by hand
    assert stock["decode", "k3_kl"] == pytest.approx(float((x.exp() - 1 - x).mean()), rel=1e-12)
    assert stock["decode", "k3_kl"] > 0 and stock["decode", "ppl_ratio"] != 1.0


def norms_in_bf16(built):
    """The realistic bug: RMSNorm's mean of squares, rsqrt and product in the input's bf16, not in fp32."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for module in built.body.modules():
        if type(module).__name__ == "Qwen3RMSNorm":
            module.forward = types.MethodType(forward, module)


def test_every_module_is_within_its_op_class_bound_and_realistic_body_bugs_are_red(workload):
    stock = module_accuracy(build_model(spec(), dtype=torch.bfloat16, attention="eager"), workload)
    assert set(stock.op_class) == {"linear", "rmsnorm", "rotary", "activation", "attention"}
    # Per layer 7 linears, 4 norms, SiLU, the attention function and the softmax in it; the final norm; RoPE.
    assert len(stock) == 2 * (7 + 4 + 1 + 2) + 1 + 1, stock
    elementwise = stock.op_class != "attention"
    assert stock.passed.all() and (stock.bound_used[elementwise] > 0.5).all(), stock  # tight, not vacuous
    # Attention's bound admits the worst case of bf16 scores and probabilities (docs/contract.md): measured at
    # 0.04 - 0.16 of it, so a softmax computed in bf16 is caught by the body's provenance, not here.
    assert (stock.bound_used[~elementwise] > 0.02).all(), stock
    assert (stock.elements > 0).all() and list(stock.columns) == list(ACCURACY_COLUMNS)
    # Each attention function's effective score scale, fitted from its errors: the config's, to well under a bf16 ulp.
    functions = stock.module.str.endswith(".attention_function")
    assert functions.sum() == 2 and (stock.scale_error[functions].abs() < 2**-10).all(), stock
    assert stock.scale_error[~functions].isna().all()
    # Scores 1 % hotter than the config implies: inside the worst-case bound, red by the scale's fit, which finds 1 %.
    hot = build_model(spec(), dtype=torch.bfloat16, attention="eager")
    for module in hot.body.modules():
        if type(module).__name__ == "Qwen3Attention":
            module.scaling *= 1.01
    table = module_accuracy(hot, workload).set_index("module")
    attention = table[table.index.str.endswith(".attention_function")]
    assert (~attention.passed).all() and attention.bound_used.min() > 1.5, attention
    assert ((attention.scale_error - 0.01).abs() < 0.001).all(), attention
    assert table[table.op_class != "attention"].passed.all()
    # An MLP that runs GELU where the config says SiLU: judged against the config's activation, not the module's own.
    gelu = build_model(spec(), dtype=torch.bfloat16, attention="eager")
    for module in gelu.body.modules():
        if hasattr(module, "act_fn"):
            module.act_fn = torch.nn.GELU()
    table = module_accuracy(gelu, workload)
    activations = table[table.op_class == "activation"]
    assert len(activations) == 2 and (~activations.passed).all() and activations.bound_used.min() > 100, activations
    buggy = build_model(spec(), dtype=torch.bfloat16, attention="eager")
    norms_in_bf16(buggy)
    table = module_accuracy(buggy, workload).set_index("module")
    norms = table[table.op_class == "rmsnorm"]
    assert (~norms.passed).all() and norms.bound_used.min() > 1.5, norms
    assert table[table.op_class != "rmsnorm"].passed.all()  # each module is judged on its own inputs
    # A RoPE base of 1e4 where the config says 1e6.
    rope = build_model(spec(), dtype=torch.bfloat16, attention="eager")
    rotary = rope.body.rotary_emb
    rotary.inv_freq.copy_(1.0 / (1e4 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)))
    table = module_accuracy(rope, workload).set_index("module")
    assert not table.passed["model.rotary_emb"] and table.bound_used["model.rotary_emb"] > 100


def test_the_end_to_end_error_against_a_float64_forward_is_reported_for_any_cell(eager, workload):
    sdpa = build_model(spec(), dtype=torch.bfloat16, attention="sdpa")
    errors = {}
    for name, built in (("eager", eager), ("sdpa", sdpa)):
        for cell in ("BN/packed", "decode"):
            logp, _ = cell_logprobs(built, workload, cell, backend="aten")
            errors[name, cell] = end_to_end_error(built, workload, logp)
    assert all(e["tokens"] == 33 and 0 < e["mean_abs_error"] <= e["max_abs_error"] < 0.5 for e in errors.values())
    assert errors["eager", "BN/packed"] == errors["eager", "decode"]  # the same bits, the same float64 truth
    assert errors["sdpa", "BN/packed"] != errors["sdpa", "decode"]


def test_the_body_records_which_attention_function_and_kernels_ran(eager, workload):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ran = body_provenance(eager, workload, "decode")
    assert ran["attention"] == ["transformers.models.qwen3.modeling_qwen3.eager_attention_forward"]
    assert {"aten::linear", "aten::matmul", "aten::softmax"} <= set(ran["kernels"])
    assert not any("scaled_dot_product" in kernel for kernel in ran["kernels"])
    sdpa = body_provenance(build_model(spec(), dtype=torch.bfloat16, attention="sdpa"), workload, "BN/packed")
    assert sdpa["attention"] == ["transformers.integrations.sdpa_attention.sdpa_attention_forward"]
    assert "aten::scaled_dot_product_attention" in sdpa["kernels"] and "aten::softmax" not in sdpa["kernels"]
    assert (
        "eager" not in ALL_ATTENTION_FUNCTIONS._local_mapping and "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    )


@pytest.mark.parametrize(
    ("prompts", "responses", "message"),
    [
        ([5, 0], [3, 3], r"prompt_lens=\[5, 0\]: one positive int per sequence"),
        ([5], [3, 3], "1 prompt_lens but 2 response_lens"),
        ([500], [13], "513 tokens is longer than the model's max_position_embeddings=512"),
    ],
)
def test_a_token_workload_the_model_cannot_take_is_refused_in_one_line(eager, prompts, responses, message):
    with pytest.raises(ConfigError, match=message):
        token_workload(eager, 3, prompts, responses)


def save_tokens(path, **tensors):
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path))
    return str(path)


def test_a_replayed_token_workload_is_the_captured_one(eager, workload, tmp_path):
    path = save_tokens(
        tmp_path / "tokens.safetensors",
        input_ids=torch.cat(workload.sequences),
        seq_lens=torch.tensor(workload.seq_lens, dtype=torch.int32),
        prompt_lens=torch.tensor(workload.prompt_lens),
    )
    replayed = replayed_workload(path, vocab=3001)
    assert replayed.prompt_lens == workload.prompt_lens
    assert all(torch.equal(a, b) for a, b in zip(replayed.sequences, workload.sequences, strict=True))
    logp, _ = cell_logprobs(eager, replayed, "decode", backend="aten")
    assert torch.equal(
        kernels.bit_view(logp), kernels.bit_view(cell_logprobs(eager, workload, "decode", backend="aten")[0])
    )


IDS = torch.tensor([5, 6, 7, 8, 9, 10, 11])
GOOD = {"input_ids": IDS, "seq_lens": torch.tensor([3, 4]), "prompt_lens": torch.tensor([1, 2])}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prompt_lens": None}, r"has no 'prompt_lens' tensor"),
        ({"input_ids": IDS.float()}, r"input_ids is F32 \[7\]; it must be a 1-D integer tensor"),
        ({"seq_lens": torch.tensor([[3, 4]])}, r"seq_lens is I64 \[1, 2\]"),
        ({"seq_lens": torch.tensor([3, 3])}, r"must each be >= 2 and add up to input_ids' 7 tokens"),
        # Four lengths whose int64 sum wraps round to the 7 ids.
        (
            {"seq_lens": torch.tensor([2**62, 2**62, 2**62, 2**62 + 7]), "prompt_lens": torch.tensor([1, 1, 1, 1])},
            r"must each be >= 2 and add up to input_ids' 7 tokens",
        ),
        ({"prompt_lens": torch.tensor([1])}, r"seq_lens has 2 entries and prompt_lens 1"),
        ({"prompt_lens": torch.tensor([1, 4])}, r"sequence 1 has prompt_lens 4 of seq_lens 4"),
        ({"input_ids": torch.tensor([5, 6, 7, 8, 3001, 10, 11])}, r"input_ids\[4\] = 3001 is outside the vocab"),
    ],
)
def test_a_token_replay_file_the_cells_cannot_run_is_refused_in_one_line(tmp_path, changes, message):
    tensors = {k: v for k, v in {**GOOD, **changes}.items() if v is not None}
    path = save_tokens(tmp_path / "tokens.safetensors", **tensors)
    with pytest.raises(ReplayInputError, match=message) as err:
        replayed_workload(path, vocab=3001)
    assert "\n" not in str(err.value) and path in str(err.value)


def test_a_token_replay_path_that_is_no_safetensors_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "tokens.safetensors").write_text("not safetensors")
    for path in (tmp_path / "missing.safetensors", tmp_path, tmp_path / "tokens.safetensors"):
        with pytest.raises(ReplayInputError, match="token replay file") as err:
            replayed_workload(str(path), vocab=3001)
        assert "\n" not in str(err.value)


def test_a_module_whose_output_is_not_finite_fails_its_accuracy_row(workload):
    broken = build_model(spec(), dtype=torch.bfloat16, attention="eager")
    down = broken.model.get_submodule("model.layers.1.mlp.down_proj")
    stock = down.forward

    def poisoned(x):
        out = stock(x)
        out[0, 3, 7] = float("nan")
        return out

    down.forward = poisoned
    table = module_accuracy(broken, workload).set_index("module")
    assert not table.passed["model.layers.1.mlp.down_proj"]
    assert table.bound_used["model.layers.1.mlp.down_proj"] == math.inf


def test_an_embedding_tied_to_the_head_takes_the_heads_scale_so_logits_are_realistic():
    """Tied at the embedding's unit std, Qwen3-1.7B's shape gave logits of std 45: every sampled token was the argmax,
    every logp 0, and every cell agreed in logp whatever the body did."""
    tied = build_model(spec(hf_config={"tie_word_embeddings": True}), dtype=torch.bfloat16, attention="eager")
    weight = tied.head_weight
    assert weight.data_ptr() == tied.model.get_input_embeddings().weight.data_ptr()  # one tensor
    assert abs(weight.float().std() - 4 / 128**0.5) < 0.01
    workload = token_workload(tied, 3, [5, 8], [12, 12])
    logp, _ = cell_logprobs(tied, workload, "BN/packed", backend="aten")
    judged = logp  # the response tokens
    assert judged.mean() < -0.3 and (judged < -1e-3).float().mean() > 0.5, judged


def test_the_dataflow_of_a_stock_model_holds_and_a_product_off_by_more_than_one_rounding_is_named(eager, workload):
    """Every hand-off bitwise and every residual add or gate-times-up within one rounding, used to the full (the bound
    is tight); one token's gate-times-up product moved by 2^-6 breaks its edge alone, on that token alone."""
    records = record_cell(eager, workload, "decode", 5)
    ids = torch.cat(workload.sequences)
    edges = pre_norm_residual_edges(eager, records, ids)
    assert len(edges) == 48 and all(edge.passed for edge in edges), [e for e in edges if not e.passed]
    assert 0.9 < max(edge.used for edge in edges) <= 1
    cached = [edge for edge in edges if "read back from its KV cache" in edge.what]
    assert len(cached) == 2 and all(edge.tokens > 100 for edge in cached)  # every decode step read its cache back
    roles = ("forward_accuracy", "forward_accuracy")
    assert dataflow_verdict(eager, records, ids, "decode", roles).passed
    down = records["model.layers.1.mlp.down_proj"]
    down.calls[-1].inputs[0][0] *= 1 + 2**-6  # the product down_proj was given, for the last call's first token
    down.__dict__.pop("main_input", None)
    broken = [edge for edge in pre_norm_residual_edges(eager, records, ids) if not edge.passed]
    what = "model.layers.1.mlp.down_proj input = model.layers.1.mlp.act_fn output * model.layers.1.mlp.up_proj output"
    assert [(edge.what, edge.failing) for edge in broken] == [(what, 1)] and broken[0].used > 1.5, broken
    verdict = dataflow_verdict(eager, records, ids, "decode", roles)
    assert not verdict.passed and f"1 of 48 edges of the qwen3 dataflow broken; first {what}: 1 of" in verdict.detail
    # A model type whose dataflow is not described: nothing was judged, which is red.
    other = types.SimpleNamespace(model=types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt2")))
    verdict = dataflow_verdict(other, records, ids, "decode", roles)
    assert (
        not verdict.passed and "model_type 'gpt2' has no dataflow described here: nothing was judged" in verdict.detail
    )


def test_a_cells_head_bound_is_the_bound_of_its_own_rows_whichever_it_takes_from_the_canonical_cell():
    """A row bitwise equal to the canonical cell's, with the same target, takes that cell's bound; a row whose hidden
    state or target moved gets its own. Either way each row's bound is the one computed for the cell's own rows."""
    generator = torch.Generator().manual_seed(11)
    rows, hidden_size, vocab = 37, 64, 1001
    hidden = torch.randn(rows, hidden_size, generator=generator).bfloat16()
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.5).bfloat16()
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[:5] = kernels.IGNORE_INDEX
    canonical = kernels.rounding_bound(hidden, weight, targets, logits_dtype=torch.bfloat16)
    known = (hidden, targets, canonical)
    assert head_bound(hidden.clone(), weight, targets.clone(), torch.bfloat16, known) is canonical
    moved, retargeted = hidden.clone(), targets.clone()
    moved[[2, 9, 30]] = torch.randn(3, hidden_size, generator=generator).bfloat16()
    moved.view(torch.int16)[17, 0] += 1  # one element of one row, one ulp
    retargeted[21] = (retargeted[21] + 1) % vocab
    got = head_bound(moved, weight, retargeted, torch.bfloat16, known)
    own = kernels.rounding_bound(moved, weight, retargeted, logits_dtype=torch.bfloat16)
    for field in ("logp", "lse", "spread"):
        assert torch.equal(kernels.bit_view(getattr(got, field)), kernels.bit_view(getattr(own, field))), field
    assert not torch.equal(got.logp, canonical.logp) and not torch.equal(got.lse, canonical.lse)
