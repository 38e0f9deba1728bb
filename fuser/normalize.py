"""What onnxruntime runs, fuser accepts: in-memory fixes of a loaded model, each reported.

Run on fuser's own copy of the input (never the caller's model or file), before anything else
looks at the graph. Each fix makes the model *more* valid, never changes what it computes, and
does nothing to a model that needs none (fusing a fused model changes no byte):

- nodes not in topological order are sorted (onnxruntime sorts them itself), keeping the
  original order wherever it is valid;
- IR version below 4 with initializers that are not graph inputs (onnxruntime reads them as
  constants; ONNX requires IR 4 for that): the IR version becomes 4, which says exactly that;
- graph inputs without a type or shape that an initializer gives are typed from it; graph
  outputs without one get what shape inference finds (`fill_outputs`).

Refused, as onnxruntime refuses them: an ai.onnx opset newer than onnx and onnxruntime know.
LayerNormalization below opset 17 is left as it is (onnxruntime runs it as opset 17's, and so do
fuser's checks: see `fuser.checkview`); the report says so.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import onnx
from onnx import defs

from .checkview import LAYERNORM_OPSET, NodeScan, legacy_layernorms, missing_type, onnx_opset
from .errors import ModelLoadError
from .graph import GraphIndex, TypeTable, ValueType, may_hold_subgraphs, subgraph_free_names
from .modelio import LoadedModel

# IR version from which initializers need not be graph inputs.
IR_INITIALIZERS_AS_CONSTANTS = 4


def normalize(loaded: LoadedModel, *, sort: bool = True, scan: NodeScan | None = None) -> list[str]:
    """Check the opsets and fix what onnxruntime tolerates, in `loaded.model`; returns what was
    done, one sentence each (empty for a model that needed nothing).

    `sort=False` leaves the node order alone: for a caller whose next step is onnx's checker,
    which refuses nodes out of topological order, and that calls `sort_nodes` only then
    (checking the order is a walk over every node's inputs and outputs, most of a large
    model's normalization), putting its notes first as this does. `scan`: `scan_nodes` of
    the model, if made already (with `sort=False`: sorting would reorder what it found);
    normalizing changes no node, so the caller may give it to `checker_view` after."""
    if scan is not None and sort:
        raise ValueError("normalize: a scan of the nodes is for sort=False only")
    check_opsets(loaded)
    notes: list[str] = sort_nodes(loaded) if sort else []
    notes += _ir_version(loaded.model)
    notes += _type_inputs_from_initializers(loaded.model.graph)
    legacy = scan.layernorms if scan is not None else legacy_layernorms(loaded.model)
    if legacy:
        names = ", ".join(f"'{n.name or n.output[0]}'" for n in legacy[:3])
        more = f" and {len(legacy) - 3} more" if len(legacy) > 3 else ""
        notes.append(
            f"LayerNormalization {names}{more} at opset {onnx_opset(loaded.model)} (ONNX defines "
            f"it from {LAYERNORM_OPSET}): read as onnxruntime runs it, as opset "
            f"{LAYERNORM_OPSET}'s"
        )
    return notes


def check_opsets(loaded: LoadedModel) -> None:
    """Refuse an ai.onnx opset beyond the newest onnx defines (onnxruntime refuses it too)."""
    newest = defs.onnx_opset_version()
    for entry in loaded.model.opset_import:
        if entry.domain in ("", "ai.onnx") and entry.version > newest:
            raise ModelLoadError(
                f"{loaded.label}: imports opset {entry.version} of ai.onnx, newer than any "
                f"onnx and onnxruntime know (newest: {newest}); onnxruntime cannot run it"
            )


def _ir_version(model: onnx.ModelProto) -> list[str]:
    if model.ir_version >= IR_INITIALIZERS_AS_CONSTANTS:
        return []
    declared = {v.name for v in model.graph.input}
    unlisted = [t.name for t in model.graph.initializer if t.name not in declared]
    if not unlisted:
        return []
    old = model.ir_version
    model.ir_version = IR_INITIALIZERS_AS_CONSTANTS
    shown = ", ".join(f"'{n}'" for n in unlisted[:3]) + (" ..." if len(unlisted) > 3 else "")
    return [
        f"IR version {old} -> {IR_INITIALIZERS_AS_CONSTANTS}: initializers {shown} are not graph "
        "inputs, which IR 4 allows (onnxruntime reads them as constants)"
    ]


# -- topological order --------------------------------------------------------------------------


def _sub_graphs(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.GraphProto]]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.name, attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for i, sub in enumerate(attr.graphs):
                yield f"{attr.name}[{i}]", sub


def _in_order(graph: onnx.GraphProto, visible: set[str]) -> bool:
    """Whether every node reads only values defined before it (or outside the graph).

    One pass over the nodes (this runs on every input, sorted or not); only the nodes that may
    hold a subgraph have their attributes read (see `may_hold_subgraphs`: the checker refuses a
    graph attribute on any other node)."""
    known = visible | {v.name for v in graph.input} | {t.name for t in graph.initializer}
    known |= {s.values.name for s in graph.sparse_initializer}
    known.add("")  # an omitted optional input
    nested: list[onnx.GraphProto] = []
    for node in graph.node:
        if not known.issuperset(node.input):
            return False
        if may_hold_subgraphs(node):
            for _, sub in _sub_graphs(node):
                if not subgraph_free_names(sub) <= known:
                    return False
                nested.append(sub)
        known.update(node.output)
    return all(_in_order(sub, known) for sub in nested)


def sort_nodes(loaded: LoadedModel) -> list[str]:
    """Sort the nodes of `loaded.model` (and its subgraphs) topologically where they are not,
    keeping the original order wherever it is valid; returns what was done (empty for a model
    in order). A cycle or a dangling input is a `ModelLoadError` naming the node."""
    if _in_order(loaded.model.graph, set()):
        return []
    notes: list[str] = []
    opsets = {
        ("" if o.domain == "ai.onnx" else o.domain): o.version for o in loaded.model.opset_import
    }
    try:
        _sort_graph(loaded.model.graph, loaded, opsets, None, "", notes)
    except ModelLoadError as exc:  # a cycle or a dangling input: name the file too
        raise ModelLoadError(f"{loaded.label}: {exc}") from exc
    return notes


def _sort_graph(
    graph: onnx.GraphProto,
    loaded: LoadedModel,
    opsets: Mapping[str, int],
    outer: GraphIndex | None,
    path: str,
    notes: list[str],
) -> None:
    # GraphIndex sorts as the passes will (Kahn's, lowest original position first), and says
    # which node closes a cycle or reads a value nothing provides.
    index = GraphIndex.build(graph, loaded, opsets, TypeTable(), outer=outer, path=path)
    if index.modified:
        index.write_back()
        where = f"subgraph {path}: " if path else ""
        notes.append(
            f"{where}nodes sorted topologically (they were not; onnxruntime sorts them itself)"
        )
    for node in graph.node:
        for attr, sub in _sub_graphs(node):
            name = f"{node.name or node.op_type}.{attr}"
            _sort_graph(sub, loaded, opsets, index, f"{path}/{name}" if path else name, notes)


# -- graph inputs and outputs without types -----------------------------------------------------


def _set_type(value: onnx.ValueInfoProto, found: ValueType) -> None:
    tensor = value.type.tensor_type
    tensor.elem_type = found.elem_type
    if found.shape is None:
        return
    tensor.shape.SetInParent()
    del tensor.shape.dim[:]
    for dim in found.shape:
        new = tensor.shape.dim.add()
        if isinstance(dim, int):
            new.dim_value = dim
        elif isinstance(dim, str):
            new.dim_param = dim


def _type_inputs_from_initializers(graph: onnx.GraphProto) -> list[str]:
    untyped = [(v, m) for v in graph.input if (m := missing_type(v)) is not None]
    if not untyped:  # the common case: no need to index the initializers
        return []
    tensors = {t.name: t for t in graph.initializer}
    notes = []
    for value, missing in untyped:
        tensor = tensors.get(value.name)
        if tensor is None:
            continue
        _set_type(value, ValueType(tensor.data_type, tuple(tensor.dims)))
        notes.append(f"graph input '{value.name}' had no {missing}: taken from its initializer")
    return notes


def fill_outputs(model: onnx.ModelProto, types: TypeTable | None) -> list[str]:
    """Give graph outputs without a type or shape what shape inference found for them."""
    notes = []
    for value in model.graph.output:
        missing = missing_type(value)
        if missing is None or types is None or value.name not in types:
            continue
        try:
            found = types[value.name]
        except KeyError:
            continue
        if not found.elem_type or (missing == "shape" and found.shape is None):
            continue
        if missing == "shape":
            found = ValueType(value.type.tensor_type.elem_type or found.elem_type, found.shape)
        _set_type(value, found)
        notes.append(f"graph output '{value.name}' had no {missing}: inferred")
    return notes
