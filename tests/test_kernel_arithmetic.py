"""kernels.reduction_bound and kernels.bias_allowance (docs/contract.md#the-kernels-own-arithmetic), and the kernels
API that hands the harness the logits a call stored (keep_logits) and an overflow as a value (nonfinite)."""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from rlsweep.contract import ContractError, contract_from_mapping, default_contract_path, load_contract

FAILURE = 1e-9


def stock(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What stock PyTorch computes from stored logits: fp32 logsumexp and log_softmax + gather."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=1)
    logp = torch.log_softmax(x, dim=1).gather(1, targets[:, None])[:, 0]
    return logp.double(), lse.double()


def inputs(seed: int, rows: int, vocab: int, std: float) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * std).bfloat16()
    return logits, torch.randint(0, vocab, (rows,), generator=generator)


def judged(logits, targets, logp, lse, vocab_tile=256):
    """(max |error| / bound over logp and lse, |sum of errors| / allowance over logp and lse)."""
    bound = kernels.reduction_bound(logits, targets, failure_probability=FAILURE, tokens=len(targets),
                                    vocab_tile=vocab_tile)  # fmt: skip
    ratios, biases = [], []
    for name, value in (("logp", logp), ("lse", lse)):
        error = value - getattr(bound, name)
        ratios.append(float((error.abs() / getattr(bound, f"{name}_bound")).max()))
        systematic, variance = getattr(bound, f"{name}_systematic"), getattr(bound, f"{name}_variance")
        biases.append(abs(float(error.sum())) / kernels.bias_allowance(systematic, variance, FAILURE))
    return max(ratios), max(biases)


@pytest.mark.parametrize("vocab, std", [(17, 4.0), (3001, 4.0), (3001, 0.5), (3001, 32.0), (40000, 4.0)])
def test_stock_pytorch_stays_within_the_bound_and_unbiased_over_many_seeds(vocab, std):
    seeds = 100 if (vocab, std) == (3001, 4.0) else 10 if vocab > 3001 else 25
    worst = (0.0, 0.0)
    for seed in range(seeds):
        logits, targets = inputs(seed, 64, vocab, std)
        worst = tuple(map(max, worst, judged(logits, targets, *stock(logits, targets))))
    assert worst[0] <= 1 and worst[1] <= 1, worst
    assert worst[0] > 0  # the comparison sees rounding at all: the bound is not vacuously large ...
    assert worst[0] < 0.5  # ... and stock PyTorch uses well under half of it (measured: at most 0.16)


@pytest.mark.parametrize("vocab", [3001, 40000])
def test_a_relative_scale_of_1e_4_is_red_per_token(vocab):
    logits, targets = inputs(7, 64, vocab, 4.0)
    x = logits.float() / (1 + 1e-4)
    lse = torch.logsumexp(x, dim=1).double()
    logp = torch.log_softmax(x, dim=1).gather(1, targets[:, None])[:, 0].double()
    ratio, bias = judged(logits, targets, logp, lse)
    assert ratio >= 3 and bias >= 3, (ratio, bias)


def test_a_bias_inside_every_per_token_bound_is_red():
    """A shift of a third of each token's bound, one-signed: every token passes, their sum does not."""
    logits, targets = inputs(3, 400, 3001, 4.0)
    bound = kernels.reduction_bound(logits, targets, failure_probability=FAILURE, tokens=400, vocab_tile=256)
    _, lse = stock(logits, targets)
    shifted = lse + bound.lse_bound / 3
    assert bool(((shifted - bound.lse).abs() <= bound.lse_bound).all())
    allowance = kernels.bias_allowance(bound.lse_systematic, bound.lse_variance, FAILURE)
    assert abs(float((shifted - bound.lse).sum())) > 3 * allowance
    assert abs(float((lse - bound.lse).sum())) <= allowance  # and the unshifted sum is inside


def test_a_fused_heads_bound_adds_its_fp32_logits_error():
    """Without stored logits the comparand is float64 of the float64 products, the fp32 logits' error in the bound."""
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(8, 64, generator=generator).bfloat16()
    weight = (torch.randn(500, 64, generator=generator) * 0.5).bfloat16()
    targets = torch.randint(0, 500, (8,), generator=generator)
    products, errors = kernels.logit_errors(hidden, weight, torch.float32)
    plain = kernels.reduction_bound(products, targets, failure_probability=FAILURE, tokens=8, vocab_tile=256)
    fused = kernels.reduction_bound(products, targets, failure_probability=FAILURE, tokens=8, vocab_tile=256,
                                    errors=errors)  # fmt: skip
    spread = torch.logsumexp(products + errors, dim=1) - torch.logsumexp(products, dim=1)
    assert torch.allclose(fused.lse_bound - plain.lse_bound, spread, rtol=1e-9, atol=0)
    assert bool((fused.logp_bound > fused.lse_bound).all())  # the target logit's own error on top
    fp32 = (hidden.float() @ weight.float().T).double()  # what a fused head reduces, in fp32
    assert bool(((fp32 - products).abs() <= errors).all())


@pytest.mark.parametrize("probability", [0.0, 1.0, -1e-9, math.nan])
def test_a_failure_probability_outside_0_1_is_refused(probability):
    logits, targets = inputs(0, 2, 17, 1.0)
    with pytest.raises(kernels.KernelInputError, match="failure_probability"):
        kernels.reduction_bound(logits, targets, failure_probability=probability, tokens=2, vocab_tile=16)


