"""Small graph-walking checks shared by the normalization patterns (RMSNorm; LayerNorm could
use them too): read a node's attribute or a constant, step through no-op Casts, and check the
constants that carry meaning exactly (a one-element constant, a reduction over the last axis
with keepdims=1, a parameter broadcasting along the last axis only), and read a norm's epsilon
exactly (`epsilon`: a double one float32 cannot hold travels as an input of the fused op).

A failed check raises `NearMiss` deep in a walk; the pattern turns it into its `Rejection`, so
every reason names the node and the value a user sees in `fuser inspect`.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from fuser.fusedop import Dim
from fuser.graph import GraphIndex


class NearMiss(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised deep in a walk to give up with a reason naming `value` and the `nodes` at fault."""

    def __init__(self, reason: str, value: str | None = None, nodes: tuple[int, ...] = ()) -> None:
        super().__init__(reason)
        self.reason, self.value, self.nodes = reason, value, nodes


_INT, _FLOAT, _INTS = onnx.AttributeProto.INT, onnx.AttributeProto.FLOAT, onnx.AttributeProto.INTS


def _value(a: onnx.AttributeProto) -> Any:
    # An int, a float or ints are read directly: get_attribute_value's dispatch costs more
    # than the read, and these are most of the attributes a match asks for.
    kind = a.type
    if not a.ref_attr_name:
        if kind == _INT:
            return a.i
        if kind == _FLOAT:
            return a.f
        if kind == _INTS:  # a Reduce*'s axes
            return list(a.ints)
    return onnx.helper.get_attribute_value(a)


def attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    """The value of attribute `name` of `node`, or `default`."""
    for a in node.attribute:
        if a.name == name:
            return _value(a)
    return default


