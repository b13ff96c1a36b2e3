"""A whole model swept by ``python -m rlsweep model=qwen3_tiny``: its tables, its verdicts, the divergence table, the
gate across tp, and realistic body bugs planted as a profile's backend module (tests/bug_bodies.py) going red."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")

from rlsweep_fixtures import import_path, multirun, run_rlsweep

from rlsweep import analysis
from rlsweep.gate import DIVERGENCE_PNG, load_run, run_gate
from rlsweep.planned import plan_problems
from rlsweep.report import main as report_main
from rlsweep.tables import DIVERGENCE_COLUMNS, RUN_COLUMNS
from rlsweep.verdicts import Outcome

TESTS = Path(__file__).parent
MODEL = "model=qwen3_tiny"
SMALL = "layout.cells=[BN/packed,BN/pad_right,decode]"  # a trainer's cell, a padded batch and a rollout


def tables(run_dir: Path) -> dict[str, pd.DataFrame]:
    return {name: pd.read_parquet(run_dir / name) for name in ("tokens", "checks", "divergence")}


def red(checks: pd.DataFrame) -> pd.DataFrame:
    return checks[~checks.passed]


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("eager")
    done = run_rlsweep(run_dir, MODEL, "profile=hf_eager_cpu_bf16")
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def sdpa_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sdpa")
    done = run_rlsweep(run_dir, MODEL, "profile=hf_sdpa_cpu_bf16")
    assert done.returncode == 0, done.stderr[-3000:]  # its forward_invariance reds are declared
    return run_dir


@pytest.mark.xdist_group("eager_run")  # one worker runs the module fixture once
def test_eager_attention_is_green_in_every_cell_with_every_whole_model_verdict(eager_run):
    found = tables(eager_run)
    checks, tokens = found["checks"], found["tokens"]
    assert checks.passed.all() and found["divergence"].empty
    cells = set(tokens.cell)
    assert len(cells) == 13 and {"BN/packed", "BN/chunked", "B1/chunked", "decode", "needle/M=257/pos=128"} <= cells
    body = checks[(checks.judgment == "provenance") & (checks.tensor == "body")]
    assert set(body.lhs_cell) == cells and body.detail.str.contains("eager_attention_forward").all()
    modules = checks[checks.judgment == "module_accuracy"].set_index("tensor")
    assert set(modules.index) == {"linear", "rmsnorm", "rotary", "activation", "attention", "dataflow", "end_to_end"}
    assert (modules.value[["linear", "rmsnorm", "rotary", "activation"]] > 0.5).all()  # tight bounds, not vacuous
    dataflow = modules.loc[["dataflow"]]  # every cell: each residual add and the gate times up within one rounding
    assert len(dataflow) == 13 and (dataflow.value > 0.5).all() and (dataflow.value <= 1).all()
    assert 0 < modules.value["end_to_end"] < 1 and math.isnan(modules.threshold["end_to_end"])
    rollout = checks[checks.judgment == "trainer_rollout"]
    assert set(rollout.lhs_cell) == {"decode", "BN/pad_left", "B1/full"} and set(rollout.rhs_cell) == {"BN/packed"}
    ratio = rollout.metric == "ppl_ratio"
    assert (rollout.value[ratio] == 1.0).all() and (rollout.value[~ratio] == 0.0).all()
    # The head's accuracy is judged on each cell's own hidden states, against float64 of the head on them.
    accuracy = checks[checks.judgment == "forward_accuracy"]
    assert set(accuracy.lhs_cell) == cells and (accuracy.value > 0).all()
    assert tokens.active.sum() == 13 * 27 and (tokens.ref_logp[tokens.active] < 0).all()


def test_stock_sdpa_is_red_in_the_moved_cells_and_names_its_first_attention(sdpa_run):
    found = tables(sdpa_run)
    checks, divergence = found["checks"], found["divergence"]
    failed = red(checks)
    assert set(failed.judgment) == {"forward_invariance"}, failed.detail.tolist()[:3]
    # The cells sdpa's blocks move on every CPU measured (a padded batch and the needles on some only).
    assert {"B1/full", "decode", "BN/chunked", "B1/chunked"} <= set(failed.lhs_cell)
    assert list(divergence.columns) == [*RUN_COLUMNS.names, *DIVERGENCE_COLUMNS]
    first = divergence[divergence.first_diverging]
    assert set(first.cell) == set(failed.lhs_cell)  # one first module per red cell
    # An attention module, layer 0's in most cells (on an AVX2 CPU layer 1's in BN/pad_left, whose layer 0 agreed).
    assert first.module.str.fullmatch(r"model\.layers\.\d+\.self_attn").all() and (first.tokens_differing > 0).all()
    assert (first.module == "model.layers.0.self_attn").sum() >= len(first) - 1
    # Each red row names its cell's first diverging module, as the divergence table does.
    module_of = first.set_index("cell").module
    for row in failed.itertuples():
        assert f"first diverging module {module_of[row.lhs_cell]} (Qwen3Attention)" in row.detail, row.detail
    assert (divergence.canonical_cell == "BN/packed").all()
    rollout = checks[(checks.judgment == "trainer_rollout")].set_index(["lhs_cell", "metric"]).value
    assert rollout["decode", "k3_kl"] > 0 and rollout["decode", "ppl_ratio"] != 1.0


@pytest.mark.slow
def test_a_whole_model_sweep_is_gated_across_tp_and_profiles(tmp_path):
    sweep = tmp_path / "sweep"
    done = multirun(sweep, MODEL, SMALL, "profile=hf_eager_cpu_bf16,cpu_bf16", "tp=1,2")
    assert done.returncode == 2, done.stderr[-3000:]
    result = run_gate(sweep)
    assert not result.incomplete and len(result.runs) == 4
    tp = result.sweep_checks[result.sweep_checks.judgment == "tp_invariance"]
    assert len(tp) and tp.passed.all()  # the head splits bitwise at tp 2 behind either body
    # Both sampled the same tokens, but their bodies ran other attention: their hidden states differ by more than any
    # head bound covers, so parity does not pair them (it judges heads on the same hidden states).
    assert not (result.sweep_checks.judgment == "backend_parity").any()
    unexpected = result.unexpected
    assert set(unexpected.profile) == {"cpu_bf16"} and set(unexpected.judgment) == {"forward_invariance"}
    # The report draws the divergence per moved cell and lists the trainer against each rollout cell.
    out = tmp_path / "report"
    assert report_main([str(sweep), "--out", str(out)]) == 2
    assert (out / DIVERGENCE_PNG).stat().st_size > 0
    markdown = (out / "report.md").read_text()
    rollout = markdown.split("## Whole model: trainer against rollout")[1].split("\n## ")[0]
    rows = {tuple(cells[:3]): cells[3:] for line in rollout.splitlines() if line.startswith("| ")
            for cells in [[cell.strip() for cell in line.strip("|").split("|")]]}  # fmt: skip
    assert rows["hf_eager_cpu_bf16", "1", "decode"] == ["0", "0", "0", "1", "0"]  # k1, k2, k3, ppl, max |dlogp|
    k1, k2, k3, ratio, largest = map(float, rows["cpu_bf16", "1", "decode"])
    assert k1 != 0
    assert k2 > 0 and k3 > 0 and ratio != 1 and largest > 0.01
    first = markdown.split("## Whole model: the first diverging module")[1].split("\n## ")[0]
    assert "| cpu_bf16 | 2 | 5 | decode | model.layers.0.self_attn | Qwen3Attention |" in first, first
    assert f"]({DIVERGENCE_PNG})" in first


@pytest.mark.xdist_group("eager_run")  # one worker runs the module fixture once
def test_a_checks_table_that_lost_a_whole_model_row_is_not_what_its_config_plans(eager_run):
    run = load_run(eager_run)
    config, contract, checks = run.config, run.contract, run.checks
    assert plan_problems(config, contract, checks, standalone=True) == []
    for judgment, tensor in (("module_accuracy", "rmsnorm"), ("provenance", "body"), ("trainer_rollout", "logp")):
        dropped = checks.drop(checks.index[(checks.judgment == judgment) & (checks.tensor == tensor)][:1])
        assert plan_problems(config, contract, dropped, standalone=True), (judgment, tensor)


@pytest.mark.parametrize(
    ("bug", "profile", "judgment", "tensor"),
    [
        ("norms_in_bf16", "hf_eager_cpu_bf16", "module_accuracy", "rmsnorm"),
        ("norm_eps_1e3", "hf_eager_cpu_bf16", "module_accuracy", "rmsnorm"),
        ("rope_base_1e4", "hf_eager_cpu_bf16", "module_accuracy", "rotary"),
        ("scores_over_head_dim", "hf_sdpa_cpu_bf16", "module_accuracy", "attention"),
        ("scores_scaled_1pct", "hf_sdpa_cpu_bf16", "module_accuracy", "attention"),
        ("attention_swapped", "cpu_bf16", "provenance", "body"),
        ("mlp_batch_scaled", "hf_eager_cpu_bf16", "forward_invariance", "logp"),
        ("silu_in_bf16", "hf_eager_cpu_bf16", "module_accuracy", "activation"),
        # Attention's bound admits bf16 probabilities; a hand-written bf16 softmax is red as an attention function
        # other than the one the profile names, and no aten softmax ran.
        ("softmax_in_bf16", "hf_eager_cpu_bf16", "provenance", "body"),
    ],
)
def test_realistic_body_bugs_are_red_by_a_margin(tmp_path, bug, profile, judgment, tensor):
    env = {"PYTHONPATH": import_path(TESTS), "RLSWEEP_BODY_BUG": bug}
    bodies = "profile.backend_module=bug_bodies"
    done = run_rlsweep(tmp_path, MODEL, f"profile={profile}", bodies, SMALL, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    failed = red(tables(tmp_path)["checks"])
    assert ((failed.judgment == judgment) & (failed.tensor == tensor)).any(), failed[["judgment", "tensor"]]
    if judgment == "module_accuracy":
        modules = failed[failed.judgment == judgment]
        # The epsilon moves a norm's output by a fraction of a bf16 ulp (1e-3 / 2 relative): over the bound in every
        # norm, by less than the other bugs (docs/contract.md#whole-model-modules).
        margin = 1.0 if bug == "norm_eps_1e3" else 1.5
        assert set(modules.tensor) == {tensor} and modules.value.min() > margin, modules.detail.tolist()
        assert bug != "norm_eps_1e3" or "9 module(s), 9 over their bound" in modules.detail.iloc[0]
    if bug == "mlp_batch_scaled":
        first = tables(tmp_path)["divergence"].query("first_diverging")
        assert set(first.module) == {"model.layers.0.mlp"} and set(first.cell) == {"BN/pad_right", "decode"}


@pytest.mark.parametrize(
    ("bug", "edge"),
    [
        ("residual_scaled", "model.layers.0.post_attention_layernorm input = model.layers.0 input + "
                            "model.layers.0.self_attn output"),
        ("final_norm_skipped", "model.norm is an RMSNorm: model.norm is a Identity"),
        ("gate_up_swapped", "model.layers.0.mlp.act_fn input = model.layers.0.mlp.gate_proj output"),
        ("hidden_scaled_after_norm", "model output = model.norm output"),
        ("embeddings_scaled", "model.layers.0 input = model.embed_tokens output"),
        ("rope_keys_skipped", "model.layers.0.self_attn attention function's key = "
                              "RoPE(model.layers.0.self_attn.k_norm output)"),
        ("rope_interleaved", "model.layers.0.self_attn attention function's query = "
                             "RoPE(model.layers.0.self_attn.q_norm output)"),
        ("values_from_keys", "model.layers.0.self_attn.v_proj input = model.layers.0.self_attn input: "
                             "model.layers.0.self_attn.v_proj never ran"),
        ("attention_heads_transposed", "model.layers.0.self_attn.o_proj input = "
                                       "model.layers.0.self_attn attention function's output"),
    ],
)  # fmt: skip
def test_glue_bugs_every_layout_computes_alike_are_red_in_every_cell_naming_the_edge(tmp_path, bug, edge):
    """Bugs between modules that no module's accuracy sees, each op being right on its own inputs, and that give every
    layout the same bits (but one: heads and tokens mixed before o_proj move a prefill, not a decode step). The
    dataflow row names the first edge they break, in every cell."""
    env = {"PYTHONPATH": import_path(TESTS), "RLSWEEP_BODY_BUG": bug}
    done = run_rlsweep(tmp_path, MODEL, "profile=hf_eager_cpu_bf16", "profile.backend_module=bug_bodies",
                       "layout.cells=[BN/packed,decode]", env=env)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    failed = red(tables(tmp_path)["checks"])
    dataflow = failed[failed.tensor == "dataflow"]
    assert set(zip(dataflow.judgment, dataflow.lhs_cell, strict=True)) == {
        ("module_accuracy", cell) for cell in ("BN/packed", "decode")
    }, failed.detail.tolist()
    # Heads and tokens mixed before o_proj move a prefill's logprobs, not a decode step's: invariance sees that too.
    assert bug == "attention_heads_transposed" or len(failed) == 2, failed.detail.tolist()
    failed = dataflow
    assert failed.detail.str.contains(f"first {edge}", regex=False).all(), failed.detail.tolist()
    assert (failed.value > 2).all(), failed.detail.tolist()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model.body.source=checkpoint", "model.body.path=Qwen/Qwen3-1.7B"), "never reaches a model hub"),
        (("+model.body.hf_config.auto_map={AutoModelForCausalLM:x.Y}",), "trust_remote_code"),
        (("model.weights.seed=3",), "model.weights.seed=3 applies to the head alone"),
        (("workload.hidden_scale=2",), "workload.hidden_scale=2.0 applies to the head alone"),
        (("grad=true",), "its backward is not judged"),
        (("grad=true", "profile.body_attention=invariant"), "the invariant body is forward-only"),
        (("model.hidden_size=64",), "model.hidden_size=64 is not the whole model's own hidden_size=128"),
        (("profile.body_attention=flash",), "body_attention"),
    ],
)
def test_a_whole_model_run_refuses_what_it_cannot_judge_in_one_line(tmp_path, overrides, message):
    done = run_rlsweep(tmp_path, MODEL, "profile=hf_eager_cpu_bf16", *overrides)
    assert done.returncode == 1, done.stderr[-2000:]
    assert re.search(message, done.stderr), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_body_attention_on_a_head_alone_is_refused(tmp_path):
    done = run_rlsweep(tmp_path, "model=tiny", "profile=cpu_bf16", "profile.body_attention=eager")
    assert done.returncode == 1 and "is a head alone" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("profile", ["invariant_body_cpu_bf16", "hf_sdpa_cpu_bf16"])
def test_a_whole_model_profile_on_a_head_alone_is_refused_not_run_on_the_head(tmp_path, profile):
    """A profile that names a body judges that body; on a model without one it would judge the head alone and could
    be GREEN with no body run at all."""
    done = run_rlsweep(tmp_path, "model=tiny", f"profile={profile}")
    assert done.returncode == 1, done.stdout[-2000:]
    assert f"profile {profile!r} judges a whole model's body" in done.stderr and "is a head alone" in done.stderr
    assert not list(tmp_path.glob("*/part-*.parquet")), "a refused run wrote a table"


@pytest.mark.slow
def test_a_checkpoint_saved_from_the_config_built_model_loads_by_path_with_its_fingerprint_and_results(
    tmp_path, eager_run
):
    """model=checkpoint reads a save_pretrained dir: the same config fingerprint, weight hash, tokens and bits as the
    config-built model whose weights it holds."""
    from omegaconf import OmegaConf
    from rlsweep_fixtures import compose_run

    from rlsweep.hf_model import WholeModelSpec, build_model

    body = OmegaConf.to_container(compose_run(MODEL).model.body, resolve=True)
    built = build_model(WholeModelSpec.parse({"name": "qwen3_tiny", **body}), dtype=torch.bfloat16, attention="eager")
    checkpoint = tmp_path / "qwen3_tiny"
    built.model.save_pretrained(checkpoint)
    run_dir = tmp_path / "run"
    done = run_rlsweep(run_dir, "model=checkpoint", f"model.body.path={checkpoint}", "profile=hf_eager_cpu_bf16")
    assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = tables(run_dir), tables(eager_run)
    for name in ("config_fingerprint", "weight_hash", "workload_hash"):
        assert set(ours["checks"][name]) == set(theirs["checks"][name]), name
    keys = ["cell", "sample_id", "position"]
    ours_tokens, their_tokens = (t["tokens"].sort_values(keys).reset_index(drop=True) for t in (ours, theirs))
    assert ours_tokens[keys].equals(their_tokens[keys])
    for column in ("logp", "lse"):  # bit patterns, not values
        assert (ours_tokens[column].to_numpy().view("u4") == their_tokens[column].to_numpy().view("u4")).all(), column
    assert set(ours["checks"].model) == {"checkpoint"}


def test_the_packing_control_is_red_in_every_cell_with_the_first_layers_attention_named(tmp_path):
    """hf_packing_control_cpu_bf16 packs with an all-ones mask: attention reaches across sequences, so every other
    cell differs from the trainer cell, as declared, and the divergence names layer 0's attention first."""
    done = run_rlsweep(tmp_path / "control", MODEL, "profile=hf_packing_control_cpu_bf16", SMALL)
    assert done.returncode == 0, done.stderr[-3000:]  # its reds are declared, strictly
    found = tables(tmp_path / "control")
    failed = red(found["checks"])
    moved = failed[failed.judgment == "forward_invariance"]
    assert set(failed.judgment) == {"forward_invariance", "module_accuracy"}, failed
    assert set(moved.lhs_cell) == {"BN/pad_right", "decode"}
    # Its attention sees keys the packed layout does not let it see: red against the layout, in that cell only.
    attention = failed[failed.judgment == "module_accuracy"]
    assert list(zip(attention.tensor, attention.lhs_cell, strict=True)) == [("attention", "BN/packed")]
    assert attention.value.iloc[0] > 100, attention.detail.iloc[0]
    first = found["divergence"].query("first_diverging")
    assert set(first.cell) == {"BN/pad_right", "decode"} and set(first.module) == {"model.layers.0.self_attn"}
    # Only the first sequence of the row attends to nothing foreign: every later one moves.
    assert (first.tokens_differing > 0).all() and (first.max_abs_diff > 0.01).all(), first
    # Without the mistake (the same profile, attention confined) the same cells agree to the bit.
    done = run_rlsweep(tmp_path / "confined", MODEL, "profile=hf_packing_control_cpu_bf16", SMALL,
                       "profile.body_packing=confined", "profile.expected_red=[]")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


