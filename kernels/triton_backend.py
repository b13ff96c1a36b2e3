"""Triton backend: invariant matmul, fixed global vocab tiles, partials merged exactly (in any order)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import ModuleType

import torch

from kernels.backend import ShardPartials, WholeVocab, register_backend
from kernels.capability import ImplementationKind, LogprobBackendCapability
from kernels.contract import EXECUTION_DTYPE_NAMES, DeterminismScope, MergeOrder
from kernels.errors import BackendUnavailableError
from kernels.launches import KernelLaunch, distinct_launches, launch_triton, record, recording_launches
from kernels.provenance import NodeProvenance, observe
from kernels.sharding import ShardingSpec
from kernels.validation import IGNORE_INDEX


@dataclass(frozen=True)
class MatmulTiling:
    """One tile configuration per (device kind, dtype); never a function of M or N."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# Compiled CUDA: bf16 operands go to the tensor cores with fp32 accumulation; fp32 operands use
# IEEE fp32 (no TF32). Interpreter: fp32 products summed over K in order (see the kernel).
CUDA_TILING = {
    torch.bfloat16: MatmulTiling(128, 256, 64, 8, 8, 3),  # H200: 0.96x cuBLAS at T=16384 (docs/benchmarks.md)
    torch.float32: MatmulTiling(128, 64, 32, 8, 8, 3),
}
# The backward's d hidden += d logits @ w: same tiles as the matmul (an fp32 output block takes 128 KB of shared
# memory, so its TMA kernel runs one program per tile: docs/benchmarks.md).
D_HIDDEN_TILING = {torch.bfloat16: MatmulTiling(128, 256, 64, 8, 8, 3), torch.float32: CUDA_TILING[torch.float32]}
# Decode sizes on the TMA path (at most DECODE_ROWS rows, bf16): 64 x 128 blocks, a quarter of the shipped ones, so
# the weight's 1.2 GB read is cut in twice as many, smaller pieces (H200, T = 64: 1.00 - 1.13x cuBLAS over two runs
# against 0.87x). A block's shape never changes an output's arithmetic (fp32 sum over K in BLOCK_K steps, the same
# per element); tests/test_kernel_invariance.py checks the two tilings bitwise on CUDA
# (docs/kernels.md#why-the-triton-kernels-are-invariant).
DECODE_ROWS = 64
DECODE_TILING = {torch.bfloat16: MatmulTiling(64, 128, 64, 8, 4, 4)}
INTERPRETER_TILING = MatmulTiling(64, 256, 64, 8, 4, 1)  # 64*64*256 products: under the 2**20 block cap
# The forward's logits under the interpreter, which pays per program: 32-row blocks, as wide as the cap allows, give
# a decode-sized call 6 programs where 64 x 256 gave 12 (tiny model, vocab 3001: a 4-row call 0.09 s against 0.23;
# 445 rows 1.17 s against 1.21). The shape of a block changes no output's arithmetic: each sums its K steps in order.
INTERPRETER_FORWARD_TILING = MatmulTiling(32, 512, 64, 8, 4, 1)
# The fused head's tiling: its tile of vocab columns is the contract's vocab_tile, so only the rows and the K
# step are chosen here, per device kind and dtype, never from M or N (docs/kernels.md, "The fused head").
FUSED_TILING = {
    torch.bfloat16: MatmulTiling(128, 0, 64, 8, 8, 3),
    torch.float32: MatmulTiling(64, 0, 32, 8, 8, 3),
}
FUSED_TMA = True  # use fused_head_tma_kernel where the GPU and the operands allow it (tma_ready)
STORE_BY_TMA = True  # the TMA matmul writes a bf16 output through a descriptor (tma_matmul)
FUSED_PROGRAMS_PER_SM = 2  # persistent programs of the TMA kernel per multiprocessor (H200: 2 beat 1)
FUSED_MAX_TILE = 256  # compiled: a 128 x 256 fp32 accumulator is what one program's registers hold
INTERPRETER_FUSED_ROWS = 64
INTERPRETER_BLOCK_NUMEL = 1 << 20  # the interpreter's broadcast product is rows x K step x tile
# The tile-partials kernel, compiled (H200, T = 16384: one row per one-warp program reduces without crossing warps;
# kernels.logprob took 1.75 ms with it against 2.16 with 4 rows on 4 warps; with the next tile's load issued early,
# 8 tiles per program took 1.20 ms against 1.27 with 16 and 1.34 with 32, docs/benchmarks.md).
PARTIAL_ROWS = 1  # rows per program
PARTIAL_WARPS = 1  # warps per program
PARTIAL_TILES = 8  # tiles per program: fewer, longer programs; no effect on the bits
PARTIAL_PROGRAMS = 8192  # fewer tiles per program until the tile-partials launch has this many programs
GRADIENT_CHUNK_COLUMNS = 4096  # vocab columns whose d logits [T, chunk] the backward holds at once
INTERPRETER_PARTIAL_ROWS = 64  # the interpreter pays per program, not per row
INTERPRETER_PARTIAL_TILES = 16  # likewise: fewer, longer programs than compiled (PARTIAL_TILES)
MERGE_ROWS = 16  # rows per program of the merge (any count gives the same bits: docs/kernels.md)
INTERPRETER_MERGE_ROWS = 128  # the interpreter pays per program
MERGE_CHUNK = 256  # tiles the merge loads at once per row
TARGET_ROWS = 128  # rows per program of the target-logit copy
TRITON_KERNELS = "kernels.triton_kernels"  # imported on first use: TRITON_INTERPRET is read at decoration
PARTIALS_KERNELS = ("tile_partials_kernel", "target_logit_kernel")  # a shard's partials from given logits
FINISH_KERNELS = ("tile_merge_kernel", "whole_vocab_finish_kernel")  # the merge: of ranks, or TP = 1's own
WHOLE_VOCAB_KERNEL = "whole_vocab_kernel"  # TP = 1 in one launch: both the logprob and the tp_merge node
ONE_LAUNCH_ROWS = 1024  # whole_vocab in one launch up to this many rows, in two above (docs/kernels.md)
ONE_LAUNCH_TILES = 4  # tiles per program of the one launch: fewer arrivals per row than 1, more programs than 8


