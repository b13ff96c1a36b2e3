"""Triton kernels whose arithmetic per output never depends on the call's row count or TP degree.

Imported lazily by ``kernels.triton_backend``: Triton decides at decoration time whether a kernel
runs compiled (CUDA) or in its CPU interpreter, so ``TRITON_INTERPRET`` must be set before this
module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

# What c10::BFloat16 writes for every NaN, whatever its sign and payload: positive, quiet, no payload.
BF16_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC0)


@triton.jit
def round_to_bf16(x):
    """fp32 -> bf16 rounded to nearest, ties to even, by integer arithmetic on the bits.

    The interpreter's own cast truncates toward zero (its "rtne" option too) and mangles fp32 subnormals and
    low-payload NaNs; compiled CUDA rounds to nearest even, and this gives its bits. Both paths run this.
    """
    bits = x.to(tl.uint32, bitcast=True)
    lowest_kept = (bits >> 16) & 1
    # Adding just under half a bf16 ulp (plus the kept lsb: ties go to even) and cutting the low half
    # rounds the magnitude; a carry out of the mantissa steps the exponent, past the largest finite to inf.
    rounded = (bits + 0x7FFF + lowest_kept) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, BF16_NAN_BITS, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)


LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def tile_max_sumexp(x):
    """x [rows, columns] fp32, padding -inf -> per row (max, sum exp(x - max)); an all -inf row is the identity
    (-inf, 0). exp is the hardware's exp2 of (x - max) * log2 e: one instruction where libdevice's expf takes
    about a dozen, and the argument's rounding is relative to x - max, so the terms that matter keep ~2 ulp."""
    m = tl.max(x, axis=1)
    shift = tl.where(m == float("-inf"), 0.0, m)  # exp(-inf - 0) = 0, not NaN
    return m, tl.sum(tl.math.exp2((x - shift[:, None]) * LOG2E), axis=1)


@triton.jit
def widen_to_fp32(x):
    """bf16 or fp32 -> fp32 exactly: a bf16 is the upper half of its fp32 (the interpreter's cast loses subnormals)."""
    if x.dtype == tl.bfloat16:
        wide = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        wide = x.to(tl.float32)
    return wide


