"""The arithmetic between a whole model's modules, against what its architecture says (docs/whole_model.md#dataflow).

Module accuracy judges each module on the inputs it was given, so the glue between modules is in no module: the
residual adds, the hand-off of one module's output to the next, the MLP's gate times up, the final norm's output
becoming the body's. For model types whose decoder has the pre-norm residual form (``PRE_NORM_RESIDUAL``), every
token's rows recorded in a cell (``rlsweep.recording``) are checked against that form, edge by edge:

- a hand-off is bitwise: the next module's main input has the bits of the output (or input) it is said to take;
- a sum or product of two recorded tensors is within one rounding of its float64 value (``rounding_used``), and the
  query and key the attention function got are RoPE of the projections within the roundings RoPE takes
  (``rope_used``).

A dropped or scaled residual, a norm replaced or skipped, a layer run twice, gate and up swapped, RoPE skipped for
the keys or pairing other elements, hidden states scaled between the last norm and the head: each breaks an edge in
every cell where it acts, layout or not. The bounds are proven for torch's elementwise ops on any device: two values
of the dtype added or multiplied in fp32 (exact, or one fp32 rounding) and rounded once to the dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kernels.bitwise import bit_view
from kernels.rounding import SIGNIFICAND_BITS, half_ulp
from rlsweep.hf_model import BuiltModel
from rlsweep.model_judgments import DATAFLOW
from rlsweep.module_accuracy import op_class
from rlsweep.recording import MODULE_PREFIX, ModuleRecord
from rlsweep.verdicts import Judgment, Verdict

# transformers model types whose base model is: embed_tokens, then each layer x -> h = x + self_attn(
# input_layernorm(x)) -> h + mlp(post_attention_layernorm(h)), then norm (their modeling code in transformers 5)
PRE_NORM_RESIDUAL = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
GATED_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")  # a dense MLP's children, in that order
LAYER_CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
DOCS = "docs/whole_model.md#dataflow"


@dataclass(frozen=True)
class Edge:
    """One edge of the dataflow in one cell: ``what`` it says, the tokens it was checked on, how many broke it, the
    largest share of its bound any element used (a hand-off: 0 or inf), and why it could not be checked."""

    what: str
    tokens: int
    failing: int
    used: float
    why: str = ""

    @property
    def passed(self) -> bool:
        return not self.why and self.failing == 0


@dataclass(frozen=True)
class Port:
    """A module's main input ("input") or output ("output"), by path."""

    path: str
    part: str

    def __str__(self) -> str:
        return f"{self.path} {self.part}"


def rows_at(records: Mapping[str, ModuleRecord], port: Port) -> tuple[torch.Tensor, torch.Tensor] | str:
    """(tokens ascending, rows [tokens, ...] on the CPU) of ``port`` in a cell, or why there are none."""
    record = records.get(port.path)
    if record is None or not record.calls:
        return f"{port.path} never ran on a token of the workload"
    tokens, _, outputs = record.rows
    rows = outputs if port.part == "output" else record.main_input
    if rows is None:
        return f"{port} differs in shape or dtype between calls, or has no main input"
    return tokens, rows.cpu()


def paired(records: Mapping[str, ModuleRecord], *ports: Port) -> tuple[torch.Tensor, list[torch.Tensor]] | str:
    """The tokens every port holds (the same set, or why not) and each port's rows flattened [tokens, n]."""
    found = [rows_at(records, port) for port in ports]
    missing = [why for why in found if isinstance(why, str)]
    if missing:
        return missing[0]
    tokens = found[0][0]
    for port, (other, _) in zip(ports[1:], found[1:], strict=True):
        if not torch.equal(other, tokens):
            return f"{port} holds other tokens ({len(other)}) than {ports[0]} ({len(tokens)})"
    return tokens, [rows.reshape(len(tokens), -1) for _, rows in found]


def handoff(records: Mapping[str, ModuleRecord], source: Port, target: Port) -> Edge:
    """``target`` has the bits of ``source`` on every token."""
    what = f"{target} = {source}"
    found = rows_at(records, source)
    if isinstance(found, str):
        return Edge(what, 0, 0, math.inf, found)
    return rows_equal(what, *found, rows_at(records, target))


def one_rounding(records: Mapping[str, ModuleRecord], result: Port, sign: str, a: Port, b: Port) -> Edge:
    """``result`` is ``a`` ``sign`` ("+" or "*") ``b`` rounded once to its dtype, within ``rounding_used``."""
    what = f"{result} = {a} {sign} {b}"
    pair = paired(records, result, a, b)
    if isinstance(pair, str):
        return Edge(what, 0, 0, math.inf, pair)
    tokens, (r, x, y) = pair
    if not (r.shape == x.shape == y.shape) or r.dtype not in SIGNIFICAND_BITS:
        why = f"{result} is {r.dtype} {list(r.shape)} per token, {a} {list(x.shape)}, {b} {list(y.shape)}"
        return Edge(what, len(tokens), len(tokens), math.inf, why)
    exact = x.double() + y.double() if sign == "+" else x.double() * y.double()
    used = rounding_used(r, exact)
    failing = int((used > 1).any(dim=1).sum())
    return Edge(what, len(tokens), failing, float(used.max()) if used.numel() else 0.0)


