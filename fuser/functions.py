"""Function bodies in fused models: attach them (so stock onnxruntime runs a fused model) and
inline them (so a fused model becomes plain ONNX again).

`attach` writes, for every fused node in the graph and its subgraphs, the body its op declares
(`FusedOp.body`, built in `fuser.bodies`) as a model-local FunctionProto in domain `fuser`; the
node names its variant in `NodeProto.overload` (ONNX IR 10). A runtime with a kernel for the op
(fuser's plugin, an NPU backend) runs the op itself; one without inlines the body. The schemas
stay registered in onnx.defs, so the checker and shape inference treat fused nodes as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import onnx
import onnx.inliner
from onnx import helper

from . import fusedop
from .bodies.builder import Body, BodyError, BodyRequest
from .errors import FusionError
from .fusedop import DOMAIN, VERSION
from .graph import SUBGRAPH_OPS, TypeTable, may_hold_subgraphs
from .registry import ensure_fused_ops_registered

# NodeProto.overload and FunctionProto.overload exist from IR version 10 on.
OVERLOAD_IR_VERSION = 10

ElemTypes = Callable[[str], int]


def graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every subgraph in it, depth first."""
    yield graph
    for node in graph.node:
        if not may_hold_subgraphs(node):  # no other node has graph attributes (see there)
            continue
        yield from _subgraphs_of(node)


