"""The Linears reading a normalized value, for the "norm -> every Linear on it" patterns.

A Linear is `Y = N @ W (+ b)`: MatMul(N, W) with W a constant 2-D weight, then optionally an Add
of a constant bias broadcasting along the last axis only (either operand order); Gemm(N, W)
on a 2-D N; or Reshape(N, [-1, K]) (a constant target that only flattens the leading dims) ->
Gemm or MatMul, whose output is then 2-D (`flatten`). Gemm's transB, alpha and beta are folded
into new W'/b' initializers:  alpha * A @ op(B) + beta * C  =  A @ (alpha * op(B)) + beta * C.
No-op Casts, Reshapes that provably keep the shape, and (`narrow`: LayerNorm, RMSNorm) a Cast
to a narrower float type between N and its Linears are looked through. A reader that is almost
a Linear (non-constant weight, N as the right operand, a Reshape that does more than flatten)
is a `NearMiss` with its reason; any other reader is left outside (the fused op then outputs
N).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from fuser.graph import GraphIndex

from ._walk import (
    NearMiss,
    attr,
    const,
    const_shape,
    constant_why,
    is_cast_to,
    only_reader,
    operand_const,
    rank,
)

#: The normalized value's last dim, or a function telling it (asked only when a Reshape reads
#: the value: working it out reads types nothing else needs).
Width = int | None | Callable[[], int | None]


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
    """What reads the normalized value: Linears taken, the pass-through nodes taken on the way
    (Casts, identity Reshapes), near misses, the readers left outside (described as
    "'name' (OpType)"), and the float type a narrowing Cast took the Linears to (0: none)."""

    linears: tuple[Linear, ...]
    casts: tuple[int, ...]
    misses: tuple[NearMiss, ...]
    outside: tuple[str, ...]
    cast_to: int = 0


def _tensor(graph: GraphIndex, array: np.ndarray, base: str) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(array), graph.unique_value_name(base))


def _row_bias(
    graph: GraphIndex, name: str, n: int, out_rank: Callable[[], int | None], matmul: int
) -> tuple[str, tuple[onnx.TensorProto, ...]] | None:
    """`name` as an [n] bias if it is a constant broadcasting along the last axis only (no
    more axes than the output's rank, asked of `out_rank` only for a bias of rank 2 or more:
    the usual [n] bias needs no type lookup)."""
    c = operand_const(graph, name)
    if c is None:
        return None
    if c.ndim > 1:
        known = out_rank()
        if c.ndim > (1 if known is None else known):
            return None
    if any(d != 1 for d in c.shape[:-1]) or (c.ndim and c.shape[-1] not in (1, n)):
        return None
    if c.shape == (n,):
        return name, ()
    tensor = _tensor(graph, np.broadcast_to(c.reshape(-1), (n,)), f"{graph.describe(matmul)}.bias")
    return tensor.name, (tensor,)


def _weight_shape(graph: GraphIndex, node_id: int, nodes: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D shape of the constant weight of MatMul/Gemm `node_id`, or a near miss. Only the
    shape: a plain initializer's data is not read (a match needs its values only to fold
    Gemm's transB or alpha)."""
    node = graph.nodes[node_id]
    weight = node.input[1]
    # The usual weight, a plain 2-D initializer (as `const_shape` reads it): its two dims
    # without the tuple of them (one per Linear of every match).
    tensor = graph.initializers.get(weight)
    if tensor is not None and weight not in graph.producer and weight not in graph.graph_inputs:
        dims = tensor.dims
        if len(dims) == 2:
            return dims[0], dims[1]
    shape = const_shape(graph, weight)
    if shape is None:
        where = f"{node.op_type} '{graph.describe(node_id)}'"
        raise NearMiss(
            f"weight '{weight}' of {where} is {constant_why(graph, weight)}", weight, nodes
        )
    if len(shape) != 2:
        where = f"{node.op_type} '{graph.describe(node_id)}'"
        raise NearMiss(
            f"weight '{weight}' of {where} has rank {len(shape)}; a fused Linear takes a 2-D "
            "weight",
            weight,
            nodes,
        )
    return shape[0], shape[1]