# Both Triton backends: fixed global vocab tiles merged exactly, the same bits for every TP degree (checked
# bitwise for tp = 2, 4, 8 against tp = 1; docs/dispatch.md). On cpu they run in Triton's interpreter.
GLOBAL_TILES = LogprobBackendCapability(
    implementation_kind=ImplementationKind.PRODUCTION,
    dtypes=frozenset(EXECUTION_DTYPE_NAMES),
    determinism_scopes=frozenset(DeterminismScope),
    merge_orders=frozenset({MergeOrder.GLOBAL_TILE}),
)


def load_kernels(device: torch.device) -> tuple[ModuleType, bool]:
    """Import the Triton kernels, or say why they cannot run on ``device``; once per device type (every call
    needs it, and the answer cannot change once triton is imported; a refusal is not remembered)."""
    return kernels_for(device.type)


@functools.cache
def kernels_for(device_type: str) -> tuple[ModuleType, bool]:
    try:
        kernels_module = importlib.import_module(TRITON_KERNELS)
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError as err:  # pragma: no cover - triton is a hard dependency
        raise BackendUnavailableError(f"the triton backend needs the triton package: {err}") from err
    interpreted = isinstance(kernels_module.invariant_matmul_kernel, InterpretedFunction)
    if isinstance(triton_language_helper(), InterpretedFunction) != interpreted:
        raise BackendUnavailableError(
            "triton was first imported with another TRITON_INTERPRET setting than these kernels, so its own "
            "helpers (tl.cdiv, tl.sum) would run in the other mode; set TRITON_INTERPRET before triton is first "
            "imported in this process"
        )
    if device_type == "cpu" and not interpreted:
        raise BackendUnavailableError(
            "the triton backend got CPU tensors but Triton is compiling for a GPU; set "
            "TRITON_INTERPRET=1 before triton is first imported to run its kernels on the CPU"
        )
    if device_type not in ("cpu", "cuda"):
        raise BackendUnavailableError(f"the triton backend runs on cpu or cuda, not {device_type!r}")
    return kernels_module, interpreted


