"""The model as onnx's checker and shape inference can see it, where onnxruntime is laxer.

fuser accepts what onnxruntime runs. Where onnxruntime accepts more than the ONNX spec, onnx's
own tools see a *view* of the model (a copy; the model itself is never changed here):

- External and large initializers become typed graph inputs: the checker would resolve
  external files against the working directory (fuser has validated those locations itself,
  in modelio), and neither tool needs the values of large tensors, whose copying into each
  tool's protobuf would be most of a large model's load time.
- External tensors in node attributes (a Constant's value, written so by exporters that store
  every large tensor outside the file; onnxruntime runs such a model): the checker would
  resolve their files against the folder of the serialization it reads, not the input's. A
  main-graph Constant holding one becomes a typed graph input, as a heavy initializer does;
  any other (a Constant in a subgraph, ConstantOfShape, a custom op's attribute), and an
  external initializer of a subgraph, is read into the view inline from its validated file.
- ``LayerNormalization`` below opset 17: onnxruntime registers it in the ONNX domain from
  version 1 (it began as a contrib op), with opset 17's inputs, outputs, attributes and
  results (checked on onnxruntime 1.32: the same outputs at opsets 1-16 as at 17, Mean and
  InvStdDev included). The view makes such nodes ``LEGACY_LAYERNORM`` of ``LEGACY_DOMAIN``,
  whose schema has that signature and that inference, so the checker checks them and shape
  inference types their outputs.
- ``SimplifiedLayerNormalization`` in the ONNX domain: onnxruntime registers its RMSNorm there
  (since version 1, at every opset; onnxruntime's transformer optimizer writes it so), onnx has
  no schema for it. The view makes such nodes ``LEGACY_SIMPLIFIED_LAYERNORM`` of
  ``LEGACY_DOMAIN``, with onnxruntime 1.32's signature (X: T, scale: V, Y: V, optional
  inv_std_var: U; axis, epsilon, stash_type) and the types onnxruntime gives: Y has X's shape
  and the scale's element type, inv_std_var stash_type's (float unless said) with the
  normalized axes 1 (its shape only when the last axis is normalized: for another axis
  onnxruntime's declared shape differs from the one it computes).
- Graph inputs and outputs without a shape (or type), which the checker refuses ("Field
  'shape' of 'type' is required but missing") and onnxruntime runs: the view gives them an
  empty placeholder, so the checker still checks everything else, and each is reported as a
  warning naming the value.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from onnx import defs, helper

from .graph import SUBGRAPH_OPS, node_subgraphs
from .modelio import TENSOR_ATTRIBUTE_OPS, LoadedModel, read_external_bytes

LEGACY_DOMAIN = "fuser.ort_legacy"
# The op's name there: not "LayerNormalization", since a second schema of an ONNX op's name in
# any domain breaks onnx.reference (it looks schemas up by name alone).
LEGACY_LAYERNORM = "OrtLayerNormalizationV1"
# The first opset whose ONNX domain defines LayerNormalization.
LAYERNORM_OPSET = 17


@dataclass(frozen=True)
class View:
    """A model prepared for onnx's tools, and what its preparation had to overlook."""

    model: onnx.ModelProto
    warnings: tuple[str, ...] = ()
    nested: bool = True  # whether a node may hold a subgraph (`NodeScan.nested`)


def onnx_opset(model: onnx.ModelProto) -> int:
    """The model's ai.onnx opset (0 if it imports none)."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 0


# The float types onnxruntime's normalization ops accept.
_FLOATS = ["tensor(float16)", "tensor(float)", "tensor(double)", "tensor(bfloat16)"]


def _formal(name: str, kind: str, optional: bool = False) -> defs.OpSchema.FormalParameter:
    option = defs.OpSchema.FormalParameterOption
    return defs.OpSchema.FormalParameter(
        name, kind, "", param_option=option.Optional if optional else option.Single
    )


def _norm_attributes() -> list[defs.OpSchema.Attribute]:
    """axis, epsilon and stash_type with onnxruntime's defaults (both legacy norms have them)."""
    return [
        defs.OpSchema.Attribute("axis", helper.make_attribute("axis", -1), ""),
        defs.OpSchema.Attribute("epsilon", helper.make_attribute("epsilon", 1e-5), ""),
        defs.OpSchema.Attribute("stash_type", helper.make_attribute("stash_type", 1), ""),
    ]


