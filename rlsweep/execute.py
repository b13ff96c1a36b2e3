"""Kernel calls: each layout cell's calls through ``kernels.lm_head_logprob``, results in logical order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

import kernels
from rlsweep.arithmetic import ArithmeticCollector, KernelArithmetic
from rlsweep.errors import ConfigError
from rlsweep.layouts import NONE, Call, Cell, largest_calls, restore_logical_order
from rlsweep.spec import RunSpec
from rlsweep.synthetic import GENERATION_ROWS, normal_matrix_bytes
from rlsweep.tensor_files import bits_sha256
from rlsweep.workload import Workload, WorkloadShape

REFERENCE_BACKEND = "reference"
FLOAT64_BYTES = 8  # the reference and the target sampling compute in float64
FLOAT32_BYTES = 4  # the stock path upcasts logits to fp32 before its vocab reductions
WORKING_ARRAYS = 3  # a reduction over the vocab holds its input, x - max and exp(x - max) at once
RECORD_BYTES = 768  # per (cell, token): results, then the tokens table as Python lists and Arrow (measured ~650 on CPU)
GRAD_RECORD_BYTES = 320  # grad=true, per (cell, token): the tokens table's gradient columns (measured ~300 on CPU)
INT32_BYTES = 4
# kernels.gradient_bound's float64 working set besides its outputs, in arrays of [V, H] and of [rows, V]. Measured
# peaks on CPU (commit f036513), outputs included: 73 bytes per weight element in one call and 87 in 4 or 16 calls
# (V = 32768, H = 1024, T = 64), 140 per logit (V = 512, H = 64, T = 16000).
GRADIENT_BOUND_ARRAYS = {"weight": 10, "logits": 20}
RUNTIME_BYTES = 256 << 20  # code and buffers loaded on first use (measured on CPU: 70 MiB aten, 140 MiB Triton)
MIB, GIB = 1 << 20, 1 << 30


# hidden[T, H], weight[V, H], targets[T] (and keep_logits=, nonfinite=) -> LogprobResult: a dispatched op, or the
# reference call.
LogprobCall = Callable[..., kernels.LogprobResult]


@dataclass(frozen=True)
class CellResult:
    """One cell's outputs restored to logical order: logp/lse [T] (CPU), owner_rank [T], per-call provenance;
    with an upstream gradient, d hidden [T, H] (fp32, CPU), d weight [V, H] summed over the calls (fp32, CPU; the
    run drops it once judged) and the sha256 of that d weight's bits (``bits_sha256``), which the run keeps."""

    cell: Cell
    logp: torch.Tensor
    lse: torch.Tensor
    owner_rank: torch.Tensor
    provenance: tuple[kernels.Provenance, ...]
    grad_hidden: torch.Tensor | None = None
    grad_weight: torch.Tensor | None = None
    grad_weight_bits: str | None = None
    stray_grad_rows: int = 0  # pad and filler rows of its calls whose d hidden is not 0 (their upstream is 0)
    arithmetic: KernelArithmetic | None = None  # the kernel_* comparands, where the contract judges them


@dataclass(frozen=True)
class Filler:
    """Unrelated rows for needle calls: hidden [F, H] and targets [F]."""

    hidden: torch.Tensor
    targets: torch.Tensor