def _matmul(
    graph: GraphIndex, node_id: int, value: str, pre: tuple[int, ...], flatten: int
) -> Linear:
    node = graph.nodes[node_id]
    nodes = (*pre, node_id)
    if node.input[0] != value:
        raise NearMiss(
            f"normalized value '{value}' is the right operand of MatMul "
            f"'{graph.describe(node_id)}'; the fused op computes normalized @ W",
            value,
            nodes,
        )
    n = _weight_shape(graph, node_id, nodes)[1]
    out = node.output[0]
    add = only_reader(graph, out)
    if add is not None:
        a = graph.nodes[add]
        if a.op_type == "Add" and a.domain == "" and list(a.input).count(out) == 1:
            other = a.input[1] if a.input[0] == out else a.input[0]

            def out_rank() -> int | None:
                if flatten:
                    return 2
                shape = graph.shape(out)
                return None if shape is None else len(shape)

            bias = _row_bias(graph, other, n, out_rank, node_id)
            if bias is not None:
                return Linear((*nodes, add), node.input[1], bias[0], a.output[0], flatten, bias[1])
    return Linear(nodes, node.input[1], "", out, flatten)


def _gemm(graph: GraphIndex, node_id: int, pre: tuple[int, ...], flatten: int) -> Linear:
    node = graph.nodes[node_id]
    name = graph.describe(node_id)
    nodes = (*pre, node_id)
    if attr(node, "transA", 0):
        raise NearMiss(
            f"Gemm '{name}' has transA=1 (it reads the normalized value transposed)",
            node.input[0],
            nodes,
        )
    rows, cols = _weight_shape(graph, node_id, nodes)
    weight = node.input[1]
    alpha, beta = float(attr(node, "alpha", 1.0)), float(attr(node, "beta", 1.0))
    trans_b = int(attr(node, "transB", 0))
    inits: list[onnx.TensorProto] = []
    if trans_b or alpha != 1.0:
        w = const(graph, weight)
        assert w is not None  # a constant: its shape was read above
        folded = (alpha * (w.T if trans_b else w).astype(np.float64)).astype(w.dtype)
        inits.append(_tensor(graph, folded, f"{name}.W_folded"))
        weight = inits[-1].name
    n = rows if trans_b else cols
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


_INT64_MAX = np.iinfo(np.int64).max
ShapeItem = int | str  # an int, or "shape[i]": dim i (negative) of the tensor whose Shape is read


