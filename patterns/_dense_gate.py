"""The dense half of Llama-4's router after its logits X: the walk `softmax_topk` uses to find
transformers' `Llama4Router` as the exporters write it (TorchScript opset 14, dynamo opset 18).

    top, idx = TopK(X, k)                                       (largest, last axis)
    row = ScatterElements(fill like X, idx, top, axis=last)     fill: ConstantOfShape(Shape(X))
                                                                or Expand(scalar, Shape(X))
    scores = [Cast float32] -> Sigmoid -> [Cast back]           (`sigmoid(x.float()).to(dtype)`)

Anchored at the Sigmoid. A Sigmoid that reads no ScatterElements fed by a TopK is not this
form (None, no near-miss); once the scatter is fed by a TopK, every check that fails says why
and names the value. Any constant fill is exact (the op's reference scatters it in X's dtype and
takes the sigmoid of the whole row, as the chain does), provided float32 holds it (attributes
are float32) and it is a number: a NaN fill is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from fuser.graph import GraphIndex

from ._gating import Problem, attr, filled_like, is_op, through_cast

_ELEM_NAMES: dict[int, str] = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.DOUBLE: "float64",
}


@dataclass(frozen=True)
class Dense:
    """What the walk found: the TopK, the nodes after it (fill, scatter, casts, the Sigmoid,
    in graph order; the TopK excluded), the fill, whether the sigmoid runs on a float32 copy
    of a narrower X (`to_float32`) and the value holding the dense scores."""

    topk: int
    nodes: tuple[int, ...]
    fill: float
    to_float32: int
    out: str


def _name(graph: GraphIndex, node_id: int) -> str:
    node = graph.node(node_id)
    return node.name or node.op_type


def _only_reader(graph: GraphIndex, value: str, reader: int) -> bool:
    return graph.readers(value) == [reader] and not graph.is_graph_output(value)


def _axis(value: int, rank: int | None) -> int | None:
    """`value` as a non-negative axis, or None when it is negative and the rank is unknown."""
    if value >= 0:
        return value
    return None if rank is None else value + rank


def dense_scatter(graph: GraphIndex, sigmoid_id: int) -> Dense | Problem | None:
    """The TopK -> ScatterElements(fill) -> [Cast] -> Sigmoid [-> Cast] form ending at the
    Sigmoid `sigmoid_id`, why it does not fit, or None when the Sigmoid reads no such scatter."""
    sigmoid = graph.node(sigmoid_id)
    cast_id, _, producer = through_cast(graph, sigmoid.input[0])
    if producer is None or not is_op(graph, producer, "ScatterElements"):
        return None
    scatter_id, scatter = producer, graph.node(producer)
    data, indices, updates = [*scatter.input, "", "", ""][:3]
    topk_id = graph.producer.get(updates)
    by_index = graph.producer.get(indices)
    if topk_id is None or not is_op(graph, topk_id, "TopK"):
        if by_index is not None and is_op(graph, by_index, "TopK"):
            return Problem(
                f"ScatterElements '{_name(graph, scatter_id)}' writes '{updates}', not the values "
                f"of TopK '{_name(graph, by_index)}' whose indices it scatters at",
                updates,
            )
        return None  # a scatter of something else: not a router
    topk = graph.node(topk_id)
    sname, tname = _name(graph, scatter_id), _name(graph, topk_id)
    if topk.output[0] != updates:
        return Problem(
            f"ScatterElements '{sname}' writes the indices of TopK '{tname}', not its values",
            updates,
        )
    if len(topk.output) < 2 or indices != topk.output[1]:
        return Problem(
            f"ScatterElements '{sname}' scatters at '{indices}', not at the indices of TopK "
            f"'{tname}' ('{topk.output[1] if len(topk.output) > 1 else ''}')",
            indices,
        )
    x = topk.input[0]
    shape = graph.shape(x)
    rank = None if shape is None else len(shape)
    scatter_axis = _axis(int(attr(scatter, "axis", 0)), rank)
    topk_axis = _axis(int(attr(topk, "axis", -1)), rank)
    if scatter_axis is None or topk_axis is None or scatter_axis != topk_axis:
        return Problem(
            f"ScatterElements '{sname}' scatters along axis {int(attr(scatter, 'axis', 0))}, "
            f"TopK '{tname}' selects along axis {int(attr(topk, 'axis', -1))}"
            + (" (rank unknown: cannot tell they agree)" if rank is None else ""),
            scatter.output[0],
        )
    reduction = attr(scatter, "reduction", b"none")
    if reduction not in (b"none", "none"):
        red = reduction.decode() if isinstance(reduction, bytes) else reduction
        return Problem(
            f"ScatterElements '{sname}' has reduction={red}: the dense row is not a plain write",
            scatter.output[0],
        )
    others = [r for r in graph.readers(updates) if r != scatter_id]
    if others or graph.is_graph_output(updates):
        who = f"read by '{graph.describe(others[0])}'" if others else "a graph output"
        return Problem(
            f"the values '{updates}' of TopK '{tname}' are also {who}; SoftmaxTopK's dense form "
            "outputs only the scattered row",
            updates,
        )
    found = filled_like(graph, data, x, rank)
    if found is None:
        return Problem(
            f"ScatterElements '{sname}' writes into '{data}', not a constant fill shaped as "
            f"the logits '{x}' (ConstantOfShape or Expand of a scalar over Shape('{x}'))",
            data,
        )
    fill, fill_nodes = found
    if math.isnan(fill):
        return Problem(f"the fill '{data}' of ScatterElements '{sname}' is NaN", data)
    if not math.isinf(fill) and float(np.float32(fill)) != fill:
        return Problem(
            f"the fill {fill!r} of '{data}' is not a float32 value (the fill attribute is float32)",
            data,
        )
    # The fill and its Shape are fused when nothing else reads them.
    fill_id, shape_id = fill_nodes
    kept = [fill_id] if _only_reader(graph, data, scatter_id) else []
    if kept and _only_reader(graph, graph.node(fill_id).input[-1], fill_id):
        kept.append(shape_id)
    x_elem = graph.elem_type(x)
    to_float32 = 0
    if cast_id is not None:
        to = int(attr(graph.node(cast_id), "to", 0))
        if to == TensorProto.FLOAT and x_elem != TensorProto.FLOAT:
            to_float32 = 1
        elif to != x_elem:
            return Problem(
                f"Cast '{_name(graph, cast_id)}' before Sigmoid '{_name(graph, sigmoid_id)}' "
                f"converts the scattered row to {_ELEM_NAMES.get(to, f'type {to}')}; only a "
                "Cast to float32 (or to the same type) is looked through",
                graph.node(cast_id).output[0],
            )
    nodes = [*reversed(kept), scatter_id, *([cast_id] if cast_id is not None else []), sigmoid_id]
    out = sigmoid.output[0]
    back = _cast_back(graph, out, x_elem, to_float32)
    if back is not None:
        nodes.append(back)
        out = graph.node(back).output[0]
        to_float32 = 0
    return Dense(topk_id, tuple(nodes), fill, to_float32, out)


def _cast_back(graph: GraphIndex, out: str, x_elem: int | None, to_float32: int) -> int | None:
    """The Cast after the Sigmoid that the fused op absorbs, or None: a no-op Cast (fp32 model,
    TorchScript's `.float()` / `.to(float32)`), or the Cast of the float32 sigmoid back to a
    16-bit X (`.to(dtype)`): the op computes 16-bit rows in float32 and rounds once at the end,
    the same numbers. Not a float64 X: its float32 detour rounds, which the op without
    to_float32 would not."""
    readers = graph.readers(out)
    if len(readers) != 1 or graph.is_graph_output(out) or not is_op(graph, readers[0], "Cast"):
        return None
    to = int(attr(graph.node(readers[0]), "to", 0))
    current = TensorProto.FLOAT if to_float32 else x_elem
    if to == current:
        return readers[0] if to_float32 == 0 else None  # float32 stays: values are float32
    narrow = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
    if to_float32 and to == x_elem and x_elem in narrow:
        return readers[0]
    return None
