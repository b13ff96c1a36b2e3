"""The invariant body's ops on plain tensors: linear, RMSNorm, SiLU and attention whose every output row has the same
bits whatever else the call holds and wherever the row sits in it (docs/kernels.md#the-invariant-body).

- linear: ``invariant_matmul`` (one tile configuration per device kind and dtype, K walked in order, no split-K);
- RMSNorm: one program per fixed block of rows, each row's sum of squares one fixed-shape reduction;
- SiLU: one code path for every element;
- attention: each query row reduces over its keys in fixed blocks of ``AttentionTiling.block_n`` keys counted from
  its sequence's first key, in order, with an online softmax; the tiles of query rows are cut within one sequence
  (one contiguous run of allowed keys per row, starting at the same key), so a packed row, a padded batch, a chunk
  against a KV cache and a decode step give a row the same blocks.

They run the Triton kernels of ``kernels.body_kernels``, compiled on CUDA and under the interpreter on the CPU. None
has a backward: asking for a gradient through one raises ``NoBackwardError``.
"""

from __future__ import annotations

import functools
import importlib
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType

import torch

from kernels.errors import DtypeMismatchError, KernelInputError, NoBackwardError, ShapeMismatchError
from kernels.launches import launch_triton
from kernels.triton_backend import INTERPRETER_FORWARD_TILING, MatmulTiling, invariant_matmul, load_kernels, triton_cdiv

BODY_KERNELS = "kernels.body_kernels"  # imported on first use: TRITON_INTERPRET is read at decoration
DTYPES = (torch.bfloat16, torch.float32)  # what the body's kernels take and give


