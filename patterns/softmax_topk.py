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

NAME = "softmax_topk"
PRIORITY = 40

SOFTMAX_TOPK_ORDER = "softmax_topk"
TOPK_SOFTMAX_ORDER = "topk_softmax"


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
        TensorInfo(values_type, top),
        TensorInfo(TensorProto.INT64, top),
        TensorInfo(x.elem_type, x.shape),
    ]


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Softmax along `axis`, computed in float64, rounded to x's dtype."""
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
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


def reference(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any]
) -> tuple[np.ndarray, ...]:
    """(values, indices, probs); `probs` is empty in topk_softmax order.

    TopK ranks the values in the dtype the original TopK sees, so ties are exactly its ties.
    With sorted=0 ONNX leaves the order of the k results unspecified; they come sorted here.
    """
    x = inputs[0]
    assert x is not None
    axis = int(attrs["axis"]) % x.ndim
    k = int(attrs["k"])
    to_float32 = bool(int(attrs["to_float32"]))
    compute = compute_dtype(x.dtype)
    between = np.dtype(np.float32) if to_float32 else compute  # after the optional Cast
    if attrs["order"] == TOPK_SOFTMAX_ORDER:
        top, indices = _topk(x, k, axis)
        values = _softmax(top.astype(between), axis)
        probs = np.zeros((0,), dtype=x.dtype)
    else:
        full = _softmax(x.astype(compute), axis)
        values, indices = _topk(full.astype(between), k, axis)
        probs = full.astype(x.dtype)
    if int(attrs["renormalize"]):
        values = _renormalize(values, axis)
    return values.astype(np.float32 if to_float32 else x.dtype), indices, probs


