"""A float64 copy of a model: its values in (nearly) real arithmetic, to measure rounding noise.

Validation judges a fused model against what the original computes in exact arithmetic, within
the original's own rounding error (`fuser.compare`). Evaluating the original with every float
tensor, type and Cast in float64 gives that truth to ~1e-16: a LayerNorm over a constant row,
where float32 rounding of the mean is amplified by 1/sqrt(eps), is exact there.

Not every op has a float64 kernel in onnxruntime's CPU package (Conv, Erf, OneHot): those
nodes run in float32 between Casts (`in_float32`), which keeps the truth exact everywhere else;
a copy that still does not load is not used (validation then relies on the last-bit spread).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from .graph import ValueType, node_subgraphs
from .modelio import LoadedModel, iter_all_tensors, read_tensor

_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
_DOUBLE = onnx.TensorProto.DOUBLE
# Above this many bytes of float tensors the copy (twice their size for float32) costs more
# memory than validating large models may take; the last-bit spread serves alone there.
MAX_BYTES = 512 * 2**20


def float_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the model's float tensors (initializers and constants), external ones included."""
    total = 0
    for tensor in iter_all_tensors(model.graph):
        if tensor.data_type in _FLOATS:
            size = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
            total += int(np.prod(tensor.dims, dtype=np.int64)) * size
    return total


def as_float64(loaded: LoadedModel) -> onnx.ModelProto:
    """A copy of `loaded` computing in float64 wherever it computed in a float type."""
    model = onnx.ModelProto()
    model.CopyFrom(loaded.model)
    _graph(model.graph, loaded)
    return model


def _tensor(tensor: onnx.TensorProto, loaded: LoadedModel) -> None:
    if tensor.data_type not in _FLOATS:
        return
    array = read_tensor(loaded, tensor).astype(np.float64)
    tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))


def _value_info(value: onnx.ValueInfoProto) -> None:
    tensor = value.type.tensor_type
    if value.type.HasField("tensor_type") and tensor.elem_type in _FLOATS:
        tensor.elem_type = _DOUBLE


def _graph(graph: onnx.GraphProto, loaded: LoadedModel) -> None:
    for value in (*graph.input, *graph.output, *graph.value_info):
        _value_info(value)
    for tensor in graph.initializer:
        _tensor(tensor, loaded)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                _tensor(attr.t, loaded)
            elif attr.name in ("to", "dtype") and attr.type == onnx.AttributeProto.INT:
                attr.i = _DOUBLE if attr.i in _FLOATS else attr.i
        if node.op_type == "Constant":
            _constant_float(node)
        for sub in node_subgraphs(node):
            _graph(sub, loaded)


def _constant_float(node: onnx.NodeProto) -> None:
    """Constant's value_float(s) would make float32: turn them into a float64 tensor."""
    for attr in list(node.attribute):
        if attr.name in ("value_float", "value_floats"):
            values = [attr.f] if attr.name == "value_float" else list(attr.floats)
            array = np.array(values[0] if attr.name == "value_float" else values, np.float64)
            node.attribute.remove(attr)
            node.attribute.append(
                onnx.helper.make_attribute("value", numpy_helper.from_array(array))
            )


_MISSING = re.compile(r"Could not find an implementation for (\w+)\(")


def missing_kernel(message: str) -> str | None:
    """The op type onnxruntime has no kernel for, from its session-creation error."""
    found = _MISSING.search(message)
    return found.group(1) if found else None


# Ops onnxruntime 1.32's CPU package has no float64 kernel for (measured on the examples).
NO_FLOAT64_KERNEL = ("Conv", "ConvTranspose", "Erf", "OneHot")


def in_float32(model: onnx.ModelProto, op_types: Collection[str]) -> None:
    """Run every main-graph node of `op_types` in the float64 copy in float32 between Casts."""
    from .engine import infer_types
    from .ort import skeleton

    table: Mapping[str, ValueType] = infer_types(skeleton(model)).get("") or {}

    def is_double(name: str) -> bool:
        vt = table.get(name) if name else None
        return vt is not None and vt.elem_type == _DOUBLE

    rebuilt: list[onnx.NodeProto] = []
    for index, node in enumerate(model.graph.node):
        if node.op_type not in op_types:
            rebuilt.append(node)
            continue
        tag = f"__fuser_f32_{index}"
        for i, name in enumerate(node.input):
            if is_double(name):
                narrow = f"{name}{tag}_in{i}"
                rebuilt.append(onnx.helper.make_node("Cast", [name], [narrow], to=1))
                node.input[i] = narrow
        after: list[onnx.NodeProto] = []
        for i, name in enumerate(node.output):
            if is_double(name):
                narrow = f"{name}{tag}_out{i}"
                after.append(onnx.helper.make_node("Cast", [narrow], [name], to=_DOUBLE))
                node.output[i] = narrow
        rebuilt.extend([node, *after])
    del model.graph.node[:]
    model.graph.node.extend(rebuilt)