@register_backend(
    "triton",
    kernels={
        "matmul": {f"{TRITON_KERNELS}.invariant_matmul_kernel", f"{TRITON_KERNELS}.tma_matmul_kernel"},
        "logprob": {f"{TRITON_KERNELS}.{name}" for name in (*PARTIALS_KERNELS, WHOLE_VOCAB_KERNEL)},
        "tp_merge": {f"{TRITON_KERNELS}.{name}" for name in (*FINISH_KERNELS, WHOLE_VOCAB_KERNEL)},
    },
    capability=GLOBAL_TILES,
)
class TritonBackend:
    id: str
    runs_triton = True  # on the CPU only under Triton's interpreter (``rlsweep.run.prepare_backend``)
    checks_finite_logits = True  # a non-finite logit makes its tile's sum NaN (tile_partials_kernel)
    # Column indices are int32, and merge_tiles' int64 fixed-point sum stays below 2**63 under 2**31 columns.
    max_vocab_columns = 2**31 - 1

    def logits_dtype(self, execution_dtype: torch.dtype) -> torch.dtype:
        """Where this backend's logits are rounded: the execution dtype (the fused head keeps them fp32)."""
        return execution_dtype

    def matmul(self, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, NodeProvenance]:
        return self.invariant_matmul(hidden, weight, self.logits_dtype(hidden.dtype))

    def invariant_matmul(
        self, hidden: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype
    ) -> tuple[torch.Tensor, NodeProvenance]:
        """hidden @ weight.T in one fixed tiling, fp32 accumulation, rounded once to ``out_dtype``."""
        logits = invariant_matmul(hidden, weight, out_dtype)
        return logits, observe("matmul", self.id, logits, interpreted=load_kernels(hidden.device)[1])

    def shard_gradients(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        local_targets: torch.Tensor,
        lse: torch.Tensor,
        scale: torch.Tensor,
        g_target: torch.Tensor,
        d_hidden: torch.Tensor,
        d_weight: torch.Tensor,
        sharding: ShardingSpec,
    ) -> None:
        """This rank's real weight rows [n, H] -> their d weight, written to ``d_weight`` [n, H]; their d hidden
        products added to the fp32 ``d_hidden`` [T, H], K walked in vocab order. d logits = g_target [T] at the
        row's shard-local target (``local_targets``, -1: not in this shard) + scale [T] * softmax (kernels/grad.py).

        A chunk of GRADIENT_CHUNK_COLUMNS vocab columns at a time: its logits recomputed and turned into d logits
        in the inputs' dtype (``gradient_logits_kernel``), then d hidden += d logits @ w and d weight = d logits.T
        @ hidden. d hidden's K steps never straddle a vocab tile, and a shard starts on one, so its sum has the
        same steps at every tp; chunks are whole tiles, so their size changes nothing either."""
        kernels_module, interpreted = load_kernels(hidden.device)
        rows, depth = hidden.shape
        columns = weight.shape[0]
        tiling = INTERPRETER_TILING if interpreted else CUDA_TILING[hidden.dtype]
        tile = sharding.vocab_tile
        d_hidden_tiling = INTERPRETER_TILING if interpreted else D_HIDDEN_TILING[hidden.dtype]
        vocab_step = min(d_hidden_tiling.block_k, tile)
        chunk = max(tile, GRADIENT_CHUNK_COLUMNS // tile * tile)
        buffer = aligned_empty(rows, min(chunk, columns), hidden.dtype, hidden.device)
        matmul = matmul_launcher(interpreted, hidden, weight)
        tma = matmul is tma_matmul
        round_logits = self.logits_dtype(hidden.dtype) == torch.bfloat16  # recompute the logits the forward stored
        for start in range(0, columns, chunk):
            stop = min(start + chunk, columns)
            w, d_logits = weight[start:stop], buffer[:, : stop - start]
            chunk_targets = torch.where((local_targets >= start) & (local_targets < stop), local_targets - start, -1)
            epilogue = (lse, scale, g_target, chunk_targets, d_logits)
            if tma:
                from triton.tools.tensor_descriptor import TensorDescriptor

                tiles = triton_cdiv(rows, tiling.block_m) * triton_cdiv(stop - start, tiling.block_n)
                programs = persistent_programs(tiles, hidden.device)
                launch_triton(
                    kernels_module.gradient_logits_tma_kernel, (programs,),
                    TensorDescriptor.from_tensor(hidden, [tiling.block_m, tiling.block_k]),
                    TensorDescriptor.from_tensor(w, [tiling.block_n, tiling.block_k]),
                    *epilogue, rows, stop - start, d_logits.stride(0), depth,
                    BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, GROUP_M=tiling.group_m,
                    PROGRAMS=programs, ROUND_LOGITS=round_logits,
                    num_warps=tiling.num_warps, num_stages=tiling.num_stages,
                )  # fmt: skip
            else:
                grid = (triton_cdiv(rows, tiling.block_m) * triton_cdiv(stop - start, tiling.block_n),)
                launch_triton(
                    kernels_module.gradient_logits_kernel, grid,
                    hidden, w, *epilogue, rows, stop - start, depth,
                    hidden.stride(0), hidden.stride(1), w.stride(0), w.stride(1), d_logits.stride(0),
                    BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, GROUP_M=tiling.group_m,
                    ROUND_LOGITS=round_logits, INTERPRETED=interpreted,
                    num_warps=tiling.num_warps, num_stages=tiling.num_stages,
                )  # fmt: skip
            # d hidden [T, H] += d_logits [T, c] @ w [c, H], continuing the fp32 sum over the vocab.
            matmul(kernels_module, d_logits, w, d_hidden, d_hidden_tiling, vocab_step,
                   a_by_k=False, b_by_k=True, accumulate=True)  # fmt: skip
            # d weight [c, H] = d_logits.T [c, T] @ hidden [T, H], a sum over the call's rows in row order.
            matmul(kernels_module, d_logits, hidden, d_weight[start:stop], tiling, tiling.block_k,
                   a_by_k=True, b_by_k=True, accumulate=False)  # fmt: skip

    def max_vocab_tile(self, device: torch.device) -> int:
        """The widest vocab tile the tile-partials kernel can hold on ``device``: its block is rows x tile."""
        _, interpreted = load_kernels(device)
        from triton.language import TRITON_MAX_TENSOR_NUMEL  # 2**20 elements, compiled and interpreted alike

        return TRITON_MAX_TENSOR_NUMEL // partial_rows(interpreted)

    def tile_partials(
        self, kernels_module: ModuleType, interpreted: bool, logits: torch.Tensor, sharding: ShardingSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(maxes, sums) [T, n_tiles] of this rank's shard of logits (``tile_partials_kernel``), as views of
        tile-major storage: the merge reads one tile of consecutive rows at a time."""
        logits = aligned_rows(logits)
        rows, n_real = logits.shape
        lo, hi = sharding.shard
        n_tiles = (hi - lo) // sharding.vocab_tile
        maxes, sums = tile_scratch(n_tiles, rows, logits.device)
        rows_per_program = partial_rows(interpreted)
        blocks = triton_cdiv(rows, rows_per_program)
        tiles = min(INTERPRETER_PARTIAL_TILES, n_tiles) if interpreted else partial_tiles(blocks, n_tiles)
        launch_triton(
            kernels_module.tile_partials_kernel, (blocks, triton_cdiv(n_tiles, tiles)),
            logits, maxes, sums, rows, n_real, logits.stride(0), n_tiles, *maxes.stride(),
            ROWS=rows_per_program, TILE=sharding.vocab_tile, TILES=tiles, num_warps=PARTIAL_WARPS,
        )  # fmt: skip
        return maxes, sums

    def shard_partials(
        self, logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor, sharding: ShardingSpec
    ) -> tuple[ShardPartials, NodeProvenance]:
        kernels_module, interpreted = load_kernels(logits.device)
        rows, n_real = logits.shape
        maxes, sums = self.tile_partials(kernels_module, interpreted, logits, sharding)
        target = torch.empty((rows,), dtype=torch.float32, device=logits.device)
        launch_triton(
            kernels_module.target_logit_kernel, (triton_cdiv(rows, TARGET_ROWS),),
            logits, local_targets, owned, target, rows, n_real, logits.stride(0), BLOCK=TARGET_ROWS,
        )  # fmt: skip
        return ShardPartials(maxes, sums, target, owned), observe("logprob", self.id, sums, interpreted=interpreted)

    def whole_vocab(
        self, logits: torch.Tensor, targets: torch.Tensor, sharding: ShardingSpec
    ) -> tuple[WholeVocab, NodeProvenance, NodeProvenance]:
        """TP = 1 with no torch op but allocations: logits[T, V] and targets[T] (unchecked) -> logp, lse, active,
        owner rank and status words (``WholeVocab``), with the records of the logprob node (the tile partials) and
        the tp_merge node (merge, target logit, logp and the checks of the targets' range and of the outputs). Up to
        ONE_LAUNCH_ROWS rows in one launch (``whole_vocab_kernel``, recorded for both nodes); more rows in two,
        ``tile_partials_kernel`` then ``whole_vocab_finish_kernel``. The tiles and the merge are those of
        ``shard_partials`` then ``merge`` either way, so the bits are the same at every TP degree."""
        kernels_module, interpreted = load_kernels(logits.device)
        targets = targets.contiguous()  # the kernels read targets[row] at target_ptr + row
        rows, vocab = logits.shape
        if rows > ONE_LAUNCH_ROWS:
            return self.whole_vocab_in_two(kernels_module, interpreted, logits, targets, sharding)
        logits = aligned_rows(logits)
        n_tiles = sharding.padded_vocab_size // sharding.vocab_tile
        rows_per_program = partial_rows(interpreted)
        blocks = triton_cdiv(rows, rows_per_program)
        tiles = min(INTERPRETER_PARTIAL_TILES if interpreted else ONE_LAUNCH_TILES, n_tiles)
        maxes, sums = tile_scratch(n_tiles, rows, logits.device, row_major=True)
        logp, lse, active, owner, status = row_outputs(rows, blocks, logits.device)
        counts = arrival_counts(logits.device, blocks, interpreted)
        with recording_launches() as launches:
            launch_triton(
                kernels_module.whole_vocab_kernel, (blocks, triton_cdiv(n_tiles, tiles)),
                logits, targets, maxes, sums, counts, status, logp, lse, active.view(torch.uint8), owner,
                rows, vocab, logits.stride(0), *maxes.stride(), n_tiles=n_tiles, ROWS=rows_per_program,
                TILE=sharding.vocab_tile, TILES=tiles, CHUNK=merge_chunk(n_tiles), IGNORE=IGNORE_INDEX,
                num_warps=PARTIAL_WARPS,
            )  # fmt: skip
        for launch in launches:  # the one launch is the tp_merge node's too
            record(launch)
        return self.whole_vocab_result(WholeVocab(logp, lse, active, owner, status), sums, launches, interpreted)

    def whole_vocab_in_two(
        self,
        kernels_module: ModuleType,
        interpreted: bool,
        logits: torch.Tensor,
        targets: torch.Tensor,
        sharding: ShardingSpec,
    ) -> tuple[WholeVocab, NodeProvenance, NodeProvenance]:
        """``whole_vocab`` in two launches: the partials, then a kernel that merges and finishes the rows."""
        with recording_launches() as partial_launches:  # the logprob node's own record
            maxes, sums = self.tile_partials(kernels_module, interpreted, logits, sharding)
        # Allocated after the first launch: at training sizes that host work then runs beside the partials kernel
        # instead of delaying it (H200, T = 16384: the run that allocated first measured 1.44 ms against 1.27).
        rows, vocab = logits.shape
        n_tiles, merge_rows = maxes.shape[1], merge_block(interpreted)
        programs = triton_cdiv(rows, merge_rows)
        logp, lse, active, owner, status = row_outputs(rows, programs, logits.device)
        launch_triton(
            kernels_module.whole_vocab_finish_kernel, (programs,),
            logits, targets, maxes, sums, status, logp, lse, active.view(torch.uint8), owner,
            rows, vocab, logits.stride(0), *maxes.stride(), n_tiles=n_tiles, BLOCK=merge_rows,
            CHUNK=merge_chunk(n_tiles), IGNORE=IGNORE_INDEX,
        )  # fmt: skip
        return self.whole_vocab_result(
            WholeVocab(logp, lse, active, owner, status), sums, partial_launches, interpreted
        )

    def whole_vocab_result(
        self, whole: WholeVocab, sums: torch.Tensor, partial_launches: Sequence[KernelLaunch], interpreted: bool
    ) -> tuple[WholeVocab, NodeProvenance, NodeProvenance]:
        """``whole_vocab``'s return: its outputs and the records of its two nodes, the logprob node's with the
        launches that made the partials ``sums``."""
        partials = observe("logprob", self.id, sums, interpreted=interpreted)
        merged = observe("tp_merge", self.id, whole.lse, tiles=sums.shape[1], interpreted=interpreted)
        return whole, replace(partials, launches=distinct_launches(partial_launches)), merged

    def merge(self, partials: Sequence[ShardPartials]) -> tuple[torch.Tensor, NodeProvenance]:
        # Ranks hold contiguous shards in rank order, so concatenation is global tile order (one rank: no copy).
        maxes = torch.cat([p.maxes for p in partials], dim=1) if len(partials) > 1 else partials[0].maxes
        sums = torch.cat([p.sumexps for p in partials], dim=1) if len(partials) > 1 else partials[0].sumexps
        if maxes.stride() != sums.stride():
            maxes, sums = maxes.contiguous(), sums.contiguous()
        kernels_module, interpreted = load_kernels(maxes.device)
        rows, n_tiles = maxes.shape
        lse = torch.empty((rows,), dtype=torch.float32, device=maxes.device)
        merge_rows = merge_block(interpreted)
        launch_triton(kernels_module.tile_merge_kernel, (triton_cdiv(rows, merge_rows),), maxes, sums, lse, rows,
                      *maxes.stride(), n_tiles, BLOCK=merge_rows, CHUNK=merge_chunk(n_tiles))  # fmt: skip
        return lse, observe("tp_merge", self.id, lse, tiles=n_tiles, interpreted=interpreted)


@register_backend(
    "triton_fused",
    kernels={
        "matmul": {
            f"{TRITON_KERNELS}.{name}"
            for name in ("fused_head_kernel", "fused_head_tma_kernel", "invariant_matmul_kernel", "tma_matmul_kernel")
        },
        "logprob": {
            f"{TRITON_KERNELS}.{name}"
            for name in ("fused_head_kernel", "fused_head_tma_kernel", *PARTIALS_KERNELS, WHOLE_VOCAB_KERNEL)
        },
        "tp_merge": {f"{TRITON_KERNELS}.{name}" for name in (*FINISH_KERNELS, WHOLE_VOCAB_KERNEL)},
    },
    # The matmul and the per-tile partials are one kernel and the logits stay fp32 in registers; the tiles are
    # the global vocab tiles of the unfused backend, merged by the same exact merge.
    capability=GLOBAL_TILES,
)
class TritonFusedBackend(TritonBackend):
    """``lm_head_logprob`` without [T, V] logits: ``fused_partials`` is the matmul and logprob nodes at once.

    ``matmul`` (for ``kernels.matmul``) gives the fp32 logits the fused kernel keeps in registers, and
    ``shard_partials`` reduces given logits, so ``kernels.logprob`` works on this backend too.
    """

    def logits_dtype(self, execution_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def max_vocab_tile(self, device: torch.device) -> int:
        _, interpreted = load_kernels(device)
        fused = INTERPRETER_BLOCK_NUMEL // INTERPRETER_FUSED_ROWS if interpreted else FUSED_MAX_TILE
        return min(fused, super().max_vocab_tile(device))

    def fused_partials(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        local_targets: torch.Tensor,
        owned: torch.Tensor,
        sharding: ShardingSpec,
    ) -> tuple[ShardPartials, NodeProvenance]:
        """hidden[T, H] and this rank's real weight rows -> its per-tile partials and owned target logits."""
        kernels_module, interpreted = load_kernels(hidden.device)
        tile = sharding.vocab_tile
        lo, hi = sharding.shard
        n_tiles = (hi - lo) // tile
        rows, depth = hidden.shape
        if interpreted:
            block_m, group_m, warps, stages = INTERPRETER_FUSED_ROWS, 8, 4, 1
            block_k = max(1, min(64, INTERPRETER_BLOCK_NUMEL // (block_m * tile)))
        else:
            tiling = FUSED_TILING[hidden.dtype]
            block_m, block_k, group_m, warps, stages = (
                tiling.block_m, tiling.block_k, tiling.group_m, tiling.num_warps, tiling.num_stages,
            )  # fmt: skip
        maxes = torch.empty((rows, n_tiles), dtype=torch.float32, device=hidden.device)
        sums = torch.empty_like(maxes)
        target = torch.zeros((rows,), dtype=torch.float32, device=hidden.device)
        local = torch.where(owned, local_targets, -1)
        programs = triton_cdiv(rows, block_m) * n_tiles
        tma = not interpreted and tma_ready(hidden, weight)
        if tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            persistent = persistent_programs(programs, hidden.device)
            launch_triton(
                kernels_module.fused_head_tma_kernel, (persistent,),
                TensorDescriptor.from_tensor(hidden, [block_m, block_k]),
                TensorDescriptor.from_tensor(weight, [tile, block_k]),
                local, maxes, sums, target, rows, weight.shape[0], n_tiles, depth,
                BLOCK_M=block_m, TILE=tile, BLOCK_K=block_k, GROUP_M=group_m, PROGRAMS=persistent,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip
        else:
            launch_triton(
                kernels_module.fused_head_kernel, (programs,),
                hidden, weight, local, maxes, sums, target, rows, weight.shape[0], depth,
                hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), n_tiles,
                BLOCK_M=block_m, TILE=tile, BLOCK_K=block_k, GROUP_M=group_m, INTERPRETED=interpreted,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip
        partials = ShardPartials(maxes, sums, target, owned)
        return partials, observe("logprob", self.id, sums, fused=True, tma=tma, interpreted=interpreted)


def pointer_matmul(kernels_module, a, b, c, tiling, block_k, *, a_by_k, b_by_k, accumulate, interpreted):
    """c (+)= A @ B through ``invariant_matmul_kernel``: A is a [M, K] (a_by_k: a is [K, M]), B is b [N, K]
    (b_by_k: b is [K, N]); the depth is a runtime argument where compiled (it may be the call's rows)."""
    rows, cols = c.shape
    depth = a.shape[0] if a_by_k else a.shape[1]
    stride_am, stride_ak = (a.stride(1), a.stride(0)) if a_by_k else (a.stride(0), a.stride(1))
    stride_bn, stride_bk = (b.stride(1), b.stride(0)) if b_by_k else (b.stride(0), b.stride(1))
    grid = (triton_cdiv(rows, tiling.block_m) * triton_cdiv(cols, tiling.block_n),)
    launch_triton(
        kernels_module.invariant_matmul_kernel, grid,
        a, b, c, rows, cols, depth, depth if interpreted else 0,
        stride_am, stride_ak, stride_bn, stride_bk, c.stride(0), c.stride(1),
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=block_k, GROUP_M=tiling.group_m,
        ACCUMULATE=accumulate, INTERPRETED=interpreted, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )  # fmt: skip


def tma_matmul(kernels_module, a, b, c, tiling, block_k, *, a_by_k, b_by_k, accumulate):
    """``pointer_matmul`` by ``tma_matmul_kernel`` (compute capability 9+): persistent programs for a bf16 output;
    one program per tile for an fp32 one, whose 128 KB output block fits beside the pipeline only once its buffers
    are free (H200: persistent ran out of shared memory or, with 2 stages, took 2.0 ms where this takes 1.0)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, cols = c.shape
    depth = a.shape[0] if a_by_k else a.shape[1]
    a_block = [block_k, tiling.block_m] if a_by_k else [tiling.block_m, block_k]
    b_block = [block_k, tiling.block_n] if b_by_k else [tiling.block_n, block_k]
    tiles = triton_cdiv(rows, tiling.block_m) * triton_cdiv(cols, tiling.block_n)
    persistent = c.element_size() < 4
    programs = persistent_programs(tiles, c.device) if persistent else 0
    # A bf16 output leaves by TMA: masked stores against a runtime width cannot be vectorized (0.75x cuBLAS).
    store_by_tma = STORE_BY_TMA and c.dtype == torch.bfloat16 and not accumulate and tma_aligned(c)
    c_desc = TensorDescriptor.from_tensor(c, [tiling.block_m, tiling.block_n]) if store_by_tma else None
    launch_triton(
        kernels_module.tma_matmul_kernel, (programs or tiles,),
        TensorDescriptor.from_tensor(a, a_block), TensorDescriptor.from_tensor(b, b_block),
        c, c_desc, rows, cols, depth, c.stride(0), c.stride(1),
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=block_k, GROUP_M=tiling.group_m,
        PROGRAMS=programs, A_BY_K=a_by_k, B_BY_K=b_by_k, ACCUMULATE=accumulate, STORE_BY_TMA=store_by_tma,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )  # fmt: skip


def invariant_matmul(hidden: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                     interpreter_tiling: MatmulTiling = INTERPRETER_FORWARD_TILING) -> torch.Tensor:  # fmt: skip
    """hidden [M, K] @ weight [N, K].T in one fixed tiling per device kind and dtype, fp32 accumulation, rounded once
    to ``out_dtype``: the head's logits and every linear layer of the invariant body (``kernels.body``). Under the
    interpreter ``interpreter_tiling`` (the block's shape changes no output's arithmetic there: each sums its
    BLOCK_K steps in order; it must not follow M)."""
    kernels_module, interpreted = load_kernels(hidden.device)
    rows, cols = hidden.shape[0], weight.shape[0]
    out = aligned_empty(rows, cols, out_dtype, hidden.device)
    matmul = matmul_launcher(interpreted, hidden, weight)
    if interpreted:
        tiling = interpreter_tiling
    elif matmul is tma_matmul and rows <= DECODE_ROWS and hidden.dtype in DECODE_TILING:
        tiling = DECODE_TILING[hidden.dtype]
    else:
        tiling = CUDA_TILING[hidden.dtype]
    matmul(kernels_module, hidden, weight, out, tiling, tiling.block_k, a_by_k=False, b_by_k=False, accumulate=False)
    return out


def matmul_launcher(interpreted: bool, hidden: torch.Tensor, weight: torch.Tensor) -> Callable[..., None]:
    """``tma_matmul`` for bf16 operands where TMA is ready, else ``pointer_matmul``: decided by the device, the
    dtype and the hidden size (the operands' alignment), never by the number of rows."""
    if not interpreted and hidden.dtype == torch.bfloat16 and tma_ready(hidden, weight):
        return tma_matmul
    return functools.partial(pointer_matmul, interpreted=interpreted)


def tma_ready(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Tensor-memory access (compute capability 9+): row-major operands, 16-byte aligned rows and bases, and a
    weight shard with at least one real row. The choice depends on the device and the hidden size only."""
    return (
        FUSED_TMA
        and compute_capability(hidden.device)[0] >= 9
        and weight.shape[0] > 0
        and tma_aligned(hidden)
        and tma_aligned(weight)
    )


def tma_aligned(tensor: torch.Tensor) -> bool:
    """A 2-d tensor a TMA descriptor can address: row-major, 16-byte aligned base and row stride."""
    return (
        tensor.stride(1) == 1 and (tensor.stride(0) * tensor.element_size()) % 16 == 0 and tensor.data_ptr() % 16 == 0
    )


def persistent_programs(tiles: int, device: torch.device) -> int:
    """How many persistent programs walk ``tiles`` output blocks: FUSED_PROGRAMS_PER_SM per multiprocessor, at
    most one per block. Only which program takes a block depends on it, never a block's arithmetic."""
    return min(tiles, FUSED_PROGRAMS_PER_SM * multiprocessors(device))


@functools.cache
def compute_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def partial_tiles(blocks: int, n_tiles: int) -> int:
    """Tiles per program of the compiled tile-partials kernel: PARTIAL_TILES, halved while the launch would have
    fewer than PARTIAL_PROGRAMS programs (decode sizes: few rows, so a row's tiles are spread over more programs).
    It sets how many programs share a row, never a tile's arithmetic, so it may follow the row count."""
    tiles = PARTIAL_TILES
    while tiles > 1 and blocks * triton_cdiv(n_tiles, tiles) < PARTIAL_PROGRAMS:
        tiles //= 2
    return max(1, min(tiles, n_tiles))


def tile_scratch(
    n_tiles: int, rows: int, device: torch.device, *, row_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(maxes, sums) [rows, n_tiles] fp32, views of one buffer laid out for the program that reads them: tile-major
    where a merge program reads one tile of consecutive rows at a time, row-major where one program reads all of a
    row's tiles (the one launch's last program per row block: H200, T = 64, 13.9 µs against 14.7 tile-major). The
    merge is exact, so the layout never changes a bit."""
    if row_major:
        scratch = torch.empty((2, rows, n_tiles), dtype=torch.float32, device=device)
        return scratch[0], scratch[1]
    scratch = torch.empty((2, n_tiles, rows), dtype=torch.float32, device=device)
    return scratch[0].T, scratch[1].T


def row_outputs(
    rows: int, blocks: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a kernel that finishes rows (``finish_rows``) writes: logp and lse [rows] fp32 (two rows of one buffer),
    active [rows] bool, owner rank [rows] int64, and one int32 status word per block of rows. Each is written
    whole, so none is zeroed: a call queues no kernel but its own."""
    out = torch.empty((2, rows), dtype=torch.float32, device=device)
    active = torch.empty((rows,), dtype=torch.bool, device=device)
    owner = torch.empty((rows,), dtype=torch.int64, device=device)
    return out[0], out[1], active, owner, torch.empty((blocks,), dtype=torch.int32, device=device)


# (device index, raw CUDA stream) -> the int32 arrival counts that whole_vocab_kernel launches on that stream share.
_ARRIVAL_COUNTS: dict[tuple[int, int], torch.Tensor] = {}


def arrival_counts(device: torch.device, blocks: int, interpreted: bool) -> torch.Tensor:
    """Zeroed int32 arrival counts for ``blocks`` row blocks of ``whole_vocab_kernel``. The kernel sets each count
    back to zero once its block is merged, and launches on one CUDA stream run one after another, so every launch
    on a stream reuses one buffer, zeroed once: no fill kernel per call. Fresh zeros where that does not hold: under
    the interpreter (Python threads may interleave two launches) and while a CUDA graph is captured (a replay may
    run beside eager launches on the capturing stream)."""
    if interpreted or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros((blocks,), dtype=torch.int32, device=device)
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    counts = _ARRIVAL_COUNTS.get(key)
    if counts is None or counts.numel() < blocks:  # freed in stream order: no launch still queued can lose it
        counts = _ARRIVAL_COUNTS[key] = torch.zeros((max(blocks, ONE_LAUNCH_ROWS),), dtype=torch.int32, device=device)
    return counts


def merge_block(interpreted: bool) -> int:
    """Rows per program of the merge kernels: any count gives the same bits (``merge_tiles`` is exact)."""
    return INTERPRETER_MERGE_ROWS if interpreted else MERGE_ROWS


def merge_chunk(n_tiles: int) -> int:
    """Tiles the merge loads at once per row: MERGE_CHUNK, or all of a narrower vocab's (a power of two)."""
    return min(MERGE_CHUNK, 1 << (n_tiles - 1).bit_length())


def partial_rows(interpreted: bool) -> int:
    """Rows per program of the tile-partials kernel."""
    return INTERPRETER_PARTIAL_ROWS if interpreted else PARTIAL_ROWS


def triton_language_helper():
    """A @triton.jit function of triton.language itself, decorated when triton was first imported."""
    import triton.language.standard

    return triton.language.standard.sum


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Triton compiles one variant per 16-divisibility of integer arguments and 16-byte alignment of
# pointers, and the variant decides the load layout and with it the order of the in-tile sum. A
# shard's logits (row stride = shard width) and the full vocab's (row stride = vocab) must reach the
# same variant, so rows always start 16-element aligned.
ROW_ALIGNMENT = 16


def aligned_empty(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised [rows, cols] view whose row stride is a multiple of ROW_ALIGNMENT."""
    stride = triton_cdiv(max(cols, 1), ROW_ALIGNMENT) * ROW_ALIGNMENT
    return torch.empty((rows, stride), dtype=dtype, device=device)[:, :cols]


def aligned_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` itself when its rows start aligned, else an aligned copy (same values)."""
    element = logits.element_size()
    if (
        logits.stride(1) == 1
        and logits.stride(0) % ROW_ALIGNMENT == 0
        and logits.data_ptr() % (ROW_ALIGNMENT * element) == 0
    ):
        return logits
    copy = aligned_empty(*logits.shape, logits.dtype, logits.device)
    copy.copy_(logits)
    return copy