ACCURACY, INVARIANCE = "module_accuracy", "forward_invariance"


@pytest.mark.parametrize(
    ("bug", "cells", "reds"),
    [
        # Left-padded tokens see their pads; causality still hides a right-padded row's pads after its tokens.
        ("padding_mask_ignored", "BN/packed,BN/pad_right,BN/pad_left", {(ACCURACY, "attention", "BN/pad_left")}),
        # Positions counted from the cache, not given: right for a call that holds one sequence from its start only
        # (varlen4's prompts are of one length, so decode's left-padded prefill has no pad to count).
        (
            "position_ids_dropped",
            "BN/packed,B1/full,BN/pad_left",
            {(ACCURACY, "rotary", "BN/packed"), (ACCURACY, "rotary", "BN/pad_left")},
        ),
        # Another matmul path for calls of several sequences (a padded batch, each decode step), not the packed row:
        # out of its bound, and other bits for the rows the packed row gave the same inputs.
        (
            "linear_batched_bf16_sum",
            "BN/packed,BN/pad_right,decode",
            {
                (j, t, c)
                for j, t in ((ACCURACY, "linear"), (INVARIANCE, "row_local"))
                for c in ("BN/pad_right", "decode")
            },
        ),
        # An fp8 KV cache that gives each call its own keys and values as computed: only the cells that read a cache
        # back (a later chunk, a decode step) attend to rounded keys, which every op's bound admits.
        (
            "kv_cache_fp8_stored",
            "BN/packed,BN/chunked,decode",
            {(ACCURACY, "dataflow", "BN/chunked"), (ACCURACY, "dataflow", "decode")},
        ),
        # Glue no op class covers: the MLP's output scaled for calls of several sequences. Every op within its bound;
        # the MLP gives the rows whose inputs the packed row gave it other bits, and its output is not its down_proj's.
        (
            "mlp_batch_scaled",
            "BN/packed,B1/full,BN/pad_right,decode",
            {
                (j, t, c)
                for j, t in ((INVARIANCE, "row_local"), (ACCURACY, "dataflow"))
                for c in ("BN/pad_right", "decode")
            },
        ),
        # Glue in no module of its own: a decoder layer's residual add scaled for calls of several sequences. The
        # layer's norm after attention gets other inputs where its attention gave the same outputs, and an input that
        # is not the layer's input plus its attention's output.
        (
            "residual_batch_scaled",
            "BN/packed,B1/full,BN/pad_right,decode",
            {
                (j, t, c)
                for j, t in ((INVARIANCE, "row_local"), (ACCURACY, "dataflow"))
                for c in ("BN/pad_right", "decode")
            },
        ),
    ],
)
def test_a_layout_bug_is_red_where_it_acts_though_the_profile_declares_its_cells_red(tmp_path, bug, cells, reds):
    """hf_sdpa_cpu_bf16 declares forward_invariance red in every cell (its kernel rounds per layout), so a bug that
    only moves the logprobs of some layouts (a leaked padding mask, positions not the sequence's own, a batched matmul
    path, batched glue) moved no verdict it had not declared. Every module is judged in every cell, attention and RoPE
    against what the cell's layout says, and what acts row by row (linear, norm, MLP, activation, and the glue of the
    layers around attention) owes a row the packed row gave the same inputs the same bits: red in the cells the bug
    acts in, by far, and only there."""
    env = {"PYTHONPATH": import_path(TESTS), "RLSWEEP_BODY_BUG": bug}
    done = run_rlsweep(tmp_path, MODEL, "profile=hf_sdpa_cpu_bf16", "profile.backend_module=bug_bodies",
                       f"layout.cells=[{cells}]", env=env)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    checks = tables(tmp_path)["checks"]
    failed = checks[~checks.passed & checks.expected_pass]  # the profile's own reds are declared
    assert set(zip(failed.judgment, failed.tensor, failed.lhs_cell, strict=True)) == reds, failed.detail.tolist()
    accuracy = failed[failed.judgment == ACCURACY]
    assert (accuracy.value > 20).all(), accuracy.detail.tolist()  # 86 times its bound with AVX2, over 100 with AVX-512
    first = {"linear_batched_bf16_sum": "model.layers.0.self_attn.q_proj (Linear), its output",
             "mlp_batch_scaled": "model.layers.0.mlp (Qwen3MLP), its output",
             "residual_batch_scaled": "model.layers.0 (Qwen3DecoderLayer), the input of "
                                      "model.layers.0.post_attention_layernorm"}  # fmt: skip
    glue = failed[failed.tensor == "row_local"]
    assert glue.detail.str.contains(f"first {first.get(bug)}", regex=False).all(), glue.detail.tolist()
    modules = checks[(checks.judgment == ACCURACY) & (checks.tensor != "end_to_end")]
    assert set(modules.lhs_cell) == set(cells.split(",")) and len(modules) == 6 * len(cells.split(","))
    assert not modules.value.isna().any(), modules.detail.tolist()  # every op class judged something in every cell
    row_local = checks[checks.tensor == "row_local"]
    assert set(row_local.lhs_cell) == set(cells.split(",")[1:]) and (row_local.value >= 0).all()
    # The report colours a cell by its worst invariance verdict, the body's rows included: red where the bug acts.
    outcomes = analysis.cell_outcomes(analysis.load_checks(tmp_path)).set_index("cell").outcome
    invariance_reds = {cell for judgment, _, cell in reds if judgment == INVARIANCE}
    assert {cell for cell, out in outcomes.items() if out == Outcome.NOT_AS_EXPECTED} == invariance_reds