SOFTMAX_TOPK = FusedOp(
    name="SoftmaxTopK",
    doc="Softmax and TopK along the last axis (either order), optionally renormalized.",
    inputs=(Param("X", "T", "logits"),),
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
    ),
    type_constraints=(
        ("T", FLOAT_TYPES, "float tensors"),
        ("V", FLOAT_TYPES, "T, or float32 with to_float32"),
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
    name = softmax.name or "Softmax"
    if graph.opset("") >= 13:
        axis = int(_attr(softmax, "axis", -1))
        if axis == -1 or (rank is not None and axis == rank - 1):
            return None
        if rank is None:
            return (
                f"Softmax '{name}' has axis={axis} and the rank of '{x}' is unknown: "
                "cannot tell whether it is the last axis"
            )
        return f"Softmax '{name}' normalizes axis {axis} of '{x}', not the last axis ({rank - 1})"
    # Before opset 13 Softmax flattens its input to 2-D at `axis` (default 1) and normalizes
    # everything from `axis` on together: a last-axis softmax only when axis is the last one.
    axis = int(_attr(softmax, "axis", 1))
    if axis == -1 or (rank is not None and axis == rank - 1):
        return None
    if rank is None:
        return (
            f"Softmax '{name}' (opset {graph.opset('')}, coerced 2-D at axis {axis}) reads "
            f"'{x}' of unknown rank: cannot prove it is a last-axis softmax"
        )
    return (
        f"Softmax '{name}' (opset {graph.opset('')}) normalizes dims {axis}..{rank - 1} of "
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


def _renormalization(graph: GraphIndex, values: str, rank: int | None) -> tuple[list[int], str]:
    """The ReduceSum and Div that renormalize `values` (empty if none), or why they do not fit."""
    readers = graph.readers(values)
    sums = [
        r for r in readers if _is_op(graph, r, "ReduceSum") and graph.node(r).input[0] == values
    ]
    if not sums:
        return [], ""
    sum_id = sums[0]
    reduce = graph.node(sum_id)
    total = reduce.output[0]
    divs = [
        r
        for r in graph.readers(total)
        if _is_op(graph, r, "Div")
        and graph.node(r).input[0] == values
        and graph.node(r).input[1] == total
    ]
    if not divs:
        return [], ""
    div_id = divs[0]
    left_out = (
        f"renormalization ('{graph.describe(sum_id)}', '{graph.describe(div_id)}') left unfused: "
    )
    others = [r for r in readers if r not in (sum_id, div_id)]
    if others or graph.is_graph_output(values):
        who = f"read by '{graph.describe(others[0])}'" if others else "a graph output"
        return [], left_out + f"the top-k values '{values}' are also {who}"
    if len(graph.readers(total)) > 1 or graph.is_graph_output(total):
        return [], left_out + f"the sum '{total}' is also read elsewhere"
    if int(_attr(reduce, "keepdims", 1)) != 1:
        return [], left_out + "ReduceSum has keepdims=0"
    if graph.opset("") >= 13:
        axes_name = reduce.input[1] if len(reduce.input) > 1 else ""
        found = graph.constant(axes_name) if axes_name else None
        axes = None if found is None else [int(a) for a in found.reshape(-1)]
    else:
        axes = _attr(reduce, "axes", None)
    last = {-1} if rank is None else {-1, rank - 1}
    if axes is None or len(axes) != 1 or axes[0] not in last:
        return [], left_out + f"ReduceSum axes {axes} are not the last axis alone"
    return [sum_id, div_id], ""


@dataclass(frozen=True)
class SoftmaxTopKPattern:
    """Softmax -> [Cast] -> TopK [-> renormalize], or TopK -> [Cast] -> Softmax; anchored at
    the Softmax."""

    name: str = NAME
    description: str = (
        "Softmax -> TopK (-> ReduceSum/Div renormalize), or TopK -> Softmax => SoftmaxTopK"
    )
    anchors: tuple[tuple[str, str], ...] = (("", "Softmax"),)
    ops: tuple[FusedOp, ...] = (SOFTMAX_TOPK,)

    def match(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None:
        softmax = graph.node(node_id)
        before = self._topk_before(graph, softmax)
        if before is not None:
            return self._match_topk_softmax(graph, node_id, *before)
        after = _through_cast(graph, softmax.output[0], "TopK")
        if not after:
            return None
        cast_id, topk_id = after[0]
        return self._match_softmax_topk(graph, node_id, cast_id, topk_id)

    @staticmethod
    def _topk_before(graph: GraphIndex, softmax: onnx.NodeProto) -> tuple[int | None, int] | None:
        """(Cast id or None, TopK id) when the Softmax reads TopK values, maybe through a Cast."""
        cast_id = None
        value = softmax.input[0]
        producer = graph.producer.get(value)
        if producer is not None and _is_op(graph, producer, "Cast"):
            cast_id, value = producer, graph.node(producer).input[0]
            producer = graph.producer.get(value)
        if producer is None or not _is_op(graph, producer, "TopK"):
            return None
        if graph.node(producer).output[0] != value:
            return None
        return cast_id, producer

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
        renorm, note = _renormalization(graph, values, rank)
        out_values = graph.node(renorm[-1]).output[0] if renorm else values
        attrs = self._attributes(k, SOFTMAX_TOPK_ORDER, renorm, topk, to_float32)
        outputs = (out_values, topk.output[1] if len(topk.output) > 1 else "", "")
        return Match(
            self.name, SOFTMAX_TOPK, tuple(ids + renorm), (x,), outputs, attrs,
            exportable={softmax.output[0]: 2}, notes=(note,) if note else (),
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
        renorm, note = _renormalization(graph, softmax.output[0], rank)
        out_values = graph.node(renorm[-1]).output[0] if renorm else softmax.output[0]
        attrs = self._attributes(k, TOPK_SOFTMAX_ORDER, renorm, topk, to_float32)
        outputs = (out_values, topk.output[1] if len(topk.output) > 1 else "", "")
        return Match(
            self.name,
            SOFTMAX_TOPK,
            tuple(ids + renorm),
            (x,),
            outputs,
            attrs,
            notes=(note,) if note else (),
        )

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
        k: int, order: str, renorm: list[int], topk: onnx.NodeProto, to_float32: int
    ) -> dict[str, Any]:
        return {
            "k": k,
            "axis": -1,
            "order": order,
            "renormalize": 1 if renorm else 0,
            "sorted": int(_attr(topk, "sorted", 1)),
            "to_float32": to_float32,
        }


PATTERN = SoftmaxTopKPattern()
