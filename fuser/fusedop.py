"""The fused-op contract: one definition per fused op type, everything else derived from it.

A `FusedOp` holds the op's ONNX signature (inputs, outputs, attributes, type constraints), its
shape inference, and its numpy `reference` (the semantics of the original chain). From it fuser
derives the `onnx.defs` schema (so the checker and shape inference accept fused models), the
onnxruntime plugin's registration, and the oracle every test compares against.

Shape inference is written once, in plain Python over `TensorInfo` (element type + shape with
symbolic dims), and adapted to onnx's inference context here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import onnx
from onnx import defs, helper

if TYPE_CHECKING:
    from .bodies.builder import BodyBuilder

DOMAIN = "fuser"
VERSION = 1

Dim = int | str | None
ParamOption = Literal["single", "optional", "variadic"]
AttrKind = Literal["int", "float", "string", "ints", "floats"]

_OPTIONS = {
    "single": defs.OpSchema.FormalParameterOption.Single,
    "optional": defs.OpSchema.FormalParameterOption.Optional,
    "variadic": defs.OpSchema.FormalParameterOption.Variadic,
}
_ATTR_TYPES = {
    "int": defs.OpSchema.AttrType.INT,
    "float": defs.OpSchema.AttrType.FLOAT,
    "string": defs.OpSchema.AttrType.STRING,
    "ints": defs.OpSchema.AttrType.INTS,
    "floats": defs.OpSchema.AttrType.FLOATS,
}
# The NPU's Cube and Vector units take float16 and float32 only: a fused op the kernels cannot
# run is never emitted, so a float64 chain is refused by the matcher's type rule, with a reason.
FLOAT_TYPES = ("tensor(float16)", "tensor(float)")


@dataclass(frozen=True)
class Param:
    """One formal input or output."""

    name: str
    type_str: str
    doc: str
    option: ParamOption = "single"
    # A variadic parameter may take no value at all (AllGatherMatMul's Y_1, Y_2, ...).
    min_arity: int = 1


@dataclass(frozen=True)
class Attr:
    """One attribute; `default` None means required."""

    name: str
    kind: AttrKind
    doc: str
    default: Any = None


@dataclass(frozen=True)
class TensorInfo:
    """What shape inference knows of a tensor: element type (TensorProto enum) and shape."""

    elem_type: int
    shape: tuple[Dim, ...] | None


InferFn = Callable[[Sequence[TensorInfo | None], Mapping[str, Any]], list[TensorInfo | None]]
ReferenceFn = Callable[[Sequence[np.ndarray | None], Mapping[str, Any]], tuple[np.ndarray, ...]]


@dataclass(frozen=True)
class FusedOp:
    """A fused op type of domain `fuser`.

    `infer(inputs, attrs)` returns one TensorInfo (or None: unknown) per output position;
    `reference(inputs, attrs)` returns every output, optional ones included. Absent optional
    inputs are None in both. `attrs` holds every declared attribute, defaults filled in.
    """

    name: str
    doc: str
    inputs: tuple[Param, ...]
    outputs: tuple[Param, ...]
    attributes: tuple[Attr, ...]
    type_constraints: tuple[tuple[str, tuple[str, ...], str], ...]
    infer: InferFn
    reference: ReferenceFn
    # For ops that gather an input across ranks (AllGatherMatMul): which input. The plugin then
    # exchanges that input with the other ranks and passes `reference` and the kernel all
    # shards stacked on a new leading axis ([group_size, *shard]), and `rank` in attrs.
    collective_input: int | None = None
    # The op's function body (the original chain in standard ops, `fuser.bodies`): written
    # into fused models as a model-local function so that any onnxruntime can run them.
    body: BodyBuilder | None = None
    # Tiling attributes (tile_*) are accepted on every fused op: they are chosen by the cost
    # model and the set of fields belongs to the kernel, not to the op's semantics.
    tiling_prefix: str = field(default="tile_", init=False)

    def attribute_values(self, node: onnx.NodeProto) -> dict[str, Any]:
        """The node's attributes as Python values, declared defaults filled in."""
        values = {a.name: a.default for a in self.attributes}
        for attr in node.attribute:
            values[attr.name] = helper.get_attribute_value(attr)
            if isinstance(values[attr.name], bytes):
                values[attr.name] = values[attr.name].decode()
            elif isinstance(values[attr.name], list | tuple):
                values[attr.name] = list(values[attr.name])
        return values

    def schema(self) -> defs.OpSchema:
        """The onnx.defs schema, with shape inference wired to `infer`."""
        schema = defs.OpSchema(
            self.name,
            DOMAIN,
            VERSION,
            self.doc,
            inputs=[_formal(p, min_arity=p.min_arity) for p in self.inputs],
            outputs=[_formal(p, min_arity=p.min_arity) for p in self.outputs],
            type_constraints=[(n, list(t), d) for n, t, d in self.type_constraints],
            attributes=[_attribute(a) for a in self.attributes] + _tiling_attributes(self),
        )
        schema.set_type_and_shape_inference_function(self._onnx_inference)
        return schema

    def _onnx_inference(self, ctx: onnx.shape_inference.InferenceContext) -> None:
        infos: list[TensorInfo | None] = []
        for i in range(ctx.get_num_inputs()):
            infos.append(_tensor_info(ctx.get_input_type(i)) if ctx.has_input(i) else None)
        attrs: dict[str, Any] = {a.name: a.default for a in self.attributes}
        for attr in self.attributes:
            proto = ctx.get_attribute(attr.name)
            if proto is not None:
                value = helper.get_attribute_value(proto)
                attrs[attr.name] = value.decode() if isinstance(value, bytes) else value
        results = self.infer(infos, attrs)
        for i in range(ctx.get_num_outputs()):
            if i < len(results) and ctx.has_output(i) and results[i] is not None:
                ctx.set_output_type(i, _type_proto(results[i]))  # type: ignore[arg-type]


