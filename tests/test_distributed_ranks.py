"""The rank group of tp_mode="distributed" fails closed: a rank that cannot start, raises, dies or is left behind
ends the group with one typed line (kernels.RankGroupError), and ``python -m rlsweep`` with exit 1.

Every test here starts real gloo rank processes on the CPU; each call is bounded (RankGroup polls its ranks) and
the command-line runs have timeouts, so none can hang.
"""

from __future__ import annotations

import functools
import importlib
import sys

import pytest
import torch
from rlsweep_fixtures import run_rlsweep

import kernels

VOCAB, TILE = 100, 16
SPLIT = kernels.ShardingSpec.even(VOCAB, TILE, 2)


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(6, 16, generator=generator), torch.randn(VOCAB, 16, generator=generator)
    return hidden, weight, torch.randint(0, VOCAB, (6,), generator=generator)


def test_ranks_that_cannot_join_their_group_raise_one_typed_line_when_the_group_opens(monkeypatch):
    """A rendezvous the ranks cannot make (here: gloo told to use an interface that does not exist) raised the
    ranks' own tracebacks on stderr and, at the first call, only "died (exit codes [1, 1])"."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-nic0")  # the rank processes inherit the environment
    with pytest.raises(kernels.RankGroupError, match=r"rank \d \(backend=aten, tp=2\) while starting: .*no-such-nic0"):
        with kernels.distributed_ranks("aten", SPLIT, "cpu"):
            pass


def test_a_run_whose_ranks_cannot_start_is_exit_1_with_one_line(tmp_path):
    done = run_rlsweep(tmp_path, "tp=2", "tp_mode=distributed", "layout=smoke", env={"GLOO_SOCKET_IFNAME": "no-nic0"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr  # one line, no rank traceback
    assert "rlsweep: error: RankGroupError: distributed rank" in done.stderr and "no-nic0" in done.stderr


@pytest.fixture
def rank_faults():
    """The backend of tests/rank_faults.py, registered in this process for one test (its ranks import it)."""
    module = importlib.import_module("rank_faults")
    yield module
    kernels.unregister_backend("rank_faults")
    sys.modules.pop("rank_faults")


def test_a_backend_registered_by_a_module_of_its_own_runs_on_distributed_ranks(rank_faults):
    """Each rank imports the module that registered the backend; a user's backend (docs/extending.md) came back
    from every rank as "unknown backend"."""
    call = functools.partial(kernels.lm_head_logprob, *inputs(), backend="rank_faults", tp=2, vocab_tile=TILE)
    emulated, distributed = call(tp_mode="emulated"), call(tp_mode="distributed")
    assert distributed.provenance.nodes["matmul"].backend == "rank_faults"
    for name in ("logp", "lse", "owner_rank"):
        assert torch.equal(getattr(emulated, name), getattr(distributed, name)), name
