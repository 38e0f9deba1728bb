"""Finding the activation that reads a Conv (or its BN) output, in the forms exporters write.

`find(graph, value)` looks at the readers of `value` and answers with `Found` (the activation,
the nodes it takes, the value it writes), `Refused` (an activation-shaped reader that cannot be
fused, with the reason and the node that heads it) or None (nothing activation-shaped reads it).

Forms: the ops Relu, Clip (bounds as attributes below opset 11, as constant inputs from 11,
also given as `CastLike(bound, x)`: that CastLike reads only x's dtype, and joins the fusion),
LeakyRelu, HardSigmoid, HardSwish, Sigmoid, Tanh, Gelu (opset 20); the decomposed
`x * Sigmoid(x)` (SiLU), `x * HardSigmoid(x)` (HardSwish), and the erf GELU
`x * 0.5 * (1 + Erf(x / sqrt2))` in the orders exporters write (TorchScript: ((x * (Erf(x / c)
+ 1)) * 0.5); the ONNX function: (x * 0.5) * (1 + Erf(x * 1/sqrt2)); dynamo: x * (0.5 * (Erf(x /
c) + 1))), and the tanh GELU `0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))` with x^3
as Pow(x, 3) (dynamo) or x * (x * x) (TorchScript), ending in the same three orders.
`Identity` nodes that are a value's only reader are looked through everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx

from fuser.graph import GraphIndex

from ._walk import attr, const, constant_why, only_reader
from .conv_activation import HARDSWISH_ALPHA, Activation

#: Standard ops that look like an activation of a Conv output (a reader of one of these that
#: is not fused is reported, never silently left).
ACTIVATION_OPS = frozenset({
    "Relu", "Clip", "LeakyRelu", "HardSigmoid", "HardSwish", "Sigmoid", "Tanh", "Gelu",
    "PRelu", "Mish", "Softplus", "Elu", "Selu", "Celu", "ThresholdedRelu", "Softsign", "Erf",
    "Swish",
})  # fmt: skip
#: Of those, the ones ConvBnRelu does not compute (and why, when it needs saying).
UNSUPPORTED = {
    "PRelu": "PRelu (learned slope) is not one of ConvBnRelu's activations",
    "Mish": "Mish is not one of ConvBnRelu's activations",
    "Softplus": "Softplus is not one of ConvBnRelu's activations",
    "Elu": "Elu is not one of ConvBnRelu's activations",
    "Selu": "Selu is not one of ConvBnRelu's activations",
    "Celu": "Celu is not one of ConvBnRelu's activations",
    "ThresholdedRelu": "ThresholdedRelu is not one of ConvBnRelu's activations",
    "Softsign": "Softsign is not one of ConvBnRelu's activations",
    "Swish": "Swish with an alpha is not one of ConvBnRelu's activations",
}


@dataclass(frozen=True)
class Found:
    """An activation to fuse: its nodes (Identity and CastLike helpers included), its output."""

    activation: Activation
    nodes: tuple[int, ...]
    out: str


@dataclass(frozen=True)
class Refused:
    """An activation-shaped reader left unfused: why, the value at fault, the heading node."""

    reason: str
    value: str | None
    head: int


def through_identity(graph: GraphIndex, value: str, members: list[int]) -> str:
    """Step forward through Identity nodes that are `value`'s only reader (they join
    `members`).

    `only_reader` and `_is` inline: this runs three times per Conv of a CNN (its match, its
    fold's prefetch, its activation), where a Python call per step is most of the cost."""
    consumers, nodes, outputs = graph.consumers, graph.nodes, graph.graph_outputs
    while True:
        readers = consumers.get(value)
        if not readers or len(readers) != 1 or value in outputs:
            return value
        r = next(iter(readers))
        node = nodes[r]
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
            return value
        members.append(r)
        value = node.output[0]


def back_through_identity(graph: GraphIndex, value: str) -> str:
    """The value an Identity chain ending at `value` starts from (each Identity the only
    reader of its input)."""
    while (p := graph.producer_of(value)) is not None and _is(p, "Identity"):
        if only_reader(graph, p.input[0]) is None:
            break
        value = p.input[0]
    return value


def find(graph: GraphIndex, value: str) -> Found | Refused | None:
    """The activation reading `value` (see the module docstring)."""
    members: list[int] = []
    consumers, nodes = graph.consumers, graph.nodes
    readers = list(consumers.get(value, ()))  # `graph.readers(v)`, inline
    # the Identity walk only where the one reader is an Identity (it steps no other node)
    if len(readers) == 1 and nodes[readers[0]].op_type == "Identity":
        v = through_identity(graph, value, members)
        readers = list(consumers.get(v, ()))
    else:
        v = value
    if len(readers) == 1:
        # The common cases, decided without the general walk (which gives the same answer):
        # a lone Relu, Sigmoid or Tanh reading v, which is no graph output; a lone reader
        # that `_activation_shaped` refuses by its op alone (a residual Add, a Concat).
        node = nodes[readers[0]]
        op = node.op_type
        if node.domain in ("", "ai.onnx"):
            if op in _PLAIN and node.input[0] == v and v not in graph.graph_outputs:
                return Found(_PLAIN[op], (*members, readers[0]), node.output[0])
            if op not in _SHAPED_OPS:
                return None
    elif len(readers) == 2:
        silu = _silu(graph, v, readers)
        if silu is not None:
            return Found(silu.activation, (*members, *silu.nodes), silu.out)
    shaped = [r for r in readers if _activation_shaped(graph, r, v)]
    if not shaped:
        return None
    head = shaped[0]
    try:
        found = _match(graph, v, readers)
    except _Miss as e:
        return Refused(e.reason, e.value, head)
    if found is None:
        return None
    if graph.is_graph_output(v):
        return Refused(
            f"{found.activation.describe()} '{graph.describe(head)}' left unfused: its input "
            f"'{v}' is a graph output",
            v,
            head,
        )
    return Found(found.activation, (*members, *found.nodes), found.out)


#: Activations without attributes or helper nodes, fused as they stand (see `_single`).
_PLAIN = {op: Activation(op) for op in ("Relu", "Sigmoid", "Tanh")}
#: The standard ops `_activation_shaped` may accept (any other reader is not one).
_SHAPED_OPS = ACTIVATION_OPS | {"Div", "Pow", "Mul"}
_SILU = Activation("Silu")


def _silu(graph: GraphIndex, v: str, readers: list[int]) -> Found | None:
    """`x * Sigmoid(x)` read off v's two readers as the general walk finds it (`_match`'s
    `_times_x`, the first Sigmoid reader), or None (then the general walk decides): the form
    exporters write for SiLU, decided without asking every reader whether it is
    activation-shaped. v is no graph output (that is refused, by the general walk)."""
    if v in graph.graph_outputs:
        return None
    nodes = graph.nodes
    first, second = nodes[readers[0]], nodes[readers[1]]
    std = ("", "ai.onnx")
    if first.domain not in std or second.domain not in std:
        return None
    if first.op_type == "Sigmoid":
        sig, r, mul, m = first, readers[0], second, readers[1]
    elif second.op_type == "Sigmoid":
        sig, r, mul, m = second, readers[1], first, readers[0]
    else:
        return None
    if mul.op_type != "Mul" or sig.input[0] != v:
        return None
    s = sig.output[0]
    if only_reader(graph, s) != m or _other_input(mul, v) != s:
        return None
    return Found(_SILU, (r, m), mul.output[0])


class _Miss(Exception):  # noqa: N818 - a control-flow signal
    def __init__(self, reason: str, value: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.value = reason, value


def _is(node: onnx.NodeProto, op: str) -> bool:
    return node.op_type == op and node.domain in ("", "ai.onnx")


def _activation_shaped(graph: GraphIndex, r: int, v: str) -> bool:
    """Whether reader `r` of `v` is an activation op on v, or the start of a decomposed one
    (x * Sigmoid(x), x * HardSigmoid(x), the erf GELU's scaling or its products): a Mul by
    anything else (a squeeze-excite gate, a residual scale) is not."""
    node = graph.node(r)
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in ACTIVATION_OPS:
        return node.input[0] == v
    if node.op_type == "Div":
        return node.input[0] == v and _is_const(graph, node.input[1], _SQRT2)
    if node.op_type == "Pow":  # the tanh GELU's x^3
        return node.input[0] == v and _is_const(graph, node.input[1], 3.0)
    if node.op_type != "Mul":
        return False
    if list(node.input[:2]) == [v, v]:  # the tanh GELU's x * x
        return True
        return False
    other = _other_input(node, v)
    if other is None:
        return False
    if _is_const(graph, other, 0.5) or _is_const(graph, other, 1 / _SQRT2):
        return True
    return _from_activation_of(graph, other, v, depth=3)


def _from_activation_of(graph: GraphIndex, value: str, v: str, depth: int) -> bool:
    """`value` is Sigmoid(v) / HardSigmoid(v), or an Erf (of anything) lies within `depth`
    Add/Mul steps upstream of it (the GELU's `1 + Erf(...)` factor)."""
    p = graph.producer_of(value)
    if p is None or p.domain not in ("", "ai.onnx"):
        return False
    if p.op_type in ("Sigmoid", "HardSigmoid"):
        return p.input[0] == v
    if p.op_type == "Erf":
        return True
    if p.op_type in ("Add", "Mul") and depth > 0:
        return any(_from_activation_of(graph, i, v, depth - 1) for i in p.input[:2] if i)
    return False


def _match(graph: GraphIndex, v: str, readers: list[int]) -> Found | None:
    nodes = [graph.node(r) for r in readers]
    ops = [n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}" for n in nodes]
    # CastLike(bound, v) reads only v's dtype: the Clip reading those bounds owns them.
    direct = [r for r, op in zip(readers, ops, strict=True) if op != "CastLike"]
    if len(direct) == 1 and ops[readers.index(direct[0])] in ACTIVATION_OPS:
        return _single(graph, v, direct[0], [r for r in readers if r not in direct])
    for r, op in zip(readers, ops, strict=True):
        if op in ("Sigmoid", "HardSigmoid"):
            found = _times_x(graph, v, r, readers)
            if found is not None:
                return found
    for r, op in zip(readers, ops, strict=True):
        if op in ("Div", "Mul"):
            found = _erf_gelu(graph, v, r, readers)
            if found is not None:
                return found
        if op in ("Pow", "Mul"):
            found = _tanh_gelu(graph, v, r, readers)
            if found is not None:
                return found
    shaped = [r for r in readers if _activation_shaped(graph, r, v)]
    first = graph.node(shaped[0])
    erf_like = [
        r for r in shaped
        if graph.node(r).op_type == "Mul"
        and _from_activation_of(graph, _other_input(graph.node(r), v) or "", "", depth=3)
    ]  # fmt: skip
    if erf_like:
        raise _Miss(
            f"Mul '{graph.describe(erf_like[0])}' left unfused: it looks like the erf GELU but "
            "is not x * 0.5 * (1 + Erf(x / sqrt2)) with constant factors of exactly those values",
            v,
        )
    others = [graph.describe(r) for r in readers if r != shaped[0]]
    raise _Miss(
        f"{first.op_type} '{graph.describe(shaped[0])}' left unfused: its input '{v}' is also "
        f"read by {', '.join(repr(o) for o in others)}",
        v,
    )


def _single(graph: GraphIndex, v: str, r: int, castlikes: list[int]) -> Found:
    node = graph.node(r)
    op = node.op_type
    name = graph.describe(r)
    out = node.output[0]
    if op in UNSUPPORTED:
        raise _Miss(f"'{name}': {UNSUPPORTED[op]}", out)
    if op == "Erf":
        raise _Miss(f"Erf '{name}' reads the Conv output directly: not a GELU form", out)
    if op == "Clip":
        act, helpers = _clip(graph, node, r, v, castlikes)
        return Found(act, (r, *helpers), out)
    if castlikes:
        cl = graph.describe(castlikes[0])
        raise _Miss(f"{op} '{name}' left unfused: its input '{v}' is also read by '{cl}'", v)
    if op == "Relu":
        return Found(Activation("Relu"), (r,), out)
    if op == "LeakyRelu":
        return Found(Activation("LeakyRelu", float(attr(node, "alpha", 0.01))), (r,), out)
    if op == "HardSigmoid":
        a, b = float(attr(node, "alpha", 0.2)), float(attr(node, "beta", 0.5))
        return Found(Activation("HardSigmoid", a, b), (r,), out)
    if op == "HardSwish":
        return Found(Activation("HardSwish", HARDSWISH_ALPHA, 0.5), (r,), out)
    if op in ("Sigmoid", "Tanh"):
        return Found(Activation(op), (r,), out)
    if op == "Gelu":
        approximate = attr(node, "approximate", b"none")
        approximate = approximate.decode() if isinstance(approximate, bytes) else approximate
        if approximate not in ("none", "tanh"):
            raise _Miss(f"Gelu '{name}' has approximate='{approximate}'", out)
        return Found(Activation("Gelu" if approximate == "none" else "GeluTanh"), (r,), out)
    raise _Miss(f"'{name}': {op} is not one of ConvBnRelu's activations", out)


def _clip(
    graph: GraphIndex, node: onnx.NodeProto, r: int, v: str, castlikes: list[int]
) -> tuple[Activation, list[int]]:
    name = graph.describe(r)
    if graph.opset() < 11:
        lo = float(attr(node, "min", -3.4028234663852886e38))
        hi = float(attr(node, "max", 3.4028234663852886e38))
        return Activation("Clip", lo, hi), []
    helpers: list[int] = []
    bounds = []
    for i, what, default in ((1, "min", -math.inf), (2, "max", math.inf)):
        bound = node.input[i] if len(node.input) > i else ""
        if not bound:
            bounds.append(default)
            continue
        value, helper = _bound(graph, bound, v, name, what, castlikes)
        if helper is not None:
            helpers.append(helper)
        bounds.append(value)
    stray = [c for c in castlikes if c not in helpers]
    if stray:
        raise _Miss(
            f"Clip '{name}' left unfused: its input '{v}' is also read by "
            f"'{graph.describe(stray[0])}'",
            v,
        )
    return Activation("Clip", bounds[0], bounds[1]), helpers


def _bound(
    graph: GraphIndex, bound: str, v: str, clip: str, what: str, castlikes: list[int]
) -> tuple[float, int | None]:
    helper: int | None = None
    source = bound
    producer = graph.producer.get(bound)
    if producer is not None and producer in castlikes:
        cl = graph.node(producer)
        if cl.input[1] != v or only_reader(graph, bound) is None:
            raise _Miss(f"Clip '{clip}' {what} bound '{bound}' is read elsewhere too", bound)
        helper, source = producer, cl.input[0]
    c = const(graph, source)
    if c is None:
        raise _Miss(
            f"Clip '{clip}' {what} bound '{source}' is {constant_why(graph, source)}", source
        )
    if c.size != 1:
        raise _Miss(f"Clip '{clip}' {what} bound '{source}' has {c.size} values", source)
    value = float(c.reshape(-1)[0])
    if helper is not None:
        # CastLike rounds the bound to x's dtype first.
        dtype = onnx.helper.tensor_dtype_to_np_dtype(graph.elem_type(v) or 1)
        value = float(np.asarray(value).astype(dtype))
    if math.isfinite(value) and float(np.float32(value)) != value:
        raise _Miss(
            f"Clip '{clip}' {what} bound {value!r} is not exact as a float attribute", source
        )
    return value, helper


def _other_input(node: onnx.NodeProto, v: str) -> str | None:
    """The operand of a binary node beside `v` (None if `v` is not one of its two inputs)."""
    if len(node.input) != 2:
        return None
    if node.input[0] == v:
        return node.input[1]
    if node.input[1] == v:
        return node.input[0]
    return None


def _times_x(graph: GraphIndex, v: str, r: int, readers: list[int]) -> Found | None:
    """x * Sigmoid(x) (SiLU) or x * HardSigmoid(x) (HardSwish)."""
    f = graph.node(r)
    m = only_reader(graph, f.output[0])
    if m is None or not _is(graph.node(m), "Mul") or m not in readers:
        return None
    mul = graph.node(m)
    if _other_input(mul, v) != f.output[0] or set(readers) != {r, m}:
        return None
    if f.op_type == "Sigmoid":
        return Found(Activation("Silu"), (r, m), mul.output[0])
    a, b = float(attr(f, "alpha", 0.2)), float(attr(f, "beta", 0.5))
    return Found(Activation("HardSwish", a, b), (r, m), mul.output[0])


_SQRT2 = math.sqrt(2.0)
_SQRT_2_PI = math.sqrt(2.0 / math.pi)


def _is_const(graph: GraphIndex, name: str | None, want: float) -> bool:
    """`name` is a one-value constant equal to `want` rounded to its dtype (or float32)."""
    if name is None:
        return False
    shape = graph.shape(name)
    if shape is not None and any(isinstance(d, int) and d != 1 for d in shape):
        # Not one value (a dim of 0 or > 1), whatever it holds: the common case of an
        # activation operand, decided without walking its producers for a constant (a walk
        # that reads the weights of up to 64 upstream nodes before it gives up).
        return False
    c = const(graph, name)
    if c is None or c.size != 1 or not np.issubdtype(c.dtype, np.floating):
        return False
    value = c.reshape(-1)[0]
    return bool(value == c.dtype.type(want) or float(value) == float(np.float32(want)))


def _erf_gelu(graph: GraphIndex, v: str, d: int, readers: list[int]) -> Found | None:
    """x * 0.5 * (1 + Erf(x / sqrt2)) in the exporters' orders (module docstring)."""
    scale = graph.node(d)
    other = _other_input(scale, v)
    if scale.op_type == "Div":
        if scale.input[0] != v or not _is_const(graph, scale.input[1], _SQRT2):
            return None
    elif not _is_const(graph, other, 1 / _SQRT2):
        return None
    e = only_reader(graph, scale.output[0])
    if e is None or not _is(graph.node(e), "Erf"):
        return None
    return _gelu_tail(graph, v, graph.node(e).output[0], [d, e], {d}, readers, "Gelu")


def _tanh_gelu(graph: GraphIndex, v: str, first: int, readers: list[int]) -> Found | None:
    """0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), x^3 as Pow(x, 3) (dynamo) or
    Mul(x, Mul(x, x)) (TorchScript), each product and sum in either operand order."""
    node = graph.node(first)
    if node.op_type == "Pow":
        if node.input[0] != v or not _is_const(graph, node.input[1], 3.0):
            return None
        nodes, x_readers, cube = [first], {first}, node.output[0]
    elif node.op_type == "Mul" and list(node.input[:2]) == [v, v]:
        c = only_reader(graph, node.output[0])
        if c is None or not _is(graph.node(c), "Mul"):
            return None
        if _other_input(graph.node(c), node.output[0]) != v:
            return None
        nodes, x_readers, cube = [first, c], {first, c}, graph.node(c).output[0]
    else:
        return None
    k = only_reader(graph, cube)
    if k is None or not _is(graph.node(k), "Mul"):
        return None
    if not _is_const(graph, _other_input(graph.node(k), cube), 0.044715):
        return None
    s = only_reader(graph, graph.node(k).output[0])
    if s is None or not _is(graph.node(s), "Add"):
        return None
    if _other_input(graph.node(s), graph.node(k).output[0]) != v:
        return None
    z = only_reader(graph, graph.node(s).output[0])
    if z is None or not _is(graph.node(z), "Mul"):
        return None
    if not _is_const(graph, _other_input(graph.node(z), graph.node(s).output[0]), _SQRT_2_PI):
        return None
    t = only_reader(graph, graph.node(z).output[0])
    if t is None or not _is(graph.node(t), "Tanh"):
        return None
    core = [*nodes, k, s, z, t]
    return _gelu_tail(graph, v, graph.node(t).output[0], core, x_readers | {s}, readers, "GeluTanh")


def _gelu_tail(
    graph: GraphIndex,
    v: str,
    f: str,
    core: list[int],
    x_readers: set[int],
    readers: list[int],
    name: str,
) -> Found | None:
    """The common end of both GELU forms: 1 + f, times x and 0.5 in any of three orders;
    every reader of x must be one of the form's own."""
    a = only_reader(graph, f)
    if a is None or not _is(graph.node(a), "Add"):
        return None
    if not _is_const(graph, _other_input(graph.node(a), f), 1.0):
        return None
    one_plus = graph.node(a).output[0]
    m1 = only_reader(graph, one_plus)
    if m1 is None or not _is(graph.node(m1), "Mul"):
        return None
    mul1 = graph.node(m1)
    partner = _other_input(mul1, one_plus)
    core = [*core, a, m1]
    if partner == v:
        # (x * (1 + f)) * 0.5
        m2 = only_reader(graph, mul1.output[0])
        if m2 is None or not _is(graph.node(m2), "Mul"):
            return None
        if not _is_const(graph, _other_input(graph.node(m2), mul1.output[0]), 0.5):
            return None
        nodes, uses = [*core, m2], {m1}
    elif partner is not None and _is_const(graph, partner, 0.5):
        # x * ((1 + f) * 0.5)
        m2 = only_reader(graph, mul1.output[0])
        if m2 is None or not _is(graph.node(m2), "Mul"):
            return None
        if _other_input(graph.node(m2), mul1.output[0]) != v:
            return None
        nodes, uses = [*core, m2], {m2}
    else:
        # (x * 0.5) * (1 + f)
        half = graph.producer.get(partner or "")
        if half is None or half not in readers or not _is(graph.node(half), "Mul"):
            return None
        if not _is_const(graph, _other_input(graph.node(half), v), 0.5):
            return None
        if only_reader(graph, graph.node(half).output[0]) != m1:
            return None
        nodes, uses = [*core, half], {half}
        m2 = m1
    if set(readers) != x_readers | uses:
        return None
    return Found(Activation(name), tuple(nodes), graph.node(m2).output[0])
