"""Folding an inference BatchNormalization into the Conv (or ConvTranspose) before it.

    W'[c] = W[c] * a_c,  B'_c = (B_c - mean_c) * a_c + bias_c,  a_c = scale_c / sqrt(var_c + eps)

computed in float64 and cast once to the weight's dtype. A large CNN folds tens of thousands of
small layers, where numpy's per-call overhead, not arithmetic, is the cost: the common case
(every parameter a plain raw initializer, the BN parameters [Cout] of one dtype) reads the BN
parameters as one array and computes W' and B' into one buffer, cast and checked once. The
arithmetic is the same, element for element and in the same order, as the general path, so
both give the same bytes; anything else (Constant nodes, external data, mixed dtypes,
ConvTranspose groups) takes the general path.
"""

from __future__ import annotations

import math
import operator
import sys
import typing
import weakref
from typing import NamedTuple

import numpy as np
import onnx
from onnx import numpy_helper

from fuser.graph import GraphIndex
from fuser.modelio import read_tensor

from ._conv_act_walk import through_identity

#: Element types whose raw bytes the fast path reads directly.
_RAW_FLOATS: dict[int, np.dtype] = {
    t: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t))
    for t in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
}
_EXTERNAL = onnx.TensorProto.EXTERNAL

Folded = tuple[onnx.TensorProto, onnx.TensorProto]
#: What folded bytes depend on besides the input bytes: W's dtype, the BN parameters' dtype,
#: W's size, Cout, whether the Conv has a bias, epsilon.
_Key = tuple[np.dtype, np.dtype, int, int, bool, float]


def fold(
    graph: GraphIndex,
    conv_node: onnx.NodeProto,
    bn: onnx.NodeProto,
    epsilon: float,
    transposed_group: int = 0,
    node_id: int | None = None,
    names: tuple[str, ...] | None = None,
) -> Folded | str:
    """Folded (W', B') as new initializers, or the reason folding is not possible.
    `transposed_group` > 0: a ConvTranspose weight [Cin, Cout/group, *k] with that group, whose
    output channel (g, o) is W[g * Cin/group : (g + 1) * Cin/group, o]. `node_id`: the Conv's
    id in `graph` (looked up when not given); `names`: `_names(conv_node, bn)`, when the
    caller has read them."""
    if not transposed_group:
        fast = _fold_raw(graph, conv_node, bn, epsilon, node_id, names)
        if fast is not None:
            return fast
    return _fold_general(graph, conv_node, bn, epsilon, transposed_group)


def bn_epsilon(bn: onnx.NodeProto) -> float:
    """The epsilon of BatchNormalization `bn` (ONNX's default 1e-5 when absent)."""
    for attr in bn.attribute:
        if attr.name == "epsilon":
            return float(attr.f)
    return 1e-5


#: A tensor's fields the raw path reads, in one C call per tensor.
_RAW_FIELDS = operator.attrgetter("data_type", "data_location", "raw_data")


class _Raw(NamedTuple):
    """A fold's inputs as the raw path reads them. `key` says what the folded bytes depend on
    besides `chunks` ([W, scale, bias, mean, var, B?] as stored, one bytes each): equal (key,
    chunks), equal bytes."""

    weight: onnx.TensorProto
    dims: tuple[int, ...]
    key: _Key
    chunks: list[bytes]
    tensors: list[onnx.TensorProto]


def _names(conv_node: onnx.NodeProto, bn: onnx.NodeProto) -> tuple[str, ...]:
    """The fold's parameters: (W, scale, bias, mean, var) and the Conv's B if it has one."""
    # each index into a proto's repeated field costs: both read whole, once
    conv_in, bn_in = conv_node.input[:], bn.input[:]
    if len(conv_in) > 2 and conv_in[2]:
        return (conv_in[1], *bn_in[1:5], conv_in[2])
    return (conv_in[1], *bn_in[1:5])


