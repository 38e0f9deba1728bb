"""Softmax -> TopK (-> renormalize), and TopK -> Softmax  =>  fuser.SoftmaxTopK.

Math. With p = softmax(x) along the last axis, p_i = exp(x_i - max x) / Σ_j exp(x_j - max x):
    order "softmax_topk":  (values, indices) = TopK(p, k)
    order "topk_softmax":  (t, indices) = TopK(x, k),  values = softmax(t)
    renormalize:           values = values / Σ values
TopK selects the k largest along the same (last) axis; among equal values the lower index comes
first (ONNX TopK), so the reference sorts stably. fp16 chains keep their intermediate values in
float32 and round once at the end, as onnxruntime's CPU provider runs them (it has no fp16
Softmax and drops the fp16 round trips between the ops); ties are judged there. A `Cast(to=
float)` between the two ops (`softmax(..., dtype=torch.float)`) sets `to_float32=1`: the values
come out float32.
Renormalization is `Div(values, ReduceSum(values, axes=[-1], keepdims=1))`, axes as attribute
(opset < 13) or constant input (opset >= 13). The full softmax output, if read outside the match,
is output as `probs` (softmax_topk order only).

Gating forms (`_gating`): a float32 selection bias on float16 scores (Cast up, the choice in
float32, the weights gathered from the float16 scores) is the float16 chain with a float32
bias input; a view of the scores (`Reshape` keeping [tokens, E]) before the bias is looked
through; a float16 sum written in float32 (Cast, ReduceSum, Cast back) renormalizes.

Refused, with the reason: TopK with largest=0, TopK on another axis than the softmax, k computed
at run time, a softmax not on the last axis, an opset < 13 Softmax (which coerces its input to
2-D at `axis`, default 1) unless its axis is the last one, a rank that is needed but unknown, and
a Cast between the ops to anything but float32 or the same type. A renormalization that does not
fit (other readers of the TopK values, other axes, keepdims=0) is left out of the fusion, with a
note, rather than refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from fuser.bodies import softmax_topk as softmax_topk_body
from fuser.fusedop import FLOAT_TYPES, Attr, FusedOp, Param, TensorInfo
from fuser.graph import GraphIndex
from fuser.pattern import Match, Rejection, rejection

from . import _dense_gate, _gating

#: How a Reshape of [tokens, ...] keeps the rows (the group split and its flatten back).
rows_reshape = _gating.rows_reshape

NAME = "softmax_topk"
PRIORITY = 40

SOFTMAX_TOPK_ORDER = "softmax_topk"
TOPK_SOFTMAX_ORDER = "topk_softmax"
SOFTMAX = "softmax"
SIGMOID = "sigmoid"
LOG_SOFTMAX = "log_softmax"
SCORES = (SOFTMAX, SIGMOID, LOG_SOFTMAX)
#: The gating attributes' defaults (the plain Softmax -> TopK of the first version).
DEFAULTS: dict[str, Any] = {
    "score": SOFTMAX, "n_group": 1, "topk_group": 1, "mask_value": float("-inf"),
    "epsilon": 0.0, "scale": 1.0, "dense": 0, "fill": float("-inf"),
}  # fmt: skip


# -- the fused op ---------------------------------------------------------------------------------


def _infer(
    inputs: Sequence[TensorInfo | None], attrs: Mapping[str, Any]
) -> list[TensorInfo | None]:
    x = inputs[0]
    if x is None:
        return [None, None, None]
    values_type = TensorProto.FLOAT if int(attrs["to_float32"]) else x.elem_type
    if x.shape is None or not x.shape:
        return [
            TensorInfo(values_type, None),
            TensorInfo(TensorProto.INT64, None),
            TensorInfo(x.elem_type, x.shape),
        ]
    axis = int(attrs["axis"]) % len(x.shape)
    top = (*x.shape[:axis], int(attrs["k"]), *x.shape[axis + 1 :])
    return [
        TensorInfo(values_type, x.shape if int(attrs.get("dense", 0)) else top),
        TensorInfo(TensorProto.INT64, top),
        TensorInfo(x.elem_type, x.shape),
    ]


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Softmax along `axis`, computed in float64, rounded to x's dtype; a float32 softmax's
    terms that this host's onnxruntime computes as 0 are 0 (`zero_host_underflows`)."""
    from fuser.kernels.softmax import zero_host_underflows

    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
    if x.dtype == np.float32:
        zero_host_underflows(e, x - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(x.dtype)


def _topk(x: np.ndarray, k: int, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """ONNX TopK (largest=1, sorted): a stable sort keeps the lower index first among ties."""
    order = np.argsort(-x, axis=axis, kind="stable")
    indices = np.take(order, np.arange(k), axis=axis)
    return np.take_along_axis(x, indices, axis=axis), indices.astype(np.int64)


def _renormalize(values: np.ndarray, axis: int) -> np.ndarray:
    """Div(values, ReduceSum(values, keepdims=1)), each op rounded to the values' dtype."""
    total = values.astype(np.float64).sum(axis=axis, keepdims=True).astype(values.dtype)
    return (values.astype(np.float64) / total.astype(np.float64)).astype(values.dtype)


def compute_dtype(x_dtype: np.dtype) -> np.dtype:
    """The dtype the chain's ops compute in: float32 for 16-bit inputs (onnxruntime's CPU
    provider runs fp16 Softmax/TopK/ReduceSum/Div in float32 and drops the fp16 round trips
    between them), the input's own dtype otherwise."""
    return np.dtype(np.float32) if x_dtype.itemsize < 4 else np.dtype(x_dtype)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """Sigmoid computed in float64, rounded to x's dtype."""
    with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0: the sigmoid is then 0
        return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(x.dtype)


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """LogSoftmax along `axis`, computed in float64, rounded to x's dtype."""
    x64 = x.astype(np.float64)
    shifted = x64 - x64.max(axis=axis, keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))).astype(x.dtype)