def _subgraphs_of(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield from graphs(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for sub in attr.graphs:
                yield from graphs(sub)


def fused_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node of domain `fuser`, in the graph and its subgraphs (in the order of
    `graphs`: a graph's own nodes, then its subgraphs' nodes)."""
    yield from _fused_nodes_of(model.graph)


def _fused_nodes_of(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    # One read of each node's domain (and op_type) serves both questions: is it fused, may it
    # hold subgraphs. Two walks (`graphs`, then each graph's nodes) read every node twice.
    # A registered fused op declares no graph attribute (and the checker refuses undeclared
    # ones, on the input and on the output): its nodes hold no subgraph.
    holders, registered = [], fusedop.registered()
    for node in graph.node:
        domain = node.domain
        if domain == DOMAIN:
            yield node
            if node.op_type in registered:
                continue
        if domain not in ("", "ai.onnx") or node.op_type in SUBGRAPH_OPS:
            holders.append(node)
    for holder in holders:
        for sub in _subgraphs_of(holder):
            yield from (n for n in sub.node if n.domain == DOMAIN)


def elem_types_from(tables: Mapping[str, Mapping[str, Any]]) -> ElemTypes:
    """A lookup of element types over the per-graph type tables of `engine.infer_types`."""

    typed = [t for t in tables.values() if isinstance(t, TypeTable)]
    if len(typed) == 1 == len(tables):  # a graph without subgraphs: one table to ask
        only = typed[0].elem_type

        def one_table_lookup(name: str) -> int:
            return only(name) or 0  # None (unknown) and 0 (undefined) both answer 0

        return one_table_lookup
    if len(typed) == len(tables):  # the usual case: `TypeTable.elem_type`, no TensorInfo made

        def typed_lookup(name: str) -> int:
            for table in typed:
                if name in table:
                    found = table.elem_type(name)
                    if found is not None:
                        return found
            return 0

        return typed_lookup

    def lookup(name: str) -> int:
        info = tensor_info(name, tables)
        return int(info.elem_type) if info is not None else 0

    return lookup


def tensor_info(name: str, tables: Mapping[str, Mapping[str, Any]]) -> fusedop.TensorInfo | None:
    """What the type tables know of `name` (any graph's table: names are unique in practice)."""
    for table in tables.values():
        if name in table:
            try:
                found = table[name]
            except KeyError:  # a value whose proto carries no type
                continue
            return fusedop.TensorInfo(found.elem_type, found.shape)
    return None


def attach(model: onnx.ModelProto, elem_types: ElemTypes) -> int:
    """Write the body of every fused node into `model` (in place); returns the bodies written.

    Replaces any fuser functions already there (so attaching twice gives the same bytes) and
    adds the opset imports the bodies use. A variant an opset cannot express is an error.
    """
    ensure_fused_ops_registered()
    imports = {o.domain or "": o.version for o in model.opset_import}
    opset = imports.get("", imports.get("ai.onnx", 0))
    found: dict[tuple[str, str], onnx.FunctionProto] = {}
    # Nodes of one model share a handful of bodies: build each (op, request) once. A node is
    # first looked up by its raw attributes (each serialized, tiling ones included: reading
    # every attribute's name to leave those out cost as much as serializing it), which costs a
    # few microseconds; only a node unlike any before converts them to values (`_build`,
    # where tiling is left out: nodes that differ in tiling alone share a body).
    built: dict[tuple[Any, ...], Body] = {}
    variants: dict[tuple[Any, ...], str] = {}
    registered = fusedop.registered()
    serialize = onnx.AttributeProto.SerializeToString
    for node in fused_nodes(model):
        op = registered.get(node.op_type)
        if op is None or op.body is None:
            node.ClearField("overload")
            continue
        inputs = list(node.input)  # each read of a repeated string field makes new strs
        raw = (
            op.name,
            tuple(map(serialize, node.attribute)),
            tuple(map(bool, inputs)),
            tuple(map(bool, node.output)),
            tuple([elem_types(n) if n else 0 for n in inputs]),
        )
        variant = variants.get(raw)
        if variant is None:
            variant = variants[raw] = _build(node, op, raw, opset, imports, built, found).variant
        node.overload = variant
    kept = [f for f in model.functions if f.domain != DOMAIN]
    del model.functions[:]
    model.functions.extend([*kept, *(found[k] for k in sorted(found))])
    present = {o.domain or "" for o in model.opset_import}
    for domain in sorted(set(imports) - present):
        model.opset_import.append(helper.make_opsetid(domain, imports[domain]))
    if found:
        if DOMAIN not in present:
            model.opset_import.append(helper.make_opsetid(DOMAIN, VERSION))
        model.ir_version = max(model.ir_version, OVERLOAD_IR_VERSION)
    return len(found)


def _build(
    node: onnx.NodeProto,
    op: fusedop.FusedOp,
    raw: tuple[Any, ...],
    opset: int,
    imports: dict[str, int],
    built: dict[tuple[Any, ...], Body],
    found: dict[tuple[str, str], onnx.FunctionProto],
) -> Body:
    """The body of a node unlike any before it (`raw`: op, attributes, which inputs and
    outputs it has, input types); bodies are shared by nodes whose attribute values agree
    (e.g. one naming an attribute at its default, one omitting it)."""
    _, _, inputs, outputs, input_types = raw
    attributes = op.attribute_values(node)
    memo = (
        op.name,
        # tiling (tile_*) is the kernel's business: bodies ignore it
        tuple(
            (k, repr(v))
            for k, v in sorted(attributes.items())
            if not k.startswith(op.tiling_prefix)
        ),
        inputs,
        outputs,
        input_types,
    )
    body = built.get(memo)
    if body is not None:
        return body
    builder = op.body
    assert builder is not None  # attach passes only ops with a body
    request = BodyRequest(
        op=op,
        attributes=attributes,
        inputs=inputs,
        outputs=outputs,
        input_types=input_types,
        opset=opset,
        domains={d: v for d, v in imports.items() if d},
    )
    try:
        body = built[memo] = builder(request)
    except BodyError as exc:
        raise FusionError(
            f"node '{node.name}' ({node.op_type}): no function body at opset {opset}: "
            f"{exc}; fuse with --no-functions (functions=False) to write the bare op"
        ) from exc
    key = (op.name, body.variant)
    function = function_proto(op, body, opset)
    if key in found and found[key] != function:
        raise FusionError(
            f"{op.name}: two different bodies named '{body.variant}' (node "
            f"'{node.name}'). This is a bug in fuser: please report it with the model"
        )
    found[key] = function
    for domain, version in body.domains:
        if imports.setdefault(domain, version) != version:
            raise FusionError(
                f"{op.name}'s body uses {domain} version {version}, the model imports "
                f"version {imports[domain]}"
            )
    return body


def function_proto(op: fusedop.FusedOp, body: Body, opset: int) -> onnx.FunctionProto:
    """The FunctionProto of one body: attributes it references are declared, with the fused
    op's defaults where it has one (a node may omit an attribute at its default)."""
    function = onnx.FunctionProto(
        name=op.name, domain=DOMAIN, overload=body.variant, doc_string=op.doc
    )
    function.input.extend(body.inputs)
    function.output.extend(body.outputs)
    function.node.extend(body.nodes)
    function.opset_import.append(helper.make_opsetid("", opset))
    function.opset_import.extend(helper.make_opsetid(d, v) for d, v in body.domains)
    defaults = {a.name: a.default for a in op.attributes}
    for name in body.references:
        default = defaults.get(name)
        if default is None or (isinstance(default, list) and not default):
            function.attribute.append(name)
        else:
            function.attribute_proto.append(helper.make_attribute(name, default))
    return function


def strip(model: onnx.ModelProto) -> None:
    """Remove fuser bodies and overloads (in place): the bare fused ops, as without functions."""
    kept = [f for f in model.functions if f.domain != DOMAIN]
    del model.functions[:]
    model.functions.extend(kept)
    for node in fused_nodes(model):
        node.ClearField("overload")


def inline(model: onnx.ModelProto, tables: Mapping[str, Mapping[str, Any]]) -> onnx.ModelProto:
    """A copy of `model` with every fused node replaced by its body: plain ONNX, no `fuser`
    node, no fuser function, no fuser opset import. Other model-local functions stay.

    `tables`: the per-graph types of `engine.infer_types`. A collective fused op's omitted
    optional outputs are named and typed first (by the op's own inference): its body computes
    them with an op onnx has no schema for (com.microsoft AllGather), whose output would
    otherwise have no known type once inlined.
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for graph in graphs(copy.graph):
        _name_omitted_outputs(graph, tables)
    attach(copy, elem_types_from(tables))
    bodies = {(f.name, f.overload): f for f in copy.functions if f.domain == DOMAIN}
    nodes = list(fused_nodes(copy))
    missing = sorted({n.op_type for n in nodes if (n.op_type, n.overload) not in bodies})
    if missing:
        raise FusionError(f"fused ops without a function body: {', '.join(missing)}")
    for node in nodes:
        _fill_defaults(node, bodies[(node.op_type, node.overload)])
    names = sorted({name for name, _ in bodies})
    inlined = onnx.inliner.inline_selected_functions(
        copy, [(DOMAIN, name) for name in names], exclude=False
    )
    kept = [f for f in inlined.functions if f.domain != DOMAIN]
    del inlined.functions[:]
    inlined.functions.extend(kept)
    imports = [o for o in inlined.opset_import if o.domain != DOMAIN]
    del inlined.opset_import[:]
    inlined.opset_import.extend(imports)
    left = [n.name for n in fused_nodes(inlined)]
    if left:
        raise FusionError(f"fused nodes left after inlining: {', '.join(left[:5])}")
    return inlined


def _name_omitted_outputs(graph: onnx.GraphProto, tables: Mapping[str, Mapping[str, Any]]) -> None:
    """Give each collective fused node's omitted optional outputs a fresh name and a
    value_info with the type its op infers."""
    taken = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    for node in graph.node:
        op = fusedop.registered().get(node.op_type) if node.domain == DOMAIN else None
        if op is None or op.collective_input is None:
            continue
        infos = [tensor_info(name, tables) if name else None for name in node.input]
        inferred = op.infer(infos, op.attribute_values(node))
        while len(node.output) < len(op.outputs):
            node.output.append("")
        for position, param in enumerate(op.outputs):
            if node.output[position]:
                continue
            name = f"{node.name or node.op_type}/{param.name}"
            while name in taken:
                name += "_"
            taken.add(name)
            node.output[position] = name
            info = inferred[position] if position < len(inferred) else None
            if info is not None and info.elem_type:
                shape = None if info.shape is None else list(info.shape)
                graph.value_info.append(helper.make_tensor_value_info(name, info.elem_type, shape))


def _fill_defaults(node: onnx.NodeProto, function: onnx.FunctionProto) -> None:
    """Give the node the function's attribute defaults it omits: onnxruntime applies them,
    onnx's inliner (1.23) does not, and a referenced attribute left absent would drop e.g. a
    Constant's value."""
    present = {a.name for a in node.attribute}
    node.attribute.extend(a for a in function.attribute_proto if a.name not in present)
