"""The fusion pipeline: check, index, match, decide, rewrite, verify.

Each pattern makes one pass over the graph in topological order, starting only at its anchor
op types, so a pass is linear in the number of nodes. A match is applied as soon as it is
accepted (the index updates incrementally), so later matches see the rewritten graph and can
never overlap an earlier one. Subgraphs (If/Loop/Scan bodies) get the same treatment, with the
enclosing graph visible for constants and types.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from .check_infer import check_and_infer as check_and_infer  # the pipeline's own steps,
from .check_infer import check_structure as check_structure  # public here as they were
from .check_infer import infer_types as infer_types
from .check_infer import sub_path as sub_path
from .check_infer import verify as verify
from .decide import Decider
from .finish import describe
from .fusedop import DOMAIN, VERSION, TensorInfo
from .graph import SUBGRAPH_OPS, GraphIndex, TypeTable, may_hold_kind, node_subgraphs
from .matcher import check_match
from .modelio import LoadedModel
from .pattern import Match, Pattern, Rejection, attributes_key
from .report import FusionRecord, Prediction, RejectionRecord


@dataclass
class _Memo:
    """Work that repeats per match with identical inputs, done once per signature for a
    whole fuse (a large model repeats a few layer variants thousands of times).

    A signature is the fused op and its attributes (`_attributes_key`): the fused node's op
    and attribute protos are built once per signature (a template each node is copied from);
    shape inference of the fused node, a function of the op, its attributes and its inputs'
    types, once per signature and input types."""

    templates: dict[Hashable, onnx.NodeProto] = field(default_factory=dict)  # op + attributes
    inferred: dict[Hashable, list[TensorInfo | None]] = field(default_factory=dict)
    # What the FusionRecords of one signature hold alike, one object for all of them (a
    # record lives until the report is written, through the verify and the save): the
    # attributes by (signature, key order), the notes by (the pattern's, the decider's reason)
    attributes: dict[Hashable, dict[str, Any]] = field(default_factory=dict)
    notes: dict[tuple[tuple[str, ...], str], tuple[str, ...]] = field(default_factory=dict)


@dataclass
class PassLog:
    """What the passes did, collected while they run."""

    fusions: list[FusionRecord] = field(default_factory=list)
    rejected: list[RejectionRecord] = field(default_factory=list)
    # `count_nodes` of the model's graph as the passes found it and as they left it, counted
    # from the main graph's index (see `indexed_count`)
    nodes_before: int = 0
    nodes_after: int = 0


def count_nodes(graph: onnx.GraphProto) -> int:
    """Nodes in a graph and all its subgraphs."""
    total = len(graph.node)
    for node in graph.node:
        # may_hold_subgraphs, inline: this runs over every node of the model, twice per fuse
        if node.op_type in SUBGRAPH_OPS or node.domain not in ("", "ai.onnx"):
            total += sum(count_nodes(g) for g in node_subgraphs(node))
    return total


def indexed_count(index: GraphIndex) -> int:
    """`count_nodes(index.graph)` of a graph whose index is current (just built, or written
    back): its node count plus the nodes of the subgraphs its nodes hold, the holders found
    by kind (`GraphIndex.by_kind`) rather than by reading every node's op_type and domain.
    Fused ops are not holders: their attributes are ints, floats and strings (`AttrKind`), and
    the checker refuses any other on a node of their domain (reading the attributes of every
    fused node was most of this count after the passes)."""
    holders = [kind for kind in index.by_kind if may_hold_kind(*kind) and kind[0] != DOMAIN]
    total = len(index.graph.node)
    for node_id in index.anchored(holders):
        total += sum(count_nodes(g) for g in node_subgraphs(index.node(node_id)))
    return total


def opset_map(model: onnx.ModelProto) -> dict[str, int]:
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}


# Stage progress: `progress(stage, done, total)`, stage "match" while patterns scan the graph
# and "decide" while the decider prices a match; done/total count (node, pattern) visits.
Progress = Callable[[str, int, int], None]
# Nodes visited between two progress reports (a report per node would cost more than a visit).
PROGRESS_EVERY = 256


@dataclass
class _Ticker:
    """Counts visits and forwards every PROGRESS_EVERY-th (and each stage change) to `report`."""

    report: Progress | None
    total: int
    done: int = 0

    def reach(self, done: int) -> None:
        """`done` visits so far (the pass skips nodes no pattern anchors at: many at once)."""
        if done <= self.done:
            return
        crossed = done // PROGRESS_EVERY != self.done // PROGRESS_EVERY
        self.done = done
        if self.report is not None and crossed:
            self.report("match", min(self.done, self.total), self.total)

    def stage(self, name: str) -> None:
        if self.report is not None:
            self.report(name, min(self.done, self.total), self.total)


def run_passes(
    loaded: LoadedModel,
    patterns: Sequence[Pattern],
    decider: Decider,
    types: dict[str, TypeTable],
    progress: Progress | None = None,
) -> PassLog:
    """Apply `patterns` to the model in place (graph and subgraphs); return what happened."""
    log = PassLog()
    opsets = opset_map(loaded.model)
    main = GraphIndex.build(loaded.model.graph, loaded, opsets, types.get("") or TypeTable())
    log.nodes_before = indexed_count(main)
    ticker = _Ticker(progress, max(1, len(main.nodes) * len(patterns)))
    ticker.stage("match")
    memo = _Memo()
    for index in _walk(main, loaded, opsets, types):
        for pattern in patterns:
            _run_pattern(index, pattern, decider, log, ticker, memo)
        index.write_back()
    log.nodes_after = indexed_count(main)
    if log.fusions and DOMAIN not in opsets:
        loaded.model.opset_import.append(helper.make_opsetid(DOMAIN, VERSION))
    return log


def _walk(
    index: GraphIndex,
    loaded: LoadedModel,
    opsets: dict[str, int],
    types: dict[str, TypeTable],
) -> Iterator[GraphIndex]:
    """The graph, then (after its own rewrites) each subgraph, depth first."""
    yield index
    # The nodes that may hold subgraphs, found after the graph's own passes: not the fused
    # nodes they made (their attributes are plain values, see `indexed_count`: reading the
    # ~10 attributes of each was a tenth of a second at 28k fusions)
    holders = [kind for kind in index.by_kind if may_hold_kind(*kind) and kind[0] != DOMAIN]
    for node_id in index.anchored(holders):  # in order
        node = index.node(node_id)
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for i, sub in enumerate(subs):
                path = sub_path(index.path, node, attr.name, i, len(subs))
                child = GraphIndex.build(
                    sub, loaded, opsets, types.get(path) or TypeTable(), outer=index, path=path
                )
                yield from _walk(child, loaded, opsets, types)


def _run_pattern(
    index: GraphIndex,
    pattern: Pattern,
    decider: Decider,
    log: PassLog,
    ticker: _Ticker,
    memo: _Memo,
) -> None:
    # Only the anchors are visited (a pass over every node read two fields of each, per
    # pattern); those a rewrite removed are skipped, those it adds are not visited.
    start, live = ticker.done, len(index.nodes)
    anchored = index.anchored(pattern.anchors)
    slots = [index.pos[node_id] for node_id in anchored]  # for progress: nodes passed
    for node_id, slot in zip(anchored, slots, strict=True):
        ticker.reach(start + min(slot, live))
        if node_id not in index.nodes:
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
        ticker.stage("decide")
        decision = decider.decide(index, found)
        ticker.stage("match")
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
        signature = _attributes_key(found, decision.attributes)
        attributes = fused_attributes(found, decision.attributes)  # made once, for both
        disagreement = inferred_type_disagreement(index, found, attributes, memo, signature)
        if disagreement is not None:
            log.rejected.append(
                RejectionRecord(
                    pattern.name,
                    tuple(index.describe(i) for i in found.nodes),
                    disagreement[0],
                    disagreement[1],
                    index.path,
                )
            )
            continue
        notes = found.notes
        if decision.reason:  # e.g. "predicted 2.3x faster (symbolic dims priced at 256 ...)"
            said = (notes, decision.reason)
            shared = memo.notes.get(said)
            if shared is None:
                shared = memo.notes[said] = (*notes, f"cost model: {decision.reason}")
            notes = shared
        _apply(index, found, attributes, decision.prediction, log, notes, memo, signature)
    ticker.reach(start + live)


def _apply(
    index: GraphIndex,
    match: Match,
    attributes: dict[str, Any],
    prediction: Prediction | None,
    log: PassLog,
    notes: tuple[str, ...],
    memo: _Memo | None = None,
    signature: Hashable | None = None,
) -> None:
    """Rewrite `match` into one fused node with `attributes` (`fused_attributes`), and log it."""
    replaced = index.describe_all(match.nodes)
    anchor = index.node(match.nodes[0])
    base = anchor.name or f"{anchor.op_type}_{match.nodes[0]}"
    name = index.unique_node_name(f"{base}/{match.op.name}")
    if memo is not None and signature is not None:  # equal keys, equal attributes (and order)
        attributes = memo.attributes.setdefault((signature, tuple(attributes)), attributes)
    for reader, old, new in match.rewires:
        index.rewire_input(reader, old, new)
    template = memo.templates.get(signature) if memo is not None and signature is not None else None
    inputs, outputs = _trim(match.inputs), _trim(match.outputs)
    fused = index.new_node()  # made in the graph's node list: not copied there after
    if template is not None:  # op and attributes copied in one C call, the rest set after
        fused.CopyFrom(template)
        fused.name = name
    else:  # the fields as NodeProto(op_type=..., ...) would set them
        fused.op_type, fused.domain, fused.name = match.op.name, DOMAIN, name
    fused.input.extend(inputs)
    fused.output.extend(outputs)
    fused.doc_string = describe(match.pattern, replaced)
    if template is None:
        for key in sorted(attributes):  # filled in place: extend would copy each attribute
            fill_attribute(fused.attribute.add(), key, attributes[key])
        if memo is not None and signature is not None:
            # a copy owned by no node: a later edit of this node never reaches the next ones
            template = onnx.NodeProto(op_type=fused.op_type, domain=fused.domain)
            template.attribute.extend(fused.attribute)
            memo.templates[signature] = template
    # the index takes the names from the lists the node was given (a fused node's
    # attributes are plain values: it holds no subgraph)
    index.replace(
        match.nodes, fused, match.new_initializers, placed=True, inputs=inputs, outputs=outputs
    )
    log.fusions.append(
        FusionRecord(
            match.pattern,
            name,
            match.op.name,
            replaced,
            attributes,
            index.path,
            notes,
            prediction,
        )
    )


def make_attribute(name: str, value: Any) -> onnx.AttributeProto:
    """onnx.helper.make_attribute for the plain types fused ops use, without its generality
    (which costs more than the rest of a rewrite on large models)."""
    attr = onnx.AttributeProto()
    fill_attribute(attr, name, value)
    return attr


def fill_attribute(attr: onnx.AttributeProto, name: str, value: Any) -> None:
    """Make the empty `attr` the attribute `name` = `value` (as `make_attribute`)."""
    attr.name = name
    if isinstance(value, bool | int | np.integer):
        attr.type, attr.i = onnx.AttributeProto.INT, int(value)
    elif isinstance(value, float | np.floating):
        attr.type, attr.f = onnx.AttributeProto.FLOAT, float(value)
    elif isinstance(value, str):
        attr.type, attr.s = onnx.AttributeProto.STRING, value.encode()
    elif isinstance(value, list | tuple) and value and all(isinstance(v, int) for v in value):
        attr.type = onnx.AttributeProto.INTS
        attr.ints.extend(value)
    else:
        attr.CopyFrom(helper.make_attribute(name, value))


def fused_attributes(match: Match, extra_attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The fused node's attributes: the match's (absent ones dropped) plus the decider's."""
    attributes = {k: v for k, v in match.attributes.items() if v is not None}
    attributes.update(extra_attrs)
    return attributes