def call_inputs(call: Call, workload: Workload, filler: Filler) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [rows, H] and targets [rows] of one call; pad rows are zero with IGNORE_INDEX targets."""
    device = workload.hidden.device
    hidden = workload.hidden.new_zeros((call.rows, workload.hidden.shape[1]))
    targets = torch.full((call.rows,), kernels.IGNORE_INDEX, dtype=torch.int64, device=device)
    logical = (call.logical != NONE).to(device)
    hidden[logical] = workload.hidden[call.logical[call.logical != NONE].to(device)]
    targets[logical] = workload.targets[call.logical[call.logical != NONE].to(device)]
    from_filler = (call.filler != NONE).to(device)
    if bool(from_filler.any()):
        index = call.filler[call.filler != NONE].to(device)
        hidden[from_filler] = filler.hidden[index]
        targets[from_filler] = filler.targets[index]
    return hidden, targets


def run_cell(
    cell: Cell,
    workload: Workload,
    weight: torch.Tensor,
    filler: Filler,
    compute: LogprobCall,
    upstream: torch.Tensor | None = None,
    arithmetic: ArithmeticCollector | None = None,
) -> CellResult:
    """Every call of the cell, then logical order; kernels' typed errors propagate unchanged, but a NaN or Inf that
    a backend computed from finite inputs is returned, for the verdicts to judge (``nonfinite="return"``).

    ``upstream`` [T]: differentiate sum(upstream * logp) too; pad and filler rows get 0, so only the logical
    tokens' own gradients reach d weight. ``arithmetic``: gathers each call's kernel_* comparands from the logits
    the call stored (``keep_logits``).
    """
    options = {"keep_logits": arithmetic is not None, "nonfinite": "return"}
    logps, lses, owners, provenance, hidden_grads = [], [], [], [], []
    weight_grad, stray = None, 0
    for call in cell.calls:
        hidden, targets = call_inputs(call, workload, filler)
        if upstream is None:
            result = compute(hidden, weight, targets, **options)
        else:
            hidden = hidden.detach().requires_grad_(True)
            leaf = weight.detach().requires_grad_(True)
            result = compute(hidden, leaf, targets, **options)
            logical = call.logical != NONE
            g = torch.zeros(call.rows, dtype=torch.float32)
            g[logical] = upstream[call.logical[logical]]
            (result.logp * g.to(result.logp.device)).sum().backward()
            hidden_grads.append(hidden.grad.float().cpu())
            # Pad and filler rows send no gradient back, so theirs must be 0 (NaN too is not): restore_logical_order
            # drops them, and a backward that wrote into another sample's row of the batch would pass unseen.
            stray += int((hidden_grads[-1][~logical] != 0).any(dim=1).sum())
            grad = leaf.grad.float()
            weight_grad = grad if weight_grad is None else weight_grad + grad  # calls in order
        if arithmetic is not None:
            arithmetic.add(call, hidden.detach(), targets, result.logits)
        logps.append(result.logp.detach().cpu())
        lses.append(result.lse.detach().cpu())
        owners.append(result.owner_rank.cpu())
        provenance.append(result.provenance)
    total = workload.num_tokens
    weight_grad = None if weight_grad is None else weight_grad.cpu()
    return CellResult(
        cell=cell,
        logp=restore_logical_order(cell, logps, total),
        lse=restore_logical_order(cell, lses, total),
        owner_rank=restore_logical_order(cell, owners, total),
        provenance=tuple(provenance),
        grad_hidden=restore_logical_order(cell, hidden_grads, total) if upstream is not None else None,
        grad_weight=weight_grad,
        grad_weight_bits=None if weight_grad is None else bits_sha256(weight_grad),
        stray_grad_rows=stray,
        arithmetic=None if arithmetic is None else arithmetic.finish(),
    )


def run_reference(
    canonical: Cell, workload: Workload, weight: torch.Tensor, filler: Filler, vocab_tile: int
) -> CellResult:
    """The float64 gold, once per run, on the canonical cell at tp=1."""
    reference = partial(kernels.lm_head_logprob, backend=REFERENCE_BACKEND, vocab_tile=vocab_tile)
    return run_cell(canonical, workload, weight, filler, reference)


@dataclass(frozen=True)
class Footprint:
    """A run's estimated peak bytes on its device, term by term (``peak_bytes`` says what each counts)."""

    resident: dict[str, int]  # held for the whole run
    phases: dict[str, int]  # held one at a time: only the largest adds to the peak
    sizes: dict[str, int]  # the sizes the estimate was made from

    @property
    def peak(self) -> int:
        return sum(self.resident.values()) + max(self.phases.values(), default=0)

    def describe(self) -> str:
        largest = max(self.phases, key=self.phases.__getitem__)
        terms = [*self.resident.items(), (f"largest phase, {largest}", self.phases[largest])]
        return " + ".join(f"{name} {size_text(size)}" for name, size in terms)


def size_text(size: int) -> str:
    return f"{size / GIB:,.1f} GiB" if size >= GIB else f"{size / MIB:,.1f} MiB"


