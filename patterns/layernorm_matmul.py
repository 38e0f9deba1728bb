"""LayerNorm (op or decomposed) -> every Linear on its output  =>  fuser.LayerNormMatMul.

Math. Over the trailing normalized axes A of x (axis = first of them):
    mu = mean_A(x),  var = mean_A((x - mu)^2),  N = (x - mu) / sqrt(var + eps) * gamma + beta
and each Linear reading N is  Y_i = N @ W_i (+ b_i).  The fused op computes N once and every
Y_i from it, so the normalized tensor need not round-trip through memory; it is output too when
something else reads it (a residual Add, a `Shape`, an unfused MatMul).

Matched:
- `LayerNormalization` (opset 17+): axis, epsilon, stash_type taken as they are.
- Decomposed, as exporters write it below opset 17:
    mu = ReduceMean(x);  d = Sub(x, mu);  v = ReduceMean(Pow(d, 2) | Mul(d, d))
    N  = Div(d, Sqrt(Add(v, eps))) | Mul(d, Reciprocal(Sqrt(Add(v, eps))))
    N  = Add(Mul(N, gamma), beta)            (affine part optional, either operand order)
  axes as attribute (opset < 18) or input (opset 18+); no-op Casts (to the dtype the value
  already has) are looked through. The fused op gets stash_type=0 (the decomposed form); its
  statistics are accurate all the same (see `layer_norm`), as onnxruntime's optimizer makes
  them by replacing the chain with its LayerNormalization kernel. TorchScript writes a
  float16 LayerNorm with the variance in float64 (Cast after the Sub, Cast back after the
  Div): that form gets stash_type=1 (statistics in float32), equal within float16 resolution,
  and says so in the fusion's notes.
- Consumers of N: MatMul(N, W) with W a constant 2-D weight, then optionally Add of a constant
  bias broadcasting along the last axis only (either operand order); and Reshape(N, [-1, K]) ->
  Gemm (GPT-2's Conv1D), with transB, alpha and beta folded into new W'/b' initializers at fuse
  time:  alpha * A @ op(B) + beta * C  =  A @ (alpha * op(B)) + (beta * C);  that output is 2-D
  (flatten=1). The Reshape's target may be constant or computed from Shape(N), as TorchScript
  writes `x.view(-1, x.size(-1))`; those few shape nodes then join the match. All such
  consumers of one N go into one fused node, one output each.

Every constant that carries meaning is checked exactly, never with a tolerance: ReduceMean
keepdims=1 and both ReduceMeans over the same trailing axes, exponent exactly 2, epsilon a
one-element constant kept as read (a tiny epsilon is not zero), gamma and beta broadcasting
only along the normalized axes. A mean or variance read outside the chain, or that is a graph
output, is an internal value with an outside reader: the matcher refuses that with its reason.

A `Shape` reading N is re-pointed to X when gamma and beta provably keep X's shape (they
broadcast only into it); any other reader, or a Shape when that is not proven, makes the fused
op output `normalized`. Gamma or beta that broadcast N up beyond X's shape (X's last dim 1,
gamma [4]) are refused: the fused op's `normalized` has X's shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from fuser.bodies import layernorm_matmul as layernorm_matmul_body
from fuser.fusedop import Attr, Dim, FusedOp, Param, TensorInfo
from fuser.graph import GraphIndex
from fuser.matcher import type_name
from fuser.pattern import Match, Rejection, rejection

from ._linear import classify
from ._linear_op import (
    EXACT_EPSILON,
    MATMUL_TYPE,
    NORM_TYPES,
    apply_linears,
    epsilon_value,
    linear_outputs,
)
from ._walk import (
    Epsilon,
    NearMiss,
    attr,
    attrs,
    const_shape,
    epsilon,
    follow,
    is_cast_to,
    is_noop_cast,
    only_reader,
    readers_of,
    reduce_axes,
    scalar,
)
from ._walk import rank as value_rank

NAME = "layernorm_matmul"
PRIORITY = 20


# -- the fused op ------------------------------------------------------------------------------


def _infer(
    inputs: Sequence[TensorInfo | None], attrs: Mapping[str, Any]
) -> list[TensorInfo | None]:
    return linear_outputs(inputs, attrs, 3)


def layer_norm(
    x: np.ndarray,
    scale: np.ndarray | None,
    bias: np.ndarray | None,
    axis: int,
    epsilon: float,
    stash_type: int,
) -> np.ndarray:
    """ONNX LayerNormalization with accurate statistics whatever `stash_type`: in float32 at
    least, in two passes over the row shifted by its first element x0 (y = x - x0; the mean
    x0 + mean(y); then the centred d = y - mean(y) and var = mean(d^2)); the normalized value
    d / sqrt(var + eps) rounded to the input dtype once, then gamma and beta, each rounded.

    At least as accurate as onnxruntime's LayerNormalization kernel, which is also what runs
    the decomposed chain (its optimizer replaces the chain by the kernel): a float16 row
    [300, -300, 0, 0] does not overflow in the square; a constant row normalizes to exactly 0
    (its shifted values are exact zeros), even with epsilon 1e-12; a large common offset
    cancels in the shift and the variance is centred whatever x0 is (an outlier first element
    costs nothing, as it would a one-pass E[y^2] - E[y]^2). The shift replaces the first
    pass's mean reduction, so the kernel runs one reduction fewer than mean-then-correct.
    `stash_type` says what the original stated (1: the op's float32 statistics; 0: the
    decomposed form).
    """
    del stash_type  # both forms get the accurate statistics (see above)
    dtype = x.dtype
    work = np.promote_types(dtype, np.float32)
    start = axis % x.ndim
    rows = x.reshape(int(np.prod(x.shape[:start], dtype=np.int64)), -1).astype(work)
    y = rows - rows[:, :1]
    d = y - y.mean(axis=-1, keepdims=True, dtype=work)
    var = (d * d).mean(axis=-1, keepdims=True, dtype=work)
    with np.errstate(divide="ignore", invalid="ignore"):  # epsilon 0, constant row: NaN as ONNX
        n = (d / np.sqrt(var + np.asarray(epsilon, dtype=work))).astype(dtype).reshape(x.shape)
    if scale is not None:
        n = (n * scale).astype(dtype)
    if bias is not None:
        n = (n + bias).astype(dtype)
    return n


def reference(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any]
) -> tuple[np.ndarray, ...]:
    """normalized, then each N @ W_i (+ b_i): products in float64, rounded to the MatMuls'
    dtype once before the bias Add, as MatMul then Add round. With `matmul_type` N is cast to
    that type first (as the original's Cast), and the Linears run in it."""
    x = inputs[0]
    assert x is not None
    scale = inputs[1] if len(inputs) > 1 else None
    bias = inputs[2] if len(inputs) > 2 else None
    eps = epsilon_value(inputs, attrs)
    n = layer_norm(x, scale, bias, int(attrs["axis"]), eps, int(attrs["stash_type"]))
    return (n, *apply_linears(n, inputs, attrs, 3))


LAYERNORM_MATMUL = FusedOp(
    name="LayerNormMatMul",
    doc="LayerNorm over the trailing axes from `axis`, then N @ W_i (+ b_i) for each Linear.",
    inputs=(
        Param("X", "T", "input"),
        Param("scale", "T", "gamma, broadcasting along the normalized axes", "optional"),
        Param("bias", "T", "beta, broadcasting along the normalized axes", "optional"),
        Param(
            "weights",
            "U",
            "W_0 [K, N_0], b_0 [N_0] (iff has_bias[0]), W_1, ..., then epsilon (T) iff "
            "exact_epsilon",
            "variadic",
        ),
    ),
    outputs=(
        Param("normalized", "T", "the LayerNorm output, when read outside the match", "optional"),
        Param(
            "Y", "U", "Y_i = N @ W_i (+ b_i); [prod(leading dims), N_i] if flatten[i]", "variadic"
        ),
    ),
    attributes=(
        Attr("axis", "int", "first normalized axis", -1),
        Attr("epsilon", "float", "added to the variance (see exact_epsilon)", 1e-5),
        Attr(
            "stash_type",
            "int",
            "what the original said: 1 = LayerNormalization's float32 statistics, 0 = the "
            "decomposed form; both are computed at least as accurately as float32 two-pass",
            1,
        ),
        Attr("has_bias", "ints", "per Linear: 1 if b_i follows W_i"),
        Attr("flatten", "ints", "per Linear: 1 if N is flattened to 2-D first (Reshape -> Gemm)"),
        MATMUL_TYPE,
        EXACT_EPSILON,
    ),
    type_constraints=(
        ("T", NORM_TYPES, "X, gamma, beta, the normalized value (and the exact epsilon)"),
        ("U", NORM_TYPES, "the Linears' weights, biases and outputs: T, or matmul_type"),
    ),
    infer=_infer,
    reference=reference,
    body=layernorm_matmul_body.build,
)


# -- matching ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Norm:
    """The LayerNorm part of a match."""

    nodes: tuple[int, ...]
    x: str
    scale: str
    bias: str
    out: str
    axis: int
    epsilon: Epsilon
    stash_type: int
    notes: tuple[str, ...] = ()
    problem: NearMiss | None = None  # a failed check, reported if a Linear reads `out`


_WIDER: dict[int, tuple[int, ...]] = {
    onnx.TensorProto.FLOAT16: (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE),
    onnx.TensorProto.BFLOAT16: (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE),
    onnx.TensorProto.FLOAT: (onnx.TensorProto.DOUBLE,),
}


def _widening_cast(graph: GraphIndex, value: str) -> int | None:
    """The only reader of `value` if it is a Cast to a wider float type, else None."""
    reader = only_reader(graph, value)
    if reader is None or graph.nodes[reader].op_type != "Cast":  # before the type lookup
        return None
    source = graph.elem_type(value)
    if source is None:
        return None
    node = graph.nodes[reader]
    return reader if any(is_cast_to(node, t) for t in _WIDER.get(source, ())) else None


def _reduced_axes(graph: GraphIndex, node_id: int, rank: int | None) -> int:
    """How many trailing axes a ReduceMean averages over, or a near miss saying why not."""
    node = graph.nodes[node_id]
    axes = reduce_axes(graph, node_id, rank)
    if rank is None and any(a >= 0 for a in axes):
        raise NearMiss(
            f"ReduceMean '{graph.describe(node_id)}' has axes {axes} but the rank of "
            f"'{node.input[0]}' is unknown, so they cannot be checked to be the trailing axes",
            node.input[0],
            (node_id,),
        )
    negative = sorted(axes)
    if negative != list(range(-len(negative), 0)):
        where = f"a rank-{rank} input" if rank is not None else "its input"
        raise NearMiss(
            f"ReduceMean '{graph.describe(node_id)}' averages over axes {axes} of {where}; "
            "LayerNorm needs the trailing axes (e.g. [-1])",
            node.output[0],
            (node_id,),
        )
    return len(negative)


def _broadcast_problem(shape: Sequence[Dim], rank: int | None, k: int) -> str | None:
    """Why a parameter of `shape` does not broadcast along the k trailing axes only, or None."""
    if rank is not None and len(shape) > rank:
        return f"has rank {len(shape)}, more than the input's {rank}"
    for i, dim in enumerate(shape):
        axis = i - len(shape)
        if axis < -k and dim != 1:
            if rank is None:
                return f"has shape {list(shape)} and the input's rank is unknown"
            return (
                f"has shape {list(shape)}: it varies along axis {axis + rank}, which is not "
                f"normalized (only the last {k} are)"
            )
    return None


def _affine(
    graph: GraphIndex, value: str, op_type: str, rank: int | None, k: int, what: str
) -> tuple[int, str, NearMiss | None] | None:
    """The Mul gamma / Add beta reading `value`: (node id, parameter, why its broadcasting is
    wrong or None), or None if the reader is not the affine part."""
    reader = only_reader(graph, value)
    if reader is None:
        return None
    node = graph.nodes[reader]
    if node.op_type != op_type or node.domain != "" or list(node.input).count(value) != 1:
        return None
    param = node.input[1] if node.input[0] == value else node.input[0]
    known = const_shape(graph, param, operand=True)
    shape = known if known is not None else graph.shape(param)
    if shape is None:
        return None
    problem = _broadcast_problem(shape, rank, k)
    if problem is None:
        return reader, param, None
    if known is None:
        return None  # a run-time tensor of activation shape: a residual, not the affine part
    why = f"{what} '{param}' of {op_type} '{graph.describe(reader)}' {problem}"
    return reader, param, NearMiss(why, param, (reader,))


def _decomposed(graph: GraphIndex, anchor: int) -> _Norm | None:
    """The decomposed LayerNorm starting at its mean ReduceMean, or None if it is not one."""
    nodes = graph.nodes  # read directly: this walk runs for every ReduceMean anchor
    r1 = nodes[anchor]
    x = r1.input[0]
    members = [anchor]
    mean = follow(graph, r1.output[0], members)
    subs = [s for s in readers_of(graph, mean, "Sub") if list(nodes[s].input[:2]) == [x, mean]]
    if not subs:
        return None
    sub = subs[0]
    members.append(sub)
    d = nodes[sub].output[0]
    widen = _widening_cast(graph, d)
    if widen is not None:  # TorchScript's float16 LayerNorm: variance in float64
        members.append(widen)
        d = nodes[widen].output[0]
    square = divide = None
    for r in graph.consumers.get(d, ()):
        node = nodes[r]
        if node.domain != "":
            continue
        if (node.op_type == "Pow" and node.input[0] == d) or (
            node.op_type == "Mul" and list(node.input) == [d, d]
        ):
            square = r
        elif (node.op_type == "Div" and node.input[0] == d) or (
            node.op_type == "Mul" and list(node.input).count(d) == 1
        ):
            divide = r
    if square is None or divide is None:
        return None
    members.append(square)
    r2 = readers_of(graph, follow(graph, nodes[square].output[0], members), "ReduceMean")
    if not r2:
        return None
    members.append(r2[0])
    var = follow(graph, nodes[r2[0]].output[0], members)
    adds = readers_of(graph, var, "Add")
    if not adds:
        return None
    add_eps = adds[0]
    members.append(add_eps)
    var_eps = follow(graph, nodes[add_eps].output[0], members)
    sqrts = readers_of(graph, var_eps, "Sqrt") or [
        r for r in readers_of(graph, var_eps, "Pow") if nodes[r].input[0] == var_eps
    ]  # Sqrt written as Pow(v, 0.5): the exponent is checked below
    if not sqrts:
        return None
    members.append(sqrts[0])
    std = follow(graph, nodes[sqrts[0]].output[0], members)
    div_node = nodes[divide]
    if div_node.op_type == "Mul":  # d * Reciprocal(std)
        recips = readers_of(graph, std, "Reciprocal")
        if not recips:
            return None
        members.append(recips[0])
        std = follow(graph, nodes[recips[0]].output[0], members)
    operands = list(div_node.input)
    if operands != [d, std] and (div_node.op_type == "Div" or operands != [std, d]):
        return None
    members.append(divide)

    # The structure is a LayerNorm: now every constant that carries meaning, exactly. A failed
    # check is reported only if a Linear reads the output (else this is not the pattern), so
    # the walk goes on to the output.
    rank = value_rank(graph, x)
    problem: NearMiss | None = None
    k, eps = 1, Epsilon(0.0)
    try:
        k, eps = _statistics(graph, anchor, r2[0], var, square, add_eps, rank, widen is not None)
        root = graph.nodes[sqrts[0]]
        if root.op_type == "Pow":
            half = scalar(graph, root.input[1], "exponent", sqrts[0], rank)
            if half != 0.5:
                raise NearMiss(
                    f"Pow '{graph.describe(sqrts[0])}' raises the variance to {half:g}; the "
                    "standard deviation needs exactly 0.5 (Sqrt)",
                    root.input[1],
                    (sqrts[0],),
                )
    except NearMiss as miss:
        problem = miss
    out = follow(graph, div_node.output[0], members)
    notes: tuple[str, ...] = ()
    if widen is not None:
        back = only_reader(graph, out)
        x_type = graph.elem_type(x)
        if back is None or not is_cast_to(graph.nodes[back], x_type):
            return None  # statistics and output in the wide type: not this form
        members.append(back)
        out = graph.nodes[back].output[0]
        notes = (
            f"statistics in float32 (stash_type=1); the original computes the mean in "
            f"{type_name(x_type)} and the variance in "
            f"{type_name(attr(graph.nodes[widen], 'to', 0))} (Cast "
            f"'{graph.describe(widen)}'): equal within {type_name(x_type)} resolution",
        )
    params = {"Mul": "", "Add": ""}
    for op_type, what in (("Mul", "gamma"), ("Add", "beta")):
        found = _affine(graph, out, op_type, rank, k, what)
        if found is None:
            continue
        reader, params[op_type], broadcast = found
        problem = problem or broadcast
        members.append(reader)
        out = follow(graph, graph.nodes[reader].output[0], members)
    # A no-op Cast in front of the LayerNorm joins the match when only the LayerNorm reads it.
    while (
        (producer := graph.producer.get(x)) is not None
        and is_noop_cast(graph, graph.nodes[producer])
        and set(graph.readers(x)) <= {anchor, sub}
        and not graph.is_graph_output(x)
    ):
        members.insert(1, producer)
        x = graph.nodes[producer].input[0]
    stash_type = int(widen is not None)
    return _Norm(
        tuple(members),
        x,
        params["Mul"],
        params["Add"],
        out,
        -k,
        eps,
        stash_type,
        notes,
        problem,
    )


def _statistics(
    graph: GraphIndex,
    mean: int,
    var: int,
    variance: str,
    square: int,
    add_eps: int,
    rank: int | None,
    widened: bool,
) -> tuple[int, Epsilon]:
    """(normalized axes, epsilon) of a decomposed LayerNorm, or a near miss: both ReduceMeans
    (`mean`, `var`) over the same trailing axes with keepdims=1, exponent exactly 2, epsilon a
    single value added to `variance`."""
    k = _reduced_axes(graph, mean, rank)
    if _reduced_axes(graph, var, rank) != k:
        raise NearMiss(
            f"ReduceMeans '{graph.describe(mean)}' and '{graph.describe(var)}' average over "
            "different axes",
            graph.nodes[var].output[0],
            (var,),
        )
    sq_node = graph.nodes[square]
    if sq_node.op_type == "Pow":
        exponent = scalar(graph, sq_node.input[1], "exponent", square, rank)
        if exponent != 2.0:
            raise NearMiss(
                f"Pow '{graph.describe(square)}' raises to {exponent:g}; the variance needs "
                "exactly 2",
                sq_node.input[1],
                (square,),
            )
    if widened:  # far below the float16 output's resolution: float32 holds it well enough
        value = scalar(graph, _other(graph.nodes[add_eps], variance), "epsilon", add_eps, rank)
        return k, Epsilon(float(np.float32(value)))
    x_type = graph.elem_type(graph.nodes[mean].input[0])
    return k, epsilon(graph, add_eps, variance, x_type, LAYERNORM_MATMUL.name, rank)


def _other(node: onnx.NodeProto, value: str) -> str:
    """The operand of a binary `node` that is not `value`."""
    return node.input[1] if node.input[0] == value else node.input[0]


_LAYERNORM_ATTRS = {"axis": -1, "epsilon": 1e-5, "stash_type": 1}


def _layernorm_op(graph: GraphIndex, anchor: int) -> _Norm:
    node = graph.nodes[anchor]
    read = attrs(node, _LAYERNORM_ATTRS)
    scale = node.input[1] if len(node.input) > 1 else ""
    bias = node.input[2] if len(node.input) > 2 else ""
    return _Norm(
        (anchor,),
        node.input[0],
        scale,
        bias,
        node.output[0],
        int(read["axis"]),
        Epsilon(float(read["epsilon"])),
        int(read["stash_type"]),
    )


def _keeps_x_shape(graph: GraphIndex, norm: _Norm) -> bool | str | None:
    """Whether the normalized value has X's shape: True if gamma and beta provably only
    broadcast into it, None if shapes leave it open, or why not (they broadcast it up: X's
    last dim 1 and gamma [4] give [.., 4]; the fused op's `normalized` has X's shape)."""
    x_shape = graph.shape(norm.x)
    proven = x_shape is not None
    for name, what in ((norm.scale, "gamma"), (norm.bias, "beta")):
        if not name:
            continue
        known = const_shape(graph, name)
        shape = known if known is not None else graph.shape(name)
        if shape is None or x_shape is None:
            proven = False
            continue
        raised = len(shape) > len(x_shape)
        for dim, x_dim in zip(reversed(shape), reversed(x_shape), strict=False):
            if dim == 1 or dim == x_dim:
                continue
            if isinstance(x_dim, int) and isinstance(dim, int):
                raised = True
            else:
                proven = False
        if raised:
            return (
                f"{what} '{name}' of shape {list(shape)} broadcasts the normalized value up "
                f"from the shape of '{norm.x}' {list(x_shape)}; LayerNormMatMul keeps X's shape"
            )
    return True if proven else None


def _last_dim(graph: GraphIndex, norm: _Norm) -> int | None:
    """The size of the normalized value's last axis, if anything tells it.

    Shape inference often loses the activations' shapes (a Reshape to a computed shape upstream
    is enough); the input and the affine parameters then still tell it, since the output's
    last axis is their broadcast.
    """
    shape = graph.shape(norm.out)
    if shape and isinstance(shape[-1], int):
        return shape[-1]
    sizes = []
    for name in (norm.x, norm.scale, norm.bias):
        dims = graph.shape(name) if name else None
        if dims is None and name and name != norm.x:
            dims = const_shape(graph, name)
        if dims and isinstance(dims[-1], int):
            sizes.append(dims[-1])
    return max(sizes) if sizes else None


@dataclass(frozen=True)
class LayerNormMatMulPattern:
    """LayerNorm (op or decomposed) -> all Linears on its output, anchored at the LayerNorm."""

    name: str = NAME
    description: str = (
        "LayerNormalization (op or decomposed) -> MatMul (+ Add bias) / "
        "Reshape -> Gemm, all on one normalized value => LayerNormMatMul"
    )
    anchors: tuple[tuple[str, str], ...] = (("", "LayerNormalization"), ("", "ReduceMean"))
    ops: tuple[FusedOp, ...] = (LAYERNORM_MATMUL,)

    def match(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None:
        node = graph.nodes[node_id]
        if node.op_type == "LayerNormalization":
            norm: _Norm | None = _layernorm_op(graph, node_id)
        elif not node.input or len(graph.consumers.get(node.input[0], ())) < 2:
            # A decomposed LayerNorm's mean ReduceMean shares its input with the Sub(x, mean):
            # a ReduceMean alone on its input (the variance's, an RMSNorm's, a pooling) is
            # no candidate, and is refused before any walk.
            return None
        else:
            norm = _decomposed(graph, node_id)
        if norm is None:
            return None
        readers = classify(
            graph, norm.out, lambda: _last_dim(graph, norm), narrow=True, selects=True
        )
        if norm.problem is not None:
            if not readers.linears and not readers.misses:
                return None  # no Linear after it: not this pattern, whatever its constants
            problem = norm.problem
            return rejection(self.name, graph, norm.nodes, problem.reason, problem.value)
        if not readers.linears:
            if not readers.misses:
                return None  # a LayerNorm without a Linear after it: not this pattern
            first = readers.misses[0]
            reason = "; ".join(m.reason for m in readers.misses)
            return rejection(self.name, graph, (*norm.nodes, *first.nodes), reason, first.value)
        keeps = _keeps_x_shape(graph, norm)
        if isinstance(keeps, str):
            return rejection(self.name, graph, norm.nodes, keeps, norm.out)
        # A Reshape shared by several flattened Linears is listed by each of them: once here.
        nodes = tuple(
            dict.fromkeys(
                (*norm.nodes, *readers.casts, *(i for lin in readers.linears for i in lin.nodes))
            )
        )
        inputs = [norm.x, norm.scale, norm.bias]
        for lin in readers.linears:
            inputs += [lin.weight, lin.bias] if lin.bias else [lin.weight]
        inputs += norm.epsilon.inputs
        attributes = {
            "axis": norm.axis,
            **norm.epsilon.attributes,
            "stash_type": norm.stash_type,
            "has_bias": [1 if lin.bias else 0 for lin in readers.linears],
            "flatten": [lin.flatten for lin in readers.linears],
        }
        if readers.cast_to:
            attributes["matmul_type"] = readers.cast_to
        notes = (*norm.notes, *(f"left unfused: {m.reason}" for m in readers.misses))
        # Shape readers are re-pointed to X by the matcher (shape_sources), not served by output.
        others = [r for r in readers.outside if not r.endswith("(Shape)")]
        if others:
            notes += (f"normalized also output, for {', '.join(others)}",)
        return Match(
            self.name,
            LAYERNORM_MATMUL,
            nodes,
            tuple(inputs),
            ("", *(lin.output for lin in readers.linears)),
            attributes,
            exportable={norm.out: 0},
            # Shape(N) may read X instead only if gamma and beta provably keep X's shape.
            shape_sources={norm.out: norm.x} if keeps else {},
            new_initializers=(
                *(t for lin in readers.linears for t in lin.new_initializers),
                *filter(None, (norm.epsilon.new_initializer,)),
            ),
            notes=notes,
        )


PATTERN = LayerNormMatMulPattern()
