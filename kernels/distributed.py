"""tp_mode="distributed": real ranks with torch.distributed (gloo on CPU, NCCL with one GPU per rank).

A ``RankGroup`` spawns one rank process per shard of a ``ShardingSpec`` once and keeps them for many
calls: the weight travels to the ranks once, each call sends only hidden states and targets. Each rank
runs the same per-rank code as the emulated mode (``kernels.ranks.rank_forward``) on its own view of the
spec (``sharding.for_rank(rank)``), all-gathers the per-tile partials and target logits, merges them with
the same ``finish`` and checks that every rank holds the same bits; rank 0 sends the replicated result
back. ``lm_head_logprob(..., tp_mode="distributed")`` uses the group opened with ``distributed_ranks(...)``
when one matches the call, else a group for that call alone (docs/kernels.md#vocab-parallel-tp).

A backward request (``RankGroup.gradients``) runs ``kernels.grad.rank_gradients`` on every rank: rank r receives
the fp32 d hidden sum of ranks 0..r-1, adds its shard's products and sends it on, so the ranks continue one sum
in global vocab order, the emulated mode's; the last rank broadcasts it, and each rank sends back its own d
weight rows.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing.connection
import os
import queue
import signal
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import replace
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.backend import LogprobBackend, ShardPartials, get_backend
from kernels.bitwise import bit_view
from kernels.errors import RankGroupError, ShapeMismatchError, TPConfigError
from kernels.grad import Upstream, rank_gradients
from kernels.launches import observed_provenance, observing
from kernels.ranks import LogprobResult, RankOutput, finish, rank_forward
from kernels.sharding import ShardingSpec
from kernels.validation import version_stamp

DEVICE_TYPES = ("cpu", "cuda")  # where rank processes compute: gloo on the CPU, NCCL on one GPU per rank
POLL_SECONDS = 1.0  # how often the caller checks that its ranks are alive, and an idle rank its caller
DEATH_GRACE_SECONDS = 0.5  # how long a rank's error waits for a peer's death that may have caused it
STOP_SECONDS = 10.0  # how long closing a group waits for its ranks to stop before it kills them
# How long a rank waits in a collective for its peers: a rank that hangs fails the others' next collective after it,
# and the call raises. torch's default for gloo, given to NCCL too; read when a group opens.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
STOP = "stop"
FORWARD, BACKWARD = "forward", "backward"  # the two requests a rank serves


class RankGroup:
    """``sharding.world_size`` live rank processes for one backend, vocab split and device type."""

    def __init__(self, backend: str, sharding: ShardingSpec, device_type: str):
        if not isinstance(sharding, ShardingSpec):
            raise TPConfigError(
                f"sharding must be a ShardingSpec (e.g. ShardingSpec.even(vocab, vocab_tile, tp)), got {sharding!r}"
            )
        if device_type not in DEVICE_TYPES:
            raise TPConfigError(f"device_type must be one of {DEVICE_TYPES}, got {device_type!r}")
        tp = sharding.world_size
        if device_type == "cuda" and torch.cuda.device_count() < tp:
            raise TPConfigError(
                f"tp_mode=distributed with tp={tp} needs {tp} GPUs (one per rank); "
                f"this machine has {torch.cuda.device_count()}"
            )
        # An unknown id fails here, before any process starts; a rank imports the module that registered the
        # backend before it looks the id up, so a backend of a user's own module is found there too.
        module = type(get_backend(backend)).__module__
        self.sharding = sharding.for_rank(0)  # every rank derives its own view from the same split
        self.key = (backend, self.sharding, device_type)
        self.weight_sent: tuple[weakref.ref, tuple | None] | None = None  # the weight the ranks hold, and its stamp
        self.closed: str | None = None  # why the group serves no more calls, once it does not
        self._serving = threading.Lock()  # one call at a time: calls from two threads would read each other's replies
        self._workdir: tempfile.TemporaryDirectory | None = None
        self._ranks, self._requests = [], []
        self._joined = False  # every rank has joined the process group: until then, none can read a request
        with self._closed_on_failure():
            try:
                # Not removable only where the process is out of file descriptors: the error that says so is raised.
                self._workdir = tempfile.TemporaryDirectory(prefix="rlsweep-tp-", ignore_cleanup_errors=True)
                context = rank_context(device_type)
                self._requests = [context.Queue() for _ in range(tp)]
                self._replies = context.Queue()
                args = (
                    self.sharding,
                    backend,
                    module,
                    device_type,
                    COLLECTIVE_TIMEOUT,
                    self._workdir.name,
                    dict(os.environ),
                    self._replies,
                )
                self._ranks = [
                    context.Process(target=rank_loop, args=(rank, *args, self._requests[rank]), daemon=True)
                    for rank in range(tp)
                ]
                for process in self._ranks:
                    process.start()
            except Exception as err:  # out of processes, file descriptors or temp space
                raise RankGroupError(f"could not start the distributed ranks {self.described}: {err}") from err
            self._collect("starting")
            self._joined = True

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> LogprobResult:
        """One distributed call; the weight is sent only when it is not the one the ranks hold."""
        out = self._request(FORWARD, hidden, weight, targets)[0]
        return replace(
            out,
            logp=out.logp.to(hidden.device),
            lse=out.lse.to(hidden.device),
            active=out.active.to(hidden.device),
            owner_rank=out.owner_rank.to(hidden.device),
        )

    def gradients(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        lse: torch.Tensor,
        g_logp: torch.Tensor | None,
        g_lse: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(d hidden [T, H], d weight [V, H]) of a forward whose lse is ``lse``, computed by the ranks."""
        upstream = tuple(None if g is None else g.detach().to("cpu", copy=True) for g in (g_logp, g_lse))
        replies = self._request(BACKWARD, hidden, weight, targets, lse.detach().to("cpu", copy=True), *upstream)
        d_hidden = replies[0][0].to(hidden.device)
        d_weight = torch.cat([rows for _, rows in replies]).to(weight.device)
        return d_hidden, d_weight

    def _request(self, kind: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *extra) -> list:
        """Send one request to every rank and return their replies in rank order."""
        if weight.dim() != 2 or weight.shape[0] != self.sharding.vocab_size:
            raise ShapeMismatchError(
                f"weight must be [V, H] with V={self.sharding.vocab_size} (the group's vocab split), "
                f"got shape {tuple(weight.shape)}"
            )
        with self._serving:
            if self.closed is not None:
                raise RankGroupError(f"this rank group {self.described} serves no more calls: {self.closed}")
            # The same tensor object, unchanged since it was sent: the ranks already hold this weight. A new tensor
            # that reuses a freed one's memory is another object, so it is sent.
            stamp = version_stamp(weight)
            held = self.weight_sent is not None and self.weight_sent[0]() is weight and self.weight_sent[1] == stamp
            # Copies: the queue moves a CPU tensor's storage into shared memory, which must not be the caller's.
            new_weight = None if held and stamp is not None else weight.detach().to("cpu", copy=True)
            # The caller's observed_provenance() holds in the ranks too: their nodes observe what it would.
            tensors = (hidden.detach().to("cpu", copy=True), targets.to("cpu", copy=True), new_weight)
            message = (kind, observing(), *tensors, *extra)
            with self._closed_on_failure():
                try:  # every rank's copy before any is sent: a rank sent a call its peers never get waits for them
                    sent = [pickled(message) for _ in self._requests]
                except Exception as err:
                    raise RankGroupError(
                        f"could not send a {kind} call to the distributed ranks {self.described}: {err} (tensors "
                        "travel to the rank processes in shared memory, /dev/shm)"
                    ) from err
                for requests, request in zip(self._requests, sent, strict=True):
                    requests.put(request)
                self.weight_sent = (weakref.ref(weight), stamp)
                return self._collect(f"serving a {kind} call")

    @property
    def described(self) -> str:
        return f"(backend={self.key[0]}, tp={self.sharding.world_size})"

    @contextlib.contextmanager
    def _closed_on_failure(self) -> Iterator[None]:
        """Anything that ends a call early closes the group: a rank's failure, but also the caller's own exception
        or interrupt, after which the ranks are mid-call and their replies would answer the next call."""
        try:
            yield
        except BaseException as err:
            self.close(str(err).splitlines()[0] if isinstance(err, RankGroupError) else f"a call ended by {err!r}")
            raise

    def _collect(self, doing: str) -> list:
        """Every rank's reply, in rank order. A rank that failed or died raises RankGroupError: one line naming the
        rank and its error, with the rank's traceback as a note. A rank that fails in a collective when another
        rank died is not the cause: the dead rank is named."""
        replies: dict[int, object] = {}
        while_ = f"while {doing} {self.described}"
        while len(replies) < len(self._ranks):
            try:
                status, rank, payload = ForkingPickler.loads(self._replies.get(timeout=POLL_SECONDS))
            except queue.Empty:
                if dead := self._dead(replies):
                    raise RankGroupError(f"distributed {dead} {while_}") from None
                continue
            if status == "error":
                # A rank that raised tells the caller before its peers can notice; one that died tells nothing.
                multiprocessing.connection.wait([self._ranks[r].sentinel for r in range(len(self._ranks)) if r != rank],
                                                timeout=DEATH_GRACE_SECONDS)  # fmt: skip
                dead = self._dead(replies, killed_only=True)
                err = RankGroupError(
                    f"distributed {dead} {while_}" if dead
                    else f"distributed rank {rank} failed {while_}: {payload.strip().splitlines()[-1]}"
                )  # fmt: skip
                err.add_note(f"rank {rank}'s traceback:\n{payload}")
                raise err
            replies[rank] = payload
        return [replies[rank] for rank in range(len(self._ranks))]

    def _dead(self, replied, *, killed_only: bool = False) -> str:
        """The ranks that ended without a reply, and how ("" if none); ``killed_only``: those a signal or a
        crash ended, not a rank that returned after telling the caller its error."""
        ended = {}
        for r, process in enumerate(self._ranks):
            if r not in replied and multiprocessing.connection.wait([process.sentinel], timeout=0):
                process.join()  # its sentinel closes as it exits, a moment before its exit code can be read
                if process.exitcode != 0 or not killed_only:
                    ended[r] = process.exitcode
        return ", ".join(f"rank {r} died ({exit_status(code)})" for r, code in ended.items())

    def close(self, reason: str = "its block has ended") -> None:
        """Stop every rank (one not stopped after STOP_SECONDS is killed, as are the ranks of a group that never
        finished joining), remove the rendezvous dir, and refuse calls from now on, naming ``reason``."""
        if self.closed is not None:
            return
        self.closed = reason
        started = [(process, self._requests[rank]) for rank, process in enumerate(self._ranks) if process.pid]
        for process, requests in started:
            if process.is_alive():
                requests.put(pickled(STOP))
        deadline = time.monotonic() + (STOP_SECONDS if self._joined else 0.0)
        for process, _ in started:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process, _ in started:
            if process.is_alive():  # stuck in a kernel or a collective
                process.kill()
                process.join()
        if self._workdir is not None:
            self._workdir.cleanup()


