"""com.microsoft AllGather -> MatMul (-> Add bias)  =>  fuser.AllGatherMatMul.

Math. Rank r of a group of G holds the shard X_r; AllGather concatenates the shards in rank
order along `axis`, and a Linear layer follows:
    G_all = concat(X_0, ..., X_{G-1}, axis),   Y = G_all @ W (+ B)
with W (and B) constant on this rank. Tensor parallelism gathers on the hidden (last) axis,
sequence parallelism on the sequence axis; the math is the same. One fused op lets the kernel
overlap the exchange with the matmul (each arriving shard's rows, or its slice of the
contraction, can be multiplied at once). The plugin passes `reference` all shards stacked on a
new leading axis ([G, *shard], `FusedOp.collective_input`), so it concatenates them itself.

`axis`: the AllGather schema says the default is 1 but onnxruntime's shape inference and kernel
use 0 and accept no negative axis. fuser follows onnxruntime (an absent axis is 0, noted in
the report) and stores a non-negative axis, normalized against the rank of the shard as shape
inference knows it.

Refused, with the reason: AllGather without group_size (or < 1), a negative axis on a shard of
unknown rank, an axis out of range, the gathered tensor only as the right operand of its
MatMuls, a weight computed at run time (or an overridable graph input). A bias Add that does
not fit (computed at run time, broadcasting beyond [.., N], or a MatMul output read elsewhere)
is left out of the fusion, with a note, rather than refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from fuser.bodies import allgather_matmul as allgather_matmul_body
from fuser.fusedop import FLOAT_TYPES, Attr, FusedOp, Param, TensorInfo, matmul_shape
from fuser.graph import GraphIndex
from fuser.pattern import Match, Rejection, rejection

NAME = "allgather_matmul"
PRIORITY = 40
MS_DOMAIN = "com.microsoft"
# onnxruntime's AllGather (shape inference and kernel) defaults to 0, not the schema's 1.
RUNTIME_DEFAULT_AXIS = 0


# -- the fused op ---------------------------------------------------------------------------------


def _infer(
    inputs: Sequence[TensorInfo | None], attrs: Mapping[str, Any]
) -> list[TensorInfo | None]:
    x, w = inputs[0], inputs[1]
    if x is None:
        return [None, None]
    if x.shape is None:
        return [TensorInfo(x.elem_type, None), TensorInfo(x.elem_type, None)]
    axis, group = int(attrs["axis"]), int(attrs["group_size"])
    dim = x.shape[axis]
    gathered = (
        *x.shape[:axis],
        dim * group if isinstance(dim, int) else None,
        *x.shape[axis + 1 :],
    )
    y = None if w is None or w.shape is None else matmul_shape(gathered, w.shape)
    return [TensorInfo(x.elem_type, y), TensorInfo(x.elem_type, gathered)]


def reference(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any]
) -> tuple[np.ndarray, ...]:
    """(Y, gathered): input 0 holds every rank's shard, stacked [group_size, *shard].

    MatMul and Add are each computed in float64 and rounded to the input dtype, as the two
    original ops round their results.
    """
    shards, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    assert shards is not None
    assert w is not None
    gathered = np.concatenate(list(shards), axis=int(attrs["axis"]))
    dtype = gathered.dtype
    y = np.matmul(gathered.astype(np.float64), w.astype(np.float64)).astype(dtype)
    if b is not None:
        y = (y.astype(np.float64) + b.astype(np.float64)).astype(dtype)
    return y, gathered


ALLGATHER_MATMUL = FusedOp(
    name="AllGatherMatMul",
    doc="AllGather of the ranks' shards along axis, then MatMul with a constant weight (+ bias).",
    inputs=(
        Param("X", "T", "this rank's shard"),
        Param("W", "T", "weight (right operand of the MatMul)"),
        Param("B", "T", "bias, broadcast along the last axis of Y", "optional"),
    ),
    outputs=(
        Param("Y", "T", "concat(shards, axis) @ W (+ B)"),
        Param("gathered", "T", "concat(shards, axis), when read outside the match", "optional"),
    ),
    attributes=(
        Attr("group_size", "int", "number of ranks gathered"),
        Attr("axis", "int", "gather axis, non-negative (normalized at fuse time)"),
    ),
    type_constraints=(("T", FLOAT_TYPES, "float tensors"),),
    infer=_infer,
    reference=reference,
    body=allgather_matmul_body.build,
    collective_input=0,
)


# -- the pattern ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    """Why a check failed, and the value at fault (becomes a Rejection)."""

    reason: str
    value: str | None


def _attr(node: onnx.NodeProto, name: str) -> Any:
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return None


def _gather_attributes(
    graph: GraphIndex, gather: onnx.NodeProto
) -> tuple[int, int, list[str]] | _Problem:
    """(group_size, non-negative axis, notes) of an AllGather, or why they cannot be known."""
    name, x = gather.name or "AllGather", gather.input[0]
    group_size = _attr(gather, "group_size")
    if group_size is None:
        return _Problem(f"AllGather '{name}' has no group_size attribute", gather.output[0])
    if int(group_size) < 1:
        return _Problem(f"AllGather '{name}' has group_size={group_size}", gather.output[0])
    notes: list[str] = []
    axis = _attr(gather, "axis")
    if axis is None:
        axis = RUNTIME_DEFAULT_AXIS
        notes.append(
            f"AllGather '{name}' has no axis: used onnxruntime's default 0 (the schema says 1)"
        )
    axis = int(axis)
    shape = graph.shape(x)
    if shape is None:
        if axis < 0:
            return _Problem(
                f"AllGather '{name}' has axis={axis} and the rank of its input '{x}' is unknown "
                "to shape inference: cannot normalize the axis (onnxruntime accepts no "
                "negative axis)",
                x,
            )
        return int(group_size), axis, notes
    rank = len(shape)
    if not -rank <= axis < rank:
        return _Problem(f"AllGather '{name}' axis={axis} is out of range for rank-{rank} '{x}'", x)
    if axis < 0:
        notes.append(f"AllGather '{name}' axis {axis} normalized to {axis % rank} (rank {rank})")
    return int(group_size), axis % rank, notes


def _weight_problem(graph: GraphIndex, matmul_id: int) -> _Problem | None:
    w = graph.node(matmul_id).input[1]
    if graph.constant(w) is not None:
        return None
    why = "an overridable graph input" if w in graph.graph_inputs else "computed at run time"
    return _Problem(
        f"weight '{w}' of MatMul '{graph.describe(matmul_id)}' is {why}; AllGatherMatMul needs "
        "a constant weight",
        w,
    )


def _bias(graph: GraphIndex, matmul_id: int) -> tuple[int | None, str, str]:
    """(Add id, bias name, note): the bias Add after the MatMul, if it can join the fusion."""
    y = graph.node(matmul_id).output[0]
    readers = graph.readers(y)
    adds = [r for r in readers if graph.node(r).op_type == "Add" and graph.node(r).domain == ""]
    if not adds:
        return None, "", ""
    add_id = adds[0]
    add = graph.node(add_id)
    bias = add.input[1] if add.input[0] == y else add.input[0]
    left_out = f"bias Add '{graph.describe(add_id)}' left unfused: "
    if bias == y:
        return None, "", left_out + "it adds the MatMul output to itself"
    if len(readers) > 1 or graph.is_graph_output(y):
        return None, "", left_out + f"the MatMul output '{y}' is also read elsewhere"
    value = graph.constant(bias)
    if value is None:
        return None, "", left_out + f"'{bias}' is not a constant"
    weight = graph.constant(graph.node(matmul_id).input[1])
    n = weight.shape[-1] if weight is not None and weight.ndim >= 2 else None
    y_shape = graph.shape(y)
    # A bias only adds along Y's last axis: it may not broadcast Y to a larger shape.
    fits = value.ndim == 0 or (
        all(d == 1 for d in value.shape[:-1])
        and value.shape[-1] in (1, n)
        and (value.ndim == 1 or (y_shape is not None and value.ndim <= len(y_shape)))
    )
    if not fits:
        return (
            None,
            "",
            left_out
            + (f"'{bias}' of shape {list(value.shape)} is not a bias over the last axis ({n})"),
        )
    return add_id, bias, ""


@dataclass(frozen=True)
class AllGatherMatMulPattern:
    """com.microsoft AllGather -> MatMul (gathered tensor on the left) -> Add bias (optional);
    anchored at the AllGather."""

    name: str = NAME
    description: str = "com.microsoft AllGather -> MatMul (-> Add bias) => AllGatherMatMul"
    anchors: tuple[tuple[str, str], ...] = ((MS_DOMAIN, "AllGather"),)
    ops: tuple[FusedOp, ...] = (ALLGATHER_MATMUL,)

    def match(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None:
        gather = graph.node(node_id)
        gathered = gather.output[0]
        matmuls = [
            r
            for r in graph.readers(gathered)
            if graph.node(r).op_type == "MatMul" and graph.node(r).domain in ("", "ai.onnx")
        ]
        if not matmuls:
            return None
        left = [r for r in matmuls if graph.node(r).input[0] == gathered]
        if not left:
            return rejection(
                self.name, graph, [node_id, matmuls[0]],
                f"gathered tensor '{gathered}' is the right operand of MatMul "
                f"'{graph.describe(matmuls[0])}'; AllGatherMatMul gathers the left operand",
                gathered,
            )  # fmt: skip
        found = _gather_attributes(graph, gather)
        if isinstance(found, _Problem):
            return rejection(self.name, graph, [node_id, left[0]], found.reason, found.value)
        group_size, axis, notes = found
        problems = [(r, _weight_problem(graph, r)) for r in left]
        usable = [r for r, problem in problems if problem is None]
        if not usable:
            first = problems[0][1]
            assert first is not None
            return rejection(self.name, graph, [node_id, left[0]], first.reason, first.value)
        matmul_id = usable[0]
        matmul = graph.node(matmul_id)
        others = [graph.describe(r) for r in graph.readers(gathered) if r != matmul_id]
        if others:
            notes.append(
                f"'{gathered}' is also read by {', '.join(others)}: output as 'gathered' "
                "(one MatMul per fused node)"
            )
        add_id, bias, note = _bias(graph, matmul_id)
        if note:
            notes.append(note)
        ids = [node_id, matmul_id, *([add_id] if add_id is not None else [])]
        y = graph.node(ids[-1]).output[0]
        return Match(
            self.name, ALLGATHER_MATMUL, tuple(ids), (gather.input[0], matmul.input[1], bias),
            (y, ""), {"group_size": group_size, "axis": axis},
            exportable={gathered: 1}, notes=tuple(notes),
        )  # fmt: skip


PATTERN = AllGatherMatMulPattern()