# A head backend that runs its declared ops for its first two calls (the first two cells), then takes its lse through
# amax and sum, which it does not declare: provenance stops the kernels in the third cell.
LATE_SNEAK = """
import torch
import kernels
from trainer_backend import CAPABILITY, REDUCES
from kernels.backend import STOCK_MATMUL_OPS


@kernels.register_backend(
    "late_sneak", kernels={"matmul": STOCK_MATMUL_OPS, "logprob": REDUCES, "tp_merge": REDUCES}, capability=CAPABILITY
)
class LateSneak:
    calls = 0

    def logits_logprob(self, logits, targets):
        LateSneak.calls += 1
        x = logits.float()
        logp = torch.log_softmax(x, -1).gather(-1, targets[:, None]).squeeze(-1)
        if LateSneak.calls <= 2:
            return logp, torch.logsumexp(x, -1)
        top = x.amax(-1, keepdim=True)
        return logp, (top + (x - top).exp().sum(-1, keepdim=True).log()).squeeze(-1)
"""


def test_a_run_whose_head_provenance_stops_in_a_later_cell_is_red_with_every_planned_row_once(tmp_path):
    """The verdicts a whole model's run had judged before provenance stopped it (the module and row_local rows of the
    cells before) were planned again as not run: the run ended as a harness fault (exit 1), not red."""
    (tmp_path / "late_sneak.py").write_text(LATE_SNEAK)
    backend = ("profile.backend_family=late_sneak", "profile.backend_module=late_sneak",
               "profile.required_nodes={matmul:late_sneak,logprob:late_sneak,tp_merge:late_sneak}")  # fmt: skip
    done = run_rlsweep(tmp_path / "run", MODEL, "profile=hf_sdpa_cpu_bf16", SMALL, *backend,
                       env={"PYTHONPATH": import_path(tmp_path, TESTS)})  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    checks = tables(tmp_path / "run")["checks"]
    keys = checks[["judgment", "tensor", "lhs_cell", "metric"]].astype(str).agg("/".join, axis=1)
    assert not keys.duplicated().any(), keys[keys.duplicated()].tolist()
    failed = checks[~checks.passed & checks.expected_pass]
    provenance = failed[failed.judgment == "provenance"]
    assert set(provenance.lhs_cell) == {"decode"}, failed[["judgment", "tensor", "lhs_cell", "detail"]]
    assert failed.detail.str.contains("backend 'late_sneak' launched 'aten::amax'").all()  # the rest: not run for it
    judged = checks[(checks.lhs_cell == "BN/pad_right") & checks.tensor.isin(["linear", "row_local"])]
    assert len(judged) == 2 and judged.passed.all() and (judged.metric != "not_run").all()


