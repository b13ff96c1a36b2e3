"""The tolerance contract loader: rows, roles, rejections that protect verdicts, sha256."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from omegaconf import OmegaConf

from rlsweep.contract import (
    BITWISE_JUDGMENTS,
    CONTRACT_DTYPES,
    ROUNDING_MODEL,
    contract_from_mapping,
    default_contract_path,
    load_contract,
    op_class,
)
from rlsweep.errors import ContractError


@pytest.fixture(scope="module")
def document():
    return OmegaConf.to_container(OmegaConf.load(default_contract_path()), resolve=True)


@pytest.mark.parametrize(("version", "accuracy_mode"), [("v2", ROUNDING_MODEL), ("v1", "tolerance")])
def test_both_contracts_load_with_every_forward_row(version, accuracy_mode):
    contract = load_contract(default_contract_path(version))
    assert contract.version == version
    for dtype in CONTRACT_DTYPES:
        op = op_class(dtype, None)
        for tensor in ("logp", "lse"):
            assert contract.tolerance("forward_accuracy", tensor, dtype, op=op).mode == accuracy_mode
            assert contract.tolerance("forward_invariance", tensor, dtype, op=op).mode == "bitwise"
            assert contract.tolerance("tp_invariance", tensor, dtype, op=op).mode == "bitwise"
            fixed = contract.tolerance("tp_invariance", tensor, dtype, op=op, scope="fixed_topology")
            assert fixed.mode == accuracy_mode
        chain = contract.chain_thresholds(dtype)
        if version == "v2":
            assert chain.mode == ROUNDING_MODEL
        else:
            assert set(chain.figures) == set(contract.chain_metrics)


def test_v2_keys_rows_by_op_class_so_two_bf16_profiles_differ():
    contract = load_contract()
    assert contract.tolerance("forward_accuracy", "logp", "bfloat16", op="logits_float32").mode == ROUNDING_MODEL
    with pytest.raises(ContractError, match="op class 'logits_bfloat16'"):
        contract.tolerance("forward_accuracy", "logp", "float32", op="logits_bfloat16")


def test_a_rounding_model_row_carries_no_figure(document):
    bad = copy.deepcopy(document)
    bad["judgments"]["forward_accuracy"]["rows"]["logp"]["bfloat16"]["logits_bfloat16"]["atol"] = 0.5
    with pytest.raises(ContractError, match="a rounding_model row has only 'mode'"):
        contract_from_mapping(bad)


def test_rounding_model_rows_judge_by_the_bound_and_report_its_share():
    row = load_contract().tolerance("forward_accuracy", "logp", "bfloat16", op="logits_bfloat16")
    lhs, rhs = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.05, -2.0, -3.3])
    within = row.check(lhs, rhs, torch.tensor([0.1, 0.1, 0.4]))
    assert within.passed and abs(within.max_ratio - 0.75) < 1e-6 and row.threshold == 1.0
    beyond = row.check(lhs, rhs, torch.tensor([0.1, 0.1, 0.2]))
    assert not beyond.passed and beyond.first_index == 2 and beyond.mismatches == 1
    with pytest.raises(ContractError, match="needs a bound"):
        row.check(lhs, rhs)


@pytest.mark.parametrize("judgment", BITWISE_JUDGMENTS)
def test_non_bitwise_invariance_row_is_rejected(document, judgment):
    bad = copy.deepcopy(document)
    tensor = next(iter(bad["judgments"][judgment]["rows"]))
    bad["judgments"][judgment]["rows"][tensor]["bfloat16"] = {"atol": 1e-3, "rtol": 0.0, "mode": "tolerance"}
    with pytest.raises(ContractError, match=f"{judgment}.rows.{tensor}.bfloat16"):
        contract_from_mapping(bad)


def test_cross_tp_bitwise_scope_must_be_bitwise(document):
    bad = copy.deepcopy(document)
    bad["judgments"]["tp_invariance"]["scopes"]["cross_tp_bitwise"]["rows"]["lse"]["float32"]["atol"] = 1e-6
    with pytest.raises(ContractError, match="cross_tp_bitwise"):
        contract_from_mapping(bad)


@pytest.mark.parametrize("over", ["all_tokens", None, ""])
def test_chain_metrics_over_anything_but_the_active_tokens_is_rejected(document, over):
    bad = copy.deepcopy(document)
    bad["chain_logprob_aggregates"]["over"] = over
    with pytest.raises(ContractError, match=re.escape("chain_logprob_aggregates.over must be 'active_tokens'")):
        contract_from_mapping(bad)


def test_require_all_false_is_rejected(document):
    bad = copy.deepcopy(document)
    bad["chain_logprob_aggregates"]["require_all"] = False
    with pytest.raises(ContractError, match="require_all must be true"):
        contract_from_mapping(bad)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("tf32", "enabled", "tf32='enabled', but every run uses tf32='disabled'"),
        ("accumulation_dtype", "bfloat16", "accumulation_dtype='bfloat16', but every run uses"),
        ("reference_dtype", "float32", "reference_dtype='float32', but every run uses"),
        ("fp8", "e4m3", "fp8='e4m3', but every run uses"),
        ("execution_dtype", "float8", "execution_dtype='float8'; valid: bfloat16, float32"),
    ],
)
def test_a_dtype_policy_the_runs_do_not_follow_is_refused(document, key, value, message):
    bad = copy.deepcopy(document)
    bad["dtype_policy"][key] = value
    with pytest.raises(ContractError, match=re.escape(message)):
        contract_from_mapping(bad)


@pytest.mark.parametrize("name", ["v2", "v9"])
def test_a_contract_file_whose_version_is_not_its_name_is_refused(tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(default_contract_path("v1").read_text())  # version: v1
    with pytest.raises(ContractError, match=re.escape(f"version='v1' is not the version of contract file {name}")):
        load_contract(path)


CLIP = "chain_logprob_aggregates.clip_interval"
BAD_CLIPS = {
    "a string": ([".nan", 1.2], f"{CLIP}[0] must be a finite number, got '.nan'"),
    "NaN": ([0.8, float("nan")], f"{CLIP}[1] must be a finite number, got nan"),
    "infinite": ([0.8, float("inf")], f"{CLIP}[1] must be a finite number, got inf"),
    "a bool": ([True, 1.2], f"{CLIP}[0] must be a finite number, got True"),
    "one end": ([0.8], f"{CLIP} must be [low, high] with 0 < low < 1 < high, got [0.8]"),
    "not around 1": ([1.1, 1.2], f"{CLIP} must be [low, high] with 0 < low < 1 < high, got [1.1, 1.2]"),
}


@pytest.mark.parametrize("case", sorted(BAD_CLIPS))
def test_a_clip_interval_that_is_not_two_finite_numbers_around_1_is_refused_by_name(document, case):
    clip, message = BAD_CLIPS[case]
    bad = copy.deepcopy(document)
    bad["chain_logprob_aggregates"]["clip_interval"] = clip
    with pytest.raises(ContractError, match=re.escape(message)):
        contract_from_mapping(bad)


def set_roles(document, **section):
    document["comparison_roles"].update(section)


def set_pair(document, name, pair):
    document["comparison_roles"]["judgments"][name] = pair


# A comparison_roles or judged_metrics section of the wrong shape is named, not a TypeError from inside the loader.
BAD_SHAPES = {
    "roles not a list": (lambda d: set_roles(d, roles=None), "comparison_roles.roles must be a list of distinct"),
    "a role twice": (
        lambda d: set_roles(d, roles=["candidate", "reference", "candidate"]),
        "comparison_roles.roles must be a list of distinct role names",
    ),
    "judgments a list": (lambda d: set_roles(d, judgments=[1]), "comparison_roles.judgments must be a mapping"),
    "pair a string": (lambda d: set_pair(d, "forward_accuracy", "candidate"), "forward_accuracy must be a mapping"),
    "pair with another key": (
        lambda d: set_pair(d, "forward_accuracy", {"lhs": "candidate", "rhs": "reference", "note": 1}),
        "comparison_roles.forward_accuracy: unknown key(s) ['note']",
    ),
    "forbidden not a list": (lambda d: set_roles(d, forbidden=None), "comparison_roles.forbidden must be a list"),
    "forbidden pair without rhs": (
        lambda d: set_roles(d, forbidden=[{"lhs": "reference"}]),
        "comparison_roles.forbidden[0].rhs=None is not one of",
    ),
    "forbidden pair with a misspelt role": (
        lambda d: set_roles(d, forbidden=[{"lhs": "referense", "rhs": "candidate"}]),
        "comparison_roles.forbidden[0].lhs='referense' is not one of",
    ),
    "judged_metrics of lists": (
        lambda d: d["chain_logprob_aggregates"].update(judged_metrics=[["max_abs_dlogp"]]),
        "chain_logprob_aggregates.judged_metrics must be a list of distinct metric names",
    ),
}


def assert_refused(document, change, message):
    """``change`` applied to a copy of ``document`` makes it a contract refused with ``message``."""
    bad = copy.deepcopy(document)
    change(bad)
    with pytest.raises(ContractError, match=re.escape(message)):
        contract_from_mapping(bad)


@pytest.mark.parametrize("case", sorted(BAD_SHAPES))
def test_a_roles_or_metrics_section_of_the_wrong_shape_is_refused_by_name(document, case):
    assert_refused(document, *BAD_SHAPES[case])


@pytest.fixture(scope="module")
def v1_document():
    return OmegaConf.to_container(OmegaConf.load(default_contract_path("v1")), resolve=True)


def widen_rtol(document, rtol):
    document["judgments"]["forward_accuracy"]["rows"]["logp"]["bfloat16"]["rtol"] = rtol


def widen_chain(document, metric, figure):
    document["chain_logprob_aggregates"]["thresholds"]["bfloat16"][metric] = figure


def judge_also(document, metric, figure):
    """Judge ``metric`` too, by ``figure`` at every dtype."""
    chain = document["chain_logprob_aggregates"]
    chain["judged_metrics"] = [*chain.get("judged_metrics", ["max_abs_dlogp", "approx_kl0", "clipfrac0"]), metric]
    for thresholds in chain["thresholds"].values():
        thresholds[metric] = figure


# Figures no value can exceed: a row or a chain metric that could never fail.
FIGURES_THAT_CANNOT_FAIL = {
    "rtol 1": (lambda d: widen_rtol(d, 1.0), "rtol=1.0 passes a kernel that returns 0 for every token"),
    "rtol 5": (lambda d: widen_rtol(d, 5), "rtol=5.0 passes a kernel that returns 0 for every token"),
    "clipfrac0 1": (lambda d: widen_chain(d, "clipfrac0", 1), "bfloat16.clipfrac0=1.0 can never fail"),
    "rollout_probs_diff_max 2": (
        lambda d: judge_also(d, "rollout_probs_diff_max", 2.0),
        "bfloat16.rollout_probs_diff_max=2.0 can never fail",
    ),
}


@pytest.mark.parametrize("case", sorted(FIGURES_THAT_CANNOT_FAIL))
def test_a_figure_no_value_can_exceed_is_refused(v1_document, case):
    assert_refused(v1_document, *FIGURES_THAT_CANNOT_FAIL[case])


def test_figures_just_below_the_ceiling_are_accepted(v1_document):
    loose = copy.deepcopy(v1_document)
    widen_rtol(loose, 0.999)
    widen_chain(loose, "clipfrac0", 0.999)
    contract_from_mapping(loose)


def test_sha256_ignores_the_pin_and_int_float_spelling_but_not_thresholds():
    document = OmegaConf.to_container(OmegaConf.load(default_contract_path("v1")), resolve=True)
    base = contract_from_mapping(document).sha256
    pinned = copy.deepcopy(document)
    pinned["expected_sha256"] = base
    respelled = copy.deepcopy(document)
    respelled["judgments"]["forward_invariance"]["rows"]["logp"]["bfloat16"]["atol"] = 0
    loosened = copy.deepcopy(document)
    loosened["judgments"]["forward_accuracy"]["rows"]["logp"]["bfloat16"]["atol"] = 0.5
    assert contract_from_mapping(pinned).sha256 == base
    assert contract_from_mapping(respelled).sha256 == base
    assert contract_from_mapping(loosened).sha256 != base


def test_bitwise_check_compares_bit_patterns():
    row = load_contract().tolerance("forward_invariance", "lse", "float32", op="logits_float32")
    result = row.check(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([1.0, -0.0, 2.0]))
    assert not result.passed and result.first_index == 1 and result.mismatches == 1


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_accuracy_check_fails_on_nan(version):
    row = load_contract(default_contract_path(version)).tolerance(
        "forward_accuracy", "logp", "bfloat16", op="logits_bfloat16"
    )
    result = row.check(torch.tensor([-1.0, float("nan")]), torch.tensor([-1.0, -2.0]), torch.tensor([0.5, 0.5]))
    assert not result.passed and result.first_index == 1