def _gather(graph: GraphIndex, names: tuple[str, ...], epsilon: float) -> _Raw | None:
    """The raw path's inputs (`names` as `_names` gives them), or None when a parameter is not
    a non-overridable initializer held as raw float bytes in the model, the BN parameters are
    not all [Cout] of one dtype, or a size disagrees with the dims."""
    if sys.byteorder != "little" or len(names) < 5 or not graph.graph_inputs.isdisjoint(names):
        return None
    found = list(map(graph.initializers.get, names))
    try:
        fields = list(map(_RAW_FIELDS, found))
    except AttributeError:  # a name that is no initializer
        return None
    tensors = typing.cast(list[onnx.TensorProto], found)  # none is None: each had the fields
    w_type, w_location, w_data = fields[0]
    dtype = _RAW_FLOATS.get(w_type)
    if dtype is None or w_location == _EXTERNAL or not w_data:
        return None
    w_tensor = tensors[0]
    w_dims = tuple(w_tensor.dims[:])  # a slice is one C call; iterating the field, one a dim
    if len(w_dims) < 2 or len(w_data) != math.prod(w_dims) * dtype.itemsize:
        return None
    cout = w_dims[0]
    p_type = fields[1][0]
    p_dtype = _RAW_FLOATS.get(p_type)
    if p_dtype is None:
        return None
    size = cout * p_dtype.itemsize
    for data_type, location, data in fields[1:]:
        if data_type != p_type or location == _EXTERNAL or len(data) != size:
            return None
    one = [cout]
    for tensor in tensors[1:]:
        if tensor.dims[:] != one:
            return None
    key = (dtype, p_dtype, len(w_data) // dtype.itemsize, cout, len(names) > 5, epsilon)
    return _Raw(w_tensor, w_dims, key, [f[2] for f in fields], tensors)


def _fold_rows(data: bytes, n: int, key: _Key) -> tuple[np.ndarray, np.ndarray]:
    """`n` folds of one `key` at once, their inputs laid end to end in `data`: the float64
    [W', B'] rows [n, size + cout] and those rows cast to W's dtype.

    Every value is computed element by element with the same operations in the same order
    whatever `n` is (IEEE +, -, *, / and sqrt are correctly rounded, and so is the cast), so
    a fold computed in a batch gives the bytes it gives alone."""
    dtype, p_dtype, size, cout, has_bias, epsilon = key
    params = (5 if has_bias else 4) * cout
    # One float64 buffer [n, W | scale, bias, mean, var, B?] (one conversion when W and the
    # parameters share a dtype); W' is computed in place and B' into the scale row once `a`
    # is made, so each row's [W', B'] is one contiguous run, cast and checked once.
    if dtype == p_dtype:
        values = np.frombuffer(data, dtype).astype(np.float64).reshape(n, size + params)
    else:
        raw = np.frombuffer(data, np.uint8).reshape(n, -1)
        split = size * dtype.itemsize
        values = np.concatenate(
            (
                np.ascontiguousarray(raw[:, :split]).view(dtype),
                np.ascontiguousarray(raw[:, split:]).view(p_dtype),
            ),
            axis=1,
            dtype=np.float64,
        )
    rows = values[:, size:].reshape(n, -1, cout, copy=False)
    # A negative variance or a weight float16 cannot hold is refused by the caller with its
    # reason, not reported as a numpy warning on the user's terminal.
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        a = rows[:, 0] / np.sqrt(rows[:, 3] + epsilon)
        w = values[:, :size].reshape(n, cout, -1, copy=False)
        w *= a[:, :, None]
        b_new = rows[:, 0]  # scale is read only by `a`
        # (B - mean) * a + bias, as the general path (B = 0 without a Conv bias: 0.0 - mean,
        # not -mean, so that a zero mean gives +0 there too).
        np.subtract(rows[:, 4] if has_bias else 0.0, rows[:, 2], out=b_new)
        b_new *= a
        b_new += rows[:, 1]
        out = values[:, : size + cout]
        return out, out.astype(dtype)


def _fold_raw(
    graph: GraphIndex,
    conv_node: onnx.NodeProto,
    bn: onnx.NodeProto,
    epsilon: float,
    node_id: int | None,
    names: tuple[str, ...] | None = None,
) -> Folded | str | None:
    """The fold of the common case (see the module docstring), or None for the general path."""
    if names is None:
        names = _names(conv_node, bn)
    if node_id is None:
        node_id = graph.producer.get(conv_node.output[0], -1)
    ahead = PREFETCH.take(graph, node_id, names, epsilon)
    if ahead is not None:
        raw, w_new, b_new = ahead
    else:
        found = _gather(graph, names, epsilon)
        if found is None:
            return None
        raw = found
        out, cast = _fold_rows(b"".join(raw.chunks), 1, raw.key)
        if not np.isfinite(cast).all():
            if not np.isfinite(out).all():
                return "folding gives non-finite weights (var + epsilon <= 0?)"
            return f"folded weights overflow {raw.key[0]}"
        folded = cast.tobytes()
        split = raw.key[2] * raw.key[0].itemsize
        w_new, b_new = folded[:split], folded[split:]
    base = conv_node.name or conv_node.output[0]
    data_type = raw.weight.data_type
    return (
        onnx.TensorProto(
            name=graph.unique_value_name(f"{base}.W_bn_folded"),
            data_type=data_type,
            dims=raw.dims,
            raw_data=w_new,
        ),
        onnx.TensorProto(
            name=graph.unique_value_name(f"{base}.B_bn_folded"),
            data_type=data_type,
            dims=(raw.key[3],),
            raw_data=b_new,
        ),
    )


#: Convs folded ahead, per batch, and the size of a Conv (W and BN parameters, elements) up
#: to which it is: above it numpy's per-call overhead is small beside the arithmetic.
_AHEAD, _AHEAD_ELEMENTS = 256, 4096

#: A fold computed ahead: the parameter names and epsilon it is of, its inputs, W' and B'.
_Entry = tuple[tuple[str, ...], float, _Raw, bytes, bytes]


class _Prefetch:
    """Folds of the raw path computed ahead, a batch of Convs at a time.

    A large CNN folds tens of thousands of small layers one match at a time, where numpy's
    per-call overhead (some fifteen calls a fold) and reading the six tensors, not the
    arithmetic, is the cost. When a match asks for a fold not computed yet, the next `_AHEAD`
    Convs of the graph (in the pass's order) that read a BatchNormalization are gathered and
    folded together, per key, in one run of numpy calls (`_fold_rows`: the same bytes as
    alone). A fold is handed out only to the Conv it was computed for, for the same parameter
    names and epsilon, each name still the very initializer read (nothing rewrites an
    initializer in place during a pass; a replaced one is another object): a graph the pass
    changed meanwhile, or a fold not computed ahead, takes the fold of its own inputs. A fold
    that is not finite is not kept (the match computes it again, to say why)."""

    def __init__(self) -> None:
        self._graph: weakref.ref[GraphIndex] | None = None
        self._order: dict[int, int] = {}
        self._convs: list[int] = []
        self._covered = 0
        self._folds: dict[int, _Entry] = {}

    def take(
        self, graph: GraphIndex, node_id: int, names: tuple[str, ...], epsilon: float
    ) -> tuple[_Raw, bytes, bytes] | None:
        """The gathered inputs and the folded W' and B' bytes of Conv `node_id`'s fold with
        these parameters if computed ahead, else None."""
        if self._graph is None or self._graph() is not graph:
            self._start(graph)
        entry = self._folds.pop(node_id, None)  # each fold serves its Conv once
        if entry is None:
            at = self._order.get(node_id)
            if at is None or at < self._covered:
                return None  # not a Conv of the pass, or one whose fold was tried ahead
            self._fill(graph, at)
            entry = self._folds.pop(node_id, None)
            if entry is None:
                return None
        known, eps, raw, w_new, b_new = entry
        if known != names or eps != epsilon:
            return None
        if not all(map(operator.is_, map(graph.initializers.get, names), raw.tensors)):
            return None
        return raw, w_new, b_new

    @property
    def held(self) -> int:
        """Folds computed ahead and not handed out yet (each holds its tensors, and a tensor
        held keeps its whole model's memory alive: none once the pass's graph is gone)."""
        return len(self._folds)

    @property
    def ordered(self) -> int:
        """Convs of the pass whose place in its order is kept (none once all are covered)."""
        return len(self._order)

    def _start(self, graph: GraphIndex) -> None:
        self._graph = weakref.ref(graph, self._forget)
        self._convs = graph.anchored([("", "Conv")])
        self._order = {node_id: i for i, node_id in enumerate(self._convs)}
        self._covered = 0
        self._folds = {}

    def _forget(self, gone: weakref.ref[GraphIndex]) -> None:
        """The pass's graph is gone: let go of what was computed for it (the folds hold its
        model's tensors, and so all its memory, until the next fuse otherwise)."""
        if self._graph is gone:
            self._graph, self._convs, self._order, self._folds = None, [], {}, {}

    def _fill(self, graph: GraphIndex, at: int) -> None:
        """Fold the Convs `at` .. `at + _AHEAD` (in the pass's order) that read a BN."""
        self._covered = at + _AHEAD
        self._folds = folds = {}
        groups: dict[_Key, list[tuple[int, tuple[str, ...], float, _Raw]]] = {}
        nodes = graph.nodes
        batch = self._convs[at : at + _AHEAD]
        if self._covered >= len(self._convs):
            # The pass's last batch: every Conv is covered now, so `take` answers None for any
            # fold not kept (as it would from the order): the order (an int and an entry per
            # Conv, ~2 MB at 28k Convs) is let go, not held through the rewrite's peak.
            self._convs, self._order = [], {}
        for node_id in batch:
            conv_node = nodes.get(node_id)
            if conv_node is None:
                continue
            bn = _bn_reader(graph, conv_node)
            if bn is None:
                continue
            names, epsilon = _names(conv_node, bn), bn_epsilon(bn)
            raw = _gather(graph, names, epsilon)
            if raw is not None and _elements(raw.key) <= _AHEAD_ELEMENTS:
                groups.setdefault(raw.key, []).append((node_id, names, epsilon, raw))
        for key, members in groups.items():
            data = b"".join([chunk for member in members for chunk in member[3].chunks])
            cast = _fold_rows(data, len(members), key)[1]
            finite = np.isfinite(cast).all(axis=1).tolist()
            size = key[2]
            w_all, b_all = cast[:, :size].tobytes(), cast[:, size:].tobytes()
            w_width, b_width = len(w_all) // len(members), len(b_all) // len(members)
            for i, (node_id, names, epsilon, raw) in enumerate(members):
                if finite[i]:
                    w_new = w_all[i * w_width : (i + 1) * w_width]
                    b_new = b_all[i * b_width : (i + 1) * b_width]
                    folds[node_id] = (names, epsilon, raw, w_new, b_new)


def _elements(key: _Key) -> int:
    """How many values a fold of `key` reads (W and the BN parameters)."""
    _, _, size, cout, has_bias, _ = key
    return size + (5 if has_bias else 4) * cout


def _bn_reader(graph: GraphIndex, conv_node: onnx.NodeProto) -> onnx.NodeProto | None:
    """The BatchNormalization a Conv's output feeds (through Identity nodes), as
    conv_bn_relu's match finds it, or None."""
    value = conv_node.output[0]
    nodes = graph.nodes
    readers = graph.consumers.get(value)
    if readers and len(readers) == 1:
        # the common case, a BN the Conv's one reader: the walk below would stop at it (it is
        # no Identity) and take it
        node = nodes[next(iter(readers))]
        if node.op_type == "BatchNormalization" and node.domain == "" and node.input[0] == value:
            return node
    value = through_identity(graph, value, [])
    for r in graph.consumers.get(value, ()):
        node = nodes[r]
        if node.op_type == "BatchNormalization" and node.domain == "" and node.input[0] == value:
            return node
    return None


PREFETCH = _Prefetch()  # one per process: a pass's folds, released with its graph


def _fold_general(
    graph: GraphIndex,
    conv_node: onnx.NodeProto,
    bn: onnx.NodeProto,
    epsilon: float,
    transposed_group: int = 0,
) -> Folded | str:
    """`fold` for any parameters the graph knows at fuse time (Constant nodes, constant
    subgraphs, external data, any dtypes)."""
    names = [conv_node.input[1], *bn.input[1:5]]
    conv_b = conv_node.input[2] if len(conv_node.input) > 2 and conv_node.input[2] else ""
    if conv_b:
        names.append(conv_b)
    values = {}
    for name in names:
        value = _parameter(graph, name)
        if value is None:
            why = (
                "an overridable graph input"
                if name in graph.graph_inputs
                else "computed at run time"
            )
            return f"'{name}' is {why}"
        values[name] = value
    w = values[conv_node.input[1]]
    scale, bias, mean, var = (values[n].astype(np.float64) for n in bn.input[1:5])
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        a = scale / np.sqrt(var + epsilon)
        if transposed_group:
            g = transposed_group
            # [G, Cin/G, Cout/G, *k] scaled by a[G, 1, Cout/G]
            wg = w.astype(np.float64).reshape(g, w.shape[0] // g, *w.shape[1:])
            w_new = (wg * a.reshape(g, 1, -1, *([1] * (w.ndim - 2)))).reshape(w.shape)
        else:
            w_new = w.astype(np.float64) * a.reshape(-1, *([1] * (w.ndim - 1)))
        b0 = values[conv_b].astype(np.float64) if conv_b else np.zeros(a.shape[0])
        b_new = (b0 - mean) * a + bias
        dtype = w.dtype
        w_cast, b_cast = w_new.astype(dtype, copy=False), b_new.astype(dtype, copy=False)
    # A non-finite float64 value stays non-finite when cast: all finite after the cast means
    # both checks pass, and only a failure needs the float64 values to say which one failed.
    if not (np.isfinite(w_cast).all() and np.isfinite(b_cast).all()):
        if not (np.isfinite(w_new).all() and np.isfinite(b_new).all()):
            return "folding gives non-finite weights (var + epsilon <= 0?)"
        return f"folded weights overflow {dtype}"
    base = conv_node.name or conv_node.output[0]
    w_tensor = _tensor(w_cast, graph.unique_value_name(f"{base}.W_bn_folded"))
    b_tensor = _tensor(b_cast, graph.unique_value_name(f"{base}.B_bn_folded"))
    return w_tensor, b_tensor


def _parameter(graph: GraphIndex, name: str) -> np.ndarray | None:
    """`graph.constant(name)`, an initializer read without keeping it in the index's constant
    cache: each Conv's weight and BN parameters are read once, by their fold, and caching them
    would hold a second copy of every folded weight for the whole pass."""
    tensor = graph.initializers.get(name)
    if tensor is not None and name not in graph.graph_inputs:
        return read_tensor(graph.source, tensor)
    return graph.constant(name)


def _tensor(array: np.ndarray, name: str) -> onnx.TensorProto:
    """numpy_helper.from_array for the float dtypes folding produces, without its generality."""
    if array.dtype not in (np.float16, np.float32, np.float64) or sys.byteorder != "little":
        return numpy_helper.from_array(array, name)
    return onnx.TensorProto(
        name=name,
        data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype),
        dims=array.shape,
        raw_data=np.ascontiguousarray(array).tobytes(),
    )
