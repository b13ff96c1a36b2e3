"""The RL mismatch metrics of the chain_aggregates judgment: definitions, aliases, bounds, contract rows, tables."""

from __future__ import annotations

import copy
import math
import re
import secrets
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from rlsweep_fixtures import compose_run, execute_run, run_rlsweep, tables_left

from rlsweep.analysis import load_checks
from rlsweep.contract import (
    REQUIRED_CHAIN_METRICS,
    ROUNDING_MODEL,
    contract_from_mapping,
    default_contract_path,
    load_contract,
)
from rlsweep.errors import ContractError
from rlsweep.judgments import Standard, apply_expected, chain_aggregates
from rlsweep.mismatch import ALIAS_OF, BY_NAME, METRIC_NAMES, METRICS, REPORTED_NAMES, ActiveTokens
from rlsweep.spec import ExpectedRed
from rlsweep.verdicts import REPORTED_ONLY
from rlsweep.workload import Workload

SEQ_LENS = (5, 12, 3, 9, 7)  # unequal; sample 2 gets no active token, so it is no sequence of the metrics
SILENT_SAMPLE = 2
DTYPE, OP = "bfloat16", "logits_bfloat16"


def random_case(seed: int):
    """A workload with inactive tokens scattered through every sample, a float64 reference, a float32 candidate
    (NaN on inactive tokens: they must not count) and a random per-token bound."""
    gen = torch.Generator().manual_seed(seed)
    sample_ids = torch.cat([torch.full((n,), s) for s, n in enumerate(SEQ_LENS)])
    positions = torch.cat([torch.arange(n) for n in SEQ_LENS])
    starts = torch.cat([torch.tensor([0]), torch.tensor(SEQ_LENS).cumsum(0)[:-1]])
    active = torch.rand(len(sample_ids), generator=gen) < 0.6
    active[starts] = True  # >= 1 per sample
    active[sample_ids == SILENT_SAMPLE] = False
    reference = -(torch.rand(len(sample_ids), generator=gen, dtype=torch.float64) * 6 + 0.01)
    dlogp = torch.randn(len(sample_ids), generator=gen, dtype=torch.float64) * 0.15
    dlogp[starts[:2]] = torch.tensor([0.3, 0.0], dtype=torch.float64)  # one token clipped, one not
    candidate = torch.where(active, reference + dlogp, torch.nan).float()
    bound = torch.rand(len(sample_ids), generator=gen, dtype=torch.float64) * 0.1 + 0.01
    workload = Workload("random", seed, sample_ids, positions, torch.zeros(len(sample_ids), 1), sample_ids, active,
                        active, SEQ_LENS)  # fmt: skip
    return workload, reference, candidate, bound


def judge(contract, workload, reference, candidate, bound):
    """chain_aggregates of candidate vs reference -> {metric: verdict}."""
    cell = SimpleNamespace(name="BN/packed")
    standard = Standard(contract, DTYPE, OP, {"logp": bound, "lse": bound})
    verdicts = chain_aggregates(
        SimpleNamespace(cell=cell, logp=candidate), SimpleNamespace(cell=cell, logp=reference), workload, standard
    )
    assert [v.metric for v in verdicts] == list(REPORTED_NAMES)
    return {verdict.metric: verdict for verdict in verdicts}


def hand_computed(workload, reference, candidate, clip) -> dict[str, float]:
    """Every metric in plain float64 Python, from the definitions in docs/contract.md."""
    pairs = [(float(candidate[t]), float(reference[t]), int(workload.sample_ids[t]))
             for t in range(workload.num_tokens) if workload.active[t]]  # fmt: skip
    d = [lhs - rhs for lhs, rhs, _ in pairs]
    samples = sorted({s for _, _, s in pairs})
    sums = [sum(lhs - rhs for lhs, rhs, s in pairs if s == sample) for sample in samples]
    means = [sum(lhs for lhs, _, s in pairs if s == sample) / sum(1 for *_, s in pairs if s == sample)
             for sample in samples]  # fmt: skip
    rhs_means = [sum(rhs for _, rhs, s in pairs if s == sample) / sum(1 for *_, s in pairs if s == sample)
                 for sample in samples]  # fmt: skip

    def mean(values):
        return sum(values) / len(values)

    dp = [abs(math.exp(lhs) - math.exp(rhs)) for lhs, rhs, _ in pairs]
    return {
        "max_abs_dlogp": max(abs(x) for x in d),
        "approx_kl0": mean([math.exp(x) - 1 - x for x in d]),
        "clipfrac0": mean([not clip[0] <= math.exp(x) <= clip[1] for x in d]),
        "k1_kl": mean([rhs - lhs for lhs, rhs, _ in pairs]),
        "k2_kl": mean([x * x / 2 for x in d]),
        "k1_kl_seq": mean([-x for x in sums]),
        "k2_kl_seq": mean([x * x / 2 for x in sums]),
        "k3_kl_seq": mean([math.exp(x) - 1 - x for x in sums]),
        "chi2_token": mean([math.exp(2 * x) for x in d]) - 1,
        "chi2_seq": mean([math.exp(2 * x) for x in sums]) - 1,
        "ppl_ratio": mean([math.exp(-m) / math.exp(-r) for m, r in zip(means, rhs_means, strict=True)]),
        "rollout_probs_diff_max": max(dp),
        "rollout_probs_diff_mean": mean(dp),
    }


