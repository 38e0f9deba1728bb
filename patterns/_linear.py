"""The Linears reading a normalized value, for the "norm -> every Linear on it" patterns.

A Linear is `Y = N @ W (+ b)`: MatMul(N, W) with W a constant 2-D weight, then optionally an Add
of a constant bias broadcasting along the last axis only (either operand order); Gemm(N, W)
on a 2-D N; or Reshape(N, [-1, K]) (a constant target that only flattens the leading dims) ->
Gemm or MatMul, whose output is then 2-D (`flatten`). Gemm's transB, alpha and beta are folded
into new W'/b' initializers:  alpha * A @ op(B) + beta * C  =  A @ (alpha * op(B)) + beta * C.
No-op Casts between N and its Linears are looked through. A reader that is almost a Linear
(non-constant weight, N as the right operand, a Reshape that does more than flatten) is a
`NearMiss` with its reason; any other reader is left outside (the fused op then outputs N).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from fuser.graph import GraphIndex

from ._walk import NearMiss, attr, const, constant_why, is_noop_cast, only_reader, operand_const


@dataclass(frozen=True)
class Linear:
    """One consumer of the normalized value: its nodes, weight, bias ("" if none), output."""

    nodes: tuple[int, ...]
    weight: str
    bias: str
    output: str
    flatten: int
    new_initializers: tuple[onnx.TensorProto, ...] = ()


@dataclass(frozen=True)
class Readers:
    """What reads the normalized value: Linears taken, Casts taken, near misses, and the readers
    left outside (described as "'name' (OpType)")."""

    linears: tuple[Linear, ...]
    casts: tuple[int, ...]
    misses: tuple[NearMiss, ...]
    outside: tuple[str, ...]


def _tensor(graph: GraphIndex, array: np.ndarray, base: str) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(array), graph.unique_value_name(base))


def _row_bias(
    graph: GraphIndex, name: str, n: int, out_rank: int | None, base: str
) -> tuple[str, tuple[onnx.TensorProto, ...]] | None:
    """`name` as an [n] bias if it is a constant broadcasting along the last axis only."""
    c = operand_const(graph, name)
    if c is None or c.ndim > (1 if out_rank is None else out_rank):
        return None
    if any(d != 1 for d in c.shape[:-1]) or (c.ndim and c.shape[-1] not in (1, n)):
        return None
    if c.shape == (n,):
        return name, ()
    tensor = _tensor(graph, np.broadcast_to(c.reshape(-1), (n,)), base)
    return tensor.name, (tensor,)


def _weight(graph: GraphIndex, node_id: int, value: str, nodes: tuple[int, ...]) -> np.ndarray:
    node = graph.node(node_id)
    weight = node.input[1]
    w = const(graph, weight)
    where = f"{node.op_type} '{graph.describe(node_id)}'"
    if w is None:
        raise NearMiss(
            f"weight '{weight}' of {where} is {constant_why(graph, weight)}", weight, nodes
        )
    if w.ndim != 2:
        raise NearMiss(
            f"weight '{weight}' of {where} has rank {w.ndim}; a fused Linear takes a 2-D weight",
            weight,
            nodes,
        )
    return w


def _matmul(
    graph: GraphIndex, node_id: int, value: str, pre: tuple[int, ...], flatten: int
) -> Linear:
    node = graph.node(node_id)
    nodes = (*pre, node_id)
    if node.input[0] != value:
        raise NearMiss(
            f"normalized value '{value}' is the right operand of MatMul "
            f"'{graph.describe(node_id)}'; the fused op computes normalized @ W",
            value,
            nodes,
        )
    w = _weight(graph, node_id, value, nodes)
    out = node.output[0]
    add = only_reader(graph, out)
    if add is not None:
        a = graph.node(add)
        if a.op_type == "Add" and a.domain == "" and list(a.input).count(out) == 1:
            other = a.input[1] if a.input[0] == out else a.input[0]
            out_rank = (
                2
                if flatten
                else (None if graph.shape(out) is None else len(graph.shape(out) or ()))
            )
            base = f"{graph.describe(node_id)}.bias"
            bias = _row_bias(graph, other, int(w.shape[1]), out_rank, base)
            if bias is not None:
                return Linear((*nodes, add), node.input[1], bias[0], a.output[0], flatten, bias[1])
    return Linear(nodes, node.input[1], "", out, flatten)


def _gemm(graph: GraphIndex, node_id: int, pre: tuple[int, ...], flatten: int) -> Linear:
    node = graph.node(node_id)
    name = graph.describe(node_id)
    nodes = (*pre, node_id)
    if attr(node, "transA", 0):
        raise NearMiss(
            f"Gemm '{name}' has transA=1 (it reads the normalized value transposed)",
            node.input[0],
            nodes,
        )
    w = _weight(graph, node_id, node.input[0], nodes)
    weight = node.input[1]
    alpha, beta = float(attr(node, "alpha", 1.0)), float(attr(node, "beta", 1.0))
    trans_b = int(attr(node, "transB", 0))
    inits: list[onnx.TensorProto] = []
    if trans_b or alpha != 1.0:
        folded = (alpha * (w.T if trans_b else w).astype(np.float64)).astype(w.dtype)
        inits.append(_tensor(graph, folded, f"{name}.W_folded"))
        weight = inits[-1].name
    n = int(w.shape[0] if trans_b else w.shape[1])
    bias = node.input[2] if len(node.input) > 2 else ""
    if bias:
        c = const(graph, bias)
        if c is None:
            raise NearMiss(
                f"bias '{bias}' of Gemm '{name}' is {constant_why(graph, bias)}", bias, nodes
            )
        if (
            c.ndim > 2
            or any(d != 1 for d in c.shape[:-1])
            or (c.ndim and c.shape[-1] not in (1, n))
        ):
            raise NearMiss(
                f"bias '{bias}' of Gemm '{name}' has shape {list(c.shape)}: it varies per row "
                f"(the fused op adds one [{n}] row bias)",
                bias,
                nodes,
            )
        if beta != 1.0 or c.shape != (n,):
            row = (beta * np.broadcast_to(c.reshape(-1), (n,)).astype(np.float64)).astype(c.dtype)
            inits.append(_tensor(graph, row, f"{name}.bias_folded"))
            bias = inits[-1].name
    return Linear(nodes, weight, bias, node.output[0], flatten, tuple(inits))


def _is_linear_reader(graph: GraphIndex, reader: int, value: str) -> bool:
    r = graph.node(reader)
    return r.domain == "" and r.op_type in ("Gemm", "MatMul") and r.input[0] == value


def _flatten_reshape(
    graph: GraphIndex, node_id: int, value: str, width: int | None
) -> list[Linear] | None:
    """Reshape(value, [-1, K]) -> Gemm/MatMul (one or several, as Qwen's shared-expert gate/up)
    as flattened Linears; None if no Linear reads the Reshape; a near miss if its target does
    more than flatten the leading dims, or if something else reads the flattened value too."""
    node = graph.node(node_id)
    flat = node.output[0]
    readers = graph.readers(flat)
    linear_readers = [r for r in readers if _is_linear_reader(graph, r, flat)]
    if node.input[0] != value or not linear_readers:
        return None
    name = graph.describe(node_id)
    first = linear_readers[0]
    where = f"Reshape '{name}' before {graph.node(first).op_type} '{graph.describe(first)}'"
    others = [r for r in readers if r not in linear_readers]
    if others or graph.is_graph_output(flat):
        who = (
            f"'{graph.describe(others[0])}' ({graph.node(others[0]).op_type})"
            if others
            else "the graph output"
        )
        raise NearMiss(
            f"{where}: the flattened value '{flat}' is also read by {who}, so the Reshape "
            "cannot be fused away (and left outside it would read the fused node's output "
            "and feed it: a cycle)",
            flat,
            (node_id, first),
        )
    target = const(graph, node.input[1])
    if target is None:
        raise NearMiss(
            f"{where}: its target shape '{node.input[1]}' is computed at run time, so it "
            "cannot be checked to only flatten the leading dims",
            node.input[1],
            (node_id, first),
        )
    items = [int(v) for v in target.reshape(-1)]
    shape = graph.shape(value)
    lead = shape[:-1] if shape else (None,)
    rows = int(np.prod(lead, dtype=np.int64)) if all(isinstance(d, int) for d in lead) else None  # type: ignore[arg-type]
    if len(items) != 2 or width is None or items[1] != width or items[0] not in (-1, rows):
        raise NearMiss(
            f"Reshape '{name}' to {items} does not only flatten the leading dims of '{value}' "
            f"(expected [-1, {width if width is not None else 'last dim'}])",
            node.input[1],
            (node_id, first),
        )
    return [
        _gemm(graph, r, (node_id,), 1)
        if graph.node(r).op_type == "Gemm"
        else _matmul(graph, r, flat, (node_id,), 1)
        for r in linear_readers
    ]


def classify(graph: GraphIndex, value: str, width: int | None) -> Readers:
    """Sort the readers of `value` (whose last axis has `width` elements, if known)."""
    linears: list[Linear] = []
    casts: list[int] = []
    misses: list[NearMiss] = []
    outside: list[str] = ["the graph output"] if graph.is_graph_output(value) else []
    for r in graph.readers(value):
        node = graph.node(r)
        left_out = f"'{graph.describe(r)}' ({node.op_type})"
        try:
            found: list[Linear] | None = None
            if node.domain != "":
                pass
            elif node.op_type == "MatMul":
                found = [_matmul(graph, r, value, (), 0)]
            elif node.op_type == "Gemm" and node.input[0] == value:
                found = [_gemm(graph, r, (), 0)]
            elif node.op_type == "Reshape":
                found = _flatten_reshape(graph, r, value, width)
            elif is_noop_cast(graph, node):
                inner = classify(graph, node.output[0], width)
                misses.extend(inner.misses)
                if not inner.outside and inner.linears:
                    linears.extend(inner.linears)
                    casts.extend((r, *inner.casts))
                    continue
            if found is None:
                outside.append(left_out)
            else:
                linears.extend(found)
        except NearMiss as miss:
            misses.append(miss)
            outside.append(left_out)
    return Readers(tuple(linears), tuple(casts), tuple(misses), tuple(outside))