def _attributes_key(match: Match, extra_attrs: Mapping[str, Any]) -> Hashable | None:
    """The fused op and `fused_attributes(match, extra_attrs)` as one hashable value (None
    when the match's attributes cannot be frozen): equal keys, equal attributes."""
    own = match.attributes_key  # made once per match, shared with the decider's memos
    if own is None:
        return None
    extra = attributes_key(extra_attrs) if extra_attrs else None
    if extra is None and extra_attrs:
        return None
    return (match.op.name, own, extra)


def inferred_type_disagreement(
    index: GraphIndex,
    match: Match,
    attributes: Mapping[str, Any],
    memo: _Memo | None = None,
    signature: Hashable | None = None,
) -> tuple[str, str] | None:
    """Shape inference of the fused node against what the model says of its outputs: None if
    they agree, else (reason, value). With `memo` and `signature` (`_attributes_key` of the
    match and `attributes`), the inference is done once per signature and input types.

    Only the rewritten nodes change, so this local check is what shape inference on the whole
    result would add. A disagreement is a near-miss, not an error: the model may declare a
    type or shape its nodes do not compute (onnxruntime warns and runs it anyway), and a
    fused node would then contradict the declaration, so the match is refused, naming both.
    """
    # The inputs' facts (`Match.input_facts`: element type and shape, read once per match)
    # key the inference; their TensorInfos are made only when the memo has no answer.
    facts = match.input_facts(index)
    key = (signature, facts) if memo is not None and signature is not None else None
    inferred = memo.inferred.get(key) if memo is not None and key is not None else None
    if inferred is None:
        infos = [TensorInfo(f[0], f[1]) if f else None for f in facts]
        full = {a.name: a.default for a in match.op.attributes} | dict(attributes)
        inferred = match.op.infer(infos, full)
        if memo is not None and key is not None:
            memo.inferred[key] = inferred
    for position, value in enumerate(match.outputs):
        known = index.value_type(value) if value else None
        got = inferred[position] if position < len(inferred) else None
        if known is None or got is None or known.elem_type == 0:
            continue
        if got.elem_type != known.elem_type or (
            got.shape != known.shape and not _shapes_agree(got.shape, known.shape)
        ):
            return (
                f"the model declares {_show(known.elem_type, known.shape)} for '{value}', but "
                f"{match.op.name} replacing '{index.describe(match.nodes[0])}' infers "
                f"{_show(got.elem_type, got.shape)} from its inputs; fused, the model would "
                "contradict its own declaration (correct the value_info of "
                f"'{value}' to fuse it)",
                value,
            )
    return None


def _shapes_agree(a: tuple[Any, ...] | None, b: tuple[Any, ...] | None) -> bool:
    if a is None or b is None:
        return True
    if len(a) != len(b):
        return False
    return all(
        not (isinstance(x, int) and isinstance(y, int)) or x == y for x, y in zip(a, b, strict=True)
    )


def _show(elem_type: int, shape: tuple[Any, ...] | None) -> str:
    dims = "?" if shape is None else ",".join("?" if d is None else str(d) for d in shape)
    return f"{helper.tensor_dtype_to_np_dtype(elem_type).name}[{dims}]"


def _trim(names: tuple[str, ...]) -> list[str]:
    """Drop trailing absent optionals (ONNX allows omitting them; empty ones in the middle stay)."""
    trimmed = list(names)
    while trimmed and not trimmed[-1]:
        trimmed.pop()
    return trimmed


def timed() -> Iterator[float]:
    """Successive elapsed seconds since creation (a tiny stopwatch for stage timings)."""
    start = time.perf_counter()
    while True:
        now = time.perf_counter()
        yield now - start
        start = now