def test_each_metric_matches_a_hand_computation():
    seed = secrets.randbits(31)
    contract = load_contract()
    case = random_case(seed)
    rows = judge(contract, *case)
    expected = hand_computed(*case[:3], contract.clip_interval)
    assert 0 < expected["clipfrac0"] < 1, seed  # the spread clips some tokens, not all
    assert len({int(s) for s in case[0].sample_ids[case[0].active]}) == len(SEQ_LENS) - 1, seed
    for name in REPORTED_NAMES:
        wanted = expected[ALIAS_OF.get(name, name)]
        assert math.isclose(rows[name].value, wanted, rel_tol=1e-9, abs_tol=1e-13), (seed, name, rows[name].value)


def test_an_alias_row_is_its_twin_bitwise():
    rows = judge(load_contract(), *random_case(secrets.randbits(31)))
    assert ALIAS_OF == {"k3_kl": "approx_kl0"}
    for alias, twin in ALIAS_OF.items():
        a, b = rows[alias], rows[twin]
        assert a.value.hex() == b.value.hex() and a.threshold.hex() == b.threshold.hex()
        assert (a.passed, a.judged, a.detail) == (b.passed, b.judged, b.detail)


@pytest.mark.parametrize("metric", METRICS, ids=lambda m: m.name)
def test_limits_contain_every_dlogp_within_the_bound_and_are_attained(metric):
    """Random dlogp in the box |d| <= b stays within the limits; a corner d = +-b reaches them."""
    seed = secrets.randbits(31)
    workload, reference, _, bound = random_case(seed)
    rows = workload.active.nonzero()[:, 0]
    tokens = ActiveTokens.of(workload.sample_ids[rows], reference[rows], (0.95, 1.05))  # some bounds reach it
    b = bound[rows]
    lower, upper = metric.limits(b, tokens)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(50):
        value = metric.value((torch.rand(len(b), generator=gen, dtype=torch.float64) * 2 - 1) * b, tokens)
        assert lower <= value <= upper, (seed, value, lower, upper)
    corners = [metric.value(b, tokens), metric.value(-b, tokens)]
    assert math.isclose(max(corners), upper, rel_tol=1e-12), seed
    if metric.signed:
        assert math.isclose(min(corners), lower, rel_tol=1e-12), seed
    else:
        assert lower == -math.inf