def _score(x: np.ndarray, score: str, axis: int) -> np.ndarray:
    if score == SIGMOID:
        return _sigmoid(x)
    if score == LOG_SOFTMAX:
        return _log_softmax(x, axis)
    return _softmax(x, axis)


def group_mask(choice: np.ndarray, n_group: int, topk_group: int, fill: float) -> np.ndarray:
    """DeepSeek-V3's group limit on [rows, E]: the score of each of the n_group groups of
    E / n_group experts is the sum of its top-2 (TopK 2, ReduceSum keepdims=0), the topk_group
    best groups are kept (TopK, ties to the lower group), every other expert becomes `fill`."""
    rows, experts = choice.shape
    grouped = choice.reshape(rows, n_group, experts // n_group)
    top2, _ = _topk(grouped, 2, axis=-1)
    group_scores = (top2[..., 0] + top2[..., 1]).astype(choice.dtype)  # one Add in the dtype
    _, kept = _topk(group_scores, topk_group, axis=-1)
    keep = np.zeros((rows, n_group), dtype=bool)
    np.put_along_axis(keep, kept, True, axis=-1)
    mask = np.repeat(keep, experts // n_group, axis=-1)
    return np.where(mask, choice, choice.dtype.type(fill))


def _select(
    scores: np.ndarray, bias: np.ndarray | None, attrs: Mapping[str, Any], axis: int
) -> tuple[np.ndarray, np.ndarray]:
    """(values, indices): TopK on the choice (scores [+ bias], [group-masked]), the values
    gathered from the unbiased scores at the chosen indices (the TopK's own values when the
    choice is the scores)."""
    k = int(attrs["k"])
    n_group = int(attrs["n_group"])
    choice = scores if bias is None else (scores + bias.astype(scores.dtype)).astype(scores.dtype)
    if n_group > 1:
        moved = np.moveaxis(choice, axis, -1)
        flat = moved.reshape(-1, moved.shape[-1])
        masked = group_mask(flat, n_group, int(attrs["topk_group"]), float(attrs["mask_value"]))
        choice = np.moveaxis(masked.reshape(moved.shape), -1, axis)
    _, indices = _topk(choice, k, axis)
    return np.take_along_axis(scores, indices, axis=axis), indices


def _renormalize_and_scale(values: np.ndarray, attrs: Mapping[str, Any], axis: int) -> np.ndarray:
    """Renormalize `v / (sum(v) + epsilon)` (no Add when epsilon is 0), then times `scale`
    (no Mul when 1), each op rounded to the values' dtype."""
    dtype = values.dtype
    if int(attrs["renormalize"]):
        epsilon = float(attrs["epsilon"])
        if epsilon:
            total = values.astype(np.float64).sum(axis=axis, keepdims=True).astype(dtype)
            total = (total.astype(np.float64) + np.float64(dtype.type(epsilon))).astype(dtype)
            values = (values.astype(np.float64) / total.astype(np.float64)).astype(dtype)
        else:
            values = _renormalize(values, axis)
    scale = float(attrs["scale"])
    if scale != 1.0:
        values = (values.astype(np.float64) * np.float64(dtype.type(scale))).astype(dtype)
    return values


def scattered(
    x: np.ndarray, top: np.ndarray, indices: np.ndarray, fill: float, axis: int
) -> np.ndarray:
    """ScatterElements(data, indices, top, axis) with data a tensor of x's shape and dtype
    filled with `fill` (ConstantOfShape / Expand of the constant): the dense row of the
    Llama-4 router, the k chosen logits at their experts, `fill` everywhere else. TopK's
    indices are distinct along the axis, so the scatter writes each position at most once."""
    dense = np.full(x.shape, x.dtype.type(fill), dtype=x.dtype)
    np.put_along_axis(dense, indices, top, axis=axis)
    return dense


def reference(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any]
) -> tuple[np.ndarray, ...]:
    """(values, indices, probs); `probs` is empty in topk_softmax order.

    TopK ranks the values in the dtype the original TopK sees, so ties are exactly its ties.
    With sorted=0 ONNX leaves the order of the k results unspecified; they come sorted here.
    With dense=1 (topk_softmax order) the k values are first scattered into a row of X's shape
    filled with `fill` (in X's dtype, as the exporters' ConstantOfShape / Expand hold it), and
    the score is taken of that whole row: values have X's shape.
    """
    x = inputs[0]
    assert x is not None
    bias = inputs[1] if len(inputs) > 1 else None
    axis = int(attrs["axis"]) % x.ndim
    k = int(attrs["k"])
    score = str(attrs.get("score", SOFTMAX))
    to_float32 = bool(int(attrs["to_float32"]))
    compute = compute_dtype(x.dtype)
    between = np.dtype(np.float32) if to_float32 else compute  # after the optional Cast
    full_attrs = {**DEFAULTS, **attrs}
    if attrs["order"] == TOPK_SOFTMAX_ORDER:
        top, indices = _topk(x, k, axis)
        if int(attrs.get("dense", 0)):
            top = scattered(x, top, indices, float(attrs.get("fill", float("-inf"))), axis)
        values = _score(top.astype(between), score, axis)
        probs = np.zeros((0,), dtype=x.dtype)
    else:
        full = _score(x.astype(compute), score, axis)
        values, indices = _select(full.astype(between), bias, full_attrs, axis)
        probs = full.astype(x.dtype)
    values = _renormalize_and_scale(values, full_attrs, axis)
    return values.astype(np.float32 if to_float32 else x.dtype), indices, probs


SOFTMAX_TOPK = FusedOp(
    name="SoftmaxTopK",
    doc="MoE gating: scores (softmax, sigmoid, log-softmax) and TopK along the last axis (either "
    "order), optional selection bias and expert groups, renormalized, scaled.",
    inputs=(
        Param("X", "T", "logits"),
        Param(
            "selection_bias",
            "B",
            "per-expert bias added to the scores for the choice only "
            "(DeepSeek-V3 e_score_correction_bias); the values stay unbiased",
            "optional",
        ),
    ),
    outputs=(
        Param("values", "V", "top-k probabilities (T, or float32 with to_float32)"),
        Param("indices", "tensor(int64)", "their positions along axis (ties: lower index first)"),
        Param("probs", "T", "the full softmax output (softmax_topk order only)", "optional"),
    ),
    attributes=(
        Attr("k", "int", "number of values selected"),
        Attr("axis", "int", "softmax and TopK axis (the last one)", -1),
        Attr(
            "order",
            "string",
            "softmax_topk = TopK(Softmax(X)); topk_softmax = the other",
            "softmax_topk",
        ),
        Attr("renormalize", "int", "1 = values divided by their sum (keepdims)", 0),
        Attr("sorted", "int", "as TopK (0: order of the k results unspecified)", 1),
        Attr("to_float32", "int", "1 = a Cast to float32 sits between the two ops", 0),
        Attr("score", "string", "softmax, sigmoid or log_softmax: the scores of X", SOFTMAX),
        Attr("n_group", "int", "expert groups (DeepSeek-V3 n_group; 1 = no group limit)", 1),
        Attr("topk_group", "int", "groups kept, by the sum of each group's top-2", 1),
        Attr("mask_value", "float", "the choice of experts in dropped groups", float("-inf")),
        Attr("epsilon", "float", "renormalize as v / (sum(v) + epsilon)", 0.0),
        Attr("scale", "float", "values times this (routed scaling factor)", 1.0),
        Attr(
            "dense",
            "int",
            "1 (topk_softmax order, sigmoid) = the k values are scattered into a row of X's "
            "shape filled with `fill` before the score: values have X's shape (Llama-4)",
            0,
        ),
        Attr(
            "fill",
            "float",
            "the dense row where no expert was chosen (before the score)",
            float("-inf"),
        ),
    ),
    type_constraints=(
        ("T", FLOAT_TYPES, "float tensors"),
        ("V", FLOAT_TYPES, "T, or float32 with to_float32"),
        ("B", FLOAT_TYPES, "V, or float32 on float16 X (the choice computed in float32)"),
    ),
    infer=_infer,
    reference=reference,
    body=softmax_topk_body.build,
)


# -- the pattern ---------------------------------------------------------------------------------


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def _rank(graph: GraphIndex, value: str) -> int | None:
    shape = graph.shape(value)
    return None if shape is None else len(shape)


def _is_op(graph: GraphIndex, node_id: int, op_type: str) -> bool:
    node = graph.node(node_id)
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def _softmax_axis_problem(graph: GraphIndex, softmax: onnx.NodeProto) -> str | None:
    """Why this Softmax is not a softmax over the last axis alone, or None if it is."""
    x = softmax.input[0]
    rank = _rank(graph, x)
    op = softmax.op_type
    name = softmax.name or op
    if graph.opset("") >= 13:
        axis = int(_attr(softmax, "axis", -1))
        if axis == -1 or (rank is not None and axis == rank - 1):
            return None
        if rank is None:
            return (
                f"{op} '{name}' has axis={axis} and the rank of '{x}' is unknown: "
                "cannot tell whether it is the last axis"
            )
        return f"{op} '{name}' normalizes axis {axis} of '{x}', not the last axis ({rank - 1})"
    # Before opset 13 Softmax flattens its input to 2-D at `axis` (default 1) and normalizes
    # everything from `axis` on together: a last-axis softmax only when axis is the last one.
    axis = int(_attr(softmax, "axis", 1))
    if axis == -1 or (rank is not None and axis == rank - 1):
        return None
    if rank is None:
        return (
            f"{op} '{name}' (opset {graph.opset('')}, coerced 2-D at axis {axis}) reads "
            f"'{x}' of unknown rank: cannot prove it is a last-axis softmax"
        )
    return (
        f"{op} '{name}' (opset {graph.opset('')}) normalizes dims {axis}..{rank - 1} of "
        f"'{x}' together (coerced 2-D at axis {axis}), not the last axis alone"
    )


@dataclass(frozen=True)
class _Problem:
    """Why a check failed, and the value at fault (becomes a Rejection)."""

    reason: str
    value: str | None


def _topk_problem(graph: GraphIndex, topk: onnx.NodeProto, rank: int | None) -> _Problem | int:
    """k (a constant) if this TopK selects the k largest along the last axis, else why not."""
    name = topk.name or "TopK"
    if int(_attr(topk, "largest", 1)) != 1:
        return _Problem(f"TopK '{name}' selects the smallest values (largest=0)", topk.output[0])
    axis = int(_attr(topk, "axis", -1))
    if not (axis == -1 or (rank is not None and axis == rank - 1)):
        where = "" if rank is None else f", not the last axis ({rank - 1})"
        return _Problem(
            f"TopK '{name}' works on axis {axis}{where}, but the softmax is on the last axis",
            topk.input[0],
        )
    if graph.opset("") < 10:
        k = int(_attr(topk, "k", 0))
    else:
        k_name = topk.input[1] if len(topk.input) > 1 else ""
        value = graph.constant(k_name)
        if value is None:
            why = (
                "an overridable graph input"
                if k_name in graph.graph_inputs
                else "computed at run time"
            )
            return _Problem(
                f"k '{k_name}' of TopK '{name}' is {why}; SoftmaxTopK needs a constant k", k_name
            )
        if value.size != 1:
            return _Problem(
                f"k '{k_name}' of TopK '{name}' has {value.size} elements, expected 1", k_name
            )
        k = int(value.reshape(-1)[0])
    shape = graph.shape(topk.input[0])
    size = shape[-1] if shape else None
    if k < 1 or (isinstance(size, int) and k > size):
        return _Problem(
            f"k={k} of TopK '{name}' is outside [1, {size or 'axis size'}]", topk.input[0]
        )
    return k


def _cast_between(cast: onnx.NodeProto, elem: int | None) -> _Problem | int:
    """to_float32 (0/1) for a Cast between the two ops, or why it cannot be looked through."""
    to = int(_attr(cast, "to", 0))
    if to == elem:
        return 0  # a no-op Cast
    if to == TensorProto.FLOAT:
        return 1
    target = helper.tensor_dtype_to_np_dtype(to).name if to else "an unknown type"
    return _Problem(
        f"Cast '{cast.name or 'Cast'}' between Softmax and TopK converts to {target}; "
        "SoftmaxTopK only looks through a Cast to float32 (or to the same type)",
        cast.output[0],
    )


def _through_cast(graph: GraphIndex, value: str, want: str) -> list[tuple[int | None, int]]:
    """Readers of `value` of type `want`, directly or through one Cast: (cast id, reader id)."""
    found: list[tuple[int | None, int]] = []
    for reader in graph.readers(value):
        node = graph.node(reader)
        if _is_op(graph, reader, want) and node.input[0] == value:
            found.append((None, reader))
        elif _is_op(graph, reader, "Cast"):
            found += [
                (reader, r)
                for r in graph.readers(node.output[0])
                if _is_op(graph, r, want) and graph.node(r).input[0] == node.output[0]
            ]
    return found


@dataclass(frozen=True)
class _Finish:
    """The renormalization (ReduceSum, [Add epsilon], Div) and scale (Mul) after the values."""

    nodes: tuple[int, ...] = ()
    renormalize: int = 0
    epsilon: float = 0.0
    scale: float = 1.0
    out: str = ""
    notes: tuple[str, ...] = ()


def _renormalization(
    graph: GraphIndex, values: str, rank: int | None
) -> tuple[list[int], str, float]:
    """The ReduceSum, optional Add(epsilon) and Div that renormalize `values` (empty if none),
    why they do not fit, and the epsilon (0: none)."""
    readers = graph.readers(values)
    sums = [
        r for r in readers if _is_op(graph, r, "ReduceSum") and graph.node(r).input[0] == values
    ]
    cast_ids = _sum_casts(graph, values) if not sums else []
    if cast_ids:
        sums = [cast_ids[1]]
    if not sums:
        return [], "", 0.0
    sum_id = sums[0]
    reduce = graph.node(sum_id)
    total = reduce.output[0] if not cast_ids else graph.node(cast_ids[2]).output[0]
    eps_ids: list[int] = []
    epsilon = 0.0
    denominator = total
    adds = [r for r in graph.readers(total) if _is_op(graph, r, "Add")]
    if adds:
        add = graph.node(adds[0])
        other = add.input[1] if add.input[0] == total else add.input[0]
        found = _gating.constant_scalar(graph, other, rank)
        if found is None:
            return (
                [],
                (
                    f"renormalization left unfused: the epsilon '{other}' added to the sum "
                    f"'{total}' is not a constant scalar"
                ),
                0.0,
            )
        eps_ids, epsilon, denominator = [adds[0]], found, add.output[0]
    divs = [
        r
        for r in graph.readers(denominator)
        if _is_op(graph, r, "Div")
        and graph.node(r).input[0] == values
        and graph.node(r).input[1] == denominator
    ]
    if not divs:
        return [], "", 0.0
    div_id = divs[0]
    ids = [*cast_ids[:1], sum_id, *cast_ids[2:], *eps_ids, div_id]
    left_out = f"renormalization ({', '.join(repr(graph.describe(i)) for i in ids)}) left unfused: "
    others = [r for r in readers if r not in ids]
    if others or graph.is_graph_output(values):
        who = f"read by '{graph.describe(others[0])}'" if others else "a graph output"
        return [], left_out + f"the top-k values '{values}' are also {who}", 0.0
    for inner in (total, denominator, reduce.output[0]) if eps_ids else (total, reduce.output[0]):
        if len(graph.readers(inner)) > 1 or graph.is_graph_output(inner):
            return [], left_out + f"the sum '{inner}' is also read elsewhere", 0.0
    if int(_attr(reduce, "keepdims", 1)) != 1:
        return [], left_out + "ReduceSum has keepdims=0", 0.0
    if graph.opset("") >= 13:
        axes_name = reduce.input[1] if len(reduce.input) > 1 else ""
        found_axes = graph.constant(axes_name) if axes_name else None
        axes = None if found_axes is None else [int(a) for a in found_axes.reshape(-1)]
    else:
        axes = _attr(reduce, "axes", None)
    last = {-1} if rank is None else {-1, rank - 1}
    if axes is None or len(axes) != 1 or axes[0] not in last:
        return [], left_out + f"ReduceSum axes {axes} are not the last axis alone", 0.0
    return ids, "", epsilon


def _sum_casts(graph: GraphIndex, values: str) -> list[int]:
    """[Cast up, ReduceSum, Cast back] when float16 `values` are summed in float32 (dynamo's
    `sum` of a float16 tensor: Cast(float32) -> ReduceSum -> Cast(float16)), else []. The op
    computes a float16 chain in float32 and rounds once (`compute_dtype`): the same sum."""
    if graph.elem_type(values) != TensorProto.FLOAT16:
        return []
    for up in graph.readers(values):
        if (
            not _is_op(graph, up, "Cast")
            or int(_attr(graph.node(up), "to", 0)) != TensorProto.FLOAT
        ):
            continue
        for sum_id in graph.readers(graph.node(up).output[0]):
            if not _is_op(graph, sum_id, "ReduceSum"):
                continue
            for back in graph.readers(graph.node(sum_id).output[0]):
                node = graph.node(back)
                if _is_op(graph, back, "Cast") and int(_attr(node, "to", 0)) == TensorProto.FLOAT16:
                    return [up, sum_id, back]
    return []


def _finish(graph: GraphIndex, values: str, rank: int | None) -> _Finish:
    """Renormalization and scale after `values` (each left out, with a note, if it does not fit)."""
    renorm, note, epsilon = _renormalization(graph, values, rank)
    ids = list(renorm)
    out = graph.node(ids[-1]).output[0] if ids else values
    notes: tuple[str, ...] = (note,) if note else ()
    muls = [r for r in graph.readers(out) if _is_op(graph, r, "Mul")]
    scale = 1.0
    if muls:
        mul = graph.node(muls[0])
        other = mul.input[1] if mul.input[0] == out else mul.input[0]
        found = _gating.constant_scalar(graph, other, rank)
        if found is None:
            pass  # a Mul by a tensor (the experts' outputs): not a routed scaling factor
        elif len(graph.readers(out)) > 1 or graph.is_graph_output(out):
            notes += (
                f"scale '{graph.describe(muls[0])}' left unfused: the values '{out}' are also "
                "read elsewhere",
            )
        else:
            ids, scale, out = [*ids, muls[0]], found, mul.output[0]
    return _Finish(tuple(ids), int(bool(renorm)), epsilon, scale, out, notes)


_SCORE_OF = {"Softmax": SOFTMAX, "Sigmoid": SIGMOID, "LogSoftmax": LOG_SOFTMAX}


def _view_problem(graph: GraphIndex, reshape_id: int) -> _Problem | None:
    """Why a Reshape of the [tokens, experts] scores (`scores.view(bsz * seq_len, -1)`) is not
    shown to keep them as they are, or None: a constant shape that keeps the rows, or a shape
    computed at run time whose output is typed [the same rows, experts]."""
    node = graph.node(reshape_id)
    name = node.name or "Reshape"
    before = graph.shape(node.input[0])
    if before is None or len(before) != 2 or not isinstance(before[1], int):
        return _Problem(
            f"Reshape '{name}' of the scores '{node.input[0]}' (shape "
            f"{'unknown' if before is None else list(before)}): SoftmaxTopK takes a view of "
            "[tokens, experts] scores only",
            node.input[0],
        )
    experts = before[1]
    target = graph.constant(node.input[1])
    if target is not None:
        tokens = before[0] if isinstance(before[0], int) else None
        kept = _gating.rows_reshape(
            [int(d) for d in target.reshape(-1)],
            [experts],
            tokens,
            int(_attr(node, "allowzero", 0)),
        )
        if kept == [experts]:
            return None
        why = kept if isinstance(kept, str) else f"it makes [tokens, {kept}]"
        return _Problem(
            f"Reshape '{name}' of the scores is not a view of them: {why}", node.input[1]
        )
    after = graph.shape(node.output[0])
    if (
        after is not None
        and len(after) == 2
        and _gating.same_dim(after[0], before[0])
        and after[1] == experts
    ):
        return None
    return _Problem(
        f"Reshape '{name}' of the scores '{node.input[0]}' to a shape computed at run time "
        f"('{node.input[1]}'): its output's shape does not show it keeps [tokens, {experts}]",
        node.input[1],
    )


def _uncast_problem(
    graph: GraphIndex, x: str, to_float32: int, cast_id: int | None
) -> _Problem | None:
    """Why the choice on Cast(scores, float32) cannot be fused beside weights gathered from the
    uncast scores, or None: only 16-bit scores, whose chain the op computes in float32."""
    elem = graph.elem_type(x)
    if cast_id is None or not to_float32:
        return _Problem("the scores are not cast to float32 for the choice", x)
    if elem != TensorProto.FLOAT16:
        what = "of unknown type" if not elem else helper.tensor_dtype_to_np_dtype(elem).name
        cast = graph.node(cast_id)
        return _Problem(
            f"the choice reads Cast '{cast.name or 'Cast'}' of the {what} scores to float32 "
            "while the weights are gathered from the uncast scores; SoftmaxTopK takes that "
            "only for float16 scores (whose chain it computes in float32)",
            cast.output[0],
        )
    return None


@dataclass(frozen=True)
class SoftmaxTopKPattern:
    """Scores (Softmax, Sigmoid, LogSoftmax) -> [Cast] -> [bias, group limit] -> TopK [->
    gather, renormalize, scale], or TopK -> [Cast] -> Softmax/Sigmoid, or TopK ->
    ScatterElements(fill) -> [Cast] -> Sigmoid [-> Cast] (Llama-4); anchored at the score op."""

    name: str = NAME
    description: str = (
        "Softmax/Sigmoid/LogSoftmax -> [bias, expert groups] -> TopK (-> renormalize [+eps], "
        "scale), TopK -> Softmax/Sigmoid, or TopK -> ScatterElements(-inf) -> Sigmoid "
        "=> SoftmaxTopK"
    )
    anchors: tuple[tuple[str, str], ...] = (("", "Softmax"), ("", "Sigmoid"), ("", "LogSoftmax"))
    ops: tuple[FusedOp, ...] = (SOFTMAX_TOPK,)

    def match(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None:
        softmax = graph.node(node_id)
        score = _SCORE_OF[softmax.op_type]
        if score == SIGMOID:
            dense = _dense_gate.dense_scatter(graph, node_id)
            if isinstance(dense, _gating.Problem):
                return rejection(self.name, graph, [node_id], dense.reason, dense.value)
            if dense is not None:
                return self._match_dense(graph, node_id, dense)
        if score != LOG_SOFTMAX:
            before = self._topk_before(graph, softmax)
            if before is not None:
                return self._match_topk_softmax(graph, node_id, *before)
        casts = [
            r for r in graph.readers(softmax.output[0])
            if _is_op(graph, r, "Cast") and graph.node(r).input[0] == softmax.output[0]
        ]  # fmt: skip
        views = [
            r for r in graph.readers(softmax.output[0])
            if _is_op(graph, r, "Reshape") and graph.node(r).input[0] == softmax.output[0]
        ]  # fmt: skip
        for cast_id in [None, *casts, *views]:
            scores = softmax.output[0] if cast_id is None else graph.node(cast_id).output[0]
            uncast = softmax.output[0] if cast_id is not None else None
            view = cast_id is not None and cast_id in views

            def experts(scores: str = scores, view: bool = view) -> int | None:
                """The experts' count, from the scores' shape: asked only of a gate's scores
                (an attention Softmax's shape is not looked up)."""
                shape = graph.shape(scores)
                found = shape[-1] if shape and isinstance(shape[-1], int) else None
                if view and found is None:  # a view keeps the experts (checked below)
                    unviewed = graph.shape(softmax.output[0])
                    found = unviewed[-1] if unviewed and isinstance(unviewed[-1], int) else None
                return found

            found = _gating.selection(graph, scores, experts, uncast)
            ids = [node_id, *([cast_id] if cast_id is not None else [])]
            if view and found is not None:
                assert cast_id is not None
                problem = _view_problem(graph, cast_id)
                if problem is not None:
                    return rejection(self.name, graph, ids, problem.reason, problem.value)
            if isinstance(found, _gating.Problem):
                return rejection(self.name, graph, ids, found.reason, found.value)
            if found is not None:
                return self._match_selection(graph, node_id, cast_id, found)
        after = _through_cast(graph, softmax.output[0], "TopK")
        if not after:
            return None
        cast_id, topk_id = after[0]
        return self._match_softmax_topk(graph, node_id, cast_id, topk_id)

    @staticmethod
    def _topk_before(graph: GraphIndex, softmax: onnx.NodeProto) -> tuple[int | None, int] | None:
        """(Cast id or None, TopK id) when the Softmax reads TopK values, maybe through a Cast."""
        cast_id, value, producer = _gating.through_cast(graph, softmax.input[0])
        if producer is None or not _is_op(graph, producer, "TopK"):
            return None
        if graph.node(producer).output[0] != value:
            return None
        return cast_id, producer

    def _match_selection(
        self, graph: GraphIndex, softmax_id: int, cast_id: int | None, sel: _gating.Selection
    ) -> Match | Rejection:
        softmax, topk = graph.node(softmax_id), graph.node(sel.topk)
        x = softmax.input[0]
        ids = [softmax_id, *([cast_id] if cast_id is not None else []), *sel.nodes[:-1], sel.topk,
               sel.nodes[-1]]  # fmt: skip
        rank = _rank(graph, x)
        view = cast_id is not None and _is_op(graph, cast_id, "Reshape")  # checked by match
        common = self._common_checks(graph, softmax, topk, None if view else cast_id, rank, x)
        if isinstance(common, _Problem):
            return rejection(self.name, graph, ids, common.reason, common.value)
        k, to_float32 = common
        if sel.uncast and not view:
            # A float32 bias on 16-bit scores: Cast(scores, float32) + bias chooses, the
            # weights come from the scores themselves. The op computes a 16-bit chain's scores
            # and choice in float32 (`compute_dtype`), so this is that chain with a float32
            # bias and values in X's type; for other types the Cast would round.
            uncast = _uncast_problem(graph, x, to_float32, cast_id)
            if uncast is not None:
                return rejection(self.name, graph, ids, uncast.reason, uncast.value)
            to_float32 = 0
        if rank != 2 and sel.n_group > 1:
            return rejection(
                self.name, graph, ids,
                f"the expert-group limit reads '{x}' of rank {rank}; SoftmaxTopK takes it on "
                "[tokens, experts]", x,
            )  # fmt: skip
        fin = _finish(graph, sel.values, rank)
        attrs = self._attributes(k, SOFTMAX_TOPK_ORDER, fin, topk, to_float32, softmax)
        attrs.update(n_group=sel.n_group, topk_group=sel.topk_group, mask_value=sel.mask_value)
        indices = topk.output[1]
        inputs = (x, sel.bias) if sel.bias else (x,)
        return Match(
            self.name, SOFTMAX_TOPK, tuple(ids + list(fin.nodes)), inputs,
            (fin.out or sel.values, indices, ""), attrs,
            exportable={softmax.output[0]: 2}, notes=fin.notes,
        )  # fmt: skip

    def _match_softmax_topk(
        self, graph: GraphIndex, softmax_id: int, cast_id: int | None, topk_id: int
    ) -> Match | Rejection:
        softmax, topk = graph.node(softmax_id), graph.node(topk_id)
        x = softmax.input[0]
        ids = [softmax_id, *([cast_id] if cast_id is not None else []), topk_id]
        rank = _rank(graph, x)
        common = self._common_checks(graph, softmax, topk, cast_id, rank, x)
        if isinstance(common, _Problem):
            return rejection(self.name, graph, ids, common.reason, common.value)
        k, to_float32 = common
        values = topk.output[0]
        fin = _finish(graph, values, rank)
        attrs = self._attributes(k, SOFTMAX_TOPK_ORDER, fin, topk, to_float32, softmax)
        outputs = (fin.out or values, topk.output[1] if len(topk.output) > 1 else "", "")
        return Match(
            self.name, SOFTMAX_TOPK, tuple(ids + list(fin.nodes)), (x,), outputs, attrs,
            exportable={softmax.output[0]: 2}, notes=fin.notes,
        )  # fmt: skip

    def _match_dense(
        self, graph: GraphIndex, sigmoid_id: int, dense: _dense_gate.Dense
    ) -> Match | Rejection:
        """Llama-4: TopK -> ScatterElements into a constant row -> [Cast] -> Sigmoid [-> Cast]:
        order topk_softmax, score sigmoid, dense=1 (fill when not -inf)."""
        topk = graph.node(dense.topk)
        x = topk.input[0]
        ids = [dense.topk, *dense.nodes]
        rank = _rank(graph, x)
        k = _topk_problem(graph, topk, rank)
        if isinstance(k, _Problem):
            return rejection(self.name, graph, ids, k.reason, k.value)
        attrs = self._attributes(
            k, TOPK_SOFTMAX_ORDER, _Finish(), topk, dense.to_float32, graph.node(sigmoid_id)
        )
        attrs["dense"] = 1
        if dense.fill != float("-inf"):
            attrs["fill"] = dense.fill
        # Every value after the scatter has X's shape: a Shape that reads one reads X instead.
        rows = {graph.node(i).output[0]: x for i in dense.nodes if graph.node(i).output[0]}
        return Match(
            self.name, SOFTMAX_TOPK, tuple(ids), (x,), (dense.out, topk.output[1], ""), attrs,
            shape_sources={v: s for v, s in rows.items() if v != dense.out},
        )  # fmt: skip

    def _match_topk_softmax(
        self, graph: GraphIndex, softmax_id: int, cast_id: int | None, topk_id: int
    ) -> Match | Rejection:
        softmax, topk = graph.node(softmax_id), graph.node(topk_id)
        x = topk.input[0]
        ids = [topk_id, *([cast_id] if cast_id is not None else []), softmax_id]
        rank = _rank(graph, x)
        common = self._common_checks(graph, softmax, topk, cast_id, rank, x)
        if isinstance(common, _Problem):
            return rejection(self.name, graph, ids, common.reason, common.value)
        k, to_float32 = common
        fin = _finish(graph, softmax.output[0], rank)
        attrs = self._attributes(k, TOPK_SOFTMAX_ORDER, fin, topk, to_float32, softmax)
        outputs = (fin.out or softmax.output[0], topk.output[1] if len(topk.output) > 1 else "", "")
        return Match(
            self.name, SOFTMAX_TOPK, tuple(ids + list(fin.nodes)), (x,), outputs, attrs,
            notes=fin.notes,
        )  # fmt: skip

    @staticmethod
    def _common_checks(
        graph: GraphIndex,
        softmax: onnx.NodeProto,
        topk: onnx.NodeProto,
        cast_id: int | None,
        rank: int | None,
        x: str,
    ) -> tuple[int, int] | _Problem:
        """(k, to_float32), or why the two ops cannot be fused."""
        if softmax.op_type != "Sigmoid":  # elementwise: any axis is its axis
            axis_problem = _softmax_axis_problem(graph, softmax)
            if axis_problem is not None:
                return _Problem(axis_problem, softmax.input[0])
        k = _topk_problem(graph, topk, rank)
        if isinstance(k, _Problem):
            return k
        to_float32 = 0
        if cast_id is not None:
            cast = _cast_between(graph.node(cast_id), graph.elem_type(x))
            if isinstance(cast, _Problem):
                return cast
            to_float32 = cast
        return k, to_float32

    @staticmethod
    def _attributes(
        k: int,
        order: str,
        fin: _Finish,
        topk: onnx.NodeProto,
        to_float32: int,
        score_node: onnx.NodeProto,
    ) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "k": k,
            "axis": -1,
            "order": order,
            "renormalize": fin.renormalize,
            "sorted": int(_attr(topk, "sorted", 1)),
            "to_float32": to_float32,
        }
        # The gating attributes only where they differ from the softmax chain's (older fused
        # models and their bodies stay as they were).
        score = _SCORE_OF[score_node.op_type]
        if score != SOFTMAX:
            attrs["score"] = score
        if fin.epsilon:
            attrs["epsilon"] = fin.epsilon
        if fin.scale != 1.0:
            attrs["scale"] = fin.scale
        return attrs


PATTERN = SoftmaxTopKPattern()
