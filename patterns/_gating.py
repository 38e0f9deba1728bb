"""The selection half of a MoE gate after its scores S: the walk `softmax_topk` uses to find
the DeepSeek-V3 forms (exporter graphs of transformers' DeepseekV3TopkRouter, TorchScript and
dynamo alike).

    choice = S [+ bias]                                   (Add of a constant [E] bias)
    [group limit]  R = Reshape(choice, [-1, G, E/G]);  gs = ReduceSum(TopK(R, 2).values, -1)
                   kept = TopK(gs, topk_group).indices
                   mask = ScatterElements(zeros like gs, kept, ones like kept, axis=1)
                   keep = Cast<bool>(Reshape(Expand(Unsqueeze(mask, -1), [1, G, E/G]), [-1, E]))
                   choice = Where(Not(keep), fill, choice)    (Nots and bool Casts any count)
    indices = TopK(choice, k).indices;  values = GatherElements(S, indices, axis=-1)

The split and the flatten back may be written with a 0 (copy the token count, allowzero=0)
and a -1 (`[0, G, -1]`, `[0, -1]`, ...; `rows_reshape` tells whether they keep the rows), or
as shapes computed at run time (`view(bsz * seq_len, G, -1)`, `expand(bsz * seq_len, ...)`)
whose outputs are typed [the choice's rows, ...]. The weights may be gathered from the scores
before a Cast to float32 that the choice reads (a float32 bias on float16 scores).

Every check that fails says why and names the value; a form this walk does not know returns
None (the caller then tries the plain Softmax -> TopK).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from fuser.graph import GraphIndex


@dataclass(frozen=True)
class Problem:
    """Why a check failed, and the value at fault (becomes a Rejection)."""

    reason: str
    value: str | None


@dataclass(frozen=True)
class Selection:
    """What the walk found: the nodes between the scores and the values (TopK excluded), the
    bias, the group limit, the final TopK and the value holding the chosen unbiased scores."""

    nodes: tuple[int, ...]
    bias: str | None
    n_group: int
    topk_group: int
    mask_value: float
    topk: int
    values: str
    # The weights gathered from the scores before a Cast to float32 (a float32 selection bias
    # on 16-bit scores): the choice in float32, the values in the scores' own type.
    uncast: bool = False


def attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def is_op(graph: GraphIndex, node_id: int, op_type: str) -> bool:
    node = graph.node(node_id)
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def _producer(graph: GraphIndex, value: str, op_type: str) -> int | None:
    found = graph.producer.get(value)
    return found if found is not None and is_op(graph, found, op_type) else None


def through_cast(graph: GraphIndex, value: str) -> tuple[int | None, str, int | None]:
    """(Cast id or None, the value before it, that value's producer): `value`'s producer,
    looking through one Cast."""
    cast_id, producer = None, graph.producer.get(value)
    if producer is not None and is_op(graph, producer, "Cast"):
        cast_id, value = producer, graph.node(producer).input[0]
        producer = graph.producer.get(value)
    return cast_id, value, producer


def _readers(graph: GraphIndex, value: str, op_type: str) -> list[int]:
    return [r for r in graph.readers(value) if is_op(graph, r, op_type)]


def _name(graph: GraphIndex, node_id: int) -> str:
    node = graph.node(node_id)
    return node.name or node.op_type


def _ints(graph: GraphIndex, value: str) -> list[int] | None:
    found = graph.constant(value) if value else None
    return None if found is None else [int(v) for v in found.reshape(-1)]


def _scalar(graph: GraphIndex, value: str) -> float | None:
    found = graph.constant(value)
    if found is None or found.size != 1:
        return None
    return float(found.reshape(-1)[0])


def _last_axis(axes: list[int] | None, rank: int) -> bool:
    return axes is not None and len(axes) == 1 and axes[0] in (-1, rank - 1)


def selection(
    graph: GraphIndex,
    scores: str,
    experts: int | Callable[[], int | None] | None,
    uncast: str | None = None,
) -> Selection | Problem | None:
    """The bias/group/gather form reading `scores` [N, E], or why it does not fit, or None.
    `uncast`: the value a Cast read to make `scores`; the weights may be gathered from it.
    `experts` (E, if known) may be a function telling it: asked only once a TopK is found
    ranking the scores (most Softmaxes are no gate's)."""
    nodes: list[int] = []
    choice, bias = scores, None
    # Only an Add or a Where on the way to a TopK makes a gate: a Sigmoid + residual Add, or a
    # Sigmoid gate of an MLP, is not one (and is no near-miss either).
    adds = [
        a for a in _readers(graph, scores, "Add") if _feeds_topk(graph, graph.node(a).output[0])
    ]
    if adds:
        if callable(experts):
            experts = experts()
        add_id = adds[0]
        add = graph.node(add_id)
        other = add.input[1] if add.input[0] == scores else add.input[0]
        value = graph.constant(other)
        if value is None:
            why = "a graph input" if other in graph.graph_inputs else "computed at run time"
            return Problem(
                f"bias '{other}' of Add '{_name(graph, add_id)}' added to the scores is {why}; "
                "SoftmaxTopK needs a constant selection bias",
                other,
            )
        if value.ndim not in (1, 2) or value.shape[-1] != experts or value.size != experts:
            return Problem(
                f"bias '{other}' of Add '{_name(graph, add_id)}' has shape {list(value.shape)}, "
                f"not one value per expert [{experts}]",
                other,
            )
        nodes.append(add_id)
        choice, bias = add.output[0], other
    group = None
    if _feeds_topk(graph, choice, True):
        if callable(experts):
            experts = experts()
        group = _group_limit(graph, choice, experts)
    if isinstance(group, Problem):
        return group
    n_group, topk_group, mask_value, where_out = 1, 1, float("-inf"), choice
    if group is not None:
        group_nodes, n_group, topk_group, mask_value, where_out = group
        nodes += group_nodes
    if bias is None and group is None:
        return None
    topks = [r for r in _readers(graph, where_out, "TopK") if graph.node(r).input[0] == where_out]
    if not topks:
        return None
    topk_id = topks[0]
    topk = graph.node(topk_id)
    if graph.readers(topk.output[0]) or graph.is_graph_output(topk.output[0]):
        return Problem(
            f"the values of TopK '{_name(graph, topk_id)}' over the biased or group-masked "
            f"choice '{topk.output[0]}' are read; SoftmaxTopK gives the unbiased scores",
            topk.output[0],
        )
    indices = topk.output[1] if len(topk.output) > 1 else ""
    gathers = [
        r for r in _readers(graph, indices, "GatherElements") if graph.node(r).input[1] == indices
    ] if indices else []  # fmt: skip
    if not gathers:
        return Problem(
            f"the indices of TopK '{_name(graph, topk_id)}' gather nothing from the scores "
            f"'{scores}' (no GatherElements)",
            indices or topk.output[0],
        )
    gather = graph.node(gathers[0])
    from_uncast = uncast is not None and gather.input[0] == uncast
    if gather.input[0] != scores and not from_uncast:
        return Problem(
            f"GatherElements '{_name(graph, gathers[0])}' gathers from '{gather.input[0]}', "
            f"not the unbiased scores '{scores}'",
            gather.input[0],
        )
    if int(attr(gather, "axis", 0)) not in (-1, 1):
        return Problem(
            f"GatherElements '{_name(graph, gathers[0])}' gathers along axis "
            f"{int(attr(gather, 'axis', 0))}, not the experts' axis",
            gather.output[0],
        )
    nodes.append(gathers[0])
    return Selection(tuple(nodes), bias, n_group, topk_group, mask_value, topk_id,
                     gather.output[0], from_uncast)  # fmt: skip


def _feeds_topk(graph: GraphIndex, value: str, through_where_only: bool = False) -> bool:
    """Whether a TopK ranks `value`, directly or through a Where that reads it."""
    for r in graph.readers(value):
        node = graph.node(r)
        if is_op(graph, r, "TopK") and node.input[0] == value and not through_where_only:
            return True
        ranked = (graph.node(t).input[0] == node.output[0]
                  for t in _readers(graph, node.output[0], "TopK"))  # fmt: skip
        if is_op(graph, r, "Where") and value in node.input[1:] and any(ranked):
            return True
    return False


def filled_like(
    graph: GraphIndex, value: str, like: str, rank: int | None = None
) -> tuple[float, list[int]] | None:
    """(v, nodes) when `value` is a tensor of `like`'s shape filled with v: ConstantOfShape(
    Shape(like)) or Expand(scalar v, Shape(like)); with `rank` (like's), an Expanded scalar of
    a higher rank (which would broadcast the shape up) does not count."""
    producer = graph.producer.get(value)
    if producer is None:
        return None
    node = graph.node(producer)
    shape_in = node.input[0] if is_op(graph, producer, "ConstantOfShape") else (
        node.input[1] if is_op(graph, producer, "Expand") else ""
    )  # fmt: skip
    shape_id = _producer(graph, shape_in, "Shape") if shape_in else None
    if shape_id is None:
        return None
    shape = graph.node(shape_id)
    if shape.input[0] != like or int(attr(shape, "start", 0)) != 0 or attr(shape, "end", None):
        return None
    if is_op(graph, producer, "ConstantOfShape"):
        tensor = attr(node, "value", None)
        fill = 0.0 if tensor is None else float(onnx.numpy_helper.to_array(tensor).reshape(-1)[0])
    else:
        found = _scalar(graph, node.input[0])
        array = graph.constant(node.input[0])
        if found is None or (rank is not None and array is not None and array.ndim > rank):
            return None
        fill = found
    return fill, [producer, shape_id]


def _group_limit(
    graph: GraphIndex, choice: str, experts: int | None
) -> tuple[list[int], int, int, float, str] | Problem | None:
    """(nodes, n_group, topk_group, mask value, masked choice) of the group limit on `choice`,
    why it does not fit, or None when `choice` is not grouped."""
    wheres = [r for r in _readers(graph, choice, "Where") if choice in graph.node(r).input[1:]]
    reshapes = [r for r in _readers(graph, choice, "Reshape") if graph.node(r).input[0] == choice]
    if not wheres or not reshapes:
        return None
    where_id, reshape_id = wheres[0], reshapes[0]
    where, reshape = graph.node(where_id), graph.node(reshape_id)
    split = _ints(graph, reshape.input[1])
    shape = graph.shape(choice)
    rows = shape[0] if shape else None
    if split is None:
        # A split computed at run time (`view(bsz * seq_len, G, -1)`): its output's typed shape
        # [rows, G, E/G], the rows the choice's own, shows the grouping; else it is refused.
        if not _readers(graph, reshape.output[0], "TopK"):
            return None
        out = graph.shape(reshape.output[0])
        if experts is None or out is None or len(out) != 3 or not same_dim(out[0], rows) or \
                not isinstance(out[1], int) or not isinstance(out[2], int):  # fmt: skip
            return Problem(
                f"the group split of Reshape '{_name(graph, reshape_id)}' is computed at run "
                f"time ('{reshape.input[1]}') and its output's shape {_dims(out)} does not show "
                f"[rows of '{choice}', groups, size]",
                reshape.input[1],
            )
        split = [-1, out[1], out[2]]
    if len(split) != 3:
        return None
    if experts is None:
        return Problem(f"the number of experts of '{choice}' is unknown", choice)
    tokens = rows if isinstance(rows, int) else None
    grouping = rows_reshape(split, [experts], tokens, int(attr(reshape, "allowzero", 0)))
    if isinstance(grouping, str) or len(grouping) != 2 or min(grouping) < 1:
        why = grouping if isinstance(grouping, str) else f"as {split}: not [tokens, groups, size]"
        return Problem(
            f"Reshape '{_name(graph, reshape_id)}' of the {experts} experts of '{choice}' into "
            f"groups: {why}",
            reshape.input[1],
        )
    n_group, size = grouping
    if size < 2:
        return Problem(
            f"Reshape '{_name(graph, reshape_id)}' splits the {experts} experts of '{choice}' "
            f"as {split}: groups of {size} expert have no top-2",
            reshape.input[1],
        )
    nodes = [reshape_id]
    tops = _readers(graph, reshape.output[0], "TopK")
    if not tops or _ints(graph, graph.node(tops[0]).input[1]) != [2]:
        return Problem(
            f"the groups of Reshape '{_name(graph, reshape_id)}' are not scored by the sum of "
            "their top-2 (TopK k=2)",
            reshape.output[0],
        )
    top2 = graph.node(tops[0])
    if int(attr(top2, "largest", 1)) != 1 or int(attr(top2, "axis", -1)) not in (-1, 2):
        return Problem(
            f"TopK '{_name(graph, tops[0])}' is not the top-2 of each group", top2.output[0]
        )
    nodes.append(tops[0])
    sums = _readers(graph, top2.output[0], "ReduceSum")
    if not sums:
        return Problem(f"the top-2 of each group '{top2.output[0]}' are not summed", top2.output[0])
    total = graph.node(sums[0])
    axes = _ints(graph, total.input[1]) if len(total.input) > 1 else attr(total, "axes", None)
    if not _last_axis(axes, 3) or int(attr(total, "keepdims", 1)) != 0:
        return Problem(
            f"ReduceSum '{_name(graph, sums[0])}' does not sum each group's top-2 (axes {axes}, "
            "keepdims=0 expected)",
            total.output[0],
        )
    nodes.append(sums[0])
    gs = total.output[0]
    group_tops = _readers(graph, gs, "TopK")
    if not group_tops:
        return Problem(f"the group scores '{gs}' are not ranked by a TopK", gs)
    gtop = graph.node(group_tops[0])
    topk_group = _ints(graph, gtop.input[1]) if len(gtop.input) > 1 else None
    if topk_group is None or len(topk_group) != 1 or int(attr(gtop, "largest", 1)) != 1 or \
            int(attr(gtop, "axis", -1)) not in (-1, 1):  # fmt: skip
        return Problem(
            f"TopK '{_name(graph, group_tops[0])}' over the group scores needs a constant k, "
            "largest, on the groups' axis",
            gtop.output[0],
        )
    nodes.append(group_tops[0])
    kept = gtop.output[1]
    # back from the Where's condition to the scattered group mask
    cond = where.input[0]
    nots = 0
    while True:
        producer = graph.producer.get(cond)
        if producer is None:
            return Problem(f"the condition '{where.input[0]}' of Where is not a group mask", cond)
        node = graph.node(producer)
        if is_op(graph, producer, "Not"):
            nots += 1
        elif not (is_op(graph, producer, "Cast") and int(attr(node, "to", 0)) == TensorProto.BOOL):
            break
        nodes.append(producer)
        cond = node.input[0]
    flat_id = _producer(graph, cond, "Reshape")
    flat_shape = _ints(graph, graph.node(flat_id).input[1]) if flat_id is not None else None
    if flat_id is not None and flat_shape is None:
        flat_shape = _typed_as(graph, graph.node(flat_id).output[0], rows, [experts], [-1, experts])
        if flat_shape is None:
            return Problem(
                f"the flatten of the group mask, Reshape '{_name(graph, flat_id)}', is computed "
                f"at run time ('{graph.node(flat_id).input[1]}') and its output's shape "
                f"{_dims(graph.shape(graph.node(flat_id).output[0]))} does not show [rows of "
                f"'{choice}', {experts}]",
                graph.node(flat_id).input[1],
            )
    if flat_id is None or flat_shape is None or len(flat_shape) != 2:
        return Problem(f"the condition '{where.input[0]}' of Where is not a group mask", cond)
    flat = graph.node(flat_id)
    flattened = rows_reshape(flat_shape, [n_group, size], tokens, int(attr(flat, "allowzero", 0)))
    if flattened != [experts]:
        why = flattened if isinstance(flattened, str) else f"gives {['tokens', *flattened]}"
        return Problem(
            f"Reshape '{_name(graph, flat_id)}' does not flatten the group mask [tokens, "
            f"{n_group}, {size}] back to [tokens, {experts}] with {flat_shape}: {why}",
            flat.input[1],
        )
    expand_id = _producer(graph, graph.node(flat_id).input[0], "Expand")
    expand_to = _ints(graph, graph.node(expand_id).input[1]) if expand_id is not None else None
    if expand_id is not None and expand_to is None:
        # `expand(bsz * seq_len, G, E/G)`: a shape computed at run time, taken when the output's
        # typed shape is [rows of the choice, G, E/G] (it then broadcasts the flags as [1, ...]).
        out = graph.node(expand_id).output[0]
        expand_to = _typed_as(graph, out, rows, [n_group, size], [1, n_group, size])
    if expand_id is None or expand_to is None or len(expand_to) != 3 or \
            expand_to[1:] not in ([n_group, size], [1, size]) or expand_to[0] != 1:  # fmt: skip
        return Problem(
            f"the group mask '{cond}' is not one flag per group broadcast to its experts", cond
        )
    unsq_id = _producer(graph, graph.node(expand_id).input[0], "Unsqueeze")
    unsq = graph.node(unsq_id) if unsq_id is not None else None
    unsq_axes = None
    if unsq is not None:
        unsq_axes = _ints(graph, unsq.input[1]) if len(unsq.input) > 1 else attr(unsq, "axes", None)
    if unsq is None or unsq_axes not in ([-1], [2]):
        return Problem(
            f"the group mask '{cond}' is not one flag per group broadcast to its experts", cond
        )
    scatter_id = _producer(graph, unsq.input[0], "ScatterElements")
    scatter = graph.node(scatter_id) if scatter_id is not None else None
    if scatter is None or scatter.input[1] != kept or int(attr(scatter, "axis", 0)) not in (1, -1) \
            or attr(scatter, "reduction", b"none") not in (b"none", "none"):  # fmt: skip
        return Problem(
            f"the group mask '{cond}' is not scattered at the kept groups '{kept}'", cond
        )
    assert scatter_id is not None
    assert unsq_id is not None
    assert expand_id is not None
    zeros = filled_like(graph, scatter.input[0], gs)
    ones = filled_like(graph, scatter.input[2], kept)
    if zeros is None or ones is None or zeros[0] != 0.0 or ones[0] == 0.0:
        return Problem(
            f"ScatterElements '{_name(graph, scatter_id)}' does not write ones into zeros shaped "
            "as the group scores",
            scatter.output[0],
        )
    nodes += [flat_id, expand_id, unsq_id, scatter_id, *zeros[1], *ones[1]]
    # Where(keep, choice, fill) or Where(not keep, fill, choice)
    keep_first = nots % 2 == 0
    chosen, other = (
        (where.input[1], where.input[2]) if keep_first else (where.input[2], where.input[1])
    )
    fill = constant_scalar(graph, other, 2)  # no rank broadcast up from [N, E]
    if chosen != choice or fill is None:
        return Problem(
            f"Where '{_name(graph, where_id)}' does not keep '{choice}' in the kept groups and a "
            "constant elsewhere",
            where.output[0],
        )
    nodes.append(where_id)
    return nodes, n_group, int(topk_group[0]), fill, where.output[0]


def constant_scalar(graph: GraphIndex, value: str, rank: int | None) -> float | None:
    """The float scalar `value` holds at fuse time (one element, of a rank that does not
    broadcast a tensor of `rank` up: at most 1 when the rank is unknown), else None."""
    found = graph.constant(value)
    if found is None or found.size != 1 or found.ndim > (1 if rank is None else rank):
        return None
    return float(found.reshape(-1)[0])


def np_float(value: float) -> float:
    """`value` as float32 holds it (attributes are float32)."""
    return float(np.float32(value))


_ROWS = -2  # marker: the dim holds the token count (a 0 copying dim 0)


def rows_reshape(
    target: list[int], inner: list[int], tokens: int | None, allowzero: int
) -> list[int] | str:
    """What Reshape(x, target) makes of an x shaped [tokens, *inner] when it keeps the rows:
    the dims after the token count, the same for every token count; or why that cannot be
    told. A 0 copies x's dim at its index (allowzero=0), one -1 is inferred; dim 0 must come
    out as the token count (a 0, a -1 with the rest fixed, or the token count itself when it
    is known)."""
    if allowzero and 0 in target:
        return (
            f"allowzero=1 makes the 0 in {target} a dimension of size 0, not a copy of the input's"
        )
    if target.count(-1) > 1 or any(d < -1 for d in target):
        return f"{target} is not a valid shape (at most one -1, no other negative)"
    dims = list(target)
    for i, d in enumerate(dims):
        if d == 0:
            if i > len(inner):
                return f"the 0 at index {i} of {target} copies no dim of the input"
            dims[i] = _ROWS if i == 0 else inner[i - 1]
    total = int(np.prod(inner))
    rest = dims[1:]
    if dims[0] == -1:
        if int(np.prod(rest)) != total:
            return f"{target} does not keep the rows ({total} values per row, not {rest})"
        return rest
    if dims[0] != _ROWS and dims[0] != tokens:
        known = "unknown" if tokens is None else str(tokens)
        return f"dim 0 of {target} is {dims[0]}, not the token count ({known})"
    if -1 in rest:
        fixed = int(np.prod([d for d in rest if d != -1]))
        if fixed < 1 or total % fixed:
            return f"{target} does not split the {total} values of a row"
        rest[rest.index(-1)] = total // fixed
    if int(np.prod(rest)) != total:
        return f"{target} does not keep the rows ({total} values per row, not {rest})"
    return rest


def same_dim(a: object, b: object) -> bool:
    """Whether two dims are known to be equal: the same size, or the same symbol (a symbol
    names one size throughout a graph; onnx's own `unk__` symbols are each unique)."""
    return a is not None and a != "" and a == b


def _dims(shape: tuple[object, ...] | None) -> str:
    return "unknown" if shape is None else str([d if d not in (None, "") else "?" for d in shape])


def _typed_as(
    graph: GraphIndex, value: str, rows: object, inner: list[int], target: list[int]
) -> list[int] | None:
    """`target` when `value`'s typed shape is [rows, *inner] (the rows the same dim), else
    None: what a run-time shape is shown to be by the types the exporter proved."""
    shape = graph.shape(value)
    if shape is None or len(shape) != 1 + len(inner) or not same_dim(shape[0], rows):
        return None
    return target if list(shape[1:]) == inner else None
