"""The universal rules every match must pass, enforced here rather than in each pattern.

1. Members are live, standard nodes: a node already fused (domain `fuser`) is never re-fused,
   so matches cannot overlap.
2. An internal value read outside the match, or that is a graph output, is either carried out
   by an optional output of the fused op (when the pattern allows it) or blocks the match.
3. The rewrite creates no cycle.
4. Input element types are among those the fused op's type constraints allow.
"""

from __future__ import annotations

import functools

import onnx

from .fusedop import DOMAIN, FusedOp
from .graph import GraphIndex
from .pattern import Match, Rejection, rejection

_TYPE_NAMES = {
    f"tensor({name})": value
    for name, value in (
        ("float16", onnx.TensorProto.FLOAT16),
        ("float", onnx.TensorProto.FLOAT),
        ("double", onnx.TensorProto.DOUBLE),
        ("bfloat16", onnx.TensorProto.BFLOAT16),
        ("int64", onnx.TensorProto.INT64),
        ("int32", onnx.TensorProto.INT32),
        ("int8", onnx.TensorProto.INT8),
        ("uint8", onnx.TensorProto.UINT8),
        ("bool", onnx.TensorProto.BOOL),
    )
}


def type_name(elem_type: int | None) -> str:
    if elem_type is None or elem_type == 0:
        return "unknown"
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name


def check_match(graph: GraphIndex, match: Match) -> Match | Rejection:
    """Apply the universal rules; returns the match (outputs completed) or why it cannot be."""
    members = set(match.nodes)
    nodes = [graph.nodes.get(node_id) for node_id in match.nodes]
    for node_id, node in zip(match.nodes, nodes, strict=True):
        if node is None:
            return rejection(match.pattern, graph, [], "a node of the match was already removed")
        if node.domain == DOMAIN:
            return rejection(
                match.pattern,
                graph,
                [node_id],
                f"overlaps an earlier fusion ('{graph.describe(node_id)}')",
            )

    outputs = list(match.outputs)
    rewires: list[tuple[int, str, str]] = []
    notes = list(match.notes)
    for node in nodes:
        assert node is not None  # checked above
        for value in node.output:
            if not value or value in outputs:
                continue
            outside = [r for r in graph.consumers.get(value, ()) if r not in members]
            source = match.shape_sources.get(value)
            if source:
                shape_readers = [r for r in outside if _reads_only_shape(graph, r, value)]
                for reader in shape_readers:
                    rewires.append((reader, value, source))
                    notes.append(
                        f"Shape '{graph.describe(reader)}' reads '{source}' (same shape) "
                        f"instead of '{value}'"
                    )
                outside = [r for r in outside if r not in shape_readers]
            if not outside and not graph.is_graph_output(value):
                continue
            slot = match.exportable.get(value)
            if slot is not None and not outputs[slot]:
                outputs[slot] = value
                continue
            if outside:
                reader = graph.node(outside[0])
                who = graph.describe(outside[0])
                why = f"is also read by '{who}' ({reader.op_type}) outside the match"
            else:
                why = "is a graph output"
            return rejection(
                match.pattern,
                graph,
                list(match.nodes),
                f"internal value '{value}' {why}, and {match.op.name} cannot output it",
                value,
            )

    back_edge = _back_edge(graph, members, match.inputs)
    if back_edge is not None:
        return rejection(
            match.pattern,
            graph,
            list(match.nodes),
            f"fusing would create a cycle: value '{back_edge}' leaves the match "
            "and feeds back into it",
            back_edge,
        )

    bad_type = _unsupported_type(graph, match)
    if bad_type is not None:
        return rejection(match.pattern, graph, list(match.nodes), *bad_type)
    if not rewires and not match.rewires and outputs == list(match.outputs):
        return match  # nothing to complete (notes only grow with rewires)
    # Match(...) rather than dataclasses.replace, whose generality costs ~10 us per fusion.
    return Match(
        pattern=match.pattern,
        op=match.op,
        nodes=match.nodes,
        inputs=match.inputs,
        outputs=tuple(outputs),
        attributes=match.attributes,
        exportable=match.exportable,
        new_initializers=match.new_initializers,
        notes=tuple(notes),
        shape_sources=match.shape_sources,
        rewires=tuple(rewires),
    )


def _back_edge(graph: GraphIndex, members: set[int], inputs: tuple[str, ...]) -> str | None:
    """The value through which the fused node would feed itself (a cycle), or None.

    A path out of the match and back into a fused input ends at that input's producer, which
    then reads (transitively) a member's output and so comes after the first member in the
    topological order. When every input is produced before the first member (or outside this
    graph: initializers, graph inputs, outer values), there is no such path, and the search of
    `descendants_in_window` is skipped: the common case, a chain reading what came before."""
    pos, producer = graph.pos, graph.producer
    first = min(pos[m] for m in members)
    for name in inputs:
        node_id = producer.get(name) if name else None
        if node_id is not None and pos[node_id] >= first:
            break
    else:
        return None
    _, back_edge = graph.descendants_in_window(members, {i for i in inputs if i})
    return back_edge


def _reads_only_shape(graph: GraphIndex, node_id: int, value: str) -> bool:
    node = graph.node(node_id)
    return (
        node.op_type == "Shape" and node.domain in ("", "ai.onnx") and list(node.input) == [value]
    )


@functools.cache
def _allowed_types(
    constraints: tuple[tuple[str, tuple[str, ...], str], ...],
) -> dict[str, frozenset[int | None]]:
    """Element types each type constraint allows, once per fused op (a pass asks per match)."""
    return {name: frozenset(_TYPE_NAMES.get(t) for t in types) for name, types, _ in constraints}


def _unsupported_type(graph: GraphIndex, match: Match) -> tuple[str, str] | None:
    op: FusedOp = match.op
    allowed = _allowed_types(op.type_constraints)
    new = {t.name: t.data_type for t in match.new_initializers}
    for position, value in enumerate(match.inputs):
        if not value:
            continue
        param = op.inputs[min(position, len(op.inputs) - 1)]
        if param.type_str not in allowed:
            continue
        elem = new.get(value) or graph.elem_type(value)
        if elem is None or elem == 0:
            return (f"element type of '{value}' is unknown (shape inference found none)", value)
        if elem not in allowed[param.type_str]:
            return (f"'{value}' is {type_name(elem)}, which {op.name} does not support", value)
    return None
