"""onnx's checker and shape inference on the model fuser reads and on the model it writes.

The input is checked as `checkview` presents it (what onnxruntime accepts beyond the spec is
seen as onnx's tools understand it), and its value types come from shape inference; the
rewritten model is checked again before anything is written (`verify`).
"""

from __future__ import annotations

import onnx

from .checkview import checker_view, inference_view
from .errors import FusionError, ModelLoadError
from .graph import TypeTable, may_hold_subgraphs
from .modelio import LoadedModel
from .registry import ensure_fused_ops_registered


def check_structure(loaded: LoadedModel) -> tuple[str, ...]:
    """onnx's checker on the model as `checkview` presents it (external tensors unread,
    onnxruntime's legacy ops typed); one line on failure. Returns what the checker would have
    refused but onnxruntime runs (warnings: fuser fuses such a model anyway)."""
    view = checker_view(loaded.model)
    try:
        onnx.checker.check_model(view.model, full_check=False)
    except onnx.checker.ValidationError as exc:
        raise ModelLoadError(f"{loaded.label}: invalid ONNX model: {_first_line(exc)}") from exc
    return view.warnings


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def infer_types(model: onnx.ModelProto) -> dict[str, TypeTable]:
    """Element types and shapes of every value, per graph path (shape inference on a copy)."""
    ensure_fused_ops_registered()
    return _infer_view(inference_view(model), model)


def _infer_view(view: onnx.ModelProto | bytes, model: onnx.ModelProto) -> dict[str, TypeTable]:
    """Types from shape inference on `view` (a model or its serialization); `model`'s own
    annotations where inference fails."""
    try:
        inferred = onnx.shape_inference.infer_shapes(view, check_type=False, strict_mode=False)
    except Exception:  # inference is best-effort here; patterns refuse what they cannot type
        inferred = model
    types: dict[str, TypeTable] = {}
    if inferred is model or any(may_hold_subgraphs(n) for n in inferred.graph.node):
        _collect_types(inferred.graph, "", types)
        return types
    # No subgraph: keep the inferred values' protos alone (the type table holds the protos it
    # converts lazily, and holding any of the inferred copy keeps all of it alive); the
    # initializers' types come from the model's own tensors.
    slim = onnx.GraphProto()
    slim.input.extend(inferred.graph.input)
    slim.output.extend(inferred.graph.output)
    slim.value_info.extend(inferred.graph.value_info)
    del inferred
    _collect_types(slim, "", types)
    for tensor in model.graph.initializer:
        types[""].add_proto(tensor.name, tensor)
    return types


def check_and_infer(loaded: LoadedModel) -> tuple[dict[str, TypeTable], tuple[str, ...]] | None:
    """`check_structure` and `infer_types` on one serialization of the model's view, when
    both tools see the same view: every graph input and output typed (then the checker needs
    no placeholder and there is no output for inference to fill in). None otherwise: call
    them one by one. Serializing a large model costs about as much as either tool's work."""
    view = checker_view(loaded.model)
    if view.warnings:
        return None
    ensure_fused_ops_registered()
    data = view.model.SerializeToString()
    try:
        onnx.checker.check_model(data, full_check=False)
    except onnx.checker.ValidationError as exc:
        raise ModelLoadError(f"{loaded.label}: invalid ONNX model: {_first_line(exc)}") from exc
    return _infer_view(data, loaded.model), ()


def _collect_types(graph: onnx.GraphProto, path: str, out: dict[str, TypeTable]) -> None:
    table = TypeTable()
    for value in (*graph.input, *graph.output, *graph.value_info):
        table.add_proto(value.name, value)
    for tensor in graph.initializer:
        table.add_proto(tensor.name, tensor)
    out[path] = table
    for node in graph.node:
        if not may_hold_subgraphs(node):
            continue
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for i, sub in enumerate(subs):
                _collect_types(sub, sub_path(path, node, attr.name, i, len(subs)), out)


def sub_path(path: str, node: onnx.NodeProto, attr: str, i: int, n: int) -> str:
    """How type tables name a subgraph (the engine and the plugin walk them too)."""
    name = node.name or node.op_type
    suffix = f"{attr}[{i}]" if n > 1 else attr
    return f"{path}/{name}.{suffix}" if path else f"{name}.{suffix}"


def verify(model: onnx.ModelProto, label: str) -> None:
    """The checker on the rewritten model, seen as the input was (`checkview`): the output is
    never less valid than the input. Each fused node's shape inference was checked against the
    original graph when it was made; a failure here is fuser's bug, so say so."""
    try:
        onnx.checker.check_model(checker_view(model).model, full_check=False)
    except Exception as exc:
        raise FusionError(
            f"{label}: the fused model failed verification ({_first_line(exc)}); nothing was "
            "written. This is a bug in fuser: please report it with the model"
        ) from exc