def peak_bytes(spec: RunSpec, shape: WorkloadShape) -> Footprint:
    """Peak bytes a run allocates on its device: what it holds throughout plus its largest phase.

    With V = vocab_size, H = hidden_size, e = the execution dtype's bytes, T tokens (A active), F needle filler
    rows, R the rows of the largest kernel call of any cell (``largest_calls``), V_pad the vocab padded for tp
    in tiles of vocab_tile and C the number of cells, it counts:

    - held throughout: RUNTIME_BYTES of code and buffers loaded on first use; the weight V*H*e (twice under
      tp_mode=distributed: the ranks hold their own copy); hidden states (T + F)*H*e; C*T*RECORD_BYTES for
      the results and the tokens table;
    - synthetic weight generation: the row blocks before their concatenation (V*H*e) and the counter
      arithmetic of one block (``normal_matrix_bytes``);
    - synthetic hidden states: the counter arithmetic of T (or F filler) rows at once;
    - target sampling (synthetic workloads): float64 copies of the weight and of the A active hidden rows, and
      float64 logits, softmax and CDF [A, V];
    - the float64 reference (the canonical call, tp=1): float64 copies of the weight and hidden, the call's
      input T*H*e, and float64 logits [T, V] with two working arrays of that size (x - max, exp);
    - the largest kernel call: its input R*H*e, every rank's logits [R, V] in the execution dtype, three fp32
      working arrays [R, V] (upcast, x - max, exp: the stock path's need, above Triton's) and the fp32
      per-tile partials (max, sum) [R, V_pad / vocab_tile];
    - with grad=true, held from ``kernels.gradient_bound`` on: the float64 gold d hidden and d weight and their
      bounds, 2*(V + T)*H*8; every cell's fp32 d hidden, C*T*H*4; C*T*GRAD_RECORD_BYTES for the tokens table's
      gradient columns. No cell's d weight is held: each is judged when its cell ends and dropped, its digest kept;
    - with grad=true, the phases: ``kernels.gradient_bound`` (float64 arrays [V, H] and [T, V] besides its
      outputs, GRADIENT_BOUND_ARRAYS), counted as a cell of several calls needs it: a bound of its own, with its
      outputs and the cell's fp32 d weight held beside the run's; a call's backward (its d weight in the execution
      dtype and in fp32, the previous call's fp32 copy and the cell's running fp32 sum, 3*4 + e bytes per weight
      element, and the call's d hidden); judging a cell's d weight (the cell's own bound, its fp32 sum, a float64
      copy, three float64 comparison arrays and two int32 index arrays, all [V, H]).

    Not counted: reading a weight or replay file (as stored, then cast; the reference phase is larger unless
    the file is float64 and pads its vocab), copies a CUDA run keeps on the host (the target CDF, the
    tables), CUDA's caching allocator and library workspaces. Ranks of tp_mode=distributed on other GPUs
    than the run's are counted as if on it. tests/test_input_bounds.py checks it against a CPU run's peak RSS.
    """
    model, layout, tp_mode = spec.model, spec.layout, spec.tp_mode
    synthetic_workload = spec.workload.source == "synthetic"
    vocab, hidden, itemsize = model.vocab_size, model.hidden_size, spec.profile.dtype.itemsize
    tokens, active = shape.num_tokens, shape.num_active
    calls = largest_calls(layout, shape)
    widest = max(calls, key=calls.__getitem__)
    rows, filler = calls[widest], layout.filler_rows
    padded, vocab_tile = spec.sharding.padded_vocab_size, spec.sharding.vocab_tile
    weight = vocab * hidden * itemsize
    weight64 = vocab * hidden * FLOAT64_BYTES
    resident = {
        "runtime": RUNTIME_BYTES,
        "weight": weight * (2 if tp_mode == "distributed" else 1),
        "hidden states": (tokens + filler) * hidden * itemsize,
        "results and tables": len(calls) * tokens * RECORD_BYTES,
    }
    phases = {
        "float64 reference": weight64
        + tokens * hidden * (FLOAT64_BYTES + itemsize)
        + WORKING_ARRAYS * tokens * vocab * FLOAT64_BYTES,
        f"kernel call of {rows} rows ({widest})": rows * hidden * itemsize
        + rows * vocab * (itemsize + WORKING_ARRAYS * FLOAT32_BYTES)
        + rows * padded // vocab_tile * 2 * FLOAT32_BYTES,
        "hidden state generation": normal_matrix_bytes(max(tokens if synthetic_workload else 0, filler), hidden),
    }
    if model.weights.kind == "synthetic":
        phases["weight generation"] = weight + normal_matrix_bytes(min(GENERATION_ROWS, vocab), hidden)
    if spec.grad:
        gold = 2 * (weight64 + tokens * hidden * FLOAT64_BYTES)  # float64 d hidden, d weight and their bounds
        resident["float64 gradients and bounds"] = gold
        resident["every cell's d hidden and gradient columns"] = (
            len(calls) * tokens * (hidden * FLOAT32_BYTES + GRAD_RECORD_BYTES)
        )
        # Its working arrays [rows, V] are for a chunk of rows, up to all T.
        phases["a cell's own gradient bound"] = (
            gold
            + vocab * hidden * FLOAT32_BYTES
            + GRADIENT_BOUND_ARRAYS["weight"] * weight64
            + tokens * hidden * FLOAT64_BYTES
            + GRADIENT_BOUND_ARRAYS["logits"] * tokens * vocab * FLOAT64_BYTES
        )
        phases[f"backward of the call of {rows} rows"] = (
            vocab * hidden * (3 * FLOAT32_BYTES + itemsize) + rows * hidden * 2 * FLOAT32_BYTES
        )
        phases["judging a cell's d weight"] = gold + vocab * hidden * (
            FLOAT32_BYTES + 4 * FLOAT64_BYTES + 2 * INT32_BYTES
        )
    if synthetic_workload:
        phases["target sampling"] = (
            weight64 + active * hidden * FLOAT64_BYTES + WORKING_ARRAYS * active * vocab * FLOAT64_BYTES
        )
    sizes = {
        "hidden_size": hidden,
        "vocab_size": vocab,
        "tokens": tokens,
        "largest_call_rows": rows,
        "filler_rows": filler,
        "tp": spec.tp,
    }
    return Footprint(resident, phases, sizes)


def check_fits(footprint: Footprint, device: str, available: tuple[int, str] | None) -> None:
    """Refuse a run whose estimated peak exceeds the memory ``available`` on ``device`` (None: unknown, pass)."""
    if available is None or footprint.peak <= available[0]:
        return
    free, source = available
    sizes = " ".join(f"{name}={value}" for name, value in footprint.sizes.items())
    raise ConfigError(
        f"this run needs about {size_text(footprint.peak)} on {device} ({footprint.describe()}) but only "
        f"{size_text(free)} is available ({source}); sizes: {sizes}; make the model, workload or needles smaller"
    )