def _layernorm_schema() -> defs.OpSchema:
    formal, floats = _formal, _FLOATS
    schema = defs.OpSchema(
        LEGACY_LAYERNORM,
        LEGACY_DOMAIN,
        1,
        "onnxruntime's LayerNormalization of opsets 1-16 (opset 17's, in the ONNX domain)",
        inputs=[formal("X", "T"), formal("Scale", "T"), formal("B", "T", optional=True)],
        outputs=[
            formal("Y", "T"),
            formal("Mean", "U", optional=True),
            formal("InvStdDev", "U", optional=True),
        ],
        type_constraints=[("T", floats, ""), ("U", ["tensor(float)", "tensor(bfloat16)"], "")],
        attributes=_norm_attributes(),
    )
    schema.set_type_and_shape_inference_function(_infer_layernorm)
    return schema


def _infer_layernorm(ctx: onnx.shape_inference.InferenceContext) -> None:
    x = ctx.get_input_type(0)
    if x is None or not x.HasField("tensor_type"):
        return
    ctx.set_output_type(0, x)
    stash = ctx.get_attribute("stash_type")
    stash_type = stash.i if stash is not None else onnx.TensorProto.FLOAT
    if not x.tensor_type.HasField("shape"):
        stats = helper.make_tensor_type_proto(stash_type, None)
    else:
        dims = list(x.tensor_type.shape.dim)
        attr = ctx.get_attribute("axis")
        axis = attr.i if attr is not None else -1
        axis = axis + len(dims) if axis < 0 else axis
        stats = onnx.TypeProto()
        stats.tensor_type.elem_type = stash_type
        stats.tensor_type.shape.SetInParent()
        for i, dim in enumerate(dims):
            new = stats.tensor_type.shape.dim.add()
            if i >= axis:
                new.dim_value = 1
            else:
                new.CopyFrom(dim)
    for i in (1, 2):
        if ctx.get_num_outputs() > i and ctx.has_output(i):
            ctx.set_output_type(i, stats)


def _register() -> None:
    if not defs.has(LEGACY_LAYERNORM, LEGACY_DOMAIN):
        defs.register_schema(_layernorm_schema())


# -- ONNX-domain SimplifiedLayerNormalization -------------------------------------------------

LEGACY_SIMPLIFIED_LAYERNORM = "OrtSimplifiedLayerNormalization"
_SLN = "SimplifiedLayerNormalization"


def _simplified_layernorm_schema() -> defs.OpSchema:
    formal, floats = _formal, _FLOATS
    schema = defs.OpSchema(
        LEGACY_SIMPLIFIED_LAYERNORM,
        LEGACY_DOMAIN,
        1,
        "onnxruntime's SimplifiedLayerNormalization (RMSNorm) of the ONNX domain",
        inputs=[formal("X", "T"), formal("scale", "V")],
        outputs=[formal("Y", "V"), formal("inv_std_var", "U", optional=True)],
        type_constraints=[
            ("T", floats, ""),
            ("U", ["tensor(float)", "tensor(double)"], ""),
            ("V", floats, ""),
        ],
        attributes=_norm_attributes(),
    )
    schema.set_type_and_shape_inference_function(_infer_simplified_layernorm)
    return schema


def _infer_simplified_layernorm(ctx: onnx.shape_inference.InferenceContext) -> None:
    x = ctx.get_input_type(0)
    scale = ctx.get_input_type(1)
    scale_type = scale.tensor_type.elem_type if scale is not None else 0
    if x is None or not x.HasField("tensor_type") or not scale_type:
        return  # Y's element type is the scale's: unknown, so left unknown
    y = onnx.TypeProto()
    y.CopyFrom(x)
    y.tensor_type.elem_type = scale_type
    ctx.set_output_type(0, y)
    if ctx.get_num_outputs() < 2 or not ctx.has_output(1):
        return
    stash = ctx.get_attribute("stash_type")
    stash_type = stash.i if stash is not None else onnx.TensorProto.FLOAT
    if stash_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE):
        return  # onnxruntime refuses the model (its U is float or double)
    stats = onnx.TypeProto()
    stats.tensor_type.elem_type = stash_type
    attr = ctx.get_attribute("axis")
    axis = attr.i if attr is not None else -1
    if x.tensor_type.HasField("shape"):
        dims = list(x.tensor_type.shape.dim)
        if axis in (-1, len(dims) - 1):
            stats.tensor_type.shape.SetInParent()
            for dim in dims[:-1]:
                stats.tensor_type.shape.dim.add().CopyFrom(dim)
            stats.tensor_type.shape.dim.add().dim_value = 1
    ctx.set_output_type(1, stats)


