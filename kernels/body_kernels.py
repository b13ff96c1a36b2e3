"""Triton kernels of the invariant whole-model body: RMSNorm, SiLU and attention whose arithmetic per row never
depends on the call's row count, on a row's place in the call, or on what else is in the batch (docs/kernels.md#the-
invariant-body). The body's matmuls are ``invariant_matmul_kernel`` (``kernels.triton_kernels``).

Imported lazily by ``kernels.body``: Triton decides at decoration time whether a kernel runs compiled (CUDA) or in
its CPU interpreter, so ``TRITON_INTERPRET`` must be set before this module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_kernels import LOG2E, round_to_bf16, widen_to_fp32


@triton.jit
def store_as(ptr, values, mask):
    """Store fp32 ``values`` in ``ptr``'s dtype: bf16 rounded to nearest even (``round_to_bf16``), fp32 as it is."""
    if ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr, round_to_bf16(values), mask=mask)
    else:
        tl.store(ptr, values, mask=mask)


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, out_ptr, rows, eps, stride_x, stride_out, WIDTH: tl.constexpr,
                   BLOCK_ROWS: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    """out = w * round(x * rsqrt(mean(x^2) + eps)), each row's mean one fixed-shape fp32 sum over BLOCK_W lanes (the
    lanes past WIDTH zero), as transformers' RMSNorm rounds: the normalised row to x's dtype, then times the weight."""
    rm = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    rw = tl.arange(0, BLOCK_W)
    live = (rm[:, None] < rows) & (rw[None, :] < WIDTH)
    x = widen_to_fp32(tl.load(x_ptr + rm[:, None] * stride_x + rw[None, :], mask=live, other=0.0))
    variance = tl.sum(x * x, axis=1) / WIDTH
    normed = x * (1.0 / tl.sqrt(variance + eps))[:, None]
    if x_ptr.dtype.element_ty == tl.bfloat16:
        normed = widen_to_fp32(round_to_bf16(normed))
    w = widen_to_fp32(tl.load(w_ptr + rw, mask=rw < WIDTH, other=0.0))
    store_as(out_ptr + rm[:, None] * stride_out + rw[None, :], w[None, :] * normed, live)


@triton.jit
def silu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = x / (1 + exp(-x)) elementwise in fp32, rounded once to out's dtype: one code path for every element."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offsets < n
    x = widen_to_fp32(tl.load(x_ptr + offsets, mask=live, other=0.0))
    store_as(out_ptr + offsets, x / (1.0 + tl.math.exp2(-x * LOG2E)), live)