@dataclass(frozen=True)
class AttentionTiling:
    """Query rows per tile and keys per block: per device kind, never a function of the call."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


CUDA_ATTENTION = AttentionTiling(64, 64, 4, 2)
INTERPRETER_ATTENTION = AttentionTiling(64, 64, 1, 1)  # the interpreter pays per program: every head in one
NORM_ROWS = {"cuda": 4, "cpu": 256}  # rows per RMSNorm program (the interpreter pays per program)
SILU_BLOCK = 1024
INTERPRETER_SILU_BLOCK = 16384
# The body's linear layers under the interpreter: 64 rows a block, as many columns as the layer has up to 256 (N is
# the layer's, never the call's), so a narrow projection does not compute the head's 512-wide blocks mostly masked.
# The whole depth in one K step where the block stays under INTERPRETER_BLOCK_NUMEL products (each K step costs the
# interpreter its loads, widenings and sum again, whatever the block's size).
INTERPRETER_LINEAR_ROWS = 32
INTERPRETER_LINEAR_COLUMNS = 256
INTERPRETER_BLOCK_NUMEL = 1 << 21


def interpreter_linear_tiling(columns: int, depth: int) -> MatmulTiling:
    """The tiling of a linear layer of ``columns`` outputs and ``depth`` inputs under the interpreter: a function of
    the layer, never of the call's rows."""
    width = min(INTERPRETER_LINEAR_COLUMNS, power_of_two(columns))
    step = min(power_of_two(depth), max(16, INTERPRETER_BLOCK_NUMEL // (INTERPRETER_LINEAR_ROWS * width)))
    return replace(INTERPRETER_FORWARD_TILING, block_m=INTERPRETER_LINEAR_ROWS, block_n=width, block_k=step)


@functools.cache
def body_kernels() -> ModuleType:
    return importlib.import_module(BODY_KERNELS)


def kernels_for(device: torch.device) -> tuple[ModuleType, bool]:
    """The body's kernels module and whether they run interpreted (``load_kernels`` says why they cannot run)."""
    _, interpreted = load_kernels(device)
    return body_kernels(), interpreted


class ForwardOnly(torch.autograd.Function):
    """An op of the invariant body inside an autograd graph: its forward, and a backward that refuses."""

    @staticmethod
    def forward(ctx, compute: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
        return compute(*tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        raise NoBackwardError(
            "the invariant body is forward-only: it has no backward (train with a stock body; docs/whole_model.md)"
        )


def forward_only(compute: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``compute(*tensors)``; where autograd would record it, a node whose backward refuses (``ForwardOnly``)."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        return ForwardOnly.apply(compute, *tensors)
    return compute(*tensors)


def power_of_two(n: int) -> int:
    """The least power of two >= n: a block that holds a whole row."""
    return 1 << max(0, (n - 1).bit_length())


def check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in DTYPES:
        raise DtypeMismatchError(f"{name} is {tensor.dtype}; the invariant body takes {[str(d) for d in DTYPES]}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias) through ``invariant_matmul``, in x's dtype, rounded once: with a bias
    the product stays fp32, the bias is added there (one elementwise fp32 add) and the sum is rounded."""
    check_dtype("linear input", x)
    if weight.dtype != x.dtype or x.shape[-1] != weight.shape[-1]:
        raise ShapeMismatchError(
            f"linear: input {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} do not combine"
        )

    def compute(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        tiling = interpreter_linear_tiling(*weight.shape)
        if bias is None:
            out = invariant_matmul(rows, weight.contiguous(), x.dtype, tiling)
        else:
            out = (invariant_matmul(rows, weight.contiguous(), torch.float32, tiling) + bias.float()).to(x.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    return forward_only(compute, x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * round(x / sqrt(mean(x^2) + eps)) over the last dim, in fp32, rounded as transformers' RMSNorm."""
    check_dtype("RMSNorm input", x)
    width = x.shape[-1]
    if weight.shape != (width,) or weight.dtype != x.dtype:
        raise ShapeMismatchError(f"RMSNorm: weight {tuple(weight.shape)} {weight.dtype} for input {tuple(x.shape)}")

    def compute(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        module, interpreted = kernels_for(x.device)
        rows = x.reshape(-1, width).contiguous()
        out = torch.empty_like(rows)
        block_rows = NORM_ROWS["cpu" if interpreted else "cuda"]
        launch_triton(module.rmsnorm_kernel, (triton_cdiv(rows.shape[0], block_rows),), rows, weight.contiguous(),
                      out, rows.shape[0], float(eps), rows.stride(0), out.stride(0), WIDTH=width,
                      BLOCK_ROWS=block_rows, BLOCK_W=power_of_two(width),
                      num_warps=1 if interpreted else 8)  # fmt: skip
        return out.reshape(x.shape)

    return forward_only(compute, x, weight)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) elementwise in fp32, rounded once to x's dtype."""
    check_dtype("SiLU input", x)

    def compute(x: torch.Tensor) -> torch.Tensor:
        module, interpreted = kernels_for(x.device)
        flat = x.contiguous().reshape(-1)
        out = torch.empty_like(flat)
        block = INTERPRETER_SILU_BLOCK if interpreted else SILU_BLOCK
        launch_triton(module.silu_kernel, (triton_cdiv(flat.numel(), block),), flat, out, flat.numel(), BLOCK=block,
                      num_warps=4)  # fmt: skip
        return out.reshape(x.shape)

    return forward_only(compute, x)


def key_ranges(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row of ``allowed`` [B, Q, K] (True: the row attends that key): its first allowed key and its last
    + 1, both 0 where it attends none. A row whose allowed keys are not one contiguous run is refused."""
    keys = allowed.shape[-1]
    count = allowed.sum(-1)
    first = allowed.to(torch.int8).argmax(-1)
    end = keys - allowed.flip(-1).to(torch.int8).argmax(-1)
    some = count > 0
    broken = some & (end - first != count)
    if bool(broken.any()):
        b, q = (int(i) for i in broken.nonzero()[0])
        raise KernelInputError(
            f"attention mask row (batch {b}, query {q}) allows {int(count[b, q])} keys that are not one contiguous "
            "run; the invariant body's attention takes one run of keys per query row (causal, padded, packed)"
        )
    zero = torch.zeros_like(first)
    return torch.where(some, first, zero), torch.where(some, end, zero)


def attention_tiles(first: torch.Tensor, end: torch.Tensor, block_m: int) -> torch.Tensor:
    """[tiles, 5] int32 (batch row, first query, rows, first key, last key + 1) of query rows [B, Q] with keys
    [first, end): consecutive rows of one batch row with the same first key (one sequence), cut every ``block_m``
    rows; rows with no key are in no tile (their output is 0)."""
    queries = first.shape[1]
    flat_first, flat_end = first.reshape(-1), end.reshape(-1)
    rows = (flat_end > flat_first).nonzero().squeeze(-1)
    if rows.numel() == 0:
        return torch.zeros((0, 5), dtype=torch.int32, device=first.device)
    b, q = rows // queries, rows % queries
    starts = flat_first[rows]
    new_run = torch.ones_like(rows, dtype=torch.bool)
    new_run[1:] = (b[1:] != b[:-1]) | (q[1:] != q[:-1] + 1) | (starts[1:] != starts[:-1])
    index = torch.arange(rows.numel(), device=rows.device)
    run_start = torch.cummax(torch.where(new_run, index, torch.zeros_like(index)), 0).values
    new_tile = (index - run_start) % block_m == 0
    tile = torch.cumsum(new_tile.to(torch.int64), 0) - 1
    count = int(tile[-1]) + 1
    size = torch.zeros(count, dtype=torch.int64, device=rows.device).index_add_(0, tile, torch.ones_like(tile))
    last = torch.zeros(count, dtype=torch.int64, device=rows.device).scatter_reduce_(0, tile, flat_end[rows], "amax")
    heads = new_tile.nonzero().squeeze(-1)
    return torch.stack([b[heads], q[heads], size, starts[heads], last], dim=1).to(torch.int32).contiguous()


@dataclass(frozen=True)
class TilePlan:
    """The query tiles of one mask (``attention_tiles``) and each row's key end, kept for the mask's next call."""

    mask: weakref.ref | None
    signature: tuple
    tiles: torch.Tensor
    key_end: torch.Tensor


# The last mask's plan: every layer of one forward gets the same mask object, so its tiles are worked out once a
# forward (finding them waits for the device twice), not once a layer.
LAST_PLAN: list[TilePlan | None] = [None]


def query_tiles(allowed: torch.Tensor | None, batch: int, queries: int, keys: int, device: torch.device,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(tiles, key_end [B, Q] int32) of ``attention``'s mask (None: causal), the last mask's kept while it is alive
    and unchanged (the same object, the same version)."""
    version = None if allowed is None else (allowed._version, tuple(allowed.shape), allowed.data_ptr())
    signature = (batch, queries, keys, str(device), block_m, version)
    plan = LAST_PLAN[0]
    if plan is not None and plan.signature == signature and (allowed is None or plan.mask() is allowed):
        return plan.tiles, plan.key_end
    if allowed is None:
        rows = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
        rows = rows.expand(batch, queries, keys)
    else:
        rows = allowed[..., :keys]
        if rows.shape[1] != 1 and not bool((rows == rows[:, :1]).all()):
            raise KernelInputError("attention mask differs between heads; the invariant body takes one mask per row")
        rows = rows[:, 0].expand(batch, queries, keys)
    first, end = key_ranges(rows)
    tiles, key_end = attention_tiles(first, end, block_m), end.to(torch.int32).contiguous()
    LAST_PLAN[0] = TilePlan(None if allowed is None else weakref.ref(allowed), signature, tiles, key_end)
    return tiles, key_end


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None,
              scaling: float, tiling: AttentionTiling | None = None) -> torch.Tensor:  # fmt: skip
    """softmax(scaling q k^T, over the allowed keys) v: query [B, Hq, Q, D], key and value [B, Hkv, K, D] (Hq a
    multiple of Hkv: grouped-query heads share a KV head), ``allowed`` [B, 1 or Hq, Q, K] bool (the same for every
    head) or None (causal: the last query sees every key). Returns [B, Q, Hq, D] in query's dtype (rows with no key:
    0). ``tiling``: the device kind's own (CUDA_ATTENTION, INTERPRETER_ATTENTION) unless given; a caller that
    chose it per call would give up the invariance."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        check_dtype(f"attention {name}", tensor)
        if tensor.dim() != 4:
            raise ShapeMismatchError(f"attention {name} {tuple(tensor.shape)}: [batch, heads, length, head_dim]")
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if key.shape != value.shape or key.shape[0] != batch or key.shape[3] != dim or heads % kv_heads:
        raise ShapeMismatchError(
            f"attention: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} do not combine"
        )
    if allowed is not None and (allowed.dtype != torch.bool or allowed.dim() != 4 or allowed.shape[2] != queries):
        raise ShapeMismatchError(f"attention mask {tuple(allowed.shape)} {allowed.dtype}: bool [B, 1, Q, K]")
    _, interpreted = kernels_for(query.device)
    chosen = tiling or (INTERPRETER_ATTENTION if interpreted else CUDA_ATTENTION)
    tiles, key_end = query_tiles(allowed, batch, queries, keys, query.device, chosen.block_m)

    def compute(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        module, _ = kernels_for(query.device)
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
        out = torch.zeros((batch, queries, heads, dim), dtype=query.dtype, device=query.device)
        common = (q, k, v, out, key_end, tiles, float(scaling) * math.log2(math.e),
                  q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                  v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                  key_end.stride(0))  # fmt: skip
        if interpreted:
            launch_triton(module.attention_heads_kernel, (tiles.shape[0],), *common, GROUPS=heads // kv_heads,
                          HEADS=heads, BLOCK_H=power_of_two(heads), HEAD_DIM=dim, BLOCK_D=power_of_two(dim),
                          BLOCK_M=chosen.block_m, BLOCK_N=chosen.block_n, num_warps=1)  # fmt: skip
        else:
            launch_triton(module.attention_kernel, (tiles.shape[0], heads), *common, GROUPS=heads // kv_heads,
                          HEAD_DIM=dim, BLOCK_D=power_of_two(dim), BLOCK_M=chosen.block_m, BLOCK_N=chosen.block_n,
                          num_warps=chosen.num_warps, num_stages=chosen.num_stages)  # fmt: skip
        return out

    return forward_only(compute, query, key, value)