def test_a_candidate_beyond_its_bound_fails_every_judged_metric():
    seed = secrets.randbits(31)
    contract = load_contract()
    workload, reference, _, bound = random_case(seed)
    spread = torch.rand(len(bound), generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1.6 - 0.8
    within = (reference + spread * bound).float()  # margin 0.2 b >> float32 rounding
    assert all(v.passed and v.judged for v in judge(contract, workload, reference, within, bound).values()), seed
    beyond = judge(contract, workload, reference, (reference + 1.5 * bound).float(), bound)
    assert {name for name, v in beyond.items() if v.passed} == {"clipfrac0"}, seed  # no bound reaches the clip
    clipped = reference + 0.5 * bound
    clipped[workload.active.nonzero()[0, 0]] += math.log(contract.clip_interval[1]) + 0.01
    assert not judge(contract, workload, reference, clipped.float(), bound)["clipfrac0"].passed, seed


@pytest.mark.parametrize("fault", ["nan", "inf", "empty"])
def test_nonfinite_dlogp_or_no_active_token_fails_every_judged_metric(fault):
    workload, reference, candidate, bound = random_case(secrets.randbits(31))
    first = int(workload.active.nonzero()[0, 0])
    if fault == "empty":
        workload = replace(
            workload, active=torch.zeros_like(workload.active), sampled=torch.zeros_like(workload.active)
        )
    else:
        candidate[first] = float(fault)
    rows = judge(load_contract(), workload, reference, candidate, bound)
    assert not any(v.passed for v in rows.values())
    assert all(math.isnan(v.value) and "hard failure" in v.detail for v in rows.values())


def test_a_value_that_overflows_fails_even_an_infinite_limit():
    workload, reference, _, _ = random_case(secrets.randbits(31))
    bound = torch.full_like(reference, 1000.0)  # so wide that exp(2 * bound) is inf too
    rows = judge(load_contract(), workload, reference, (reference + 400).float(), bound)
    overflowed = {name for name, v in rows.items() if not math.isfinite(v.value)}
    assert {"chi2_token", "chi2_seq"} <= overflowed and rows["chi2_token"].threshold == math.inf
    assert not any(rows[name].passed for name in overflowed)


def test_v1_reports_the_new_metrics_without_judging_them():
    contract = load_contract(default_contract_path("v1"))
    assert contract.chain_metrics == REQUIRED_CHAIN_METRICS
    workload, reference, _, bound = random_case(secrets.randbits(31))
    far = (reference + 3 * contract.chain[DTYPE].figures["max_abs_dlogp"]).float()  # beyond every v1 figure
    rows = judge(contract, workload, reference, far, bound)
    reported = [v for name, v in rows.items() if ALIAS_OF.get(name, name) not in REQUIRED_CHAIN_METRICS]
    assert len(reported) == len(METRIC_NAMES) - len(REQUIRED_CHAIN_METRICS)
    for verdict in reported:
        assert verdict.passed and not verdict.judged and math.isnan(verdict.threshold)
        assert verdict.detail.startswith(f"{REPORTED_ONLY}: contract v1 has no row") and math.isfinite(verdict.value)
    assert not any(v.passed for v in rows.values() if v.judged)
    declaration = ExpectedRed(judgment="chain_aggregates", cells=("*",), reason="test")
    declared = apply_expected(list(rows.values()), [declaration])
    assert all(v.as_expected for v in declared)  # a declaration never turns a reported-only row into a verdict
    assert {v.metric for v in declared if not v.expected_pass} == {*REQUIRED_CHAIN_METRICS, "k3_kl"}


@pytest.fixture(scope="module")
def v1_document():
    return OmegaConf.to_container(OmegaConf.load(default_contract_path("v1")), resolve=True)


LOADER_REJECTS = {
    "unknown metric": (["max_abs_dlogp", "approx_kl0", "clipfrac0", "kl3"], "unknown chain metric(s) ['kl3']"),
    "alias": (["max_abs_dlogp", "approx_kl0", "clipfrac0", "k3_kl"], "{'k3_kl': 'approx_kl0'} are aliases"),
    "dropped": (["max_abs_dlogp", "approx_kl0"], "must keep"),
    "row missing": (["max_abs_dlogp", "approx_kl0", "clipfrac0", "k2_kl"], "thresholds.bfloat16.k2_kl"),
}


@pytest.mark.parametrize("case", sorted(LOADER_REJECTS))
def test_loader_rejects_what_would_weaken_the_chain_rows(v1_document, case):
    judged, message = LOADER_REJECTS[case]
    bad = copy.deepcopy(v1_document)
    bad["chain_logprob_aggregates"]["judged_metrics"] = judged
    with pytest.raises(ContractError, match=re.escape(message)):
        contract_from_mapping(bad)


def test_a_run_whose_contract_lacks_a_judged_row_stops_before_any_kernel(tmp_path):
    judged = "[max_abs_dlogp,approx_kl0,clipfrac0,k2_kl]"
    cfg = compose_run("layout=smoke", "contract=v1", f"+contract.chain_logprob_aggregates.judged_metrics={judged}")
    with pytest.raises(ContractError, match=re.escape("thresholds.bfloat16.k2_kl")):
        execute_run(cfg, tmp_path)
    assert tables_left(tmp_path) == []


def test_v2_judges_every_metric_from_the_rounding_model():
    contract = load_contract()
    assert contract.chain_metrics == METRIC_NAMES
    assert all(thresholds.mode == ROUNDING_MODEL for thresholds in contract.chain.values())
    assert set(BY_NAME) == set(METRIC_NAMES) and not set(ALIAS_OF) & set(METRIC_NAMES)


def test_a_run_writes_every_mismatch_metric_to_its_checks(tmp_path):
    done = run_rlsweep(tmp_path, "profile=cpu_bf16", "layout=smoke")
    assert done.returncode == 0, done.stdout + done.stderr
    checks = load_checks(tmp_path)
    chain = checks[checks.judgment == "chain_aggregates"].set_index("metric")
    assert sorted(chain.index) == sorted(REPORTED_NAMES)
    assert chain.passed.all() and chain.expected_pass.all() and chain.threshold.map(math.isfinite).all()
    assert not chain.detail.str.startswith(REPORTED_ONLY).any()
    for alias, twin in ALIAS_OF.items():
        assert chain.loc[alias, "value"].hex() == chain.loc[twin, "value"].hex()