@triton.jit(do_not_specialize=["scale_log2"])
def attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, key_end_ptr, tile_ptr, scale_log2,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_om, stride_oh, stride_eb,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Compiled (CUDA): one tile of query rows of one sequence (tile_ptr: batch row, first query, rows, the
    sequence's first key and the tile's last key + 1) for one query head, the products on the tensor cores (tl.dot;
    the probabilities rounded to the values' dtype before p v, as flash attention does): each row attends keys
    [first key, its own end) of its KV head, in BLOCK_N blocks counted from the sequence's first key, in order, with
    an online softmax in fp32.

    A row's blocks, and each block's arithmetic, are the same whatever tile it is in: a block past the row's end
    leaves its running max, sum and output bitwise as they were (its scores are -inf: exp gives 0, the rescale 1)."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.load(tile_ptr + tile * 5).to(tl.int64)
    first_query = tl.load(tile_ptr + tile * 5 + 1)
    rows = tl.load(tile_ptr + tile * 5 + 2)
    first_key = tl.load(tile_ptr + tile * 5 + 3)
    last_key = tl.load(tile_ptr + tile * 5 + 4)
    kv_head = head // GROUPS
    rm = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    query = (first_query + rm).to(tl.int64)
    live = rm < rows
    q = tl.load(
        q_ptr + batch * stride_qb + head * stride_qh + query[:, None] * stride_qm + rd[None, :],
        mask=live[:, None] & (rd[None, :] < HEAD_DIM),
        other=0.0,
    )
    key_end = tl.load(key_end_ptr + batch * stride_eb + query, mask=live, other=0)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    start = first_key
    while start < last_key:
        rn = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
        in_tile = rn < last_key
        k = tl.load(k_base + rn[None, :] * stride_kn + rd[:, None], mask=in_tile[None, :] & (rd[:, None] < HEAD_DIM),
                    other=0.0)  # fmt: skip
        scores = tl.dot(q, k, input_precision="ieee") * scale_log2
        scores = tl.where(rn[None, :] < key_end[:, None], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.math.exp2(m - shift)
        p = tl.math.exp2(scores - shift[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        v = tl.load(v_base + rn[:, None] * stride_vn + rd[None, :], mask=in_tile[:, None] & (rd[None, :] < HEAD_DIM),
                    other=0.0)  # fmt: skip
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
        start += BLOCK_N
    out = acc / total[:, None]
    store_as(o_ptr + batch * stride_ob + query[:, None] * stride_om + head * stride_oh + rd[None, :], out,
             live[:, None] & (rd[None, :] < HEAD_DIM))  # fmt: skip


@triton.jit(do_not_specialize=["scale_log2"])
def attention_heads_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, key_end_ptr, tile_ptr, scale_log2,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_om, stride_oh, stride_eb,
    GROUPS: tl.constexpr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``attention_kernel`` for the interpreter, which pays per program and per operation, not per element: one
    program takes a tile's rows for every query head at once ([heads, rows, keys] blocks), each product summed over
    the head dim as a broadcast product (as ``kernels.triton_kernels.ordered_dot`` does under the interpreter). The
    same blocks and order per row as ``attention_kernel``."""
    tile = tl.program_id(0)
    batch = tl.load(tile_ptr + tile * 5).to(tl.int64)
    first_query = tl.load(tile_ptr + tile * 5 + 1)
    rows = tl.load(tile_ptr + tile * 5 + 2)
    first_key = tl.load(tile_ptr + tile * 5 + 3)
    last_key = tl.load(tile_ptr + tile * 5 + 4)
    rh = tl.arange(0, BLOCK_H)
    rm = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    query = (first_query + rm).to(tl.int64)
    live = (rh[:, None, None] < HEADS) & (rm[None, :, None] < rows) & (rd[None, None, :] < HEAD_DIM)
    q = widen_to_fp32(tl.load(
        q_ptr + batch * stride_qb + rh[:, None, None] * stride_qh + query[None, :, None] * stride_qm
        + rd[None, None, :], mask=live, other=0.0,
    ))  # fmt: skip
    key_end = tl.load(key_end_ptr + batch * stride_eb + query, mask=rm < rows, other=0)
    kv_head = (rh // GROUPS).to(tl.int64)
    heads = rh[:, None, None] < HEADS
    dims = rd[None, None, :] < HEAD_DIM
    m = tl.full((BLOCK_H, BLOCK_M), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_H, BLOCK_M), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_M, BLOCK_D), dtype=tl.float32)
    start = first_key
    while start < last_key:
        rn = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
        in_tile = rn < last_key
        k = widen_to_fp32(tl.load(
            k_ptr + batch * stride_kb + kv_head[:, None, None] * stride_kh + rn[None, :, None] * stride_kn
            + rd[None, None, :], mask=heads & in_tile[None, :, None] & dims, other=0.0,
        ))  # fmt: skip
        scores = tl.sum(q[:, :, None, :] * k[:, None, :, :], axis=3) * scale_log2
        scores = tl.where(rn[None, None, :] < key_end[None, :, None], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=2))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.math.exp2(m - shift)
        p = tl.math.exp2(scores - shift[:, :, None])
        total = total * rescale + tl.sum(p, axis=2)
        v = widen_to_fp32(tl.load(
            v_ptr + batch * stride_vb + kv_head[:, None, None] * stride_vh + rn[None, :, None] * stride_vn
            + rd[None, None, :], mask=heads & in_tile[None, :, None] & dims, other=0.0,
        ))  # fmt: skip
        acc = acc * rescale[:, :, None] + tl.sum(p[:, :, :, None] * v[:, None, :, :], axis=2)
        m = m_new
        start += BLOCK_N
    out = acc / total[:, :, None]
    store_as(o_ptr + batch * stride_ob + query[None, :, None] * stride_om + rh[:, None, None] * stride_oh
             + rd[None, None, :], out, live)  # fmt: skip
