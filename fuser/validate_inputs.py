"""Inputs a model accepts, for validation: concrete shapes and values its readers take.

Shapes: a dim with `dim_value > 0` is fixed; a `dim_param`, a `dim_value <= 0` (PaddleOCR's
`-1`) and an empty dim are symbolic, and take `dims[dim_param]` or `dim_size`.

Values: floats are seeded normal draws. Integer inputs are drawn below the smallest bound a
reader imposes on them: an index into a Gather (an embedding table) stays below that table's
size along the gathered axis (Hugging Face BERT's `token_type_ids` index a 2-row table), an
input named like a mask, and every boolean, is 0/1. Run 0 draws normal values, run 1 makes every
row along the last axis constant (zero variance: where a normalization that lost its epsilon
shows), later runs draw wider values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from .errors import ValidationInputError

INT_RANGE = 4  # integer inputs with no known reader bound are drawn from [0, INT_RANGE)
# Ops an integer value passes through unchanged in meaning: a bound on their output holds on
# their input (an index Cast, reshaped or unsqueezed before the Gather that reads it).
_PASS_THROUGH = {
    "Cast",
    "Reshape",
    "Unsqueeze",
    "Squeeze",
    "Flatten",
    "Identity",
    "Expand",
    "Transpose",
}


@dataclass(frozen=True)
class InputSpec:
    """How one runtime input of a model is drawn: concrete shape, dtype and value range."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    high: int | None = None  # integers: drawn from [0, high)
    fixed: tuple[bool, ...] = ()  # per axis: whether the model fixes its size

    def describe(self) -> str:
        return f"{self.name}{list(self.shape)} {self.dtype.name}"


def runtime_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a caller feeds (initializers listed as inputs excluded)."""
    inits = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in inits]


def concrete_shape(
    value: onnx.ValueInfoProto, dims: Mapping[str, int], dim_size: int
) -> tuple[int, ...]:
    """`value`'s shape with every symbolic dim given a size (see the module docstring)."""
    shape: list[int] = []
    for d in value.type.tensor_type.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
            shape.append(d.dim_value)
        elif d.HasField("dim_param") and d.dim_param in dims:
            shape.append(dims[d.dim_param])
        else:
            shape.append(dim_size)
    return tuple(shape)