def _shape_items(
    graph: GraphIndex, name: str, of: str, nodes: list[int], depth: int = 0
) -> list[ShapeItem] | None:
    """A 1-D int64 value as items, when it is a constant or computed from `Shape(of)` (as
    TorchScript writes `x.view(-1, x.size(-1))`: Concat, Slice/Gather of Shape, Squeeze,
    Unsqueeze, Cast); None if it depends on anything else. The computing nodes go to `nodes`."""
    found = const(graph, name)
    if found is not None:
        return [int(v) for v in found.reshape(-1)]
    node_id = graph.producer.get(name)
    if node_id is None or graph.nodes[node_id].domain != "" or depth > 16:
        return None
    node = graph.nodes[node_id]
    nodes.append(node_id)
    of_rank = rank(graph, of)

    def dims_of(shape_node: onnx.NodeProto) -> list[ShapeItem] | None:
        """The items of `Shape(of)` (start/end attributes applied); None if that is not what
        `shape_node` is, or if the rank is unknown (then see `suffix`)."""
        if shape_node.op_type != "Shape" or shape_node.input[0] != of or of_rank is None:
            return None
        items: list[ShapeItem] = [f"shape[{i}]" for i in range(-of_rank, 0)]
        return items[attr(shape_node, "start", 0) : attr(shape_node, "end", None)]

    def suffix(shape_node: onnx.NodeProto, first: int) -> list[ShapeItem] | None:
        """Without the rank, only trailing dims are known: Shape(of)[first:] for first < 0."""
        if shape_node.op_type != "Shape" or shape_node.input[0] != of or first >= 0:
            return None
        start, end = attr(shape_node, "start", 0), attr(shape_node, "end", None)
        if end is not None or start > 0 or (start < 0 and first < start):
            return None
        return [f"shape[{i}]" for i in range(first, 0)]

    op = node.op_type
    if op in ("Cast", "Squeeze", "Unsqueeze", "Identity"):
        items = _shape_items(graph, node.input[0], of, nodes, depth + 1)
        one = op in ("Cast", "Identity") or (items is not None and len(items) == 1)
        return items if one else None
    if op == "Concat" and attr(node, "axis", 0) in (0, -1):
        parts = [_shape_items(graph, i, of, nodes, depth + 1) for i in node.input]
        return None if any(p is None for p in parts) else [x for p in parts for x in p or []]
    if op == "Shape":
        return dims_of(node) or suffix(node, attr(node, "start", 0))
    source = graph.producer.get(node.input[0])
    if source is None:
        return None
    shape_node = graph.nodes[source]
    nodes.append(source)
    if op == "Gather" and attr(node, "axis", 0) == 0:
        index = const(graph, node.input[1])
        if index is None or index.size != 1:
            return None
        i = int(index.reshape(-1)[0])
        dims = dims_of(shape_node)
        if dims is None:
            tail = suffix(shape_node, i)
            return tail[:1] if tail else None
        return [dims[i]] if -len(dims) <= i < len(dims) else None
    if op == "Slice" and len(node.input) >= 3:
        bounds = [const(graph, i) if i else None for i in node.input[1:5]]
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


def _is_linear_reader(graph: GraphIndex, reader: int, value: str) -> bool:
    r = graph.nodes[reader]
    return r.domain == "" and r.op_type in ("Gemm", "MatMul") and r.input[0] == value


