"""The fusion pipeline: check, index, match, decide, rewrite, verify.

Each pattern makes one pass over the graph in topological order, starting only at its anchor
op types, so a pass is linear in the number of nodes. A match is applied as soon as it is
accepted (the index updates incrementally), so later matches see the rewritten graph and can
never overlap an earlier one. Subgraphs (If/Loop/Scan bodies) get the same treatment, with the
enclosing graph visible for constants and types.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import onnx
from onnx import helper

from .decide import Decider
from .errors import FusionError, ModelLoadError
from .fusedop import DOMAIN, VERSION
from .graph import GraphIndex, ValueType, _node_subgraphs
from .matcher import check_match
from .modelio import LoadedModel, has_external_data
from .pattern import Match, Pattern, Rejection
from .registry import ensure_fused_ops_registered
from .report import FusionRecord, Prediction, RejectionRecord


@dataclass
class PassLog:
    """What the passes did, collected while they run."""

    fusions: list[FusionRecord] = field(default_factory=list)
    rejected: list[RejectionRecord] = field(default_factory=list)


def count_nodes(graph: onnx.GraphProto) -> int:
    """Nodes in a graph and all its subgraphs."""
    return sum(1 + sum(count_nodes(g) for g in _node_subgraphs(n)) for n in graph.node)


def opset_map(model: onnx.ModelProto) -> dict[str, int]:
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}


def checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model as onnx's checker can see it without reading external data.

    The checker resolves external files against the working directory and checks their sizes;
    fuser has already validated those locations itself (modelio), so here each external
    initializer becomes a typed graph input: same structure, no data read.
    """
    if not has_external_data(model):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    external = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    kept = [t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    declared = {v.name for v in graph.input}
    graph.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in external
        if t.name not in declared
    )
    return copy


def check_structure(loaded: LoadedModel) -> None:
    """onnx's checker on the proto (external tensors stay unread); one line on failure."""
    try:
        onnx.checker.check_model(checkable(loaded.model), full_check=False)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid model"
        raise ModelLoadError(f"{loaded.label}: invalid ONNX model: {first}") from exc


def infer_types(model: onnx.ModelProto) -> dict[str, dict[str, ValueType]]:
    """Element types and shapes of every value, per graph path (shape inference on a copy)."""
    ensure_fused_ops_registered()
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:  # inference is best-effort here; patterns refuse what they cannot type
        inferred = model
    types: dict[str, dict[str, ValueType]] = {}
    _collect_types(inferred.graph, "", types)
    return types


def _collect_types(graph: onnx.GraphProto, path: str, out: dict[str, dict[str, ValueType]]) -> None:
    from .graph import _value_type

    table: dict[str, ValueType] = {}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        vt = _value_type(value)
        if vt is not None:
            table[value.name] = vt
    for tensor in graph.initializer:
        table.setdefault(tensor.name, ValueType(tensor.data_type, tuple(tensor.dims)))
    out[path] = table
    for node in graph.node:
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for i, sub in enumerate(subs):
                _collect_types(sub, _sub_path(path, node, attr.name, i, len(subs)), out)


def _sub_path(path: str, node: onnx.NodeProto, attr: str, i: int, n: int) -> str:
    name = node.name or node.op_type
    suffix = f"{attr}[{i}]" if n > 1 else attr
    return f"{path}/{name}.{suffix}" if path else f"{name}.{suffix}"


def run_passes(
    loaded: LoadedModel,
    patterns: Sequence[Pattern],
    decider: Decider,
    types: dict[str, dict[str, ValueType]],
) -> PassLog:
    """Apply `patterns` to the model in place (graph and subgraphs); return what happened."""
    log = PassLog()
    opsets = opset_map(loaded.model)
    main = GraphIndex.build(loaded.model.graph, loaded, opsets, dict(types.get("", {})))
    for index in _walk(main, loaded, opsets, types):
        for pattern in patterns:
            _run_pattern(index, pattern, decider, log)
        index.write_back()
    if log.fusions and DOMAIN not in opsets:
        loaded.model.opset_import.append(helper.make_opsetid(DOMAIN, VERSION))
    return log


