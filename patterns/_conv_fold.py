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
import sys

import numpy as np
import onnx
from onnx import numpy_helper

from fuser.graph import GraphIndex
from fuser.modelio import read_tensor

#: Element types whose raw bytes the fast path reads directly.
_RAW_FLOATS: dict[int, np.dtype] = {
    t: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t))
    for t in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
}
_EXTERNAL = onnx.TensorProto.EXTERNAL

Folded = tuple[onnx.TensorProto, onnx.TensorProto]


def fold(
    graph: GraphIndex,
    conv_node: onnx.NodeProto,
    bn: onnx.NodeProto,
    epsilon: float,
    transposed_group: int = 0,
) -> Folded | str:
    """Folded (W', B') as new initializers, or the reason folding is not possible.
    `transposed_group` > 0: a ConvTranspose weight [Cin, Cout/group, *k] with that group, whose
    output channel (g, o) is W[g * Cin/group : (g + 1) * Cin/group, o]."""
    if not transposed_group:
        fast = _fold_raw(graph, conv_node, bn, epsilon)
        if fast is not None:
            return fast
    return _fold_general(graph, conv_node, bn, epsilon, transposed_group)


def _raw(graph: GraphIndex, name: str) -> tuple[onnx.TensorProto, bytes, np.dtype] | None:
    """A non-overridable initializer held as raw float bytes in the model, else None."""
    tensor = graph.initializers.get(name)
    if tensor is None or name in graph.graph_inputs or tensor.data_location == _EXTERNAL:
        return None
    dtype = _RAW_FLOATS.get(tensor.data_type)
    if dtype is None:
        return None
    data = tensor.raw_data
    return (tensor, data, dtype) if data else None


def _fold_raw(
    graph: GraphIndex, conv_node: onnx.NodeProto, bn: onnx.NodeProto, epsilon: float
) -> Folded | str | None:
    """The fold of the common case (see the module docstring), or None for the general path."""
    if sys.byteorder != "little":
        return None
    weight = _raw(graph, conv_node.input[1])
    if weight is None:
        return None
    w_tensor, w_data, dtype = weight
    w_dims = tuple(w_tensor.dims)
    if len(w_dims) < 2 or len(w_data) != math.prod(w_dims) * dtype.itemsize:
        return None
    cout = w_dims[0]
    conv_b = conv_node.input[2] if len(conv_node.input) > 2 else ""
    chunks: list[bytes] = []
    p_dtype: np.dtype | None = None
    for name in (*bn.input[1:5], *([conv_b] if conv_b else [])):
        found = _raw(graph, name)
        if found is None:
            return None
        tensor, data, p_dtype_here = found
        p_dtype = p_dtype or p_dtype_here
        if p_dtype_here != p_dtype or tuple(tensor.dims) != (cout,):
            return None
        if len(data) != cout * p_dtype.itemsize:
            return None
        chunks.append(data)
    assert p_dtype is not None
    # One float64 buffer [W, scale, bias, mean, var, B?] (one conversion when W and the
    # parameters share a dtype); W' is computed in place and B' into the scale row once `a`
    # is made, so [W', B'] is one contiguous run, cast and checked once.
    if dtype == p_dtype:
        values = np.frombuffer(w_data + b"".join(chunks), dtype).astype(np.float64)
    else:
        values = np.concatenate(
            (np.frombuffer(w_data, dtype), np.frombuffer(b"".join(chunks), p_dtype)),
            dtype=np.float64,
        )
    size = len(w_data) // dtype.itemsize
    rows = values[size:].reshape(-1, cout)
    # A negative variance or a weight float16 cannot hold is refused below with its reason,
    # not reported as a numpy warning on the user's terminal.
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        a = rows[0] / np.sqrt(rows[3] + epsilon)
        w = values[:size].reshape(cout, -1)
        w *= a[:, None]
        b_new = rows[0]  # scale is read only by `a`
        # (B - mean) * a + bias, as the general path (B = 0 without a Conv bias: 0.0 - mean,
        # not -mean, so that a zero mean gives +0 there too).
        np.subtract(rows[4] if conv_b else 0.0, rows[2], out=b_new)
        b_new *= a
        b_new += rows[1]
        out = values[: size + cout]
        cast = out.astype(dtype, copy=False)
    if not np.isfinite(cast).all():
        if not np.isfinite(out).all():
            return "folding gives non-finite weights (var + epsilon <= 0?)"
        return f"folded weights overflow {dtype}"
    base = conv_node.name or conv_node.output[0]
    raw = cast.tobytes()
    split = len(w_data)
    return (
        _raw_tensor(graph.unique_value_name(f"{base}.W_bn_folded"), w_tensor, w_dims, raw[:split]),
        _raw_tensor(graph.unique_value_name(f"{base}.B_bn_folded"), w_tensor, (cout,), raw[split:]),
    )


def _raw_tensor(
    name: str, like: onnx.TensorProto, dims: tuple[int, ...], raw: bytes
) -> onnx.TensorProto:
    """A tensor of `like`'s element type holding `raw` (what `_tensor` makes of the array)."""
    return onnx.TensorProto(name=name, data_type=like.data_type, dims=dims, raw_data=raw)


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