def _flatten_reshape(
    graph: GraphIndex, node_id: int, value: str, lazy_width: Width
) -> list[Linear] | None:
    """Reshape(value, [-1, K]) -> Gemm/MatMul (one or several, as Qwen's shared-expert gate/up)
    as flattened Linears; None if no Linear reads the Reshape; a near miss if its target does
    more than flatten the leading dims, or if something else reads the flattened value too."""
    node = graph.nodes[node_id]
    flat = node.output[0]
    readers = graph.readers(flat)
    linear_readers = [r for r in readers if _is_linear_reader(graph, r, flat)]
    if node.input[0] != value or not linear_readers:
        return None
    name = graph.describe(node_id)
    first = linear_readers[0]
    where = f"Reshape '{name}' before {graph.nodes[first].op_type} '{graph.describe(first)}'"
    others = [r for r in readers if r not in linear_readers]
    if others or graph.is_graph_output(flat):
        who = (
            f"'{graph.describe(others[0])}' ({graph.nodes[others[0]].op_type})"
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
    width = lazy_width() if callable(lazy_width) else lazy_width
    shape_nodes: list[int] = []
    items = _shape_items(graph, node.input[1], value, shape_nodes)
    if items is None:
        raise NearMiss(
            f"{where}: its target shape '{node.input[1]}' is computed at run time from more "
            f"than the shape of '{value}', so it cannot be checked to only flatten the "
            "leading dims",
            node.input[1],
            (node_id, first),
        )
    shape = graph.shape(value)
    lead = shape[:-1] if shape else (None,)
    rows = int(np.prod(lead, dtype=np.int64)) if all(isinstance(d, int) for d in lead) else None  # type: ignore[arg-type]
    last_ok = len(items) == 2 and (items[1] == "shape[-1]" or (width and items[1] == width))
    if not last_ok or items[0] not in (-1, rows):
        shown = "[" + ", ".join(str(i) for i in items) + "]"
        raise NearMiss(
            f"Reshape '{name}' to {shown} does not only flatten the leading dims of '{value}' "
            f"(expected [-1, {width if width is not None else 'last dim'}])",
            node.input[1],
            (node_id, first),
        )
    own = {*shape_nodes, node_id}
    for i in shape_nodes:
        for out in graph.nodes[i].output:
            if graph.is_graph_output(out) or not set(graph.readers(out)) <= own:
                raise NearMiss(
                    f"the target shape of Reshape '{name}' is computed by "
                    f"'{graph.describe(i)}', which is also read elsewhere, so the Reshape "
                    "cannot be fused away",
                    out,
                    (node_id, first),
                )
    pre = (*dict.fromkeys(shape_nodes), node_id)
    return [
        _gemm(graph, r, pre, 1)
        if graph.nodes[r].op_type == "Gemm"
        else _matmul(graph, r, flat, pre, 1)
        for r in linear_readers
    ]


_NARROWER: dict[int, tuple[int, ...]] = {
    onnx.TensorProto.DOUBLE: (
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
    ),
    onnx.TensorProto.FLOAT: (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16),
}


def _narrowing_to(source: int, node: onnx.NodeProto) -> int | None:
    """The float type a Cast of a `source`-typed value narrows it to (autocast's float32 ->
    float16), or None."""
    targets = _NARROWER.get(source, ())
    return next((t for t in targets if is_cast_to(node, t)), None)


def _is_identity_reshape(graph: GraphIndex, node: onnx.NodeProto) -> bool:
    """A Reshape whose output provably has its input's shape: every dim known and equal (an
    int, or the same symbolic name), as the dynamo exporter writes GPT-2's `view` before its
    lm_head. Its target is then irrelevant to the value."""
    before, after = graph.shape(node.input[0]), graph.shape(node.output[0])
    return (
        before is not None
        and after is not None
        and tuple(before) == tuple(after)
        and all(isinstance(d, int | str) and d != "" for d in before)
    )


@dataclass(frozen=True)
class _Group:
    """Linears reached through the same pass-through nodes' dtype (0: the value's own)."""

    cast_to: int
    linears: tuple[Linear, ...]
    through: tuple[int, ...]
    first: int  # the reader it starts at (for a near miss naming it)


_SELECTS = ("Gather", "Slice", "Transpose")


def _selected_for_linear(graph: GraphIndex, node_id: int, value: str) -> NearMiss | None:
    """A near miss when a Gather/Slice/Transpose of the normalized value feeds a MatMul, Gemm
    or Conv (ViT/BERT's [CLS] pooler head, a Transpose -> Conv): the fused op multiplies every
    row of N as it is."""
    node = graph.nodes[node_id]
    for r in graph.readers(node.output[0]):
        reader = graph.nodes[r]
        if reader.domain == "" and reader.op_type in ("MatMul", "Gemm", "Conv"):
            return NearMiss(
                f"{node.op_type} '{graph.describe(node_id)}' takes part of the normalized value "
                f"'{value}' (or moves its axes) before {reader.op_type} "
                f"'{graph.describe(r)}': the fused op multiplies N as it is, every row",
                node.output[0],
                (node_id, r),
            )
    return None


def _untyped_cast(
    graph: GraphIndex, r: int, value: str, width: Width, narrow: bool, selects: bool
) -> None:
    """A near miss if Cast `r` of `value`, whose element type nothing declares, leads to a
    Linear: whether it narrows, widens or does nothing cannot be known."""
    inner = classify(graph, graph.nodes[r].output[0], width, narrow, selects)
    if inner.linears:
        raise NearMiss(
            f"Cast '{graph.describe(r)}' of the normalized value '{value}' feeds a Linear "
            f"(output '{inner.linears[0].output}'), but the element type of '{value}' is "
            "unknown (no value_info, no schema to infer it), so the Cast cannot be checked to "
            "narrow it or to be a no-op",
            value,
            (r,),
        )


def classify(
    graph: GraphIndex,
    value: str,
    width: Width,
    narrow: bool = False,
    selects: bool = False,
    value_type: int = 0,
) -> Readers:
    """Sort the readers of `value` (whose last axis has `width` elements, if known; `width`
    may be a function telling it, asked only when a Reshape reads `value`).

    Looked through on the way to a Linear (they join the match): no-op Casts, Reshapes that
    provably keep the shape, and with `narrow` Casts to a narrower float type (autocast's
    float32 LayerNorm -> Cast(float16) -> MatMul): `Readers.cast_to` then names that type.
    All Linears of one match run in one dtype: the others are near misses. With `selects`, a
    Gather/Slice/Transpose feeding a Linear or Conv is a near miss too (LayerNorm's heads).
    `value_type` is `value`'s element type where shape inference does not know it (the output
    of an op onnx has no schema for, as com.microsoft SimplifiedLayerNormalization, worked out
    by the pattern from the op's schema); a Cast of a value of unknown type on the way to a
    Linear is a near miss: it cannot be checked to narrow or to be a no-op."""
    known = -1  # `value`'s element type, looked up at the first Cast reader (0: unknown)
    groups: list[_Group] = []
    misses: list[NearMiss] = []
    outside: list[str] = ["the graph output"] if graph.is_graph_output(value) else []
    for r in graph.consumers.get(value, ()):  # not `readers`: no list copy per value
        node = graph.nodes[r]
        try:
            found: list[Linear] | None = None
            cast = node.op_type == "Cast" and node.domain == ""
            if cast and known < 0:
                known = graph.elem_type(value) or value_type
            to = _narrowing_to(known, node) if narrow and cast else None
            through = node.domain == "" and (
                (cast and bool(known) and is_cast_to(node, known))  # a no-op Cast
                or to is not None
                or (node.op_type == "Reshape" and _is_identity_reshape(graph, node))
            )
            if node.domain != "":
                pass
            elif cast and not known:
                _untyped_cast(graph, r, value, width, narrow, selects)
            elif through:
                inner = classify(graph, node.output[0], width, narrow and to is None, selects)
                misses.extend(inner.misses)
                if inner.linears and inner.outside and to is not None:
                    raise NearMiss(
                        f"Cast '{graph.describe(r)}' of the normalized value '{value}' is also "
                        f"read by {inner.outside[0]}: the fused op does not output the cast "
                        "value",
                        node.output[0],
                        (r,),
                    )
                if not inner.outside and inner.linears:
                    cast_to = to if to is not None else inner.cast_to
                    groups.append(_Group(cast_to, inner.linears, (r, *inner.casts), r))
                    continue
            elif node.op_type == "MatMul":
                found = [_matmul(graph, r, value, (), 0)]
            elif node.op_type == "Gemm" and node.input[0] == value:
                found = [_gemm(graph, r, (), 0)]
            elif node.op_type == "Reshape":
                found = _flatten_reshape(graph, r, value, width)
            elif selects and node.op_type in _SELECTS:
                why = _selected_for_linear(graph, r, value)
                if why is not None:
                    raise why
            if found is None:
                outside.append(f"'{graph.describe(r)}' ({node.op_type})")
            else:
                groups.append(_Group(0, tuple(found), (), r))
        except NearMiss as miss:
            misses.append(miss)
            outside.append(f"'{graph.describe(r)}' ({node.op_type})")
    kept = groups[0].cast_to if groups else 0
    if any(g.cast_to == 0 for g in groups):
        kept = 0
    for g in groups:
        if g.cast_to != kept:
            first = graph.nodes[g.first]
            misses.append(
                NearMiss(
                    f"'{graph.describe(g.first)}' ({first.op_type}) reads the normalized value "
                    f"'{value}' for Linears in another dtype than the others: one fused op "
                    "runs its Linears in one dtype",
                    value,
                    (g.first,),
                )
            )
            outside.append(f"'{graph.describe(g.first)}' ({first.op_type})")
    taken = [g for g in groups if g.cast_to == kept]
    return Readers(
        tuple(lin for g in taken for lin in g.linears),
        tuple(i for g in taken for i in g.through),
        tuple(misses),
        tuple(outside),
        kept,
    )
