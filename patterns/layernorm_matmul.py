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
from onnx import numpy_helper

from fuser.bodies import layernorm_matmul as layernorm_matmul_body
from fuser.fusedop import FLOAT_TYPES, Attr, Dim, FusedOp, Param, TensorInfo
from fuser.graph import GraphIndex
from fuser.matcher import type_name
from fuser.pattern import Match, Rejection, rejection

from ._linear_op import linear_outputs, linear_weights

NAME = "layernorm_matmul"
PRIORITY = 20


# -- the fused op ------------------------------------------------------------------------------


def _weights(inputs: Sequence[Any], attrs: Mapping[str, Any]) -> list[tuple[Any, Any, bool]]:
    """(W_i, b_i or None, flatten_i) per Linear, unpacked from the variadic inputs."""
    return linear_weights(inputs, attrs, 3)


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
    """normalized, then each N @ W_i (+ b_i): products in float64, rounded to the input dtype
    once before the bias Add, as MatMul then Add round."""
    x = inputs[0]
    assert x is not None
    scale = inputs[1] if len(inputs) > 1 else None
    bias = inputs[2] if len(inputs) > 2 else None
    n = layer_norm(
        x, scale, bias, int(attrs["axis"]), float(attrs["epsilon"]), int(attrs["stash_type"])
    )
    outputs = [n]
    for w, b, flat in _weights(inputs, attrs):
        assert w is not None
        a = n.reshape(-1, n.shape[-1]) if flat else n
        y = (a.astype(np.float64) @ w.astype(np.float64)).astype(x.dtype)
        outputs.append(y if b is None else (y + b).astype(x.dtype))
    return tuple(outputs)


LAYERNORM_MATMUL = FusedOp(
    name="LayerNormMatMul",
    doc="LayerNorm over the trailing axes from `axis`, then N @ W_i (+ b_i) for each Linear.",
    inputs=(
        Param("X", "T", "input"),
        Param("scale", "T", "gamma, broadcasting along the normalized axes", "optional"),
        Param("bias", "T", "beta, broadcasting along the normalized axes", "optional"),
        Param("weights", "T", "W_0 [K, N_0], b_0 [N_0] (iff has_bias[0]), W_1, ...", "variadic"),
    ),
    outputs=(
        Param("normalized", "T", "the LayerNorm output, when read outside the match", "optional"),
        Param(
            "Y", "T", "Y_i = N @ W_i (+ b_i); [prod(leading dims), N_i] if flatten[i]", "variadic"
        ),
    ),
    attributes=(
        Attr("axis", "int", "first normalized axis", -1),
        Attr("epsilon", "float", "added to the variance", 1e-5),
        Attr(
            "stash_type",
            "int",
            "what the original said: 1 = LayerNormalization's float32 statistics, 0 = the "
            "decomposed form; both are computed at least as accurately as float32 two-pass",
            1,
        ),
        Attr("has_bias", "ints", "per Linear: 1 if b_i follows W_i"),
        Attr("flatten", "ints", "per Linear: 1 if N is flattened to 2-D first (Reshape -> Gemm)"),
    ),
    type_constraints=(("T", FLOAT_TYPES, "float tensors"),),
    infer=_infer,
    reference=reference,
    body=layernorm_matmul_body.build,
)


# -- matching ----------------------------------------------------------------------------------