def attrs(node: onnx.NodeProto, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """`attr(node, name, default)` for each name and default of `defaults`, in one pass over
    the node's attributes (a match reading several of one node's attributes)."""
    found: dict[str, Any] = {}
    for a in node.attribute:
        name = a.name
        if name in defaults and name not in found:  # the first of a name, as `attr` reads
            found[name] = _value(a)
    return {**defaults, **found}


def const(graph: GraphIndex, name: str) -> np.ndarray | None:
    """`graph.constant`, reading a `Constant` node directly (no evaluator: cheap on big graphs)."""
    if not name:
        return None
    node = graph.producer_of(name)
    if node is not None and node.op_type == "Constant" and node.domain == "" and node.attribute:
        a = node.attribute[0]
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name in ("value_float", "value_floats"):  # float32, as ONNX types them
            return np.asarray(onnx.helper.get_attribute_value(a), np.float32)
        if a.name in ("value_int", "value_ints"):
            return np.asarray(onnx.helper.get_attribute_value(a), np.int64)
    return graph.constant(name)


# The raw little-endian layout of the float types a one-element constant (an epsilon, an
# exponent) is written in, by element type: `constant_scalar` reads those without numpy.
_RAW_FLOATS = {
    onnx.TensorProto.FLOAT: struct.Struct("<f"),
    onnx.TensorProto.DOUBLE: struct.Struct("<d"),
}
_DEFAULT_LOCATION = onnx.TensorProto.DEFAULT


def constant_scalar(graph: GraphIndex, name: str) -> tuple[float, int] | None:
    """(value, rank) of `name` if it is a one-element float32/float64 `Constant` node of rank
    0 or 1 stored as raw data: what `const` reads, without a numpy round trip (a norm's
    epsilon and exponent are these, one per norm). None for any other form: ask `const`."""
    node = graph.producer_of(name) if name else None
    if node is None or node.op_type != "Constant" or node.domain != "" or not node.attribute:
        return None
    a = node.attribute[0]
    if a.name != "value":
        return None
    t = a.t
    layout = _RAW_FLOATS.get(t.data_type)
    dims = t.dims
    if layout is None or len(dims) > 1 or (dims and dims[0] != 1):
        return None
    raw = t.raw_data
    if len(raw) != layout.size or t.data_location != _DEFAULT_LOCATION or t.HasField("segment"):
        return None
    return float(layout.unpack(raw)[0]), len(dims)


def operand_const(graph: GraphIndex, name: str) -> np.ndarray | None:
    """`const` for an operand that is usually an activation: one whose inferred shape has a
    symbolic dim is computed at run time, and its producers are not walked."""
    shape = graph.shape(name)
    if shape is not None and any(isinstance(d, str) for d in shape):
        return None
    return const(graph, name)


def const_shape(graph: GraphIndex, name: str, *, operand: bool = False) -> tuple[int, ...] | None:
    """The shape of `name` if it is a constant (`operand_const` if `operand`, else `const`),
    else None. A plain initializer of this graph is a constant whose shape is its dims: the
    data is not read (a match asks for weights' and gammas' shapes, not their values)."""
    tensor = graph.initializers.get(name)
    if tensor is not None and name not in graph.producer:
        if name in graph.graph_inputs:
            return None  # overridable at run time: not a constant
        return tuple(tensor.dims)
    found = operand_const(graph, name) if operand else const(graph, name)
    return None if found is None else tuple(found.shape)


def constant_why(graph: GraphIndex, value: str) -> str:
    """Why `value` is not a constant, in words."""
    if value in graph.graph_inputs:
        if value in graph.initializers:
            return "an overridable graph input (an initializer also listed as input)"
        return "a graph input, not a constant"
    return "computed at run time, not a constant"


# The walks below run for every anchor of every pattern: they read `graph.consumers` and
# `graph.nodes` directly rather than through `readers()` (a list copy per call) and `node()`.


def only_reader(graph: GraphIndex, value: str) -> int | None:
    """The one node reading `value` (None if several, none, or it is a graph output)."""
    readers = graph.consumers.get(value)
    if not readers or len(readers) != 1 or value in graph.graph_outputs:
        return None
    return next(iter(readers))


def readers_of(graph: GraphIndex, value: str, op_type: str) -> list[int]:
    """The standard-domain readers of `value` of type `op_type`."""
    nodes = graph.nodes
    return [
        r
        for r in graph.consumers.get(value, ())
        if (node := nodes[r]).op_type == op_type and node.domain == ""
    ]


def is_cast_to(node: onnx.NodeProto, elem_type: int | None) -> bool:
    """Whether `node` is a standard Cast to `elem_type`."""
    return node.op_type == "Cast" and node.domain == "" and attr(node, "to", 0) == elem_type


def is_noop_cast(graph: GraphIndex, node: onnx.NodeProto) -> bool:
    """A Cast to the dtype its input already has."""
    if node.op_type != "Cast":  # before the type lookup: most nodes asked about are no Cast
        return False
    source = graph.elem_type(node.input[0]) if node.input else None
    return bool(source) and is_cast_to(node, source)


def follow(graph: GraphIndex, value: str, members: list[int]) -> str:
    """Step forward through no-op Casts that are a value's only reader (they join `members`)."""
    while (reader := only_reader(graph, value)) is not None:
        node = graph.nodes[reader]
        if node.op_type != "Cast" or not is_noop_cast(graph, node):
            return value
        members.append(reader)
        value = node.output[0]
    return value


def rank(graph: GraphIndex, value: str) -> int | None:
    """The rank of `value`, if shape inference knows it."""
    shape = graph.shape(value)
    return None if shape is None else len(shape)


def scalar(graph: GraphIndex, value: str, what: str, node_id: int, max_rank: int | None) -> float:
    """The value of a one-element constant (that does not raise the rank of a rank-`max_rank`
    operand), or a near miss naming it. (Names are looked up only for a near miss, here and
    in `reduce_axes`: a match reads them for nothing else.)"""
    found = constant_scalar(graph, value)
    if found is None:
        c = const(graph, value)
        if c is None:
            raise NearMiss(
                f"{what} '{value}' of '{graph.describe(node_id)}' is {constant_why(graph, value)}",
                value,
                (node_id,),
            )
        if c.size != 1:
            raise NearMiss(
                f"{what} '{value}' of '{graph.describe(node_id)}' has shape {list(c.shape)}, "
                "expected a single value",
                value,
                (node_id,),
            )
        found = float(c.reshape(-1)[0]), c.ndim
    number, ndim = found
    if max_rank is not None and ndim > max_rank:
        raise NearMiss(
            f"{what} '{value}' of '{graph.describe(node_id)}' has rank {ndim}, more than the "
            f"input's {max_rank}",
            value,
            (node_id,),
        )
    return number


_REDUCE_ATTRS = {"keepdims": 1, "axes": None, "noop_with_empty_axes": 0}


def reduce_axes(graph: GraphIndex, node_id: int, x_rank: int | None) -> list[int]:
    """The axes a Reduce* node averages over (attribute or input; empty = all), negative when
    the rank is known; a near miss if keepdims is not 1 or the axes are not constant."""
    node = graph.nodes[node_id]
    read = attrs(node, _REDUCE_ATTRS)
    keepdims = read["keepdims"]
    if keepdims != 1:
        raise NearMiss(
            f"{node.op_type} '{graph.describe(node_id)}' has keepdims={keepdims}; the statistic "
            "must keep its axis to broadcast back over the row (keepdims=1)",
            node.output[0],
            (node_id,),
        )
    if len(node.input) > 1 and node.input[1]:
        c = const(graph, node.input[1])
        if c is None:
            raise NearMiss(
                f"axes '{node.input[1]}' of {node.op_type} '{graph.describe(node_id)}' are "
                "computed at run time",
                node.input[1],
                (node_id,),
            )
        axes = [int(a) for a in c.reshape(-1)]
    else:
        found = read["axes"]
        axes = [] if found is None else [int(a) for a in found]
    if not axes:
        if read["noop_with_empty_axes"]:
            raise NearMiss(
                f"{node.op_type} '{graph.describe(node_id)}' has no axes and "
                "noop_with_empty_axes=1 (it reduces nothing)",
                node.output[0],
                (node_id,),
            )
        if x_rank is None:
            raise NearMiss(
                f"{node.op_type} '{graph.describe(node_id)}' reduces all axes of "
                f"'{node.input[0]}', whose rank is unknown",
                node.input[0],
                (node_id,),
            )
        axes = list(range(x_rank))
    if x_rank is None:
        return axes
    return sorted(a - x_rank if a >= 0 else a for a in axes)


def last_axis_problem(shape: Sequence[Dim], x_rank: int | None) -> str | None:
    """Why a parameter of `shape` does not broadcast along the last axis only, or None."""
    if x_rank is not None and len(shape) > x_rank:
        return f"has rank {len(shape)}, more than the input's {x_rank}"
    for i, dim in enumerate(shape[:-1]):
        if dim != 1:
            axis = i - len(shape)
            where = f"axis {axis + x_rank}" if x_rank is not None else f"axis {axis}"
            return f"has shape {list(shape)}: it varies along {where}, not only the last axis"
    return None


@dataclass(frozen=True)
class Epsilon:
    """A norm's epsilon as read: `value`, and where a float32 attribute cannot hold it (a
    double epsilon of a double norm) the value the fused op reads it from exactly (`input`,
    a one-element tensor: the original constant, or `new_initializer` holding it as 0-d)."""

    value: float
    input: str = ""
    new_initializer: onnx.TensorProto | None = None

    @property
    def attributes(self) -> dict[str, float | int]:
        """The fused node's `epsilon` (rounded to float32 when carried by input) and
        `exact_epsilon` (only when set: nodes that need none stay as they were)."""
        if not self.input:
            return {"epsilon": self.value}
        return {"epsilon": float(np.float32(self.value)), "exact_epsilon": 1}

    @property
    def inputs(self) -> tuple[str, ...]:
        """The fused node's trailing epsilon input, if any."""
        return (self.input,) if self.input else ()


def epsilon(
    graph: GraphIndex,
    add: int,
    operand: str,
    x_type: int | None,
    op_name: str,
    max_rank: int | None,
) -> Epsilon:
    """The epsilon Add `add` adds to `operand` (the variance or mean square): a one-element
    constant, kept exactly. One that float32 holds goes in the float attribute; a double one
    of a double norm (x_type) travels as an input; any other is a near miss."""
    node = graph.nodes[add]
    name = node.input[1] if node.input[0] == operand else node.input[0]
    value = scalar(graph, name, "epsilon", add, max_rank)
    if float(np.float32(value)) == value:
        return Epsilon(value)
    if x_type != onnx.TensorProto.DOUBLE:
        raise NearMiss(
            f"epsilon '{name}' = {value!r} is not exactly representable in {op_name}'s "
            "float32 epsilon attribute",
            name,
            (add,),
        )
    found = const(graph, name)
    if found is not None and found.ndim <= 1 and found.dtype == np.float64:
        return Epsilon(value, name)  # already the one-element double the op takes
    tensor = numpy_helper.from_array(
        np.asarray(value, np.float64), graph.unique_value_name(f"{graph.describe(add)}.epsilon")
    )
    return Epsilon(value, tensor.name, tensor)