def rounding(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The most one rounding to ``dtype`` moves a float64 value of ``magnitude``: half an ulp, plus half an fp32 ulp
    where the dtype is narrower (torch computes its elementwise ops on narrower dtypes in fp32, then rounds)."""
    magnitude = torch.nan_to_num(magnitude, posinf=0.0)
    bound = half_ulp(magnitude, dtype)
    if SIGNIFICAND_BITS[dtype] < SIGNIFICAND_BITS[torch.float32]:
        bound = bound + half_ulp(magnitude, torch.float32)
    return bound


def share_used(result: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """|result - exact| as a share of ``bound``; equal values (infinities, NaN for NaN) use 0, any other non-finite
    value inf."""
    value = result.double()
    used = (value - exact).abs() / bound
    same = (value == exact) | (value.isnan() & exact.isnan())
    return torch.where(same, 0.0, torch.where(used.isfinite(), used, math.inf))


def rounding_used(result: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|result - exact| as a share of one rounding to ``result``'s dtype (``rounding``)."""
    return share_used(result, exact, rounding(exact.abs(), result.dtype))


def embedding_edge(records: Mapping[str, ModuleRecord], embedding: torch.nn.Module, path: str,
                   token_ids: torch.Tensor) -> list[Edge]:  # fmt: skip
    """The embedding's input is the workload's ids of its tokens and its output their rows of its weight, bitwise."""
    record = records.get(path)
    first = f"{path} input = the workload's token ids"
    second = f"{path} output = {path}.weight[ids]"
    if record is None or not record.calls or record.main_input is None or record.rows[2] is None:
        why = f"{path} never ran on a token of the workload, or has no main input"
        return [Edge(first, 0, 0, math.inf, why), Edge(second, 0, 0, math.inf, why)]
    tokens, _, outputs = record.rows
    ids = record.main_input.cpu().reshape(len(tokens))
    differ = ids != token_ids[tokens]
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        looked_up = Edge(second, len(tokens), len(tokens), math.inf, f"{path} has no 2-D weight to look rows up in")
    else:
        rows = weight.detach()[ids.clamp(0, weight.shape[0] - 1).to(weight.device)].cpu()
        out = outputs.reshape(len(tokens), -1)
        if rows.shape != out.shape or rows.dtype != out.dtype:
            why = f"{path} gave {out.dtype} {list(out.shape)}, its weight's rows are {rows.dtype}"
            looked_up = Edge(second, len(tokens), len(tokens), math.inf, why)
        else:
            failing = int(((bit_view(rows) != bit_view(out)).any(dim=1) | differ).sum())
            looked_up = Edge(second, len(tokens), failing, math.inf if failing else 0.0)
    return [Edge(first, len(tokens), int(differ.sum()), math.inf if bool(differ.any()) else 0.0), looked_up]


def pre_norm_residual_edges(built: BuiltModel, records: Mapping[str, ModuleRecord],
                            token_ids: torch.Tensor) -> list[Edge]:  # fmt: skip
    """Every edge of the pre-norm residual form in one cell's records, in execution order."""
    modules = dict(built.body.named_modules(prefix=MODULE_PREFIX))
    layers = int(built.model.config.num_hidden_layers)
    edges: list[Edge] = []

    def is_norm(path: str) -> None:
        module = modules.get(path)
        if module is None or op_class(module) != "rmsnorm":
            kind = "missing" if module is None else f"a {type(module).__name__}"
            edges.append(Edge(f"{path} is an RMSNorm", 0, 0, math.inf, f"{path} is {kind}"))

    def inp(path: str) -> Port:
        return Port(path, "input")

    def out(path: str) -> Port:
        return Port(path, "output")

    embed = f"{MODULE_PREFIX}.embed_tokens"
    edges += embedding_edge(records, modules.get(embed), embed, token_ids)
    previous = out(embed)
    for index in range(layers):
        layer = f"{MODULE_PREFIX}.layers.{index}"
        norm1, attention, norm2, mlp = (f"{layer}.{child}" for child in LAYER_CHILDREN)
        is_norm(norm1)
        is_norm(norm2)
        edges += [
            handoff(records, previous, inp(layer)),
            handoff(records, inp(layer), inp(norm1)),
            handoff(records, out(norm1), inp(attention)),
        ]
        edges += attention_edges(records, modules, attention)
        edges += [
            one_rounding(records, inp(norm2), "+", inp(layer), out(attention)),
            handoff(records, out(norm2), inp(mlp)),
        ]
        if has_children(modules, mlp, *GATED_MLP):  # a dense gated MLP (an MoE block's are not)
            gate, up, down, act = (f"{mlp}.{child}" for child in GATED_MLP)
            edges += [
                handoff(records, inp(mlp), inp(gate)),
                handoff(records, inp(mlp), inp(up)),
                handoff(records, out(gate), inp(act)),
                one_rounding(records, inp(down), "*", out(act), out(up)),
                handoff(records, out(down), out(mlp)),
            ]
        edges.append(one_rounding(records, out(layer), "+", inp(norm2), out(mlp)))
        previous = out(layer)
    norm = f"{MODULE_PREFIX}.norm"
    is_norm(norm)
    edges += [handoff(records, previous, inp(norm)), handoff(records, out(norm), out(MODULE_PREFIX))]
    return edges


def has_children(modules: Mapping[str, torch.nn.Module], path: str, *children: str) -> bool:
    return all(f"{path}.{child}" in modules for child in children)


def attention_edges(records: Mapping[str, ModuleRecord], modules: Mapping[str, torch.nn.Module],
                    attention: str) -> list[Edge]:  # fmt: skip
    """An attention module's projections: each of q, k and v takes its input, its q_norm and k_norm (where it has
    them) take q's and k's outputs, and its output is o_proj's."""
    if not has_children(modules, attention, "q_proj", "k_proj", "v_proj", "o_proj"):
        return []
    given = Port(attention, "input")
    edges = [handoff(records, given, Port(f"{attention}.{p}", "input")) for p in ("q_proj", "k_proj", "v_proj")]
    for norm, projection in (("q_norm", "q_proj"), ("k_norm", "k_proj")):
        if has_children(modules, attention, norm):
            edges.append(handoff(records, Port(f"{attention}.{projection}", "output"),
                                 Port(f"{attention}.{norm}", "input")))  # fmt: skip
    edges += function_edges(records, modules, attention)
    edges.append(handoff(records, Port(f"{attention}.o_proj", "output"), Port(attention, "output")))
    return edges


def function_edges(records: Mapping[str, ModuleRecord], modules: Mapping[str, torch.nn.Module],
                   attention: str) -> list[Edge]:  # fmt: skip
    """What the attention function took and gave: its query and key are RoPE of the projections (after q_norm and
    k_norm, where the module has them) with the cos and sin the module was given, x * cos + rotate_half(x) * sin with
    each product and the sum rounded once to the dtype (``rope_used``); its value is v_proj's output and its output
    o_proj's input, bitwise. A rotation skipped, applied to one of the two or pairing other elements, a value or an
    output scaled: each breaks one."""
    record = records.get(attention)
    function = record.function if record is not None else None
    name = f"{attention} attention function"
    if function is None or not function.calls:
        why = f"{attention} called no attention function on a judged token"
        return [Edge(f"{name}'s {part}", 0, 0, math.inf, why) for part in ("query", "key", "value", "output")]
    tokens = function.rows[0]
    cos, sin = function.input_rows(3), function.input_rows(4)
    edges = []
    for index, part, projection, norm in ((0, "query", "q_proj", "q_norm"), (1, "key", "k_proj", "k_norm")):
        source = Port(f"{attention}.{norm if has_children(modules, attention, norm) else projection}", "output")
        what = f"{name}'s {part} = RoPE({source})"
        given, pre = function.input_rows(index), rows_at(records, source)
        if given is None or cos is None or sin is None or isinstance(pre, str):
            why = pre if isinstance(pre, str) else f"{attention} was given no RoPE cos and sin, or rows of other shapes"
            edges.append(Edge(what, 0, 0, math.inf, why))
            continue
        if not torch.equal(pre[0], tokens):
            edges.append(Edge(what, len(tokens), len(tokens), math.inf, f"{source} holds other tokens"))
            continue
        given, cosine, sine = given.cpu(), cos.cpu(), sin.cpu()
        x = pre[1].reshape(given.shape) if pre[1].numel() == given.numel() else None
        if x is None or cosine.shape[-1] != given.shape[-1] or given.dtype not in SIGNIFICAND_BITS:
            why = f"{source} is {list(pre[1].shape)} per token, the {part} {given.dtype} {list(given.shape)}"
            edges.append(Edge(what, len(tokens), len(tokens), math.inf, why))
            continue
        used = rope_used(given, x, cosine[:, None, :], sine[:, None, :])
        failing = int((used > 1).reshape(len(tokens), -1).any(dim=1).sum())
        edges.append(Edge(what, len(tokens), failing, float(used.max()) if used.numel() else 0.0))
    edges.append(rows_equal(f"{name}'s value = {attention}.v_proj output", tokens, function.input_rows(2),
                            rows_at(records, Port(f"{attention}.v_proj", "output"))))  # fmt: skip
    cache = record.cache
    what = f"{name}'s keys and values read back from its KV cache = those their tokens got"
    if cache.miscounted and getattr(modules.get(attention), "sliding_window", None) is None:
        edges.append(Edge(what, cache.compared, cache.compared, math.inf, cache.miscounted))
    elif cache.differing:
        why = f"{cache.differing} of {cache.compared} rows read back differ (first: logical token {cache.first})"
        edges.append(Edge(what, cache.compared, cache.differing, math.inf, why))
    else:
        edges.append(Edge(what, cache.compared, 0, 0.0))
    edges.append(rows_equal(f"{attention}.o_proj input = {name}'s output", tokens, function.rows[2],
                            rows_at(records, Port(f"{attention}.o_proj", "input"))))  # fmt: skip
    return edges


def rows_equal(what: str, tokens: torch.Tensor, rows: torch.Tensor | None,
               other: tuple[torch.Tensor, torch.Tensor] | str) -> Edge:  # fmt: skip
    """An edge whose two sides, ``rows`` at ``tokens`` and ``other`` (``rows_at``'s), hold the same bits per token."""
    if isinstance(other, str) or rows is None:
        return Edge(what, 0, 0, math.inf, other if isinstance(other, str) else "rows of other shapes between calls")
    if not torch.equal(other[0], tokens):
        return Edge(what, len(tokens), len(tokens), math.inf, f"the two sides hold other tokens ({len(other[0])})")
    a, b = rows.cpu().reshape(len(tokens), -1), other[1].reshape(len(tokens), -1)
    if a.shape != b.shape or a.dtype != b.dtype:
        why = f"{a.dtype} {list(a.shape)} per token against {b.dtype} {list(b.shape)}"
        return Edge(what, len(tokens), len(tokens), math.inf, why)
    failing = int((bit_view(a) != bit_view(b)).any(dim=1).sum())
    return Edge(what, len(tokens), failing, math.inf if failing else 0.0)


def rope_used(result: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """|result - (x cos + rotate_half(x) sin)| (float64, from the recorded values) as a share of three roundings to
    ``result``'s dtype: the two products and their sum, each at its own magnitude (``rounding``)."""
    half = x.shape[-1] // 2
    x64 = x.double()
    rotated = torch.cat([-x64[..., half:], x64[..., :half]], dim=-1)
    first, second = x64 * cos.double(), rotated * sin.double()
    exact = first + second
    products = rounding(first.abs(), result.dtype) + rounding(second.abs(), result.dtype)
    return share_used(result, exact, products + rounding(exact.abs() + products, result.dtype))


def dataflow_verdict(built: BuiltModel, records: Mapping[str, ModuleRecord], token_ids: torch.Tensor, cell: str,
                     roles: tuple[str, str]) -> Verdict:  # fmt: skip
    """module_accuracy of tensor ``dataflow`` in ``cell``: every edge of the model's dataflow held on every token the
    cell computed (``token_ids``: the workload's ids in logical order). A model type of another form is red: nothing
    was judged."""
    model_type = getattr(built.model.config, "model_type", None)
    if model_type not in PRE_NORM_RESIDUAL:
        return Verdict(Judgment.MODULE_ACCURACY, DATAFLOW, *roles, cell, cell, metric="bound_used", value=math.nan,
                       threshold=1.0, passed=False,
                       detail=f"model_type {model_type!r} has no dataflow described here: nothing was judged (the "
                              f"pre-norm residual form of {', '.join(PRE_NORM_RESIDUAL)}; {DOCS})")  # fmt: skip
    edges = pre_norm_residual_edges(built, records, token_ids)
    broken = [edge for edge in edges if not edge.passed]
    worst = max(edge.used for edge in edges)
    if broken:
        first = broken[0]
        about = first.why or f"{first.failing} of {first.tokens} tokens" + (
            "" if math.isinf(first.used) else f", {first.used:.3g} of its bound"
        )
        detail = f"{len(broken)} of {len(edges)} edges of the {model_type} dataflow broken; first {first.what}: {about}"
    else:
        detail = (
            f"all {len(edges)} edges of the {model_type} dataflow held on every token: hand-offs bitwise, sums and "
            f"products within one rounding, RoPE within its three (at most {worst:.6g} of a bound)"
        )
    return Verdict(Judgment.MODULE_ACCURACY, DATAFLOW, *roles, cell, cell, metric="bound_used", value=float(worst),
                   threshold=1.0, passed=not broken,
                   detail=f"{detail} ({DOCS})")  # fmt: skip
