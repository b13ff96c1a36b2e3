"""The rank group of tp_mode="distributed" fails closed: a rank that cannot start, raises, dies or is left behind
ends the group with one typed line (kernels.RankGroupError), and ``python -m rlsweep`` with exit 1.

Every test here starts real gloo rank processes on the CPU; each call is bounded (RankGroup polls its ranks) and
the command-line runs have timeouts, so none can hang.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest
import torch
from rlsweep_fixtures import run_rlsweep

import kernels
from kernels.distributed import RankGroup, leave_rendezvous

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
    with pytest.raises(
        kernels.RankGroupError, match=r"rank \d failed while starting \(backend=aten, tp=2\): .*no-such-nic0"
    ):
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


def faulty_call(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> kernels.LogprobResult:
    return kernels.lm_head_logprob(
        hidden, weight, targets, backend="rank_faults", tp=2, tp_mode="distributed", vocab_tile=TILE
    )


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("RAISE", r"distributed rank 1 failed while serving a forward call \(backend=rank_faults, tp=2\): "
                  r"RuntimeError: rank_faults: rank 1 raises as asked"),
        # Rank 0 then fails in its all-gather ("Connection closed by peer"): it was named, not the rank that died.
        ("DIE", r"distributed rank 1 died \(killed by SIGKILL\) while serving a forward call"),
    ],
)  # fmt: skip
def test_a_rank_that_raises_or_dies_is_named_and_its_group_refuses_every_later_call(rank_faults, fault, error):
    """A later call on a closed group waited a second and reported every rank as dead (exit codes [0, -9])."""
    hidden, weight, targets = inputs()
    with kernels.distributed_ranks("rank_faults", SPLIT, "cpu") as group:
        faulty_call(hidden, weight, targets)
        broken = hidden.clone()
        broken[0, 0] = getattr(rank_faults, fault)
        with pytest.raises(kernels.RankGroupError, match=error) as failed:
            faulty_call(broken, weight, targets)
        assert "Traceback" in "".join(failed.value.__notes__) and not any(rank.is_alive() for rank in group._ranks)
        with pytest.raises(kernels.RankGroupError, match=r"serves no more calls: distributed rank 1 "):
            faulty_call(hidden, weight, targets)


def test_a_call_the_caller_interrupts_closes_the_group_instead_of_answering_the_next_call(monkeypatch):
    """Interrupted between sending a call and reading its replies (Ctrl-C caught in the block, a signal-based
    deadline), the group stayed open and the next call returned the interrupted call's results."""
    first, weight, targets = inputs(0)
    second = inputs(1)[0]
    with kernels.distributed_ranks("aten", SPLIT, "cpu"):
        with monkeypatch.context() as patch:
            patch.setattr(RankGroup, "_collect", interrupted)
            with pytest.raises(KeyboardInterrupt):
                kernels.lm_head_logprob(
                    first, weight, targets, backend="aten", tp=2, tp_mode="distributed", vocab_tile=TILE
                )
        with pytest.raises(kernels.RankGroupError, match=r"serves no more calls: a call ended by KeyboardInterrupt"):
            kernels.lm_head_logprob(
                second, weight, targets, backend="aten", tp=2, tp_mode="distributed", vocab_tile=TILE
            )


def interrupted(group: RankGroup, doing: str) -> list:
    raise KeyboardInterrupt


# A caller whose tensors cannot go to shared memory (a full /dev/shm), on its side ("send") or on rank 0's ("reply").
SHM_FULL = """
import sys
sys.path.insert(0, {tests!r})
import torch
import kernels, rank_faults
hidden, weight, targets = torch.randn(6, 16), torch.randn({VOCAB}, 16), torch.randint(0, {VOCAB}, (6,))
with kernels.distributed_ranks("rank_faults", kernels.ShardingSpec.even({VOCAB}, {TILE}, 2), "cpu"):
    if sys.argv[1] == "send":
        torch.UntypedStorage._share_fd_cpu_ = rank_faults.shm_full
    else:
        hidden[0, 0] = rank_faults.SHM_FULL
    try:
        kernels.lm_head_logprob(hidden, weight, targets, backend="rank_faults", tp=2, tp_mode="distributed",
                                vocab_tile={TILE})
    except kernels.RankGroupError as err:
        print(str(err).splitlines()[0])
"""