def pickled(message: object) -> bytes:
    """``message`` as the bytes a queue carries, its tensors moved to shared memory here, where a failure (a full
    /dev/shm) raises: a queue pickles in a thread of its own, which prints the error and drops the message, and the
    reader waits for it for ever."""
    return bytes(ForkingPickler.dumps(message))


def exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


ACTIVE_GROUP: ContextVar[RankGroup | None] = ContextVar("ACTIVE_GROUP", default=None)


@contextlib.contextmanager
def distributed_ranks(backend: str, sharding: ShardingSpec, device_type: str) -> Iterator[RankGroup]:
    """Keep one rank per shard of ``sharding`` alive for every distributed call with these settings in the block."""
    group = RankGroup(backend, sharding, device_type)
    token = ACTIVE_GROUP.set(group)
    try:
        yield group
    finally:
        ACTIVE_GROUP.reset(token)
        group.close()


def run_distributed(
    backend: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, sharding: ShardingSpec
) -> LogprobResult:
    """The open group's ranks when it matches this call, else ranks spawned for this call alone."""
    with matching_group(backend, sharding, hidden.device.type) as group:
        return group(hidden, weight, targets)


def distributed_gradients(
    backend: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    g_logp: torch.Tensor | None,
    g_lse: torch.Tensor | None,
    sharding: ShardingSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of ``run_distributed``, on the open group's ranks when it matches, else on ranks of its own."""
    with matching_group(backend, sharding, hidden.device.type) as group:
        return group.gradients(hidden, weight, targets, lse, g_logp, g_lse)


@contextlib.contextmanager
def matching_group(backend: str, sharding: ShardingSpec, device_type: str) -> Iterator[RankGroup]:
    group = ACTIVE_GROUP.get()
    if group is not None and group.key == (backend, sharding.for_rank(0), device_type):
        yield group
        return
    with distributed_ranks(backend, sharding, device_type) as one_shot:
        yield one_shot


def rank_context(device_type: str):
    """Where rank processes start from. CPU ranks: a fork server that imported torch and ``kernels`` once per caller
    process (each rank then starts in milliseconds instead of importing them again, seconds of CPU a rank). CUDA
    ranks: spawn, a fresh interpreter each, since a process forked after the CUDA driver was touched cannot use it."""
    if device_type == "cpu" and "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["kernels"])
        return context
    return mp.get_context("spawn")


def rank_loop(
    rank: int,
    split: ShardingSpec,
    backend: str,
    module: str,
    device_type: str,
    timeout: timedelta,
    workdir: str,
    environment: dict[str, str],
    replies,
    requests,
) -> None:
    """A rank process: take the caller's ``environment`` (a rank forked from the fork server would otherwise hold
    the server's), import ``module`` (which registers ``backend``), join the group and say so, then serve calls
    until told to stop. Any failure, joining included, goes back to the caller as the rank's traceback, and the rank
    ends; the caller then ends the group. Ctrl-C is the caller's to handle (it stops its ranks), and a rank whose
    caller is gone (killed, so it could not stop them) stops too and removes the group's rendezvous dir."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches every process of the foreground group
    os.environ.clear()
    os.environ.update(environment)
    try:
        importlib.import_module(module)
        sharding = split.for_rank(rank)
        on_cuda = device_type == "cuda"
        if on_cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend="nccl" if on_cuda else "gloo",
            init_method=Path(workdir, "rendezvous").as_uri(),
            rank=rank,
            world_size=sharding.world_size,
            timeout=timeout,
        )
        impl = get_backend(backend)
        replies.put(pickled(("ok", rank, None)))  # joined: RankGroup waits for every rank's before its first call
        device = torch.device("cuda", rank) if on_cuda else torch.device("cpu")
        serve(rank, impl, sharding, device, requests, replies)
    except Exception:
        replies.put(pickled(("error", rank, traceback.format_exc())))
        replies.close()
        replies.join_thread()  # sent before this rank leaves the group, which its peers may fail on
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if not mp.parent_process().is_alive():
            leave_rendezvous(workdir)
            # No caller is left to read this rank's queues or wait for it: it ends here, not through the interpreter's
            # teardown, whose joins (a queue's feeder thread, a backend's threads) could keep an orphan alive.
            os._exit(0)


def leave_rendezvous(workdir: str) -> None:
    """An orphaned rank's share of removing the rendezvous dir: the dir goes once it is empty, never sooner. The store
    of the last rank to leave the group removes the rendezvous file; removed before that, a peer still leaving waited
    out COLLECTIVE_TIMEOUT for the file to exist again (a store opening its file retries while the path is missing),
    an orphan for half an hour."""
    with contextlib.suppress(OSError):  # not empty (a peer's store is still in it), or already gone
        os.rmdir(workdir)


def next_request(requests):
    """The caller's next request, or STOP once the caller is gone."""
    while True:
        try:
            return ForkingPickler.loads(requests.get(timeout=POLL_SECONDS))
        except queue.Empty:
            if not mp.parent_process().is_alive():
                return STOP


def serve(rank: int, impl: LogprobBackend, sharding: ShardingSpec, device: torch.device, requests, replies) -> None:
    """Answer forward and backward requests until told to stop; the weight is kept from the call that sent it."""
    weight = None
    while (request := next_request(requests)) != STOP:
        kind, observed, hidden, targets, new_weight, *extra = request
        if new_weight is not None:
            weight = new_weight.to(device)
        hidden, targets = hidden.to(device), targets.to(device)
        with observed_provenance() if observed else contextlib.nullcontext():
            if kind == BACKWARD:
                reply = rank_backward(impl, hidden, weight, targets, sharding, *(on(device, e) for e in extra))
            else:
                mine = rank_forward(impl, hidden, weight, targets, sharding)
                ranks = [mine] if mine.partials is None else all_gather_partials(mine)
                result = finish(impl, targets, sharding, ranks, tp_mode="distributed")
                check_replicas_agree(result)
                reply = to_cpu(result) if rank == 0 else None
        replies.put(pickled(("ok", rank, reply)))


def rank_backward(
    impl: LogprobBackend,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    sharding: ShardingSpec,
    lse: torch.Tensor,
    g_logp: torch.Tensor | None,
    g_lse: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """This rank's part of the backward: (d hidden on rank 0, else None; its real d weight rows), on the CPU."""
    rank, world = sharding.rank, sharding.world_size
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    if rank > 0:
        dist.recv(d_hidden, src=rank - 1)  # ranks 0..rank-1's sum: this rank continues it
    lo, hi = sharding.real_shard
    d_weight_rows = torch.empty((hi - lo, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    upstream = Upstream.of(targets, g_logp, g_lse)
    rank_gradients(impl, hidden, weight, targets, lse, upstream, sharding, d_hidden, d_weight_rows)
    if rank < world - 1:
        dist.send(d_hidden, dst=rank + 1)
    dist.broadcast(d_hidden, src=world - 1)  # the finished sum, replicated like the forward's result
    return (d_hidden.to(hidden.dtype).cpu() if rank == 0 else None), d_weight_rows.cpu()


def on(device: torch.device, tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def to_cpu(result: LogprobResult) -> LogprobResult:
    return replace(
        result,
        logp=result.logp.cpu(),
        lse=result.lse.cpu(),
        active=result.active.cpu(),
        owner_rank=result.owner_rank.cpu(),
    )


def all_gather_partials(mine: RankOutput) -> list[RankOutput]:
    """Every rank's partials and node records, in rank order (which is global tile order)."""
    partials = mine.partials
    fields = (partials.maxes, partials.sumexps, partials.target_logit, partials.owned.to(torch.uint8))
    gathered = []
    for tensor in fields:
        parts = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        gathered.append(parts)
    # Each rank's own records, so the merged provenance carries the kernels every rank launched.
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, (mine.matmul, mine.logprob))
    return [
        RankOutput(
            logits=mine.logits,
            partials=ShardPartials(maxes, sums, target, owned.bool()),
            matmul=matmul,
            logprob=logprob,
        )
        for maxes, sums, target, owned, (matmul, logprob) in zip(*gathered, records, strict=True)
    ]


def check_replicas_agree(result: LogprobResult) -> None:
    """The output is replicated: every rank must hold the same bits, or the merge is not deterministic."""
    for name in ("logp", "lse"):
        bits = bit_view(getattr(result, name))  # on the rank's device: NCCL gathers GPU tensors
        parts = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, bits)
        if any(not torch.equal(parts[0], p) for p in parts[1:]):
            raise RuntimeError(f"ranks disagree on the bits of {name}: the TP merge is not replicated")
