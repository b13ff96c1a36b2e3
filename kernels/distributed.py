"""tp_mode="distributed": real ranks with torch.distributed (gloo on CPU, NCCL with one GPU per rank).

Each rank runs the same per-rank code as the emulated mode (``rank_forward``), all-gathers the
per-tile partials and target logits, and merges them with the same ``finish``; rank 0 hands the
replicated result back to the caller through a file in a private temporary directory.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.backend import ShardPartials, get_backend
from kernels.errors import TPConfigError
from kernels.lm_head import LogprobResult, RankOutput, finish, rank_forward
from kernels.sharding import ShardingSpec


def run_distributed(
    backend: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, sharding: ShardingSpec
) -> LogprobResult:
    """Spawn ``sharding.world_size`` ranks, each computing its shard; return rank 0's merged result."""
    tp = sharding.world_size
    if hidden.is_cuda and torch.cuda.device_count() < tp:
        raise TPConfigError(
            f"tp_mode=distributed with tp={tp} needs {tp} GPUs (one per rank); "
            f"this machine has {torch.cuda.device_count()}"
        )
    device_type = hidden.device.type
    with tempfile.TemporaryDirectory(prefix="rlsweep-tp-") as workdir:
        torch.save({"hidden": hidden.cpu(), "weight": weight.cpu(), "targets": targets.cpu()}, f"{workdir}/inputs.pt")
        try:
            mp.start_processes(
                _rank_main,
                args=(tp, backend, sharding.vocab_tile, device_type, workdir),
                nprocs=tp,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as err:
            raise RuntimeError(f"a distributed rank failed (tp={tp}, backend={backend}):\n{err}") from err
        out = torch.load(f"{workdir}/result.pt", weights_only=False)
    device = hidden.device
    return replace(
        out,
        logp=out.logp.to(device),
        lse=out.lse.to(device),
        active=out.active.to(device),
        owner_rank=out.owner_rank.to(device),
    )


def _rank_main(rank: int, world: int, backend: str, vocab_tile: int, device_type: str, workdir: str) -> None:
    on_cuda = device_type == "cuda"
    if on_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend="nccl" if on_cuda else "gloo",
        init_method=Path(workdir, "rendezvous").as_uri(),
        rank=rank,
        world_size=world,
    )
    try:
        device = torch.device("cuda", rank) if on_cuda else torch.device("cpu")
        inputs = torch.load(f"{workdir}/inputs.pt", mmap=True)
        hidden, weight, targets = (inputs[k].to(device) for k in ("hidden", "weight", "targets"))
        impl = get_backend(backend)
        sharding = ShardingSpec.even(weight.shape[0], vocab_tile, world, rank)
        mine = rank_forward(impl, hidden, weight, targets, sharding)
        ranks = [mine] if mine.partials is None else _all_gather_partials(mine)
        result = finish(impl, targets, sharding, ranks, tp_mode="distributed")
        _check_replicas_agree(result)
        if rank == 0:
            cpu = replace(
                result,
                logp=result.logp.cpu(),
                lse=result.lse.cpu(),
                active=result.active.cpu(),
                owner_rank=result.owner_rank.cpu(),
            )
            torch.save(cpu, f"{workdir}/result.pt")
    finally:
        dist.destroy_process_group()


def _all_gather_partials(mine: RankOutput) -> list[RankOutput]:
    """Every rank's partials, in rank order (which is global tile order)."""
    fields = (
        mine.partials.maxes,
        mine.partials.sumexps,
        mine.partials.target_logit,
        mine.partials.owned.to(torch.uint8),
    )
    gathered = []
    for tensor in fields:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        gathered.append(parts)
    return [
        RankOutput(
            logits=mine.logits,
            partials=ShardPartials(maxes, sums, target, owned.bool()),
            matmul=mine.matmul,
            logprob=mine.logprob,
        )
        for maxes, sums, target, owned in zip(*gathered, strict=True)
    ]


def _check_replicas_agree(result: LogprobResult) -> None:
    """The output is replicated: every rank must hold the same bits, or the merge is not deterministic."""
    for name in ("logp", "lse"):
        mine = getattr(result, name).contiguous()
        bits = mine.view(torch.int32 if mine.dtype == torch.float32 else torch.int64)
        parts = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, bits)
        if any(not torch.equal(parts[0], p) for p in parts[1:]):
            raise RuntimeError(f"ranks disagree on the bits of {name}: the TP merge is not replicated")