MOE = ("model.name=moe_tiny", "model.body.hf_config.model_type=qwen3_moe", "+model.body.hf_config.num_experts=4",
       "+model.body.hf_config.num_experts_per_tok=2", "+model.body.hf_config.moe_intermediate_size=64")  # fmt: skip


def test_an_moe_models_experts_are_judged_in_every_cell_and_its_float64_forward_need_not_exist(tmp_path):
    """An MoE's experts run on the tokens routed to them, not on the call's [batch, position] rows, so the divergence
    recording keeps none of their calls: they are hooked whole in every cell after the first. Its grouped matmul has no
    float64 kernel: the reported end-to-end row says so, and the verdicts stand (the run ended in that error)."""
    done = run_rlsweep(tmp_path, MODEL, *MOE, "profile=hf_eager_cpu_bf16", SMALL)
    assert done.returncode == 0, done.stderr[-3000:]
    checks = tables(tmp_path)["checks"]
    activation = checks[(checks.judgment == "module_accuracy") & (checks.tensor == "activation")]
    assert set(activation.lhs_cell) == {"BN/packed", "BN/pad_right", "decode"}, activation
    assert activation.detail.str.contains("mlp.experts.act_fn").all() and (activation.value > 0.5).all()
    end_to_end = checks[checks.tensor == "end_to_end"].detail.iloc[0]
    assert "not computed: the model's forward in float64 raised RuntimeError" in end_to_end, end_to_end


