"""The tolerance contract loader: rows, roles, rejections that protect verdicts, sha256."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from rlsweep.contract import (
    BITWISE_JUDGMENTS,
    CHAIN_METRICS,
    CONTRACT_DTYPES,
    contract_from_mapping,
    default_contract_path,
    load_contract,
)
from rlsweep.errors import ContractError


@pytest.fixture(scope="module")
def document():
    return OmegaConf.to_container(OmegaConf.load(default_contract_path()), resolve=True)


def test_default_contract_loads_with_every_forward_row():
    contract = load_contract()
    assert contract.version == "v1"
    for dtype in CONTRACT_DTYPES:
        for tensor in ("logp", "lse"):
            assert contract.tolerance("forward_accuracy", tensor, dtype).mode == "tolerance"
            assert contract.tolerance("forward_invariance", tensor, dtype).mode == "bitwise"
            assert contract.tolerance("tp_invariance", tensor, dtype).mode == "bitwise"
            assert contract.tolerance("tp_invariance", tensor, dtype, scope="fixed_topology").mode == "tolerance"
        assert set(CHAIN_METRICS) <= set(vars(contract.chain_thresholds(dtype)))


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


def test_require_all_false_is_rejected(document):
    bad = copy.deepcopy(document)
    bad["chain_logprob_aggregates"]["require_all"] = False
    with pytest.raises(ContractError, match="require_all must be true"):
        contract_from_mapping(bad)


def test_sha256_ignores_the_pin_and_int_float_spelling_but_not_thresholds(document):
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
    row = load_contract().tolerance("forward_invariance", "lse", "float32")
    result = row.check(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([1.0, -0.0, 2.0]))
    assert not result.passed and result.first_index == 1 and result.mismatches == 1


def test_tolerance_check_fails_on_nan():
    row = load_contract().tolerance("forward_accuracy", "logp", "bfloat16")
    result = row.check(torch.tensor([-1.0, float("nan")]), torch.tensor([-1.0, -2.0]))
    assert not result.passed and result.first_index == 1