class _NearMiss(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised deep in a walk to give up with a reason; `match` turns it into a Rejection."""

    def __init__(self, reason: str, value: str | None = None, nodes: tuple[int, ...] = ()) -> None:
        super().__init__(reason)
        self.reason, self.value, self.nodes = reason, value, nodes


@dataclass(frozen=True)
class _Norm:
    """The LayerNorm part of a match."""

    nodes: tuple[int, ...]
    x: str
    scale: str
    bias: str
    out: str
    axis: int
    epsilon: float
    stash_type: int
    notes: tuple[str, ...] = ()
    problem: _NearMiss | None = None  # a failed check, reported if a Linear reads `out`


@dataclass(frozen=True)
class _Linear:
    """One consumer of the normalized value: its nodes, weight, bias and output."""

    nodes: tuple[int, ...]
    weight: str
    bias: str
    output: str
    flatten: int
    new_initializers: tuple[onnx.TensorProto, ...] = ()


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def _is_noop_cast(graph: GraphIndex, node: onnx.NodeProto) -> bool:
    if node.op_type != "Cast" or node.domain != "":
        return False
    source = graph.elem_type(node.input[0])
    return bool(source) and source == _attr(node, "to", None)


def _const(graph: GraphIndex, name: str) -> np.ndarray | None:
    """`graph.constant` (which reads a `Constant` node directly, in the dtype ONNX gives its
    attribute: `value_float` is float32, not numpy's float64)."""
    return graph.constant(name) if name else None


def _operand_const(graph: GraphIndex, name: str) -> np.ndarray | None:
    """`_const` for an operand that is usually an activation (a residual, a computed shape): one
    whose inferred shape has a symbolic dim is taken as computed at run time without walking
    its producers. (A constant shape inference could not size is then missed: the Add or the
    Mul stays outside the match, which is still correct.)"""
    shape = graph.shape(name)
    if shape is not None and any(isinstance(d, str) for d in shape):
        return None
    return _const(graph, name)


_WIDER: dict[int, tuple[int, ...]] = {
    onnx.TensorProto.FLOAT16: (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE),
    onnx.TensorProto.BFLOAT16: (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE),
    onnx.TensorProto.FLOAT: (onnx.TensorProto.DOUBLE,),
}


def _is_cast_to(node: onnx.NodeProto, elem_type: int | None) -> bool:
    return node.op_type == "Cast" and node.domain == "" and _attr(node, "to", 0) == elem_type


def _widening_cast(graph: GraphIndex, value: str) -> int | None:
    """The only reader of `value` if it is a Cast to a wider float type, else None."""
    reader = _only_reader(graph, value)
    source = graph.elem_type(value)
    if reader is None or source is None:
        return None
    node = graph.node(reader)
    return reader if any(_is_cast_to(node, t) for t in _WIDER.get(source, ())) else None


def _only_reader(graph: GraphIndex, value: str) -> int | None:
    readers = graph.readers(value)
    return readers[0] if len(readers) == 1 and not graph.is_graph_output(value) else None


def _follow(graph: GraphIndex, value: str, casts: list[int]) -> str:
    """Step forward through no-op Casts that are a value's only reader (they join the match)."""
    while (reader := _only_reader(graph, value)) is not None and _is_noop_cast(
        graph, graph.node(reader)
    ):
        casts.append(reader)
        value = graph.node(reader).output[0]
    return value


def _readers_of(graph: GraphIndex, value: str, op_type: str) -> list[int]:
    return [
        r
        for r in graph.readers(value)
        if graph.node(r).op_type == op_type and graph.node(r).domain == ""
    ]


def _rank(graph: GraphIndex, value: str) -> int | None:
    shape = graph.shape(value)
    return None if shape is None else len(shape)


def _scalar(graph: GraphIndex, value: str, what: str, node_id: int, rank: int | None) -> float:
    """The value of a one-element constant (that does not raise the rank of a rank-`rank`
    operand), or a near miss naming it."""
    const = _const(graph, value)
    name = graph.describe(node_id)
    if const is None:
        raise _NearMiss(
            f"{what} '{value}' of '{name}' is computed at run time, not a constant",
            value,
            (node_id,),
        )
    if const.size != 1:
        raise _NearMiss(
            f"{what} '{value}' of '{name}' has shape {list(const.shape)}, expected a single value",
            value,
            (node_id,),
        )
    if rank is not None and const.ndim > rank:
        raise _NearMiss(
            f"{what} '{value}' of '{name}' has rank {const.ndim}, more than the input's {rank}",
            value,
            (node_id,),
        )
    return float(const.reshape(-1)[0])


def _reduced_axes(graph: GraphIndex, node_id: int, rank: int | None) -> int:
    """How many trailing axes a ReduceMean averages over, or a near miss saying why not."""
    node = graph.node(node_id)
    name = graph.describe(node_id)
    keepdims = _attr(node, "keepdims", 1)
    if keepdims != 1:
        raise _NearMiss(
            f"ReduceMean '{name}' has keepdims={keepdims}; LayerNorm needs keepdims=1 "
            "(the statistic must broadcast back over the normalized axes)",
            node.output[0],
            (node_id,),
        )
    axes: list[int] | None
    if len(node.input) > 1 and node.input[1]:
        const = _const(graph, node.input[1])
        if const is None:
            raise _NearMiss(
                f"axes '{node.input[1]}' of ReduceMean '{name}' are computed at run time",
                node.input[1],
                (node_id,),
            )
        axes = [int(a) for a in const.reshape(-1)]
    else:
        found = _attr(node, "axes", None)
        axes = None if found is None else [int(a) for a in found]
    if not axes:
        if _attr(node, "noop_with_empty_axes", 0):
            raise _NearMiss(
                f"ReduceMean '{name}' has no axes and noop_with_empty_axes=1 (it reduces nothing)",
                node.output[0],
                (node_id,),
            )
        if rank is None:
            raise _NearMiss(
                f"ReduceMean '{name}' reduces all axes of '{node.input[0]}', whose rank is unknown",
                node.input[0],
                (node_id,),
            )
        axes = list(range(rank))
    if any(a >= 0 for a in axes) and rank is None:
        raise _NearMiss(
            f"ReduceMean '{name}' has axes {axes} but the rank of '{node.input[0]}' "
            "is unknown, so they cannot be checked to be the trailing axes",
            node.input[0],
            (node_id,),
        )
    negative = sorted(a - rank if a >= 0 and rank is not None else a for a in axes)
    if negative != list(range(-len(negative), 0)):
        where = f"a rank-{rank} input" if rank is not None else "its input"
        raise _NearMiss(
            f"ReduceMean '{name}' averages over axes {axes} of {where}; LayerNorm "
            "needs the trailing axes (e.g. [-1])",
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
) -> tuple[int, str, _NearMiss | None] | None:
    """The Mul gamma / Add beta reading `value`: (node id, parameter, why its broadcasting is
    wrong or None), or None if the reader is not the affine part."""
    reader = _only_reader(graph, value)
    if reader is None:
        return None
    node = graph.node(reader)
    if node.op_type != op_type or node.domain != "" or list(node.input).count(value) != 1:
        return None
    param = node.input[1] if node.input[0] == value else node.input[0]
    const = _operand_const(graph, param)
    shape = tuple(const.shape) if const is not None else graph.shape(param)
    if shape is None:
        return None
    problem = _broadcast_problem(shape, rank, k)
    if problem is None:
        return reader, param, None
    if const is None:
        return None  # a run-time tensor of activation shape: a residual, not the affine part
    why = f"{what} '{param}' of {op_type} '{graph.describe(reader)}' {problem}"
    return reader, param, _NearMiss(why, param, (reader,))


def _decomposed(graph: GraphIndex, anchor: int) -> _Norm | None:
    """The decomposed LayerNorm starting at its mean ReduceMean, or None if it is not one."""
    r1 = graph.node(anchor)
    x = r1.input[0]
    members = [anchor]
    mean = _follow(graph, r1.output[0], members)
    subs = [
        s
        for s in _readers_of(graph, mean, "Sub")
        if graph.node(s).input[1] == mean and graph.node(s).input[0] == x
    ]
    if not subs:
        return None
    sub = subs[0]
    members.append(sub)
    d = graph.node(sub).output[0]
    widen = _widening_cast(graph, d)
    if widen is not None:  # TorchScript's float16 LayerNorm: variance in float64
        members.append(widen)
        d = graph.node(widen).output[0]
    square = divide = None
    for r in graph.readers(d):
        node = graph.node(r)
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
    r2 = _readers_of(graph, _follow(graph, graph.node(square).output[0], members), "ReduceMean")
    if not r2:
        return None
    members.append(r2[0])
    var = _follow(graph, graph.node(r2[0]).output[0], members)
    adds = _readers_of(graph, var, "Add")
    if not adds:
        return None
    add_eps = adds[0]
    members.append(add_eps)
    sqrts = _readers_of(graph, _follow(graph, graph.node(add_eps).output[0], members), "Sqrt")
    if not sqrts:
        return None
    members.append(sqrts[0])
    std = _follow(graph, graph.node(sqrts[0]).output[0], members)
    div_node = graph.node(divide)
    if div_node.op_type == "Mul":  # d * Reciprocal(std)
        recips = _readers_of(graph, std, "Reciprocal")
        if not recips:
            return None
        members.append(recips[0])
        std = _follow(graph, graph.node(recips[0]).output[0], members)
    operands = list(div_node.input)
    if operands != [d, std] and (div_node.op_type == "Div" or operands != [std, d]):
        return None
    members.append(divide)

    # The structure is a LayerNorm: now every constant that carries meaning, exactly. A failed
    # check is reported only if a Linear reads the output (else this is not the pattern), so
    # the walk goes on to the output.
    rank = _rank(graph, x)
    problem: _NearMiss | None = None
    k, epsilon = 1, 0.0
    try:
        k, epsilon = _statistics(
            graph, anchor, r2[0], var, square, add_eps, rank, widen is not None
        )
    except _NearMiss as miss:
        problem = miss
    out = _follow(graph, div_node.output[0], members)
    notes: tuple[str, ...] = ()
    if widen is not None:
        back = _only_reader(graph, out)
        x_type = graph.elem_type(x)
        if back is None or not _is_cast_to(graph.node(back), x_type):
            return None  # statistics and output in the wide type: not this form
        members.append(back)
        out = graph.node(back).output[0]
        notes = (
            f"statistics in float32 (stash_type=1); the original computes the mean in "
            f"{type_name(x_type)} and the variance in "
            f"{type_name(_attr(graph.node(widen), 'to', 0))} (Cast "
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
        out = _follow(graph, graph.node(reader).output[0], members)
    # A no-op Cast in front of the LayerNorm joins the match when only the LayerNorm reads it.
    while (
        (producer := graph.producer.get(x)) is not None
        and _is_noop_cast(graph, graph.node(producer))
        and set(graph.readers(x)) <= {anchor, sub}
        and not graph.is_graph_output(x)
    ):
        members.insert(1, producer)
        x = graph.node(producer).input[0]
    stash_type = int(widen is not None)
    return _Norm(
        tuple(members),
        x,
        params["Mul"],
        params["Add"],
        out,
        -k,
        epsilon,
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
) -> tuple[int, float]:
    """(normalized axes, epsilon) of a decomposed LayerNorm, or a near miss: both ReduceMeans
    (`mean`, `var`) over the same trailing axes with keepdims=1, exponent exactly 2, epsilon a
    single value added to `variance`."""
    k = _reduced_axes(graph, mean, rank)
    if _reduced_axes(graph, var, rank) != k:
        raise _NearMiss(
            f"ReduceMeans '{graph.describe(mean)}' and '{graph.describe(var)}' average over "
            "different axes",
            graph.node(var).output[0],
            (var,),
        )
    sq_node = graph.node(square)
    if sq_node.op_type == "Pow":
        exponent = _scalar(graph, sq_node.input[1], "exponent", square, rank)
        if exponent != 2.0:
            raise _NearMiss(
                f"Pow '{graph.describe(square)}' raises to {exponent:g}; the variance needs "
                "exactly 2",
                sq_node.input[1],
                (square,),
            )
    add_node = graph.node(add_eps)
    eps_name = add_node.input[1] if add_node.input[0] == variance else add_node.input[0]
    epsilon = _scalar(graph, eps_name, "epsilon", add_eps, rank)
    if widened:
        return k, float(np.float32(epsilon))  # far below the float16 output's resolution
    if float(np.float32(epsilon)) != epsilon:
        raise _NearMiss(
            f"epsilon '{eps_name}' = {epsilon!r} is not exactly representable in "
            "LayerNormMatMul's float32 epsilon attribute",
            eps_name,
            (add_eps,),
        )
    return k, epsilon


def _layernorm_op(graph: GraphIndex, anchor: int) -> _Norm:
    node = graph.node(anchor)
    scale = node.input[1] if len(node.input) > 1 else ""
    bias = node.input[2] if len(node.input) > 2 else ""
    return _Norm(
        (anchor,),
        node.input[0],
        scale,
        bias,
        node.output[0],
        int(_attr(node, "axis", -1)),
        float(_attr(node, "epsilon", 1e-5)),
        int(_attr(node, "stash_type", 1)),
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
        const = _const(graph, name)
        shape = tuple(const.shape) if const is not None else graph.shape(name)
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


def _constant_why(graph: GraphIndex, value: str) -> str:
    if value in graph.graph_inputs:
        if value in graph.initializers:
            return "an overridable graph input (an initializer also listed as input)"
        return "a graph input, not a constant"
    return "computed at run time, not a constant"


def _new_tensor(graph: GraphIndex, array: np.ndarray, base: str) -> onnx.TensorProto:
    return numpy_helper.from_array(array, graph.unique_value_name(base))


def _row_bias(
    graph: GraphIndex, name: str, n: int, max_rank: int | None, base: str
) -> tuple[str, tuple[onnx.TensorProto, ...]] | None:
    """`name` as a [n] bias if it is a constant broadcasting along the last axis only."""
    const = _operand_const(graph, name)
    if const is None or const.ndim > (1 if max_rank is None else max_rank):
        return None
    if any(d != 1 for d in const.shape[:-1]) or (const.ndim and const.shape[-1] not in (1, n)):
        return None
    if const.shape == (n,):
        return name, ()
    tensor = _new_tensor(
        graph, np.ascontiguousarray(np.broadcast_to(const.reshape(-1), (n,))), base
    )
    return tensor.name, (tensor,)


def _matmul(graph: GraphIndex, node_id: int, value: str) -> _Linear:
    node = graph.node(node_id)
    name = graph.describe(node_id)
    if node.input[0] != value:
        raise _NearMiss(
            f"normalized value '{value}' is the right operand of MatMul '{name}'; "
            "LayerNormMatMul computes normalized @ W",
            value,
            (node_id,),
        )
    weight = node.input[1]
    w = _const(graph, weight)
    if w is None:
        raise _NearMiss(
            f"weight '{weight}' of MatMul '{name}' is {_constant_why(graph, weight)}",
            weight,
            (node_id,),
        )
    if w.ndim != 2:
        raise _NearMiss(
            f"weight '{weight}' of MatMul '{name}' has rank {w.ndim}; "
            "LayerNormMatMul takes 2-D weights",
            weight,
            (node_id,),
        )
    out = node.output[0]
    add = _only_reader(graph, out)
    if add is not None:
        add_node = graph.node(add)
        if (
            add_node.op_type == "Add"
            and add_node.domain == ""
            and list(add_node.input).count(out) == 1
        ):
            other = add_node.input[1] if add_node.input[0] == out else add_node.input[0]
            bias = _row_bias(graph, other, int(w.shape[1]), _rank(graph, out), f"{name}.bias")
            if bias is not None:
                return _Linear((node_id, add), weight, bias[0], add_node.output[0], 0, bias[1])
    return _Linear((node_id,), weight, "", out, 0)


def _gemm(graph: GraphIndex, node_id: int, members: tuple[int, ...], flatten: int) -> _Linear:
    node = graph.node(node_id)
    name = graph.describe(node_id)
    nodes = (*members, node_id)
    if _attr(node, "transA", 0):
        raise _NearMiss(
            f"Gemm '{name}' has transA=1 (it reads the normalized value transposed)",
            node.input[0],
            nodes,
        )
    weight = node.input[1]
    w = _const(graph, weight)
    if w is None:
        raise _NearMiss(
            f"weight '{weight}' of Gemm '{name}' is {_constant_why(graph, weight)}", weight, nodes
        )
    alpha, beta = float(_attr(node, "alpha", 1.0)), float(_attr(node, "beta", 1.0))
    trans_b = int(_attr(node, "transB", 0))
    inits: list[onnx.TensorProto] = []
    if trans_b or alpha != 1.0:
        folded = (alpha * (w.T if trans_b else w).astype(np.float64)).astype(w.dtype)
        inits.append(_new_tensor(graph, np.ascontiguousarray(folded), f"{name}.W_folded"))
        weight = inits[-1].name
    n = int(w.shape[0] if trans_b else w.shape[1])
    bias = node.input[2] if len(node.input) > 2 else ""
    if bias:
        c = _const(graph, bias)
        if c is None:
            raise _NearMiss(
                f"bias '{bias}' of Gemm '{name}' is {_constant_why(graph, bias)}", bias, nodes
            )
        if (
            c.ndim > 2
            or any(d != 1 for d in c.shape[:-1])
            or (c.ndim and c.shape[-1] not in (1, n))
        ):
            raise _NearMiss(
                f"bias '{bias}' of Gemm '{name}' has shape {list(c.shape)}: it varies "
                f"per row (LayerNormMatMul adds one [{n}] row bias)",
                bias,
                nodes,
            )
        if beta != 1.0 or c.shape != (n,):
            row = (beta * np.broadcast_to(c.reshape(-1), (n,)).astype(np.float64)).astype(c.dtype)
            inits.append(_new_tensor(graph, np.ascontiguousarray(row), f"{name}.bias_folded"))
            bias = inits[-1].name
    return _Linear(nodes, weight, bias, node.output[0], flatten, tuple(inits))


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
            const = _const(graph, name)
            dims = None if const is None else tuple(const.shape)
        if dims and isinstance(dims[-1], int):
            sizes.append(dims[-1])
    return max(sizes) if sizes else None


_INT64_MAX = np.iinfo(np.int64).max
ShapeItem = int | str  # an int, or "shape[i]": dim i (negative) of the tensor whose Shape is read


def _shape_items(
    graph: GraphIndex, name: str, of: str, nodes: list[int], depth: int = 0
) -> list[ShapeItem] | None:
    """A 1-D int64 value as items, when it is a constant or computed from `Shape(of)` (as
    TorchScript writes `x.view(-1, x.size(-1))`: Concat, Slice/Gather of Shape, Squeeze,
    Unsqueeze, Cast); None if it depends on anything else. The computing nodes go to `nodes`."""
    const = _const(graph, name)
    if const is not None:
        return [int(v) for v in const.reshape(-1)]
    node_id = graph.producer.get(name)
    if node_id is None or graph.node(node_id).domain != "" or depth > 16:
        return None
    node = graph.node(node_id)
    nodes.append(node_id)
    rank = _rank(graph, of)

    def dims_of(shape_node: onnx.NodeProto) -> list[ShapeItem] | None:
        """The items of `Shape(of)` (start/end attributes applied); None if that is not what
        `shape_node` is, or if the rank is unknown (then see `suffix`)."""
        if shape_node.op_type != "Shape" or shape_node.input[0] != of or rank is None:
            return None
        items: list[ShapeItem] = [f"shape[{i}]" for i in range(-rank, 0)]
        return items[_attr(shape_node, "start", 0) : _attr(shape_node, "end", None)]

    def suffix(shape_node: onnx.NodeProto, first: int) -> list[ShapeItem] | None:
        """Without the rank, only trailing dims are known: Shape(of)[first:] for first < 0."""
        if shape_node.op_type != "Shape" or shape_node.input[0] != of or first >= 0:
            return None
        start, end = _attr(shape_node, "start", 0), _attr(shape_node, "end", None)
        if end is not None or start > 0 or (start < 0 and first < start):
            return None
        return [f"shape[{i}]" for i in range(first, 0)]

    op = node.op_type
    if op in ("Cast", "Squeeze", "Unsqueeze", "Identity"):
        items = _shape_items(graph, node.input[0], of, nodes, depth + 1)
        one = op in ("Cast", "Identity") or (items is not None and len(items) == 1)
        return items if one else None
    if op == "Concat" and _attr(node, "axis", 0) in (0, -1):
        parts = [_shape_items(graph, i, of, nodes, depth + 1) for i in node.input]
        return None if any(p is None for p in parts) else [x for p in parts for x in p or []]
    if op == "Shape":
        return dims_of(node) or suffix(node, _attr(node, "start", 0))
    source = graph.producer.get(node.input[0])
    if source is None:
        return None
    shape_node = graph.node(source)
    nodes.append(source)
    if op == "Gather" and _attr(node, "axis", 0) == 0:
        index = _const(graph, node.input[1])
        if index is None or index.size != 1:
            return None
        i = int(index.reshape(-1)[0])
        dims = dims_of(shape_node)
        if dims is None:
            tail = suffix(shape_node, i)
            return tail[:1] if tail else None
        return [dims[i]] if -len(dims) <= i < len(dims) else None
    if op == "Slice" and len(node.input) >= 3:
        bounds = [_const(graph, i) if i else None for i in node.input[1:5]]
        if bounds[0] is None or bounds[1] is None:
            return None
        if any(b is not None and b.size != 1 for b in bounds):
            return None
        if bounds[2] is not None and int(bounds[2].reshape(-1)[0]) not in (0, -1):
            return None
        step = 1 if len(bounds) < 4 or bounds[3] is None else int(bounds[3].reshape(-1)[0])
        lo, hi = int(bounds[0].reshape(-1)[0]), int(bounds[1].reshape(-1)[0])
        dims = dims_of(shape_node)
        if dims is not None:
            return dims[lo : min(hi, _INT64_MAX) : step]
        if step == 1 and hi >= _TO_THE_END:
            return suffix(shape_node, lo)
    return None


_TO_THE_END = 2**31 - 1  # a Slice end at least this large runs to the end of a shape


def _flatten_reshape(
    graph: GraphIndex, node_id: int, value: str, last_dim: int | None
) -> tuple[int, tuple[int, ...]] | None:
    """The Gemm behind a Reshape that only flattens the leading dims of `value`, and the nodes
    computing the Reshape's target shape from `Shape(value)` (they join the match: left outside,
    they would read the normalized value and feed the match, a cycle); or None."""
    node = graph.node(node_id)
    gemm = _only_reader(graph, node.output[0])
    if node.input[0] != value or gemm is None:
        return None
    gemm_node = graph.node(gemm)
    if (
        gemm_node.op_type != "Gemm"
        or gemm_node.domain != ""
        or gemm_node.input[0] != node.output[0]
    ):
        return None
    name = graph.describe(node_id)
    shape_nodes: list[int] = []
    items = _shape_items(graph, node.input[1], value, shape_nodes)
    if items is None:
        raise _NearMiss(
            f"Reshape '{name}' before Gemm '{graph.describe(gemm)}': its target shape "
            f"'{node.input[1]}' is computed at run time from more than the shape of '{value}', "
            "so it cannot be checked to only flatten the leading dims",
            node.input[1],
            (node_id, gemm),
        )
    shape = graph.shape(value)
    lead = shape[:-1] if shape else (None,)
    static = all(isinstance(d, int) for d in lead)
    rows = int(np.prod(lead, dtype=np.int64)) if static else None  # type: ignore[arg-type]
    last_ok = len(items) == 2 and (items[1] == "shape[-1]" or (last_dim and items[1] == last_dim))
    if not last_ok or not (items[0] == -1 or (rows and items[0] == rows)):
        expected = f"[-1, {last_dim}]" if last_dim else "[-1, last dim]"
        shown = "[" + ", ".join(str(i) for i in items) + "]"
        raise _NearMiss(
            f"Reshape '{name}' to {shown} does not only flatten the leading dims of "
            f"'{value}' (expected {expected})",
            node.input[1],
            (node_id, gemm),
        )
    own = {*shape_nodes, node_id}
    for i in shape_nodes:
        for out in graph.node(i).output:
            if graph.is_graph_output(out) or not set(graph.readers(out)) <= own:
                raise _NearMiss(
                    f"the target shape of Reshape '{name}' is computed by '{graph.describe(i)}', "
                    "which is also read elsewhere, so the Reshape cannot be fused away",
                    out,
                    (node_id, gemm),
                )
    return gemm, tuple(dict.fromkeys(shape_nodes))


@dataclass(frozen=True)
class _Readers:
    """What reads the normalized value: the Linears taken, casts taken, near misses, and the
    readers left outside (then the fused op outputs `normalized` for them)."""

    linears: tuple[_Linear, ...]
    casts: tuple[int, ...]
    misses: tuple[_NearMiss, ...]
    outside: tuple[str, ...]

    @property
    def others(self) -> bool:
        return bool(self.outside)


def _classify(graph: GraphIndex, value: str, last_dim: int | None) -> _Readers:
    linears: list[_Linear] = []
    casts: list[int] = []
    misses: list[_NearMiss] = []
    outside: list[str] = ["the graph output"] if graph.is_graph_output(value) else []
    for r in graph.readers(value):
        node = graph.node(r)
        left_out = f"'{graph.describe(r)}' ({node.op_type})"
        try:
            if node.domain != "":
                outside.append(left_out)
            elif node.op_type == "MatMul":
                linears.append(_matmul(graph, r, value))
            elif node.op_type == "Gemm" and node.input[0] == value:
                linears.append(_gemm(graph, r, (), 0))
            elif node.op_type == "Reshape" and (
                found := _flatten_reshape(graph, r, value, last_dim)
            ):
                linears.append(_gemm(graph, found[0], (*found[1], r), 1))
            elif _is_noop_cast(graph, node):
                inner = _classify(graph, node.output[0], last_dim)
                misses.extend(inner.misses)
                if inner.others or not inner.linears:
                    outside.append(left_out)
                else:
                    linears.extend(inner.linears)
                    casts.extend((r, *inner.casts))
            else:
                outside.append(left_out)
        except _NearMiss as miss:
            misses.append(miss)
            outside.append(left_out)
    return _Readers(tuple(linears), tuple(casts), tuple(misses), tuple(outside))


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
        node = graph.node(node_id)
        norm = (
            _layernorm_op(graph, node_id)
            if node.op_type == "LayerNormalization"
            else _decomposed(graph, node_id)
        )
        if norm is None:
            return None
        readers = _classify(graph, norm.out, _last_dim(graph, norm))
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
        nodes = (*norm.nodes, *readers.casts, *(i for lin in readers.linears for i in lin.nodes))
        inputs = [norm.x, norm.scale, norm.bias]
        for lin in readers.linears:
            inputs += [lin.weight, lin.bias] if lin.bias else [lin.weight]
        attributes = {
            "axis": norm.axis,
            "epsilon": norm.epsilon,
            "stash_type": norm.stash_type,
            "has_bias": [1 if lin.bias else 0 for lin in readers.linears],
            "flatten": [lin.flatten for lin in readers.linears],
        }
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
            new_initializers=tuple(t for lin in readers.linears for t in lin.new_initializers),
            notes=notes,
        )


PATTERN = LayerNormMatMulPattern()