def test_new_lengths_on_a_head_workload_need_none_of_its_head_only_lists(tmp_path):
    """hunt's sample_scales and probe_samples (one per sample, for the head) were still checked against a whole model's
    new seq_lens: the run was refused over keys it never reads and a user may not set."""
    lengths = ("workload=hunt", "workload.seq_lens=[12,9]", "workload.prompt_lens=[3,4]")
    done = run_rlsweep(tmp_path, MODEL, "profile=hf_eager_cpu_bf16", *lengths, SMALL)
    assert done.returncode == 0, done.stderr[-2000:]
    tokens = tables(tmp_path)["tokens"]
    assert set(tokens.sample_id) == {0, 1} and tokens.active.sum() == 3 * (9 + 5)  # response tokens, 3 cells


INVARIANT = ("profile=invariant_body_cpu_bf16", "layout=model")  # every model-level cell kind, interpreter-sized
ROLLOUT_METRICS = {"max_abs_dlogp": 0.0, "k1_kl": 0.0, "k2_kl": 0.0, "k3_kl": 0.0, "ppl_ratio": 1.0}


@pytest.mark.slow
def test_the_invariant_body_is_bitwise_in_every_model_cell_and_its_trainer_matches_its_rollout_exactly(tmp_path):
    done = run_rlsweep(tmp_path, MODEL, *INVARIANT)
    assert done.returncode == 0, done.stderr[-3000:]
    checks = tables(tmp_path)["checks"]
    invariance = checks[checks.judgment == "forward_invariance"]
    moved = {"BN/pad_right", "BN/pad_left", "BN/permuted", "BN/chunked", "B1/full", "B1/chunked", "decode",
             "needle/M=1/pos=0", "needle/M=3/pos=1", "needle/M=3/pos=3"}  # fmt: skip
    assert set(invariance.lhs_cell) == moved and set(invariance.rhs_cell) == {"BN/packed"}
    assert set(invariance.tensor) == {"logp", "lse", "modules", "row_local"} and len(invariance) == 4 * len(moved)
    assert invariance.passed.all() and (invariance.value == 0).all(), invariance.detail.tolist()
    modules = tables(tmp_path)["divergence"]  # every cell's modules compared, none moved
    assert set(modules.cell) == moved and (modules.tokens_differing == 0).all() and (modules.tokens > 0).all()
    rollout = checks[checks.judgment == "trainer_rollout"]
    assert set(rollout.lhs_cell) == {"decode", "BN/pad_left", "B1/full"}
    for metric, exact in ROLLOUT_METRICS.items():  # exactly, not within a tolerance: the bits agree
        assert (rollout[rollout.metric == metric].value == exact).all(), rollout[rollout.metric == metric]
    accuracy = checks[checks.judgment == "module_accuracy"]
    assert {"linear", "rmsnorm", "rotary", "activation", "attention"} <= set(accuracy.tensor) and accuracy.passed.all()
    body = checks[(checks.judgment == "provenance") & (checks.tensor == "body")]
    assert len(body) == len(moved) + 1 and body.passed.all(), body.detail.tolist()
    run = load_run(tmp_path)  # the modules' rows are planned: a table that lost one is not what the config plans
    assert plan_problems(run.config, run.contract, run.checks, standalone=True) == []
    dropped = run.checks.drop(run.checks.index[run.checks.tensor == "modules"][:1])
    assert plan_problems(run.config, run.contract, dropped, standalone=True)