@pytest.mark.parametrize(
    ("side", "error"),
    [
        ("send", "could not send a forward call to the distributed ranks (backend=rank_faults, tp=2): unable to "
                 "allocate shared memory"),
        ("reply", "distributed rank 0 failed while serving a forward call (backend=rank_faults, tp=2): RuntimeError: "
                  "unable to allocate shared memory"),
    ],
)  # fmt: skip
def test_tensors_that_cannot_go_to_shared_memory_raise_instead_of_hanging(side, error):
    """A queue pickles in a thread of its own, which printed the error and dropped the message: with a weight or
    a reply larger than /dev/shm (64 MiB in a default Docker container) the call waited for ever."""
    script = SHM_FULL.format(tests=str(Path(__file__).parent), VOCAB=VOCAB, TILE=TILE)
    done = forkserver.run("-c", script, [side], cwd=Path(__file__).parent.parent, timeout=120)
    assert done.stdout.startswith(error), done.stdout + done.stderr


# A caller that opens a group, says which processes and rendezvous dir it holds, and waits to be stopped.
CALLER = f"""
import sys, time
import kernels
with kernels.distributed_ranks("aten", kernels.ShardingSpec.even({VOCAB}, {TILE}, 2), "cpu") as group:
    try:  # printed inside the try: the test sends Ctrl-C as soon as it reads the line
        print(*[rank.pid for rank in group._ranks], group._workdir.name, flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
print("exit codes", *[rank.exitcode for rank in group._ranks], flush=True)
"""


def start_caller() -> tuple[subprocess.Popen, list[int], Path]:
    """CALLER in a session of its own with Ctrl-C's default action, as a terminal's foreground job has it."""
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER],
        cwd=Path(__file__).parent.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    *pids, workdir = caller.stdout.readline().split()
    return caller, [int(pid) for pid in pids], Path(workdir)


def started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None


def gone(pid: int, start: str | None = "") -> bool:
    """No such process, one that has exited and is waiting to be reaped, or (``start`` given: ``started``'s) another
    process that took the pid since: the suite's processes and threads run through the pid space (32768 here) in
    minutes. A ``start`` of None says the process had already gone when it was read."""
    if start is None:
        return True
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return fields[0] in "ZX" or (start != "" and fields[19] != start)


def test_an_orphaned_rank_removes_the_rendezvous_dir_only_once_its_peers_stores_are_gone(tmp_path):
    """Removed while a peer's store still held the rendezvous file, the peer waited half an hour for it to come back
    (CI saw a killed caller's rank outlive the test below)."""
    workdir = tmp_path / "rlsweep-tp-x"
    (workdir / "rendezvous").parent.mkdir()
    (workdir / "rendezvous").write_bytes(b"")
    leave_rendezvous(str(workdir))
    assert (workdir / "rendezvous").exists()
    (workdir / "rendezvous").unlink()  # the last store to leave removes its file
    leave_rendezvous(str(workdir))
    assert not workdir.exists()
    leave_rendezvous(str(workdir))  # the peer that comes after finds nothing to remove


def test_ctrl_c_stops_the_ranks_through_their_caller_without_a_traceback_from_them():
    """Ctrl-C reaches every process of the foreground group: each rank printed a KeyboardInterrupt traceback (and
    `python -m rlsweep` more lines than its one "interrupted")."""
    caller, *_ = start_caller()
    try:
        os.killpg(caller.pid, signal.SIGINT)
        out, err = caller.communicate(timeout=60)
    finally:
        caller.kill()
    assert err == "" and out.split("\n")[:2] == ["interrupted", "exit codes 0 0"], out + err


def test_ranks_whose_caller_was_killed_stop_and_remove_their_rendezvous_dir():
    """A caller killed (SIGKILL, or SIGTERM's default) cannot stop its ranks: they lived on, orphaned, for ever."""
    caller, pids, workdir = start_caller()
    starts = {pid: started(pid) for pid in pids}
    try:
        caller.kill()
        caller.wait(timeout=60)
        # A rank notices within POLL_SECONDS, then leaves the group and exits: seconds alone, but a loaded machine
        # (the suite's other workers) stretched that past 30 s.
        deadline = time.monotonic() + 120
        while not all(gone(pid, starts[pid]) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in pids if not gone(pid, starts[pid])]
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                if not gone(pid, starts[pid]):
                    os.kill(pid, signal.SIGKILL)
    assert not left and not workdir.exists(), (left, workdir, workdir.exists())