@pytest.mark.parametrize("tp", [1, 3])
def test_keep_logits_hands_back_the_logits_the_reduction_read(make_inputs, tp):
    case = make_inputs(rows=9, hidden_size=16, vocab=70, dtype=torch.bfloat16, device="cpu")
    result = kernels.lm_head_logprob(case.hidden, case.weight, case.targets, backend="aten", tp=tp, vocab_tile=16,
                                     keep_logits=True)  # fmt: skip
    sharding = kernels.ShardingSpec.even(70, 16, tp)
    shards = []
    for rank in range(tp):
        lo, hi = sharding.for_rank(rank).real_shard
        shards.append(kernels.matmul(case.hidden, case.weight[lo:hi], backend="aten")[0])
    assert kernels.first_bit_difference(result.logits, torch.cat(shards, dim=1)) is None
    plain = kernels.lm_head_logprob(case.hidden, case.weight, case.targets, backend="aten", tp=tp, vocab_tile=16)
    assert plain.logits is None  # held only when asked for
    assert kernels.first_bit_difference(plain.lse, result.lse) is None


def test_a_fused_backend_stores_no_logits():
    assert not kernels.stores_logits("triton_fused")
    assert kernels.stores_logits("triton") and kernels.stores_logits("aten")


def test_nonfinite_return_hands_an_overflow_back_and_raise_stays_the_default(make_inputs, isolated_registries):
    from kernels.backend import SEGMENT_PARTIALS_OPS, STOCK_MATMUL_OPS, segment_partials, stock_matmul

    @kernels.register_backend(
        "overflowing",
        kernels={"matmul": STOCK_MATMUL_OPS, "logprob": SEGMENT_PARTIALS_OPS, "tp_merge": SEGMENT_PARTIALS_OPS},
        capability=kernels.BACKENDS["aten"].capability,
    )
    class Overflowing:  # the aten backend's nodes, but every lse is +inf
        def matmul(self, hidden, weight):
            logits = stock_matmul(hidden, weight)
            return logits, kernels.observe("matmul", self.id, logits)

        def shard_partials(self, logits, local_targets, owned, sharding):
            maxes, sums = segment_partials(logits.float())
            target = kernels.backend.gather_target_logit(logits.float(), local_targets, owned)
            partials = kernels.ShardPartials(maxes[:, None], sums[:, None], target, owned)
            return partials, kernels.observe("logprob", self.id, sums)

        def merge(self, partials):
            lse = torch.full_like(partials[0].target_logit, math.inf)
            torch.ops.aten.amax.default(partials[0].maxes, [1])
            torch.ops.aten.sum.dim_IntList(partials[0].sumexps, [1])
            return lse, kernels.observe("tp_merge", self.id, lse)

    case = make_inputs(rows=4, hidden_size=8, vocab=32, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(kernels.NonFiniteOutputError):
        kernels.lm_head_logprob(case.hidden, case.weight, case.targets, backend="overflowing", vocab_tile=16)
    result = kernels.lm_head_logprob(case.hidden, case.weight, case.targets, backend="overflowing", vocab_tile=16,
                                     nonfinite="return")  # fmt: skip
    assert bool(torch.isinf(result.lse).all())
    bad = case.hidden.clone()
    bad[0, 0] = math.nan  # a non-finite input is still refused, whatever nonfinite says
    with pytest.raises(kernels.NonFiniteInputError):
        kernels.lm_head_logprob(bad, case.weight, case.targets, backend="overflowing", vocab_tile=16,
                                nonfinite="return")  # fmt: skip
    with pytest.raises(kernels.KernelInputError, match="nonfinite"):
        kernels.lm_head_logprob(case.hidden, case.weight, case.targets, backend="aten", nonfinite="ignore")


def test_contract_v3_judges_the_kernels_arithmetic_and_needs_its_error_model():
    contract = load_contract()
    assert contract.version == "v3" and contract.judges_kernel_arithmetic and contract.failure_probability == 1e-9
    document = dict(contract.document)
    without = {key: value for key, value in document.items() if key != "error_model"}
    with pytest.raises(ContractError, match="error_model"):
        contract_from_mapping(without)
    for value in (0, 0.5, 1e-3, "1e-9"):
        with pytest.raises(ContractError, match="failure_probability"):
            contract_from_mapping({**document, "error_model": {"failure_probability": value}})
    v2 = load_contract(default_contract_path("v2"))
    older = dict(v2.document)
    assert not v2.judges_kernel_arithmetic
    with pytest.raises(ContractError, match="lacks"):
        contract_from_mapping({**older, "error_model": {"failure_probability": 1e-9}})


def test_a_cell_whose_comparands_were_not_all_gathered_is_an_error_not_a_verdict():
    from rlsweep.arithmetic import ArithmeticCollector, ComparandCache
    from rlsweep.layouts import Call

    logits, targets = inputs(5, 4, 17, 1.0)
    weight = torch.randn(17, 8).bfloat16()
    collector = ArithmeticCollector(
        weight, 4, tokens=4, vocab_tile=16, logits_dtype=torch.bfloat16, failure_probability=FAILURE,
        judge_logits=False, shared=ComparandCache(4),
    )  # fmt: skip
    hidden = torch.randn(4, 8).bfloat16()
    collector.add(Call(torch.tensor([0, 1]), torch.tensor([-1, -1])), hidden[:2], targets[:2], logits[:2])
    with pytest.raises(RuntimeError, match="2 token"):
        collector.finish()  # tokens 2 and 3 came from no call
    collector.add(Call(torch.tensor([2, 3]), torch.tensor([-1, -1])), hidden[2:], targets[2:], logits[2:])
    assert bool(torch.isfinite(collector.finish().bound.lse).all())
