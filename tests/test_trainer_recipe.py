"""The trainer's recipe (kernels/recipes.py): one function from logits to (logp, lse) is a whole backend, applied
per shard at tp > 1 by the harness, with every node's record made from what was observed."""

from __future__ import annotations

import re

import pytest
import torch

import kernels
from kernels.backend import STOCK_MATMUL_OPS

pytestmark = pytest.mark.usefixtures("isolated_registries")

ROWS, HIDDEN, VOCAB, TILE = 7, 16, 40, 16
REDUCES = frozenset({"aten::log_softmax", "aten::logsumexp"})
CAPABILITY = kernels.BACKENDS["trl_logsumexp"].capability


def register(cls: type, backend_id: str = "toy_trainer", reduces: frozenset[str] = REDUCES) -> str:
    declared = {"matmul": STOCK_MATMUL_OPS, "logprob": reduces, "tp_merge": reduces}
    kernels.register_backend(backend_id, kernels=declared, capability=CAPABILITY)(cls)
    return backend_id


class LogSoftmaxTrainer:
    id: str

    def logits_logprob(self, logits, targets):
        logits = logits.float()
        logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
        return logp, torch.logsumexp(logits, -1)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])  # tp = 4: the last rank's shard holds no real column (40 of 64)
def test_a_trainer_function_is_the_whole_backend_at_every_tp(make_inputs, tp):
    backend = register(LogSoftmaxTrainer)
    inp = make_inputs(ROWS, HIDDEN, VOCAB, torch.float32, "cpu")
    result = kernels.lm_head_logprob(inp.hidden, inp.weight, inp.targets, backend=backend, tp=tp, vocab_tile=TILE)
    logits = inp.hidden.double() @ inp.weight.double().T
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(1, inp.targets[:, None]).squeeze(1) - lse
    torch.testing.assert_close(result.lse.double(), lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(result.logp.double(), logp, rtol=0, atol=1e-5)
    shard = kernels.padded_vocab_size(VOCAB, TILE, tp) // tp
    assert result.owner_rank.tolist() == (inp.targets // shard).tolist() if tp > 1 else [0] * ROWS
    provenance = result.provenance
    assert kernels.provenance_mismatches(dict.fromkeys(kernels.OP_NODES, backend), provenance) == []
    # Each node is the user's own reduction, as the dispatcher saw it: the merge too, at tp > 1.
    assert set(provenance.nodes["tp_merge"].kernels) == REDUCES
    assert provenance.nodes["matmul"].kernels == ("aten::mm",)


def test_at_tp_above_one_the_merge_is_the_users_function_over_the_shard_lses(make_inputs):
    calls = []

    class Recorded(LogSoftmaxTrainer):
        def logits_logprob(self, logits, targets):
            calls.append(tuple(logits.shape))
            return super().logits_logprob(logits, targets)

    backend = register(Recorded)
    inp = make_inputs(ROWS, HIDDEN, VOCAB, torch.float32, "cpu")
    kernels.lm_head_logprob(inp.hidden, inp.weight, inp.targets, backend=backend, tp=4, vocab_tile=TILE)
    # Three shards with real columns, one without (never called), then the merge over the four shard lses.
    assert calls == [(ROWS, 16), (ROWS, 16), (ROWS, 8), (ROWS, 4)]


class TargetShifted(LogSoftmaxTrainer):
    """A realistic gather bug: each row reads the previous row's target (a label shift done twice)."""

    def logits_logprob(self, logits, targets):
        _, lse = super().logits_logprob(logits, targets)
        shifted = targets.roll(1)
        return torch.log_softmax(logits.float(), -1).gather(-1, shifted[:, None]).squeeze(-1), lse


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_what_the_function_does_to_the_target_is_in_its_logp_at_every_tp(make_inputs, tp):
    """The owner's target logit is the function's own logp plus its shard lse, so a wrong gather is as wrong at
    tp > 1 as at tp = 1 (were the harness to read the target from the logits, the bug would vanish at tp > 1)."""
    inp = make_inputs(ROWS, HIDDEN, VOCAB, torch.float32, "cpu")
    logits = inp.hidden.double() @ inp.weight.double().T
    lse = torch.logsumexp(logits, -1)
    right = logits.gather(1, inp.targets[:, None]).squeeze(1) - lse
    result = kernels.lm_head_logprob(
        inp.hidden, inp.weight, inp.targets, backend=register(TargetShifted), tp=tp, vocab_tile=TILE
    )
    if tp == 1:  # exactly what the bug computes
        shifted = logits.gather(1, inp.targets.roll(1)[:, None]).squeeze(1) - lse
        torch.testing.assert_close(result.logp.double(), shifted, rtol=0, atol=1e-5)
    # At tp > 1 a shard holds its own local targets, so a shifted row reads another column of the owner's shard (a
    # row may land on its own target by chance): other values than at tp = 1, as wrong, far past any tolerance.
    assert (result.logp.double() - right).abs().max() > 0.1


def test_a_class_with_no_complete_recipe_is_refused_when_registered():
    class HalfWritten:
        def matmul(self, hidden, weight): ...

        def shard_partials(self, logits, local_targets, owned, sharding): ...

    with pytest.raises(kernels.LogprobContractError, match=r"no recipe in full .*has matmul, shard_partials"):
        register(HalfWritten)
    assert "toy_trainer" not in kernels.BACKENDS


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (lambda logits: logits.float().logsumexp(-1), "must return a tuple (logp, lse) of two tensors; got Tensor"),
        (lambda logits: (logits.float(), logits.float().logsumexp(-1)), "returned logp of shape (7, 40)"),
    ],
)
def test_what_a_trainer_function_returns_is_checked_and_named(make_inputs, returned, message):
    class Wrong:
        def logits_logprob(self, logits, targets):
            return returned(logits)

    backend = register(Wrong)
    inp = make_inputs(ROWS, HIDDEN, VOCAB, torch.float32, "cpu")
    with pytest.raises((TypeError, kernels.ShapeMismatchError), match=re.escape(message)):
        kernels.lm_head_logprob(inp.hidden, inp.weight, inp.targets, backend=backend, tp=1, vocab_tile=TILE)