@triton.jit
def grouped_tile(pid, grid_m, grid_n, GROUP_M: tl.constexpr):
    """(row block, column block) of program ``pid``: grouped launch order helps L2 reuse; it changes which program
    runs when, never the arithmetic."""
    group = GROUP_M * grid_n
    first_m = (pid // group) * GROUP_M
    group_rows = min(grid_m - first_m, GROUP_M)
    return first_m + (pid % group) % group_rows, (pid % group) // group_rows


@triton.jit
def ordered_dot(
    a_ptr, b_ptr, rm, rn, M, N, depth, stride_am, stride_ak, stride_bn, stride_bk, acc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """``acc`` + the fp32 block a[rm, :depth] @ b[rn, :depth].T, K walked in order in BLOCK_K steps; rows past M
    and columns past N load as zero. ``depth`` is a compile-time constant where the caller has one (the hidden
    size: triton 3.6's interpreter cannot take a runtime int as a Python range bound), else a runtime int (compiled
    only: a depth that changes from call to call, such as the rows of a call, would compile a kernel per value)."""
    rk = tl.arange(0, BLOCK_K)
    for k0 in range(0, depth, BLOCK_K):
        kk = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
            mask=(rm[:, None] < M) & (kk[None, :] < depth),
            other=0.0,
        )
        b = tl.load(
            b_ptr + rn[None, :] * stride_bn + kk[:, None] * stride_bk,
            mask=(rn[None, :] < N) & (kk[:, None] < depth),
            other=0.0,
        )
        if INTERPRETED:
            # The interpreter's tl.dot is numpy's BLAS, whose bits for a row depend on the row's place in
            # the block (seen: row 252 of 257) and whose bf16 path is wrong. A broadcast product summed over
            # K in order is exact per product (bf16 * bf16 fits fp32) and position independent.
            acc += tl.sum(widen_to_fp32(a)[:, :, None] * widen_to_fp32(b)[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def first_sum(c_ptr, rm, rn, M, N, stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              ACCUMULATE: tl.constexpr):  # fmt: skip
    """Where a block's fp32 sum starts: c[rm, rn] itself (ACCUMULATE: the sum continues a previous call's), or 0."""
    if ACCUMULATE:
        acc = tl.load(
            c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
            mask=(rm[:, None] < M) & (rn[None, :] < N),
            other=0.0,
        )
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def store_rounded(c_ptr, acc, rm, rn, M, N, stride_cm, stride_cn):
    """Store the fp32 block ``acc`` at c[rm, rn] in c's dtype: bf16 rounded to nearest even, fp32 as it is."""
    if c_ptr.dtype.element_ty == tl.bfloat16:
        c = round_to_bf16(acc)
    else:
        c = acc
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, c, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M", "N", "k_size"])
def invariant_matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, k_size, K: tl.constexpr,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, ACCUMULATE: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """c[M, N] = a[M, K] @ b[N, K].T with one fixed tiling, no split-K and K walked in order (``ordered_dot``).

    ACCUMULATE: c is fp32 and the sum starts from its value, so calls over consecutive K ranges give the bits
    of one call over all of them (K boundaries on BLOCK_K steps)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    # int64 offsets: T * V exceeds 2**31 at real sizes (16384 x 151936).
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = first_sum(c_ptr, rm, rn, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N, ACCUMULATE)
    if K > 0:  # two calls, not one depth variable: the 3.6 interpreter turns a branch's constexpr into a tensor
        acc = ordered_dot(
            a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, acc,
            BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETED,
        )  # fmt: skip
    else:
        acc = ordered_dot(
            a_ptr, b_ptr, rm, rn, M, N, k_size, stride_am, stride_ak, stride_bn, stride_bk, acc,
            BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETED,
        )  # fmt: skip
    store_rounded(c_ptr, acc, rm, rn, M, N, stride_cm, stride_cn)


@triton.jit
def tile_partials(x, lowest):
    """Per row of the loaded tile ``x`` [rows, TILE] (bf16 or fp32; padding -inf) whose least real value is
    ``lowest``: fp32 max and sum(exp(x - max)). A NaN or infinite logit makes the sum NaN, so the caller sees a
    non-finite lse without a second pass over the logits to look for one."""
    m, s = tile_max_sumexp(widen_to_fp32(x))
    # NaN and +inf already make s NaN (x - max); a real -inf logit would vanish in exp, so it is looked for.
    return m, tl.where(lowest == float("-inf"), float("nan"), s)


@triton.jit(do_not_specialize=["T", "n_real", "n_tiles"])
def tile_partials_kernel(
    logits_ptr, max_ptr, sum_ptr, T, n_real, stride_t, n_tiles, stride_out_row, stride_out_tile,
    ROWS: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """Per (row, tile) of one shard's logits: fp32 max and sum(exp(x - max)) over TILE columns (``tile_partials``),
    stored at ``row * stride_out_row + tile * stride_out_tile`` (``store_tile_partials``)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    store_tile_partials(
        logits_ptr, max_ptr, sum_ptr, rows, tl.program_id(1) * TILES, T, n_real, stride_t, n_tiles,
        stride_out_row, stride_out_tile, TILE, TILES,
    )  # fmt: skip


@triton.jit
def store_tile_partials(
    logits_ptr, max_ptr, sum_ptr, rows, first, T, n_real, stride_t, n_tiles, stride_out_row, stride_out_tile,
    TILE: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """The partials of ``rows`` over TILES consecutive tiles from tile ``first``, one tile at a time: how many tiles
    a program takes changes the number of programs, never a tile's arithmetic. Rows past T read row T - 1 and store
    nothing, so no row mask narrows the loads either. A program whose tiles are all wholly inside the real columns
    loads them without a mask, so the loads stay as wide as the alignment allows, and issues each tile's load before
    the previous tile's reduction (two tiles in flight per warp). Otherwise (a shard's last program) each tile is
    loaded masked. Which path a tile takes depends on its global position only (shards start on tile boundaries),
    never on the call's rows, and both give a tile the same arithmetic."""
    source = tl.minimum(rows, T - 1).to(tl.int64)
    out_rows = rows.to(tl.int64) * stride_out_row
    if (first + TILES) * TILE <= n_real:
        at = logits_ptr + source[:, None] * stride_t + (first * TILE + tl.arange(0, TILE))[None, :]
        x = tl.load(at)
        for step in range(TILES):
            ahead = tl.load(at + tl.minimum(step + 1, TILES - 1) * TILE)  # the last step reloads its own tile
            m, s = tile_partials(x, tl.min(widen_to_fp32(x), axis=1))
            out = out_rows + (first + step) * stride_out_tile
            tl.store(max_ptr + out, m, mask=rows < T)
            tl.store(sum_ptr + out, s, mask=rows < T)
            x = ahead
    else:
        for step in range(TILES):
            tile = first + step
            cols = tile * TILE + tl.arange(0, TILE)
            real = cols[None, :] < n_real
            x = tl.load(logits_ptr + source[:, None] * stride_t + cols[None, :], mask=real, other=float("-inf"))
            m, s = tile_partials(x, tl.min(tl.where(real, widen_to_fp32(x), 0.0), axis=1))
            out = out_rows + tile * stride_out_tile
            keep = rows < tl.where(tile < n_tiles, T, 0)  # the last program's steps past n_tiles store nothing
            tl.store(max_ptr + out, m, mask=keep)
            tl.store(sum_ptr + out, s, mask=keep)


@triton.jit(do_not_specialize=["T", "n_real"])
def target_logit_kernel(logits_ptr, target_ptr, owned_ptr, out_ptr, T, n_real, stride_t, BLOCK: tl.constexpr):
    """out[t] = logits[t, target[t]] widened to fp32 where the shard owns the row's target, else 0: a copy, no
    arithmetic. One load per row (torch's gather splits itself in four once T * V passes 2**31)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < T
    target = tl.load(target_ptr + rows, mask=live, other=0)
    mine = live & (tl.load(owned_ptr + rows, mask=live, other=0) != 0) & (target >= 0) & (target < n_real)
    x = tl.load(logits_ptr + rows.to(tl.int64) * stride_t + target, mask=mine, other=0.0)
    tl.store(out_ptr + rows, widen_to_fp32(x), mask=live)


FIXED_POINT: tl.constexpr = tl.constexpr(2.0**32)


@triton.jit
def load_partials(max_ptr, sum_ptr, at, keep):
    """Partials read from L2, past L1: ``whole_vocab_kernel`` reads what other programs stored in the same launch."""
    m = tl.load(max_ptr + at, mask=keep, other=float("-inf"), cache_modifier=".cg")
    return m, tl.load(sum_ptr + at, mask=keep, other=0.0, cache_modifier=".cg")


@triton.jit
def chunk_partials(max_ptr, sum_ptr, base, live, stride_tile, first, n_tiles: tl.constexpr, CHUNK: tl.constexpr):
    """[CHUNK, rows] partials of tiles first .. first + CHUNK - 1 (tiles past n_tiles and rows past T: (-inf, 0))."""
    tiles = first + tl.arange(0, CHUNK)
    keep = (tiles[:, None] < n_tiles) & live[None, :]
    return load_partials(max_ptr, sum_ptr, base[None, :] + tiles[:, None].to(tl.int64) * stride_tile, keep)


@triton.jit
def fixed_point_sum(m, s, shift):
    """Per row (column of the [tiles, rows] chunk): the sum of s * exp(m - shift) in units of 2**-32, as int64."""
    rescaled = s * tl.math.exp2((m - shift[None, :]) * LOG2E)
    return tl.sum(tl.where(rescaled == rescaled, rescaled * FIXED_POINT, 0.0).to(tl.int64), axis=0)


@triton.jit
def merge_tiles(max_ptr, sum_ptr, base, live, stride_tile, n_tiles: tl.constexpr, CHUNK: tl.constexpr):
    """lse of the rows whose partials of tile t sit at ``base + t * stride_tile`` (``base`` and ``live``: [rows]).

    Exact, so no order to keep: the row's max is the max of its tile maxes, and each tile's sumexp, rescaled to it,
    is summed in fixed point (int64 in units of 2**-32: an integer sum gives the same bits in any order and any
    grouping). How many rows and tiles a program loads at once therefore never changes a bit, and neither does the
    TP degree: every rank's tiles reach the same sum. A tile rescaled to the max is at most its width, so the sum
    stays below 2**63 for any vocab below 2**31 columns; truncating each tile to 2**-32 moves a sum of at least 1
    (the max's own tile) by under n_tiles * 2**-32. A NaN sumexp (``tile_partials``: a NaN or infinite logit)
    makes the lse NaN. The tiles are loaded CHUNK at a time; the first chunk stays in registers for the sum, so a
    vocab of at most CHUNK tiles is read once, and a wider one reads its other chunks twice (max, then sum)."""
    m, s = chunk_partials(max_ptr, sum_ptr, base, live, stride_tile, 0, n_tiles, CHUNK)
    top = tl.max(m, axis=0)
    poisoned = tl.max((s != s).to(tl.int32), axis=0)
    for first in range(CHUNK, n_tiles, CHUNK):
        more_m, more_s = chunk_partials(max_ptr, sum_ptr, base, live, stride_tile, first, n_tiles, CHUNK)
        top = tl.maximum(top, tl.max(more_m, axis=0))
        poisoned = poisoned | tl.max((more_s != more_s).to(tl.int32), axis=0)
    shift = tl.where(top == float("-inf"), 0.0, top)  # rows past T: exp(-inf - 0) = 0, not NaN
    total = fixed_point_sum(m, s, shift)
    for first in range(CHUNK, n_tiles, CHUNK):
        more_m, more_s = chunk_partials(max_ptr, sum_ptr, base, live, stride_tile, first, n_tiles, CHUNK)
        total += fixed_point_sum(more_m, more_s, shift)
    lse = top + tl.log(tl.maximum(total, 1).to(tl.float32) / FIXED_POINT)  # rows past T: 0
    return tl.where(poisoned != 0, float("nan"), lse)


@triton.jit(do_not_specialize=["T"])
def tile_merge_kernel(max_ptr, sum_ptr, lse_ptr, T, stride_row, stride_tile, n_tiles: tl.constexpr,
                      BLOCK: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """lse[T] from per-tile partials (row, tile) at ``row * stride_row + tile * stride_tile`` (``merge_tiles``)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < T
    lse = merge_tiles(max_ptr, sum_ptr, rows.to(tl.int64) * stride_row, live, stride_tile, n_tiles, CHUNK)
    tl.store(lse_ptr + rows, lse, mask=live)


@triton.jit(do_not_specialize=["T", "n_real"])
def whole_vocab_kernel(
    logits_ptr, target_ptr, max_ptr, sum_ptr, count_ptr, status_ptr, logp_ptr, lse_ptr, active_ptr, owner_ptr,
    T, n_real, stride_t, stride_row, stride_tile, n_tiles: tl.constexpr,
    ROWS: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr, CHUNK: tl.constexpr, IGNORE: tl.constexpr,
):  # fmt: skip
    """TP = 1 in one launch: logits[T, n_real] and targets[T] -> the tile partials (``store_tile_partials``, as
    ``tile_partials_kernel`` stores them), then, in the last program of each row block to finish its tiles,
    ``finish_rows`` on the block's rows: the bits of the partials-merge-finish path at every TP degree.

    ``count_ptr``: int32, one arrival count per row block, zero on entry and zero again on exit. A program counts
    its arrival once its partials are stored; the one that sees every other program of its row block arrived
    merges (``merge_tiles`` reads past L1, which another program's stores do not reach) and sets the count back to
    zero, so the same counts serve the next launch on the stream. ``status_ptr``: one int32 per row block."""
    block = tl.program_id(0)
    rows = block * ROWS + tl.arange(0, ROWS)
    store_tile_partials(
        logits_ptr, max_ptr, sum_ptr, rows, tl.program_id(1) * TILES, T, n_real, stride_t, n_tiles,
        stride_row, stride_tile, TILE, TILES,
    )  # fmt: skip
    tl.debug_barrier()  # every thread's partials are stored before the program's arrival is counted
    arrived = tl.atomic_add(count_ptr + block, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        tl.debug_barrier()
        finish_rows(
            logits_ptr, target_ptr, max_ptr, sum_ptr, status_ptr + block, logp_ptr, lse_ptr, active_ptr, owner_ptr,
            rows, T, n_real, stride_t, stride_row, stride_tile, n_tiles, CHUNK, IGNORE,
        )  # fmt: skip
        tl.atomic_xchg(count_ptr + block, 0, sem="relaxed", scope="gpu")  # every arrival is in: none races it


@triton.jit(do_not_specialize=["T", "n_real"])
def whole_vocab_finish_kernel(
    logits_ptr, target_ptr, max_ptr, sum_ptr, status_ptr, logp_ptr, lse_ptr, active_ptr, owner_ptr,
    T, n_real, stride_t, stride_row, stride_tile, n_tiles: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    IGNORE: tl.constexpr,
):  # fmt: skip
    """TP = 1 after ``tile_partials_kernel``: ``finish_rows`` on BLOCK rows per program, one status word each."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    finish_rows(
        logits_ptr, target_ptr, max_ptr, sum_ptr, status_ptr + tl.program_id(0), logp_ptr, lse_ptr, active_ptr,
        owner_ptr, rows, T, n_real, stride_t, stride_row, stride_tile, n_tiles, CHUNK, IGNORE,
    )  # fmt: skip


@triton.jit
def finish_rows(
    logits_ptr, target_ptr, max_ptr, sum_ptr, status_ptr, logp_ptr, lse_ptr, active_ptr, owner_ptr, rows,
    T, n_real, stride_t, stride_row, stride_tile, n_tiles: tl.constexpr, CHUNK: tl.constexpr, IGNORE: tl.constexpr,
):  # fmt: skip
    """The tile partials of logits[T, n_real] (as ``tile_merge_kernel`` reads them) and targets[T] -> for ``rows``:
    lse (``merge_tiles``), logp = logit[target] - lse (0 where the target is IGNORE), active and owner rank (0, or
    -1 where inactive). Stores the rows' status word at ``status_ptr``: bit 0 for a target outside [0, n_real)
    that is not IGNORE (read as inactive here), bit 1 for a non-finite lse or logp; the caller reads it to raise.
    The target logits are loaded first, so their latency runs beside the merge's."""
    live = rows < T
    target = tl.load(target_ptr + rows, mask=live, other=IGNORE)
    active = target != IGNORE
    valid = (target >= 0) & (target < n_real)
    x = tl.load(logits_ptr + rows.to(tl.int64) * stride_t + tl.where(valid, target, 0), mask=live & valid, other=0)
    lse = merge_tiles(max_ptr, sum_ptr, rows.to(tl.int64) * stride_row, live, stride_tile, n_tiles, CHUNK)
    logp = tl.where(active & valid, widen_to_fp32(x) - lse, 0.0)
    finite = (tl.abs(lse) < float("inf")) & (tl.abs(logp) < float("inf"))  # false for NaN too
    out_of_range = tl.max((live & active & ~valid).to(tl.int32), axis=0)
    tl.store(status_ptr, out_of_range | (2 * tl.max((live & ~finite).to(tl.int32), axis=0)))
    tl.store(lse_ptr + rows, lse, mask=live)
    tl.store(logp_ptr + rows, logp, mask=live)
    tl.store(active_ptr + rows, active.to(tl.uint8), mask=live)
    tl.store(owner_ptr + rows, tl.where(active, 0, -1).to(tl.int64), mask=live)


@triton.jit(do_not_specialize=["M", "n_real", "n_tiles"])
def fused_head_kernel(
    a_ptr, b_ptr, target_ptr, max_ptr, sum_ptr, logit_ptr, M, n_real, K: tl.constexpr,
    stride_am, stride_ak, stride_bn, stride_bk, n_tiles,
    BLOCK_M: tl.constexpr, TILE: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Per (row, vocab tile) of hidden[M, K] @ weight[n_real, K].T: the fp32 (max, sumexp) and the target logit.

    The logits never leave the program: each computes one BLOCK_M x TILE block of them in fp32, exactly as
    ``invariant_matmul_kernel`` does (one fixed tiling, K walked in order), reduces it to per-row partials of
    its tile, and writes the logit of a row's target if the target falls in its tile (``target_ptr`` holds
    the shard-local target, -1 where the shard does not own it). Columns past ``n_real`` are padding (-inf).
    """
    pid_m, tile = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), n_tiles, GROUP_M)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tile * TILE + tl.arange(0, TILE)).to(tl.int64)
    acc = tl.zeros((BLOCK_M, TILE), dtype=tl.float32)
    acc = ordered_dot(
        a_ptr, b_ptr, rm, rn, M, n_real, K, stride_am, stride_ak, stride_bn, stride_bk, acc,
        BLOCK_M, TILE, BLOCK_K, INTERPRETED,
    )  # fmt: skip
    tile_epilogue(acc, rm, rn, tile, M, n_real, n_tiles, target_ptr, max_ptr, sum_ptr, logit_ptr, TILE)


@triton.jit
def tile_epilogue(acc, rm, rn, tile, M, n_real, n_tiles, target_ptr, max_ptr, sum_ptr, logit_ptr, TILE: tl.constexpr):
    """One fused block's fp32 logits -> its rows' (max, sumexp) of the tile and, where a row's shard-local target
    falls in the tile, that logit (a copy, no arithmetic). Columns past ``n_real`` are padding (-inf)."""
    x = tl.where(rn[None, :] < n_real, acc, float("-inf"))
    m, s = tile_max_sumexp(x)
    live = rm < M
    tl.store(max_ptr + rm * n_tiles + tile, m, mask=live)
    tl.store(sum_ptr + rm * n_tiles + tile, s, mask=live)
    target = tl.load(target_ptr + rm, mask=live, other=-1)
    picked = tl.max(tl.where(rn[None, :] == target[:, None], x, float("-inf")), axis=1)
    mine = live & (target >= tile * TILE) & (target < tile * TILE + TILE)
    tl.store(logit_ptr + rm, picked, mask=mine)


@triton.jit
def tma_dot(a_desc, b_desc, acc, row0, col0, depth, BLOCK_K: tl.constexpr, A_BY_K: tl.constexpr,
            B_BY_K: tl.constexpr):  # fmt: skip
    """``acc`` + the fp32 block A[row0:, :depth] @ B[col0:, :depth].T of the descriptors' block shapes, K walked in
    order in BLOCK_K steps; past the edges TMA loads zero. A is a_desc's [M, K] (A_BY_K: its [K, M], transposed on
    load), B is b_desc's [N, K] (B_BY_K: its [K, N]). The one TMA main loop of the fused head, the backward's d
    logits and the matmul."""
    for k0 in range(0, depth, BLOCK_K):
        if A_BY_K:
            a = a_desc.load([k0, row0]).T
        else:
            a = a_desc.load([row0, k0])
        if B_BY_K:
            b = b_desc.load([k0, col0])
        else:
            b = b_desc.load([col0, k0]).T
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["M", "n_real", "n_tiles"])
def fused_head_tma_kernel(
    a_desc, b_desc, target_ptr, max_ptr, sum_ptr, logit_ptr, M, n_real, n_tiles, K: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,
):  # fmt: skip
    """``fused_head_kernel`` on a GPU with tensor-memory access: the same tiles, K order and epilogue, with
    the operands fetched by TMA descriptors (zero past the edges) and ``PROGRAMS`` persistent programs each
    walking tiles in launch order. Which program takes a tile never changes the tile's arithmetic."""
    grid_m = tl.cdiv(M, BLOCK_M)
    for pid in tl.range(tl.program_id(0), grid_m * n_tiles, PROGRAMS, flatten=True):
        pid_m, tile = grouped_tile(pid, grid_m, n_tiles, GROUP_M)
        acc = tl.zeros((BLOCK_M, TILE), dtype=tl.float32)
        acc = tma_dot(a_desc, b_desc, acc, pid_m * BLOCK_M, tile * TILE, K, BLOCK_K, False, False)
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (tile * TILE + tl.arange(0, TILE)).to(tl.int64)
        tile_epilogue(acc, rm, rn, tile, M, n_real, n_tiles, target_ptr, max_ptr, sum_ptr, logit_ptr, TILE)


@triton.jit
def gradient_epilogue(
    acc, rm, rn, M, n_real, lse_ptr, scale_ptr, g_target_ptr, target_ptr, out_ptr, stride_om,
    ROUND_LOGITS: tl.constexpr,
):  # fmt: skip
    """One block's fp32 logits -> d logits = scale * exp(x - lse) + [column = target] * g_target, stored in
    out's dtype (bf16 rounded to nearest even). ROUND_LOGITS: x is the logit as the forward stored it in bf16.

    ``target_ptr`` holds each row's chunk-local target column, -1 where the chunk does not hold it."""
    x = acc
    if ROUND_LOGITS:
        x = widen_to_fp32(round_to_bf16(acc))
    live = rm < M
    lse = tl.load(lse_ptr + rm, mask=live, other=0.0)
    scale = tl.load(scale_ptr + rm, mask=live, other=0.0)
    g_target = tl.load(g_target_ptr + rm, mask=live, other=0.0)
    target = tl.load(target_ptr + rm, mask=live, other=-1)
    d = scale[:, None] * tl.exp(x - lse[:, None])
    d = tl.where(rn[None, :] == target[:, None], d + g_target[:, None], d)
    store_rounded(out_ptr, d, rm, rn, M, n_real, stride_om, 1)


@triton.jit(do_not_specialize=["M", "n_real"])
def gradient_logits_kernel(
    a_ptr, b_ptr, lse_ptr, scale_ptr, g_target_ptr, target_ptr, out_ptr, M, n_real, K: tl.constexpr,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ROUND_LOGITS: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """d logits [M, n_real] of hidden[M, K] @ weight[n_real, K].T: the logits recomputed as
    ``invariant_matmul_kernel`` computes them (one fixed tiling, K in order), then ``gradient_epilogue``."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(n_real, BLOCK_N), GROUP_M)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = ordered_dot(
        a_ptr, b_ptr, rm, rn, M, n_real, K, stride_am, stride_ak, stride_bn, stride_bk, acc,
        BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETED,
    )  # fmt: skip
    gradient_epilogue(
        acc, rm, rn, M, n_real, lse_ptr, scale_ptr, g_target_ptr, target_ptr, out_ptr, stride_om, ROUND_LOGITS
    )


@triton.jit(do_not_specialize=["M", "n_real"])
def gradient_logits_tma_kernel(
    a_desc, b_desc, lse_ptr, scale_ptr, g_target_ptr, target_ptr, out_ptr, M, n_real, stride_om, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, ROUND_LOGITS: tl.constexpr,
):  # fmt: skip
    """``gradient_logits_kernel`` with its operands fetched by TMA descriptors and ``PROGRAMS`` persistent
    programs: the same tiles, K order and epilogue."""
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(n_real, BLOCK_N)
    for pid in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = grouped_tile(pid, grid_m, grid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = tma_dot(a_desc, b_desc, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, K, BLOCK_K, False, False)
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        gradient_epilogue(
            acc, rm, rn, M, n_real, lse_ptr, scale_ptr, g_target_ptr, target_ptr, out_ptr, stride_om, ROUND_LOGITS
        )


@triton.jit(do_not_specialize=["M", "N", "k_size"])
def tma_matmul_kernel(
    a_desc, b_desc, c_ptr, c_desc, M, N, k_size, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, A_BY_K: tl.constexpr, B_BY_K: tl.constexpr, ACCUMULATE: tl.constexpr,
    STORE_BY_TMA: tl.constexpr,
):  # fmt: skip
    """``invariant_matmul_kernel`` with TMA operands: c[M, N] (+)= A @ B, A and B as ``tma_dot`` reads them. One
    fixed tiling, K walked in order from ``acc`` = c (ACCUMULATE, c fp32) or zero; past the edges loads zero.
    PROGRAMS > 0: that many persistent programs walk the tiles in launch order; 0: one program per tile (the
    pipeline's buffers are then free for the epilogue). STORE_BY_TMA: the bf16 block goes out through ``c_desc``
    (the hardware clips it at the edges), not as masked stores. Which program takes a tile never changes the tile's
    arithmetic."""
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    if PROGRAMS > 0:
        for pid in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
            tma_matmul_tile(
                a_desc, b_desc, c_ptr, c_desc, pid, grid_m, grid_n, M, N, k_size, stride_cm, stride_cn,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, A_BY_K, B_BY_K, ACCUMULATE, STORE_BY_TMA,
            )  # fmt: skip
    else:
        tma_matmul_tile(
            a_desc, b_desc, c_ptr, c_desc, tl.program_id(0), grid_m, grid_n, M, N, k_size, stride_cm, stride_cn,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, A_BY_K, B_BY_K, ACCUMULATE, STORE_BY_TMA,
        )  # fmt: skip


@triton.jit
def tma_matmul_tile(
    a_desc, b_desc, c_ptr, c_desc, pid, grid_m, grid_n, M, N, k_size, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_BY_K: tl.constexpr, B_BY_K: tl.constexpr, ACCUMULATE: tl.constexpr, STORE_BY_TMA: tl.constexpr,
):  # fmt: skip
    """One output block of ``tma_matmul_kernel``."""
    pid_m, pid_n = grouped_tile(pid, grid_m, grid_n, GROUP_M)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = first_sum(c_ptr, rm, rn, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N, ACCUMULATE)
    acc = tma_dot(a_desc, b_desc, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, k_size, BLOCK_K, A_BY_K, B_BY_K)
    if STORE_BY_TMA:
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], round_to_bf16(acc))
    else:
        store_rounded(c_ptr, acc, rm, rn, M, N, stride_cm, stride_cn)
