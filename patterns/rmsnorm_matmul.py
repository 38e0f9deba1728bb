"""RMSNorm (op or decomposed) -> every Linear on its output  =>  fuser.RmsNormMatMul.

Math. Over the last axis of x (D elements), with no centering:
    ms = mean(x^2),  N = x / sqrt(ms + eps) * gamma
and each Linear reading N is  Y_i = N @ W_i (+ b_i).  The fused op computes N once and every Y_i
from it (the QKV projections, gate/up), so N need not round-trip through memory; N is output too
when something else reads it (a residual Add, an unfused MatMul); a `Shape` reading N is
re-pointed to x.

Matched:
- `SimplifiedLayerNormalization` (onnxruntime's contrib op; onnxruntime serves it in the ONNX
  domain, where its transformer optimizer writes it and `fuser.checkview` lets onnx's tools
  check and type it; "com.microsoft" is accepted as well) and `RMSNormalization` (opset 23):
  epsilon and stash_type as read, axis must be the last.  onnxruntime computes both in
  float32 and applies gamma before rounding once: `round_before_scale=0` (measured on this
  machine: bit-equal in float16).  A float16 op with stash_type=0 is refused (onnxruntime's
  rounding there is not modeled).
- Decomposed, as exporters write it (transformers' Llama/Qwen/Mistral/T5 RMSNorm):
      ms = ReduceMean(Pow(x, 2) | Mul(x, x));  r = Sqrt(Add(ms, eps))
      N  = Mul(x, Reciprocal(r)) | Mul(x, Div(1, r)) | Div(x, r)      (Mul in either order)
      N  = Mul(N, gamma)                                   (optional, either operand order)
  axes as attribute (opset < 18) or input (opset 18+); no-op Casts are looked through. The
  float16 form `x32 = Cast(x, float32) ... Cast(N, float16)` then `* gamma` in float16 gets
  stash_type=1 (statistics in float32, exactly as the graph computes them) and
  round_before_scale=1 (N rounded to float16 before gamma, as the Cast then Mul round).
  Without Casts the statistics are in the input dtype (stash_type=0).
- Consumers of N: MatMul(N, W) (+ Add row bias), Gemm, Reshape(N, [-1, D]) -> Gemm/MatMul
  (`patterns/_linear.py`); all Linears of one N go into one fused node, one output each. As
  for LayerNorm, a Cast of N to a narrower float type is looked through (autocast's RMSNorm in
  float32 -> Cast(float16) -> MatMuls, one Cast per Linear or one for all): the Linears then
  run in that type (`matmul_type`), N and its statistics stay in X's.

Every constant that carries meaning is checked exactly, never with a tolerance: exponent exactly
2, ReduceMean keepdims=1 over the last axis only, epsilon a one-element constant kept as read
(a float64 epsilon must be exact in float32), the numerator of `Div(1, r)` exactly 1, gamma
broadcasting along the last axis only. A mean square read outside the chain (or a graph output)
is an internal value with an outside reader: the matcher refuses that with its reason. A failed
check is a near miss only when a Linear reads N (an RMSNorm without a Linear is not this
pattern).

The reference divides as `x * (1 / r)`; the `Div(x, r)` form differs from that by at most one
unit in the last place of the statistics dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from fuser.bodies import rmsnorm_matmul as rmsnorm_matmul_body
from fuser.fusedop import Attr, FusedOp, Param, TensorInfo
from fuser.graph import GraphIndex
from fuser.matcher import type_name
from fuser.pattern import Match, Rejection, rejection

from ._linear import Readers, classify
from ._linear_op import (
    EXACT_EPSILON,
    MATMUL_TYPE,
    NORM_TYPES,
    apply_linears,
    epsilon_value,
    linear_outputs,
    linear_weights,
)
from ._walk import (
    Epsilon,
    NearMiss,
    attr,
    const,
    epsilon,
    follow,
    is_cast_to,
    is_noop_cast,
    last_axis_problem,
    only_reader,
    operand_const,
    rank,
    readers_of,
    reduce_axes,
    scalar,
)

NAME = "rmsnorm_matmul"
PRIORITY = 20
WEIGHTS_AT = 2  # position of W_0 among the fused op's inputs


# -- the fused op ------------------------------------------------------------------------------


def weights(inputs: Sequence[Any], attrs: Mapping[str, Any]) -> list[tuple[Any, Any, bool]]:
    """(W_i, b_i or None, flatten_i) per Linear, unpacked from the variadic inputs."""
    return linear_weights(inputs, attrs, WEIGHTS_AT)


def _infer(
    inputs: Sequence[TensorInfo | None], attrs: Mapping[str, Any]
) -> list[TensorInfo | None]:
    return linear_outputs(inputs, attrs, WEIGHTS_AT)


def rms_norm(
    x: np.ndarray,
    scale: np.ndarray | None,
    epsilon: float,
    stash_type: int,
    round_before_scale: int,
) -> np.ndarray:
    """RMSNorm over the last axis: statistics in float32 at least (stash_type=1) or in the input
    dtype (0); gamma applied to N rounded to the input dtype (round_before_scale=1, the
    decomposed Cast-then-Mul) or in the statistics dtype, rounded once (0, the ops)."""
    dtype = x.dtype
    stats = np.promote_types(dtype, np.float32) if stash_type == 1 else dtype
    xs = x.astype(stats)
    with np.errstate(over="ignore"):  # float16 statistics overflow as the original's do
        ms = (xs * xs).mean(axis=-1, keepdims=True).astype(stats)
    with np.errstate(divide="ignore"):  # epsilon 0 on a zero row: inf * 0 = NaN, as ONNX
        inv = (1 / np.sqrt(ms + np.asarray(epsilon, dtype=stats))).astype(stats)
    with np.errstate(invalid="ignore"):
        n = (xs * inv).astype(stats)
    if scale is None:
        return n.astype(dtype)
    if round_before_scale:
        return (n.astype(dtype) * scale).astype(dtype)
    return (n * scale.astype(stats)).astype(dtype)


def reference(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any]
) -> tuple[np.ndarray, ...]:
    """normalized, then each N @ W_i (+ b_i): products in float64, rounded to the Linears'
    dtype once before the bias Add, as MatMul then Add round (N cast to `matmul_type` first
    when it is set, as the original's Cast)."""
    x = inputs[0]
    assert x is not None
    scale = inputs[1] if len(inputs) > 1 else None
    n = rms_norm(
        x,
        scale,
        epsilon_value(inputs, attrs),
        int(attrs["stash_type"]),
        int(attrs["round_before_scale"]),
    )
    return (n, *apply_linears(n, inputs, attrs, WEIGHTS_AT))


RMSNORM_MATMUL = FusedOp(
    name="RmsNormMatMul",
    doc="RMSNorm over the last axis, then N @ W_i (+ b_i) for each Linear.",
    inputs=(
        Param("X", "T", "input"),
        Param("scale", "T", "gamma, broadcasting along the last axis", "optional"),
        Param(
            "weights",
            "U",
            "W_0 [D, N_0], b_0 [N_0] (iff has_bias[0]), W_1, ..., then epsilon (T) iff "
            "exact_epsilon",
            "variadic",
        ),
    ),
    outputs=(
        Param("normalized", "T", "the RMSNorm output, when read outside the match", "optional"),
        Param(
            "Y", "U", "Y_i = N @ W_i (+ b_i); [prod(leading dims), N_i] if flatten[i]", "variadic"
        ),
    ),
    attributes=(
        Attr("epsilon", "float", "added to the mean square (see exact_epsilon)", 1e-5),
        Attr(
            "stash_type",
            "int",
            "1: statistics in float32 (ops; Cast-to-float32 form); 0: in the input dtype",
            1,
        ),
        Attr(
            "round_before_scale",
            "int",
            "1: N rounded to T before gamma (decomposed Cast, Mul); 0: gamma in the statistics "
            "dtype, rounded once (the ops as onnxruntime runs them)",
            1,
        ),
        Attr("has_bias", "ints", "per Linear: 1 if b_i follows W_i"),
        Attr("flatten", "ints", "per Linear: 1 if N is flattened to 2-D first (Reshape ->)"),
        MATMUL_TYPE,
        EXACT_EPSILON,
    ),
    type_constraints=(
        ("T", NORM_TYPES, "X, gamma, the normalized value (and the exact epsilon)"),
        ("U", NORM_TYPES, "the Linears' weights, biases and outputs: T, or matmul_type"),
    ),
    infer=_infer,
    reference=reference,
    body=rmsnorm_matmul_body.build,
)


# -- matching the RMSNorm ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Norm:
    """The RMSNorm part of a match."""

    nodes: tuple[int, ...]
    x: str
    scale: str
    out: str
    epsilon: Epsilon
    stash_type: int
    round_before_scale: int
    notes: tuple[str, ...] = ()
    problem: NearMiss | None = None  # a failed check, reported if a Linear reads `out`
    out_type: int = 0  # `out`'s element type where shape inference cannot know it (0: it does)


_WIDER: dict[int, tuple[int, ...]] = {
    onnx.TensorProto.FLOAT16: (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE),
    onnx.TensorProto.BFLOAT16: (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE),
    onnx.TensorProto.FLOAT: (onnx.TensorProto.DOUBLE,),
}


def _last_axis_only(graph: GraphIndex, node_id: int, x: str) -> None:
    """A ReduceMean over the last axis only, with keepdims=1, or a near miss."""
    axes = reduce_axes(graph, node_id, rank(graph, x))
    if rank(graph, x) is None and any(a >= 0 for a in axes):
        raise NearMiss(
            f"ReduceMean '{graph.describe(node_id)}' has axes {axes} but the rank of '{x}' is "
            "unknown, so they cannot be checked to be the last axis",
            graph.nodes[node_id].output[0],
            (node_id,),
        )
    if axes != [-1]:
        where = f"a rank-{rank(graph, x)} input" if rank(graph, x) is not None else "its input"
        raise NearMiss(
            f"ReduceMean '{graph.describe(node_id)}' averages over axes {axes} of {where}; "
            "RmsNormMatMul normalizes the last axis only ([-1])",
            graph.nodes[node_id].output[0],
            (node_id,),
        )


def _gamma(
    graph: GraphIndex, value: str, x_rank: int | None
) -> tuple[int, str, NearMiss | None] | None:
    """The Mul by gamma reading `value`: (node, gamma, why its broadcasting is wrong or None);
    None if the reader is not a Mul by a constant (a gate, a residual: left outside)."""
    reader = only_reader(graph, value)
    if reader is None:
        return None
    node = graph.nodes[reader]
    if node.op_type != "Mul" or node.domain != "" or list(node.input).count(value) != 1:
        return None
    gamma = node.input[1] if node.input[0] == value else node.input[0]
    c = operand_const(graph, gamma)
    if c is None:
        return None
    problem = last_axis_problem(c.shape, x_rank)
    if problem is None:
        return reader, gamma, None
    why = f"gamma '{gamma}' of Mul '{graph.describe(reader)}' {problem}"
    return reader, gamma, NearMiss(why, gamma, (reader,))


def _square_of(graph: GraphIndex, node_id: int) -> str | None:
    """x if node `node_id` is Pow(x, e) or Mul(x, x), else None."""
    node = graph.nodes[node_id]
    if node.domain != "":
        return None
    if node.op_type == "Pow":
        return node.input[0]
    if node.op_type == "Mul" and node.input[0] == node.input[1]:
        return node.input[0]
    return None


def _scaled_by_inverse(
    graph: GraphIndex, x: str, std: str, members: list[int]
) -> tuple[int, int | None] | None:
    """The node computing x / std (Div(x, std), Mul(x, Reciprocal(std)), Mul(x, Div(1, std)))
    and the Div(1, std) node whose numerator must be checked; members get the inner nodes."""
    for r in graph.readers(std):
        node = graph.nodes[r]
        if node.domain != "":
            continue
        if node.op_type == "Div" and list(node.input) == [x, std]:
            return r, None
        inner = node.op_type == "Reciprocal" or (
            node.op_type == "Div" and node.input[1] == std and node.input[0] != x
        )
        if not inner:
            continue
        casts: list[int] = []
        inv = follow(graph, node.output[0], casts)
        muls = [
            m
            for m in readers_of(graph, inv, "Mul")
            if sorted(graph.nodes[m].input) == sorted([x, inv])
        ]
        if muls and x != inv:
            members += [r, *casts]
            return muls[0], r if node.op_type == "Div" else None
    return None


def _centered(graph: GraphIndex, x: str) -> bool:
    """Whether `x` is `Sub(v, ReduceMean(v))` (through a Cast): the variance of a LayerNorm,
    which is layernorm_matmul's to match (or to report), not an RMSNorm."""
    for _ in range(2):
        producer = graph.producer_of(x)
        if producer is None or producer.domain != "":
            return False
        if producer.op_type == "Sub":
            mean = graph.producer_of(producer.input[1])
            return mean is not None and mean.op_type == "ReduceMean"
        if producer.op_type != "Cast":
            return False
        x = producer.input[0]
    return False


def _decomposed(graph: GraphIndex, anchor: int) -> _Norm | None:
    """The decomposed RMSNorm around its ReduceMean `anchor`, or None if it is not one."""
    r = graph.nodes[anchor]
    square = graph.producer.get(r.input[0])
    if square is None:
        return None
    x = _square_of(graph, square)
    if x is None or _centered(graph, x):
        return None
    members = [square, anchor]
    ms = follow(graph, r.output[0], members)
    adds = readers_of(graph, ms, "Add")
    if not adds:
        return None
    members.append(adds[0])
    sqrts = readers_of(graph, follow(graph, graph.nodes[adds[0]].output[0], members), "Sqrt")
    if not sqrts:
        return None
    members.append(sqrts[0])
    std = follow(graph, graph.nodes[sqrts[0]].output[0], members)
    found = _scaled_by_inverse(graph, x, std, members)
    if found is None:
        return None
    divide, unit_div = found
    members.append(divide)

    # The structure is an RMSNorm: now every constant that carries meaning, exactly. The walk
    # goes on to the output either way (a failed check is reported only if a Linear reads it).
    x_rank = rank(graph, x)
    problem: NearMiss | None = None
    eps = Epsilon(0.0)
    try:
        sq = graph.nodes[square]
        if sq.op_type == "Pow":
            exponent = scalar(graph, sq.input[1], "exponent", square, x_rank)
            if exponent != 2.0:
                raise NearMiss(
                    f"Pow '{graph.describe(square)}' raises to {exponent:g}; the mean square "
                    "needs exactly 2",
                    sq.input[1],
                    (square,),
                )
        _last_axis_only(graph, anchor, x)
        eps = epsilon(graph, adds[0], ms, graph.elem_type(x), RMSNORM_MATMUL.name, x_rank)
        if unit_div is not None:
            one = scalar(graph, graph.nodes[unit_div].input[0], "numerator", unit_div, x_rank)
            if one != 1.0:
                raise NearMiss(
                    f"Div '{graph.describe(unit_div)}' divides {one:g} by the RMS; the inverse "
                    "RMS needs exactly 1",
                    graph.nodes[unit_div].input[0],
                    (unit_div,),
                )
    except NearMiss as miss:
        problem = miss
    out = follow(graph, graph.nodes[divide].output[0], members)

    # The float16 form: x is Cast up from a narrower float, and N is Cast back before gamma.
    notes: tuple[str, ...] = ()
    stash_type = 0
    up = graph.producer.get(x)
    source = graph.nodes[up].input[0] if up is not None and graph.nodes[up].input else ""
    narrow = graph.elem_type(source) if source else None
    if (
        up is not None
        and narrow is not None
        and any(is_cast_to(graph.nodes[up], t) for t in _WIDER.get(narrow, ()))
    ):
        back = only_reader(graph, out)
        if back is not None and not is_cast_to(graph.nodes[back], narrow):
            # Gemma's form: the weight multiplied in the wide type, then the Cast back.
            wide = _gamma(graph, out, x_rank)
            after = None if wide is None else only_reader(graph, graph.nodes[wide[0]].output[0])
            if wide is None or after is None or not is_cast_to(graph.nodes[after], narrow):
                return None  # the output stays in the wide type: not this form
            problem = problem or NearMiss(
                f"gamma '{wide[1]}' of Mul '{graph.describe(wide[0])}' is applied in "
                f"{type_name(graph.elem_type(out))} before the Cast back to {type_name(narrow)} "
                f"('{graph.describe(after)}'); RmsNormMatMul takes gamma in the input dtype",
                wide[1],
                (wide[0],),
            )
            members += [wide[0], after]
            out = graph.nodes[after].output[0]
            return _Norm(tuple(members), source, "", out, eps, 1, 0, (), problem)
        if back is None:
            return None
        members.insert(0, up)
        members.append(back)
        out = graph.nodes[back].output[0]
        stash_type = 1
        notes = (
            f"statistics in {type_name(graph.elem_type(x))} (Cast '{graph.describe(up)}'), "
            f"N rounded to {type_name(narrow)} before gamma (Cast '{graph.describe(back)}')",
        )
        x = source
    else:
        # A no-op Cast in front joins the match when only the RMSNorm reads it.
        while (
            (producer := graph.producer.get(x)) is not None
            and is_noop_cast(graph, graph.nodes[producer])
            and set(graph.readers(x)) <= set(members)
            and not graph.is_graph_output(x)
        ):
            members.insert(0, producer)
            x = graph.nodes[producer].input[0]
    scale = ""
    gamma = _gamma(graph, out, x_rank)
    if gamma is not None:
        reader, scale, broadcast = gamma
        problem = problem or broadcast
        members.append(reader)
        out = follow(graph, graph.nodes[reader].output[0], members)
    return _Norm(tuple(members), x, scale, out, eps, stash_type, 1, notes, problem)


def _norm_op(graph: GraphIndex, anchor: int) -> _Norm:
    """SimplifiedLayerNormalization / RMSNormalization, with its attributes checked."""
    node = graph.nodes[anchor]
    x = node.input[0]
    scale = node.input[1] if len(node.input) > 1 else ""
    name = graph.describe(anchor)
    x_rank = rank(graph, x)
    axis = int(attr(node, "axis", -1))
    stash = int(attr(node, "stash_type", 1))
    problem: NearMiss | None = None
    if axis != -1 and (x_rank is None or axis != x_rank - 1):
        problem = NearMiss(
            f"{node.op_type} '{name}' normalizes from axis {axis}"
            + (f" of a rank-{x_rank} input" if x_rank is not None else " (rank unknown)")
            + "; RmsNormMatMul normalizes the last axis only",
            x,
            (anchor,),
        )
    elif stash != 1 and graph.elem_type(x) != onnx.TensorProto.FLOAT:
        problem = NearMiss(
            f"{node.op_type} '{name}' has stash_type={stash} on a "
            f"{type_name(graph.elem_type(x))} input: onnxruntime's rounding there is not modeled",
            x,
            (anchor,),
        )
    elif scale:
        c = operand_const(graph, scale)
        shape = tuple(c.shape) if c is not None else graph.shape(scale)
        why = None if shape is None else last_axis_problem(shape, x_rank)
        if why is not None:
            problem = NearMiss(
                f"scale '{scale}' of {node.op_type} '{name}' {why}", scale, (anchor,)
            )
    # Y's type is the scale's (onnxruntime's contrib schema: X T, scale V, Y V; so is opset 23's
    # RMSNormalization); in the com.microsoft domain onnx has no schema for the op, so no
    # value_info says it (in the ONNX domain checkview's schema types it).
    out_type = _scale_type(graph, scale)
    x_type = graph.elem_type(x)
    if problem is None and out_type and x_type and out_type != x_type:
        problem = NearMiss(
            f"{node.op_type} '{name}' takes a {type_name(out_type)} scale '{scale}' on a "
            f"{type_name(x_type)} input, so its output is {type_name(out_type)}; RmsNormMatMul "
            "takes X and gamma in one dtype",
            scale,
            (anchor,),
        )
    return _Norm(
        (anchor,),
        x,
        scale,
        node.output[0],
        Epsilon(float(attr(node, "epsilon", 1e-5))),
        1 if stash == 1 else 0,
        0,
        problem=problem,
        out_type=out_type,
    )


def _scale_type(graph: GraphIndex, scale: str) -> int:
    """The element type of a norm op's scale (what inference says, else a constant's dtype); 0
    if unknown or absent."""
    if not scale:
        return 0
    if graph.elem_type(scale):
        return int(graph.elem_type(scale) or 0)
    c = operand_const(graph, scale)
    return int(onnx.helper.np_dtype_to_tensor_dtype(c.dtype)) if c is not None else 0


def _width(graph: GraphIndex, norm: _Norm) -> int | None:
    """The size of the normalized axis, from N, x or gamma (shape inference often loses
    activations' shapes behind a computed Reshape)."""
    for name in (norm.out, norm.x):
        shape = graph.shape(name)
        if shape and isinstance(shape[-1], int):
            return shape[-1]
    if norm.scale:
        c = const(graph, norm.scale)
        if c is not None and c.ndim:
            return int(c.shape[-1])
    return None


# -- the pattern -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RmsNormMatMulPattern:
    """RMSNorm (op or decomposed) -> all Linears on its output, anchored at the norm op or the
    mean-square ReduceMean."""

    name: str = NAME
    description: str = (
        "SimplifiedLayerNormalization / RMSNormalization / decomposed RMSNorm (incl. the fp16"
        " Cast form) -> MatMul (+ Add bias) / Gemm / Reshape -> Gemm|MatMul => RmsNormMatMul"
    )
    anchors: tuple[tuple[str, str], ...] = (
        ("", "RMSNormalization"),
        ("", "SimplifiedLayerNormalization"),
        ("com.microsoft", "SimplifiedLayerNormalization"),
        ("", "ReduceMean"),
    )
    ops: tuple[FusedOp, ...] = (RMSNORM_MATMUL,)

    def match(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None:
        node = graph.nodes[node_id]
        norm = (
            _decomposed(graph, node_id)
            if node.op_type == "ReduceMean"
            else _norm_op(graph, node_id)
        )
        if norm is None:
            return None
        readers = classify(
            graph, norm.out, lambda: _width(graph, norm), narrow=True, value_type=norm.out_type
        )
        if not readers.linears and not readers.misses:
            return None  # no Linear after it: not this pattern, whatever its constants
        if norm.problem is not None:
            problem = norm.problem
            return rejection(
                self.name, graph, (*norm.nodes, *problem.nodes), problem.reason, problem.value
            )
        if not readers.linears:
            first = readers.misses[0]
            reason = "; ".join(m.reason for m in readers.misses)
            return rejection(self.name, graph, (*norm.nodes, *first.nodes), reason, first.value)
        return self._match(norm, readers)

    def _match(self, norm: _Norm, readers: Readers) -> Match:
        # A Reshape shared by several flattened Linears is listed by each of them: once here.
        nodes = tuple(
            dict.fromkeys(
                (*norm.nodes, *readers.casts, *(i for lin in readers.linears for i in lin.nodes))
            )
        )
        inputs = [norm.x, norm.scale]
        for lin in readers.linears:
            inputs += [lin.weight, lin.bias] if lin.bias else [lin.weight]
        inputs += norm.epsilon.inputs
        attributes = {
            **norm.epsilon.attributes,
            "stash_type": norm.stash_type,
            "round_before_scale": norm.round_before_scale,
            "has_bias": [1 if lin.bias else 0 for lin in readers.linears],
            "flatten": [lin.flatten for lin in readers.linears],
        }
        if readers.cast_to:
            attributes["matmul_type"] = readers.cast_to
        notes = (*norm.notes, *(f"left unfused: {m.reason}" for m in readers.misses))
        others = [r for r in readers.outside if not r.endswith("(Shape)")]
        if others:
            notes += (f"normalized also output, for {', '.join(others)}",)
        return Match(
            self.name,
            RMSNORM_MATMUL,
            nodes,
            tuple(inputs),
            ("", *(lin.output for lin in readers.linears)),
            attributes,
            exportable={norm.out: 0},
            shape_sources={norm.out: norm.x},
            new_initializers=(
                *(t for lin in readers.linears for t in lin.new_initializers),
                *filter(None, (norm.epsilon.new_initializer,)),
            ),
            notes=notes,
        )


PATTERN = RmsNormMatMulPattern()