def simplified_layernorms(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """SimplifiedLayerNormalization nodes of the ONNX domain (onnxruntime's; onnx has no schema
    for them)."""
    return scan_nodes(model).simplified


def _move_simplified_layernorms(model: onnx.ModelProto) -> None:
    nodes = simplified_layernorms(model)
    if not nodes:
        return
    if not defs.has(LEGACY_SIMPLIFIED_LAYERNORM, LEGACY_DOMAIN):
        defs.register_schema(_simplified_layernorm_schema())
    for node in nodes:
        node.op_type, node.domain = LEGACY_SIMPLIFIED_LAYERNORM, LEGACY_DOMAIN
    if all(o.domain != LEGACY_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(LEGACY_DOMAIN, 1))


def _move_legacy_ops(model: onnx.ModelProto) -> None:
    _move_legacy_layernorms(model)
    _move_simplified_layernorms(model)


# -- walking graphs ---------------------------------------------------------------------------


def legacy_layernorms(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """LayerNormalization nodes of the ONNX domain the model's opset does not define."""
    return scan_nodes(model).layernorms


@dataclass(frozen=True)
class NodeScan:
    """What one walk over a model's nodes (subgraphs' included) found for its view."""

    layernorms: list[onnx.NodeProto]  # `legacy_layernorms`
    simplified: list[onnx.NodeProto]  # `simplified_layernorms`
    # Whether any node of the view may hold a subgraph (`may_hold_subgraphs`; the legacy nodes
    # count, since the view moves them out of the ONNX domain).
    nested: bool
    # Nodes (subgraphs' included) with an external tensor among their attributes.
    external: list[onnx.NodeProto] = field(default_factory=list)

    @property
    def legacy(self) -> bool:
        """Whether the view renames any node."""
        return bool(self.layernorms or self.simplified)


_STANDARD = ("", "ai.onnx")


def scan_nodes(model: onnx.ModelProto) -> NodeScan:
    """One walk over every node, graphs in pre-order: two attribute reads per node (a
    large model's walks were a tenth of its check and inference)."""
    wanted = set()
    if onnx_opset(model) < LAYERNORM_OPSET:
        wanted.add("LayerNormalization")
    if not defs.has(_SLN):  # an onnx that defines it checks it itself
        wanted.add(_SLN)
    found: list[onnx.NodeProto] = []
    external: list[onnx.NodeProto] = []
    nested = _scan_graph(model.graph, frozenset(wanted), found, external)
    layernorms = [n for n in found if n.op_type == "LayerNormalization"]
    simplified = [n for n in found if n.op_type == _SLN]
    return NodeScan(layernorms, simplified, nested or bool(found), external)


def _scan_graph(
    graph: onnx.GraphProto,
    wanted: frozenset[str],
    found: list[onnx.NodeProto],
    external: list[onnx.NodeProto],
) -> bool:
    """Append `graph`'s standard-domain nodes of a `wanted` type to `found` and its nodes with
    an external attribute tensor to `external`, then its subgraphs' (depth first, in node
    order); whether any node may hold a subgraph."""
    holders = []
    for node in graph.node:
        op = node.op_type
        domain = node.domain
        if domain in _STANDARD:
            if op in wanted:
                found.append(node)
            if op in SUBGRAPH_OPS:
                holders.append(node)
            elif op in _CONSTANT_OPS and _has_external_tensor(node):
                external.append(node)
        elif not _graph_free(op, domain):
            holders.append(node)
            if _has_external_tensor(node):
                external.append(node)
        elif not _tensor_free(op, domain) and _has_external_tensor(node):
            external.append(node)
    for node in holders:
        for sub in node_subgraphs(node):
            if any(t.data_location == onnx.TensorProto.EXTERNAL for t in sub.initializer):
                external.append(node)  # a subgraph's initializer: the view hides only the main's
            _scan_graph(sub, wanted, found, external)
    return bool(holders)


# The standard ops with a tensor attribute and no graph attribute (the subgraph ops' tensors
# sit on their subgraphs' nodes and initializers).
_CONSTANT_OPS = TENSOR_ATTRIBUTE_OPS - SUBGRAPH_OPS


def _has_external_tensor(node: onnx.NodeProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in _attribute_tensors(node))


def _attribute_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    """The tensors of `node`'s own attributes (not those of its subgraphs' nodes)."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.TENSOR:
            yield attr.t
        elif attr.type == onnx.AttributeProto.TENSORS:
            yield from attr.tensors


_GRAPH_KINDS = (defs.OpSchema.AttrType.GRAPH, defs.OpSchema.AttrType.GRAPHS)
_TENSOR_KINDS = (defs.OpSchema.AttrType.TENSOR, defs.OpSchema.AttrType.TENSORS)


@functools.cache
def _graph_free(op_type: str, domain: str) -> bool:
    """Whether an op of another domain has a schema (fuser's fused ops, onnx's ML ops, ...)
    that declares no graph attribute: the checker refuses any graph attribute on its nodes,
    so a walk skips reading their attributes (most of a walk over a fused model). Looked up
    once per op (fuser never removes a schema; an op registered after its first look-up is
    only walked as before)."""
    if not defs.has(op_type, domain):
        return False
    schema = defs.get_schema(op_type, domain=domain)
    return all(a.type not in _GRAPH_KINDS for a in schema.attributes.values())


@functools.cache
def _tensor_free(op_type: str, domain: str) -> bool:
    """Whether an op of another domain with a schema declares no tensor attribute (as
    `_graph_free`: the checker refuses an undeclared attribute)."""
    schema = defs.get_schema(op_type, domain=domain)
    return all(a.type not in _TENSOR_KINDS for a in schema.attributes.values())


def _move_legacy_layernorms(model: onnx.ModelProto) -> bool:
    nodes = legacy_layernorms(model)
    if not nodes:
        return False
    _register()
    for node in nodes:
        node.op_type, node.domain = LEGACY_LAYERNORM, LEGACY_DOMAIN
    if all(o.domain != LEGACY_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(LEGACY_DOMAIN, 1))
    return True


def inference_view(model: onnx.ModelProto, scan: NodeScan | None = None) -> onnx.ModelProto:
    """`model` as shape inference should see it: legacy LayerNormalization and ONNX-domain
    SimplifiedLayerNormalization nodes typed like onnxruntime's, and large or external
    initializers as typed graph inputs (inference reads only small constants' values, and
    copying megabytes of weights to read their types would cost more than the inference). The
    model itself when none of that applies. `scan`: `scan_nodes(model)`, if made already."""
    scan = scan or scan_nodes(model)
    hidden = _heavy_initializers(model.graph)
    if not hidden and not scan.legacy:
        return model
    view = _copy_hiding(model, hidden)
    if scan.legacy:
        _move_legacy_ops(view)
    return view


# Initializers at least this large are seen by onnx's tools as typed graph inputs: their values
# matter to neither the checker's structural checks nor shape inference (shapes, axes and the
# like are small), and copying them into each tool's protobuf is most of a large model's load.
HEAVY_BYTES = 64 * 1024


def _heavy_initializers(graph: onnx.GraphProto) -> set[str]:
    return {
        t.name
        for t in graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL or len(t.raw_data) >= HEAVY_BYTES
    }


def copy_field(fd: FieldDescriptor, value: object, target: Message) -> None:
    """Set field `fd` of `target` to `value` (as `source.ListFields()` gives it) without
    copying the rest of the source message."""
    if fd.is_repeated:
        getattr(target, fd.name).extend(value)
    elif fd.message_type is not None:
        getattr(target, fd.name).CopyFrom(value)
    else:
        setattr(target, fd.name, value)


def _copy_fields(source: Message, target: Message, skip: str) -> None:
    for fd, value in source.ListFields():
        if fd.name != skip:
            copy_field(fd, value, target)


def _copy_hiding(model: onnx.ModelProto, hidden: set[str]) -> onnx.ModelProto:
    """A copy of `model` in which the main graph's `hidden` initializers are typed inputs
    instead (never copied: the copy is made field by field around them)."""
    view = onnx.ModelProto()
    _copy_fields(model, view, "graph")
    graph = model.graph
    _copy_fields(graph, view.graph, "initializer")
    view.graph.initializer.extend(t for t in graph.initializer if t.name not in hidden)
    declared = {v.name for v in graph.input}
    view.graph.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in graph.initializer
        if t.name in hidden and t.name not in declared
    )
    return view


def _hide_external_attributes(view: onnx.ModelProto, source: LoadedModel | None) -> None:
    """The view's external attribute tensors out of the checker's reach (see the module
    docstring): main-graph Constants lifted to typed graph inputs, the others read inline
    (left as they are without a `source`: the checker then names them)."""
    graph = view.graph
    lifted = [i for i, node in enumerate(graph.node) if _liftable(node)]
    for i in lifted:
        tensor = graph.node[i].attribute[0].t
        name, dims = graph.node[i].output[0], list(tensor.dims)
        graph.input.append(helper.make_tensor_value_info(name, tensor.data_type, dims))
    for i in reversed(lifted):
        del graph.node[i]
    if source is None:
        return
    for tensor in _external_nested_tensors(graph):
        data = read_external_bytes(source, tensor)
        tensor.ClearField("external_data")
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = data


def _liftable(node: onnx.NodeProto) -> bool:
    """A Constant whose one attribute, `value`, is an external tensor."""
    return (
        node.op_type == "Constant"
        and node.domain in _STANDARD
        and len(node.attribute) == 1
        and node.attribute[0].name == "value"
        and node.attribute[0].t.data_location == onnx.TensorProto.EXTERNAL
        and len(node.output) == 1
    )


def _external_nested_tensors(
    graph: onnx.GraphProto, main: bool = True
) -> Iterator[onnx.TensorProto]:
    """Every external tensor of a node attribute in `graph` and its subgraphs, and of the
    subgraphs' initializers (the main graph's are hidden otherwise); a full walk, made only
    for a model `scan_nodes` found such a tensor in."""
    tensors = [] if main else list(graph.initializer)
    for node in graph.node:
        tensors.extend(_attribute_tensors(node))
    yield from (t for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL)
    for node in graph.node:
        for sub in node_subgraphs(node):
            yield from _external_nested_tensors(sub, main=False)


def missing_type(value: onnx.ValueInfoProto) -> str | None:
    """What the checker misses on a main-graph input/output: "type", "shape" or None."""
    if not value.HasField("type") or value.type.WhichOneof("value") is None:
        return "type"
    if not value.type.HasField("tensor_type"):
        return None
    tensor = value.type.tensor_type
    if not tensor.elem_type:
        return "type"
    return None if tensor.HasField("shape") else "shape"


def _untyped_io(graph: onnx.GraphProto) -> Iterator[tuple[str, onnx.ValueInfoProto, str]]:
    """Main-graph inputs/outputs the checker refuses for a missing type or shape."""
    for kind, value in _view_io(graph):
        missing = missing_type(value)
        if missing is not None:
            yield kind, value, missing


def checker_view(
    model: onnx.ModelProto, source: LoadedModel | None = None, scan: NodeScan | None = None
) -> View:
    """`model` as onnx's checker should see it (the model itself when nothing needs hiding).
    `source`: where the model's external data files are (the input fuser read), for the
    external attribute tensors the view reads inline. `scan`: `scan_nodes(model)`, if made
    already (its nodes as they are now)."""
    scan = scan or scan_nodes(model)
    hidden = _heavy_initializers(model.graph)
    untyped = list(_untyped_io(model.graph))
    if not hidden and not untyped and not scan.legacy and not scan.external:
        return View(model, nested=scan.nested)
    view = _copy_hiding(model, hidden)
    graph = view.graph
    if scan.external:
        _hide_external_attributes(view, source)
    if scan.legacy:
        _move_legacy_ops(view)
    warnings = []
    by_name = {(k, v.name): v for k, v in _view_io(graph)}
    for kind, value, missing in untyped:
        warnings.append(
            f"graph {kind} '{value.name}' has no {missing} (onnx.checker: {_checker_says(value)}); "
            f"onnxruntime runs it, so fuser goes on, the {missing} left unknown"
        )
        placeholder = by_name[(kind, value.name)].type.tensor_type
        if not placeholder.elem_type:
            placeholder.elem_type = onnx.TensorProto.FLOAT  # seen only by the checker
        placeholder.shape.SetInParent()
    return View(view, tuple(warnings), scan.nested)


def _checker_says(value: onnx.ValueInfoProto) -> str:
    """The checker's own words about one graph input/output."""
    try:
        onnx.checker.check_value_info(value, onnx.checker.DEFAULT_CONTEXT)
    except onnx.checker.ValidationError as exc:
        text = str(exc).strip()
        return text.splitlines()[0] if text else "refused"
    return "refused"


def _view_io(graph: onnx.GraphProto) -> Iterator[tuple[str, onnx.ValueInfoProto]]:
    yield from (("input", v) for v in graph.input)
    yield from (("output", v) for v in graph.output)