def _formal(param: Param, *, min_arity: int) -> defs.OpSchema.FormalParameter:
    return defs.OpSchema.FormalParameter(
        param.name,
        param.type_str,
        param.doc,
        param_option=_OPTIONS[param.option],
        # A variadic list of weights and biases may mix types in principle; keep it flexible.
        is_homogeneous=param.option != "variadic",
        min_arity=min_arity,
    )


def _tiling_attributes(op: FusedOp) -> list[defs.OpSchema.Attribute]:
    """Optional int attributes `tile_<field>` for the fields of the op's kernel's tiling (the
    cost model stores its choice there), so the checker accepts a tiled node."""
    from .kernels.registry import tiling_fields  # the manifest's: imports no kernel module

    fields = tiling_fields(DOMAIN, op.name)
    if fields is None:
        return []
    declared = {a.name for a in op.attributes}
    return [
        defs.OpSchema.Attribute(
            f"{op.tiling_prefix}{name}", _ATTR_TYPES["int"], "tiling (cost model)", required=False
        )
        for name in fields
        if f"{op.tiling_prefix}{name}" not in declared
    ]


def _attribute(attr: Attr) -> defs.OpSchema.Attribute:
    if attr.default is None:
        return defs.OpSchema.Attribute(attr.name, _ATTR_TYPES[attr.kind], attr.doc, required=True)
    if attr.kind in ("ints", "floats") and not attr.default:
        # make_attribute cannot type an empty list; an optional typed attribute says the same.
        return defs.OpSchema.Attribute(attr.name, _ATTR_TYPES[attr.kind], attr.doc, required=False)
    return defs.OpSchema.Attribute(
        attr.name, helper.make_attribute(attr.name, attr.default), attr.doc
    )


def _tensor_info(type_proto: onnx.TypeProto | None) -> TensorInfo | None:
    if type_proto is None or not type_proto.HasField("tensor_type"):
        return None
    tensor = type_proto.tensor_type
    if not tensor.HasField("shape"):
        return TensorInfo(tensor.elem_type, None)
    dims: list[Dim] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            dims.append(dim.dim_value)
        elif dim.HasField("dim_param"):
            dims.append(dim.dim_param)
        else:
            dims.append(None)
    return TensorInfo(tensor.elem_type, tuple(dims))


def _type_proto(info: TensorInfo) -> onnx.TypeProto:
    return helper.make_tensor_type_proto(
        info.elem_type, None if info.shape is None else list(info.shape)
    )


_REGISTERED: dict[str, FusedOp] = {}


def register(op: FusedOp) -> FusedOp:
    """Register `op`'s schema with onnx.defs (once per process) and remember it by name."""
    if op.name in _REGISTERED:
        if _REGISTERED[op.name] is not op:
            raise ValueError(f"fused op '{op.name}' is defined twice")
        return op
    if not defs.has(op.name, DOMAIN):
        defs.register_schema(op.schema())
    _REGISTERED[op.name] = op
    return op


def registered() -> Mapping[str, FusedOp]:
    return dict(_REGISTERED)


def get(name: str) -> FusedOp:
    return _REGISTERED[name]


# -- helpers shared by patterns' inference functions -------------------------------------------


def broadcast_dims(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """Numpy broadcasting over possibly symbolic dims (unknown where it cannot be decided)."""
    rank = max(len(a), len(b))
    a = (1,) * (rank - len(a)) + a
    b = (1,) * (rank - len(b)) + b
    out: list[Dim] = []
    for x, y in zip(a, b, strict=True):
        if x == 1:
            out.append(y)
        elif y == 1 or x == y:
            out.append(x)
        else:
            out.append(None)
    return tuple(out)


def matmul_shape(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
    """Output shape of numpy-style matmul, or None if a rank is below 1."""
    if not a or not b:
        return None
    if len(b) == 1:
        return a[:-1]
    if len(a) == 1:
        return b[:-2] + b[-1:]
    batch = broadcast_dims(a[:-2], b[:-2])
    return (*batch, a[-2], b[-1])