def _walk(
    index: GraphIndex,
    loaded: LoadedModel,
    opsets: dict[str, int],
    types: dict[str, dict[str, ValueType]],
) -> Iterator[GraphIndex]:
    """The graph, then (after its own rewrites) each subgraph, depth first."""
    yield index
    for node_id in list(index.live_nodes()):
        node = index.node(node_id)
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for i, sub in enumerate(subs):
                path = _sub_path(index.path, node, attr.name, i, len(subs))
                child = GraphIndex.build(
                    sub, loaded, opsets, dict(types.get(path, {})), outer=index, path=path
                )
                yield from _walk(child, loaded, opsets, types)


def _run_pattern(index: GraphIndex, pattern: Pattern, decider: Decider, log: PassLog) -> None:
    anchors = set(pattern.anchors)
    for node_id in list(index.live_nodes()):
        node = index.nodes.get(node_id)
        if node is None or (node.domain or "", node.op_type) not in anchors:
            continue
        found = pattern.match(index, node_id)
        if found is None:
            continue
        if isinstance(found, Match):
            found = check_match(index, found)
        if isinstance(found, Rejection):
            log.rejected.append(
                RejectionRecord(found.pattern, found.nodes, found.reason, found.value, index.path)
            )
            continue
        decision = decider.decide(index, found)
        if not decision.fuse:
            log.rejected.append(
                RejectionRecord(
                    pattern.name,
                    tuple(index.describe(i) for i in found.nodes),
                    decision.reason,
                    None,
                    index.path,
                )
            )
            continue
        _apply(index, found, decision.attributes, decision.prediction, log)


def _apply(
    index: GraphIndex,
    match: Match,
    extra_attrs: Mapping[str, int],
    prediction: Prediction | None,
    log: PassLog,
) -> None:
    replaced = tuple(index.describe(i) for i in match.nodes)
    anchor = index.node(match.nodes[0])
    base = anchor.name or f"{anchor.op_type}_{match.nodes[0]}"
    name = index.unique_node_name(f"{base}/{match.op.name}")
    attributes = {k: v for k, v in match.attributes.items() if v is not None}
    attributes.update(extra_attrs)
    inputs = _trim(match.inputs)
    outputs = _trim(match.outputs)
    fused = helper.make_node(match.op.name, inputs, outputs, name=name, domain=DOMAIN, **attributes)
    index.replace(match.nodes, fused, match.new_initializers)
    log.fusions.append(
        FusionRecord(
            match.pattern,
            name,
            match.op.name,
            replaced,
            attributes,
            index.path,
            match.notes,
            prediction,
        )
    )


def _trim(names: tuple[str, ...]) -> list[str]:
    """Drop trailing absent optionals (ONNX allows omitting them; empty ones in the middle stay)."""
    trimmed = list(names)
    while trimmed and not trimmed[-1]:
        trimmed.pop()
    return trimmed


def verify(model: onnx.ModelProto, label: str) -> None:
    """Checker and shape inference on the rewritten model; a failure is fuser's bug, so say so."""
    model = checkable(model)
    try:
        onnx.checker.check_model(model, full_check=False)
        onnx.shape_inference.infer_shapes(
            model, check_type=True, strict_mode=_all_domains_known(model)
        )
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FusionError(
            f"{label}: the fused model failed verification ({first}); nothing was written. "
            "This is a bug in fuser: please report it with the model"
        ) from exc


def _all_domains_known(model: onnx.ModelProto) -> bool:
    known = {"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training", DOMAIN}
    return all(o.domain in known for o in model.opset_import)


def timed() -> Iterator[float]:
    """Successive elapsed seconds since creation (a tiny stopwatch for stage timings)."""
    start = time.perf_counter()
    while True:
        now = time.perf_counter()
        yield now - start
        start = now
