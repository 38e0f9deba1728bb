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
    nodes = list(map(graph.nodes.get, match.nodes))
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
    consumers, graph_outputs = graph.consumers, graph.graph_outputs
    for node in nodes:
        assert node is not None  # checked above
        for value in node.output:
            if not value or value in outputs:
                continue
            readers = consumers.get(value, ())
            # the common case, a value only members read, without a list made for it
            outside = []
            if not members.issuperset(readers):
                outside = [r for r in readers if r not in members]
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
            if not outside and value not in graph_outputs:  # graph.is_graph_output, inline
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
    return match.completed(tuple(outputs), tuple(notes), tuple(rewires))


def _back_edge(graph: GraphIndex, members: set[int], inputs: tuple[str, ...]) -> str | None:
    """The value through which the fused node would feed itself (a cycle), or None.

    A path out of the match and back into a fused input ends at that input's producer, which
    then reads (transitively) a member's output and so comes after the first member in the
    topological order. When every input is produced before the first member (or outside this
    graph: initializers, graph inputs, outer values), there is no such path, and the search of
    `descendants_in_window` is skipped: the common case, a chain reading what came before."""
    pos, producer = graph.pos, graph.producer
    first = min(map(pos.__getitem__, members))
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
    """Why an input's element type breaks the fused op's type constraints, or None.

    The verdict is a function of the op and the inputs' element types (`Match.input_facts`,
    read once per match): found once per op and element types, then only the reason, which
    names the match's own value, is written per refused match."""
    op: FusedOp = match.op
    # None: absent; 0: no type known (the fact is (), or its element type is undefined)
    elems = tuple([f[0] if f else (None if f is None else 0) for f in match.input_facts(graph)])
    known = _TYPE_VERDICTS.get(id(op))
    if known is None or known[0] is not op:
        known = _TYPE_VERDICTS[id(op)] = (op, {})
    verdicts = known[1]
    if elems in verdicts:
        found = verdicts[elems]
    else:
        found = verdicts[elems] = _type_verdict(op, elems)
    if found is None:
        return None
    position, elem = found
    value = match.inputs[position]
    if elem is None:
        return (f"element type of '{value}' is unknown (shape inference found none)", value)
    return (f"'{value}' is {type_name(elem)}, which {op.name} does not support", value)


# Verdicts of the type rule by fused op (its id, the op kept so that the id stays its own) and
# input element types: a model repeats a few variants of a fusion thousands of times.
_TypeVerdict = tuple[int, int | None] | None
_TYPE_VERDICTS: dict[int, tuple[FusedOp, dict[tuple[int | None, ...], _TypeVerdict]]] = {}


def _type_verdict(op: FusedOp, elems: tuple[int | None, ...]) -> _TypeVerdict:
    """(position, element type or None if unknown) of the first input whose element type the
    op does not allow, or None. Absent inputs (None) and unconstrained params pass; an
    unknown element type (0) does not."""
    allowed = _allowed_types(op.type_constraints)
    for position, elem in enumerate(elems):
        if elem is None:
            continue
        param = op.inputs[min(position, len(op.inputs) - 1)]
        if param.type_str not in allowed:
            continue
        if elem == 0:
            return position, None
        if elem not in allowed[param.type_str]:
            return position, elem
    return None