def symbolic_dims(model: onnx.ModelProto) -> list[str]:
    """Every symbolic dim of the runtime inputs, as `input[axis]` or its `dim_param`."""
    found: list[str] = []
    for value in runtime_inputs(model):
        for axis, d in enumerate(value.type.tensor_type.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                continue
            label = d.dim_param if d.HasField("dim_param") else f"{value.name}[{axis}]"
            if label not in found:
                found.append(label)
    return found


def input_specs(model: onnx.ModelProto, dims: Mapping[str, int], dim_size: int) -> list[InputSpec]:
    """How each runtime input of `model` is drawn."""
    if dim_size < 1:
        raise ValidationInputError(f"--dim-size {dim_size}: must be at least 1")
    for name, size in dims.items():
        if size < 1:
            raise ValidationInputError(f"--dim {name}={size}: sizes must be at least 1")
    bounds = _integer_bounds(model)
    specs: list[InputSpec] = []
    for value in runtime_inputs(model):
        if not value.type.HasField("tensor_type"):
            raise ValidationInputError(
                f"input '{value.name}' is not a tensor; pass it with --input"
            )
        elem = value.type.tensor_type.elem_type
        if elem == onnx.TensorProto.UNDEFINED:
            raise ValidationInputError(f"input '{value.name}' has no element type")
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
        high: int | None = None
        if dtype == np.bool_ or "mask" in value.name.lower():
            high = 2
        elif np.issubdtype(dtype, np.integer):
            high = min(INT_RANGE, bounds.get(value.name, INT_RANGE))
        shape = concrete_shape(value, dims, dim_size)
        fixed = tuple(
            d.HasField("dim_value") and d.dim_value > 0 for d in value.type.tensor_type.shape.dim
        )
        specs.append(InputSpec(value.name, shape, dtype, high, fixed))
    return specs


def make_feeds(
    specs: list[InputSpec],
    *,
    run: int,
    rank: int,
    seed: int,
    given: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Inputs for one run on one rank: `given` ones as they are, the rest seeded random."""
    rng = np.random.default_rng([seed, run, rank])
    known = {s.name for s in specs}
    for name in given or {}:
        if name not in known:
            raise ValidationInputError(
                f"no model input named '{name}' (inputs: {', '.join(sorted(known))})"
            )
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        if given and spec.name in given:
            feeds[spec.name] = _checked(spec, np.asarray(given[spec.name]))
        else:
            feeds[spec.name] = draw(rng, spec, run)
    return feeds


def _checked(spec: InputSpec, array: np.ndarray) -> np.ndarray:
    if array.ndim != len(spec.shape):
        raise ValidationInputError(
            f"--input {spec.name}: rank {array.ndim} given, the model takes rank {len(spec.shape)}"
        )
    fixed = [d for d, f in zip(spec.shape, spec.fixed, strict=True) if f]
    given = [d for d, f in zip(array.shape, spec.fixed, strict=True) if f]
    if fixed != given:
        raise ValidationInputError(
            f"--input {spec.name}: shape {list(array.shape)} given, the model takes "
            f"{[d if f else '?' for d, f in zip(spec.shape, spec.fixed, strict=True)]}"
        )
    if array.dtype != spec.dtype:
        if not np.can_cast(array.dtype, spec.dtype, casting="same_kind"):
            raise ValidationInputError(
                f"--input {spec.name}: dtype {array.dtype.name} given, the model takes "
                f"{spec.dtype.name}"
            )
        array = array.astype(spec.dtype)
    return array


def draw(rng: np.random.Generator, spec: InputSpec, run: int) -> np.ndarray:
    """One seeded random array for `spec` (always an ndarray, rank 0 included)."""
    shape, dtype = spec.shape, spec.dtype
    if np.issubdtype(dtype, np.floating):
        x = np.asarray(rng.standard_normal(shape) * (1.0 if run != 2 else 4.0))
        if run == 1 and x.ndim >= 1 and shape[-1] > 0:
            x = np.broadcast_to(x[..., :1], shape).copy()
        return np.asarray(x, dtype=dtype)
    high = spec.high if spec.high is not None else INT_RANGE
    values = np.asarray(rng.integers(0, max(1, high), shape))
    return np.asarray(values.astype(np.bool_) if dtype == np.bool_ else values, dtype=dtype)


def _integer_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """Per graph input, the smallest size of a table it indexes (through pass-through ops)."""
    graph = model.graph
    sizes = {t.name: tuple(t.dims) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value":
                    sizes[node.output[0]] = tuple(attr.t.dims)
    for value in [*graph.value_info, *graph.input]:
        dims = value.type.tensor_type.shape.dim
        if value.name not in sizes and dims and all(d.dim_value > 0 for d in dims):
            sizes[value.name] = tuple(d.dim_value for d in dims)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def bound(name: str, depth: int = 0) -> int | None:
        best: int | None = None
        for node in readers.get(name, []) if depth < 8 else []:
            found: int | None = None
            if node.op_type in ("Gather", "GatherElements") and node.input[1:2] == [name]:
                table = sizes.get(node.input[0])
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if table and -len(table) <= axis < len(table):
                    found = table[axis]
            elif node.op_type in _PASS_THROUGH and node.input[0] == name:
                found = min(
                    (b for o in node.output if (b := bound(o, depth + 1)) is not None),
                    default=None,
                )
            if found is not None and (best is None or found < best):
                best = found
        return best

    result: dict[str, int] = {}
    for value in runtime_inputs(model):
        b = bound(value.name)
        if b is not None:
            result[value.name] = b
    return result