@pytest.mark.parametrize(
    ("bug", "workload", "judgment"),
    [
        # The variant splits keys in blocks of 16 alone (under 48 keys) and 64 packed: sequences of 41 and 47 tokens
        # give it rows of several blocks, and it moves an attention output in 2 of 88 tokens (the workload and weights
        # are fixed: the same every run). varlen4's lengths (11 - 19) give too few such rows to show.
        (
            "attention_split_from_length",
            ("workload.seq_lens=[47,41]", "workload.prompt_lens=[1,1]"),
            "forward_invariance",
        ),
        ("linear_left_stock", (), "provenance"),
    ],
)
def test_an_invariant_body_that_varies_with_the_call_or_left_a_stock_op_is_red(tmp_path, bug, workload, judgment):
    env = {"PYTHONPATH": import_path(TESTS), "RLSWEEP_BODY_BUG": bug}
    done = run_rlsweep(tmp_path, MODEL, "profile=invariant_body_cpu_bf16", "profile.backend_module=bug_bodies",
                       "layout.cells=[BN/packed,B1/full]", "workload=varlen4", *workload, env=env)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    failed = red(tables(tmp_path)["checks"])
    assert set(failed.judgment) == {judgment}, failed[["judgment", "tensor", "detail"]]
    if judgment == "forward_invariance":
        first = tables(tmp_path)["divergence"].query("first_diverging")
        assert len(first) == 1 and first.module.str.fullmatch(r"model\.layers\.\d+\.self_attn").all(), first
        assert failed.detail.str.contains(f"first diverging module {first.module.iloc[0]} ").all()
        assert set(failed.tensor) == {"logp", "lse", "modules"}  # the modules' row names it as well
    else:
        assert failed.detail.str.contains(r"ran stock ops \['aten::linear'\]").all(), failed.detail.tolist()