# A caller whose rank 1 stops answering (SIGSTOP: as a rank stuck in a kernel) with a collective timeout of seconds.
HUNG_RANK = """
import os, signal, time
from datetime import timedelta
import torch
import kernels
from kernels import distributed
distributed.COLLECTIVE_TIMEOUT, distributed.STOP_SECONDS = timedelta(seconds=2), 1.0
hidden, weight, targets = torch.randn(6, 16), torch.randn({VOCAB}, 16), torch.randint(0, {VOCAB}, (6,))
with kernels.distributed_ranks("aten", kernels.ShardingSpec.even({VOCAB}, {TILE}, 2), "cpu") as group:
    # SIGSTOP stops every thread of the rank, its queue's writer too, which a rank stuck in a kernel would not: stopped
    # while that thread still held the replies queue's lock after the rank's join reply, it blocks its peers' replies.
    time.sleep(1.0)
    os.kill(group._ranks[1].pid, signal.SIGSTOP)
    try:
        kernels.lm_head_logprob(hidden, weight, targets, backend="aten", tp=2, tp_mode="distributed", vocab_tile={TILE})
    except kernels.RankGroupError as err:
        print(str(err).splitlines()[0])
    print("exit codes", *[rank.exitcode for rank in group._ranks])
"""


def test_a_rank_that_hangs_fails_its_peers_collective_and_the_call_after_the_collective_timeout():
    """The ranks took torch's default collective timeout, which nothing named: a hung rank held the call for 30
    minutes. COLLECTIVE_TIMEOUT is now the group's, given to every rank; the hung rank is killed as the group closes."""
    script = HUNG_RANK.format(VOCAB=VOCAB, TILE=TILE)
    done = forkserver.run("-c", script, [], cwd=Path(__file__).parent.parent, timeout=120)
    error, codes = done.stdout.splitlines()[-2:] if done.stdout.count("\n") >= 2 else ("", "")
    assert error.startswith("distributed rank 0 failed while serving a forward call") and "Timed out" in error, (
        done.stdout + done.stderr
    )
    # The hung rank is killed as the group closes; rank 0 stops on its own, or is killed too on a host too busy for it
    # to stop within the test's STOP_SECONDS.
    assert codes in ("exit codes 0 -9", "exit codes -9 -9"), done.stdout


# Calls on one group from several threads at once (asyncio.to_thread copies the context, the open group with it).
THREADS = """
from concurrent.futures import ThreadPoolExecutor
import torch
import kernels
weight, targets = torch.randn({VOCAB}, 16), torch.randint(0, {VOCAB}, (64,))
hiddens = [torch.randn(64, 16) for _ in range(8)]
want = [kernels.lm_head_logprob(h, weight, targets, backend="aten", tp=2, vocab_tile={TILE}).lse for h in hiddens]
with kernels.distributed_ranks("aten", kernels.ShardingSpec.even({VOCAB}, {TILE}, 2), "cpu") as group:
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda h: group(h, weight, targets).lse, hiddens))
print(*[torch.equal(a, b) for a, b in zip(want, got)])
"""


def test_calls_on_one_group_from_several_threads_get_their_own_results():
    """Their requests and replies interleaved: a call took another's replies, and the other waited for ever."""
    done = forkserver.run(
        "-c", THREADS.format(VOCAB=VOCAB, TILE=TILE), [], cwd=Path(__file__).parent.parent, timeout=120
    )
    assert done.stdout.split() == ["True"] * 8, done.stdout + done.stderr


# A caller out of file descriptors at one point or another of opening a group (the limit is raised again after).
OUT_OF_FILES = """
import os, resource
import kernels
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
for margin in range(0, 24, 4):
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + margin, hard))
    try:
        with kernels.distributed_ranks("aten", kernels.ShardingSpec.even(64, 16, 4), "cpu"):
            print("opened")
    except Exception as err:
        print(type(err).__name__, err)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files in /proc")
def test_a_group_that_runs_out_of_file_descriptors_while_starting_says_so(tmp_path):
    """Failing to start its third rank, a group's cleanup joined ranks never started and raised "AssertionError: can
    only join a started process" in place of the error; failing earlier, it raised a bare OSError."""
    done = forkserver.run(
        "-c",
        OUT_OF_FILES,
        [],
        cwd=Path(__file__).parent.parent,
        env={"TMPDIR": str(tmp_path)},  # a rendezvous dir is not removable without a file descriptor
        timeout=120,
    )
    failed = "RankGroupError could not start the distributed ranks (backend=aten, tp=4): [Errno 24] Too many open files"
    lines = done.stdout.splitlines()
    assert failed in lines and set(lines) <= {failed, "opened"}, done.stdout + done.stderr
