"""What validation runs and compares, worked out once from the original and the fused model.

The fused nodes of the fused model's main graph (with their patterns and the nodes they
replaced), the values to expose as extra outputs on each side (every fused node's outputs, the
inputs it is fed in isolation, TopK partners), the inputs to draw, and the ranks to run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from .errors import ValidationInputError
from .fusedop import DOMAIN
from .graph import node_subgraphs
from .modelio import LoadedModel
from .validate_inputs import InputSpec, input_specs, runtime_inputs

# The com.microsoft collectives (fuser.collective runs them): their group_size is the rank count.
COLLECTIVE_OPS = (("com.microsoft", "AllGather"), ("com.microsoft", "AllReduce"))


def group_size(model: onnx.ModelProto) -> int:
    """Ranks a model needs: the group_size of its collectives (1 if it has none)."""
    sizes: set[int] = set()

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            if (node.domain, node.op_type) in COLLECTIVE_OPS or (
                node.domain == DOMAIN and any(a.name == "group_size" for a in node.attribute)
            ):
                sizes.update(a.i for a in node.attribute if a.name == "group_size")
            for sub in node_subgraphs(node):
                visit(sub)

    visit(model.graph)
    if len(sizes) > 1:
        raise ValidationInputError(f"collectives disagree on group_size: {sorted(sizes)}")
    return sizes.pop() if sizes else 1


def lowest_float_upstream(
    model: onnx.ModelProto, outputs: Sequence[str], types: Mapping[str, Any] | None = None
) -> dict[str, str | None]:
    """Per output, the least precise float dtype among the values it is computed from.

    A float32 output computed from float16 values carries float16 error (onnxruntime's CPU
    provider even computes some float16 ops in float32 and drops roundings the fused op
    keeps), so its tolerance comes from there, not from its own dtype.
    """
    from .engine import infer_types
    from .graph import TypeTable

    table = (types if types is not None else infer_types(model)).get("") or TypeTable()
    producer = {out: node for node in model.graph.node for out in node.output if out}
    rank = {"float64": 0, "float32": 1, "float16": 2, "bfloat16": 3}  # bfloat16: 8-bit mantissa
    lowest_of: dict[str, str | None] = {}

    def own(value: str) -> str | None:
        vt = table.get(value)
        if vt is None or not vt.elem_type:
            return None
        name = onnx.helper.tensor_dtype_to_np_dtype(vt.elem_type).name
        return name if name in rank else None

    def lower(a: str | None, b: str | None) -> str | None:
        if a is None or b is None:
            return a or b
        return a if rank[a] >= rank[b] else b

    # Iterative post-order walk with memo: large graphs share most of their upstream.
    for output in outputs:
        stack: list[tuple[str, bool]] = [(output, False)]
        while stack:
            value, expanded = stack.pop()
            if value in lowest_of:
                continue
            node = producer.get(value)
            if node is None:
                lowest_of[value] = own(value)
                continue
            if not expanded:
                stack.append((value, True))
                stack.extend((i, False) for i in node.input if i and i not in lowest_of)
                continue
            found = own(value)
            for i in node.input:
                if i:
                    found = lower(found, lowest_of.get(i))
            lowest_of[value] = found
    return {o: lowest_of.get(o) for o in outputs}


@dataclass(frozen=True)
class FusedNodeInfo:
    """A fused node of the fused model's main graph, and what messages say about it."""

    node: onnx.NodeProto = field(compare=False)
    name: str
    op: str
    pattern: str
    replaced: tuple[str, ...]


@dataclass(frozen=True)
class TopKPair:
    """The (values, indices) outputs of a TopK-like node: compared together."""

    values: str
    indices: str
    axis: int
    is_sorted: bool


@dataclass(frozen=True)
class ValidationPlan:
    """What to run and compare, worked out once from the two models (shared by every rank)."""

    original: LoadedModel = field(compare=False)
    fused: LoadedModel = field(compare=False)
    specs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    nodes: tuple[FusedNodeInfo, ...]
    expose_original: tuple[str, ...]  # values of the original made graph outputs
    expose_fused: tuple[str, ...]  # values of the fused model made graph outputs
    topk: Mapping[str, TopKPair]  # by values name and by indices name
    precision: Mapping[str, str | None]
    ranks: int
    has_functions: bool
    given: Mapping[str, np.ndarray] = field(default_factory=dict, compare=False)


def plan_validation(
    original: LoadedModel,
    fused: LoadedModel,
    *,
    inputs: Mapping[str, Any] | None = None,
    dims: Mapping[str, int] | None = None,
    dim_size: int = 3,
    replaced: Mapping[str, Sequence[str]] | None = None,
    types: Mapping[str, Any] | None = None,
) -> ValidationPlan:
    """Work out the inputs, the fused nodes and the values to expose on each side.

    `replaced` maps a fused node's name to the original nodes it replaced (a FusionResult's
    report knows them; otherwise the node's doc_string is quoted). `types` is the original's
    inferred type table (`engine.infer_types`), if already computed.
    """
    from .engine import infer_types

    ranks = max(group_size(original.model), group_size(fused.model))
    outputs = tuple(o.name for o in original.model.graph.output)
    fused_outputs = {o.name for o in fused.model.graph.output}
    missing = [n for n in outputs if n not in fused_outputs]
    if missing:
        raise ValidationInputError(
            f"{fused.label}: lacks output '{missing[0]}' of {original.label}"
        )
    ins_o = {v.name for v in runtime_inputs(original.model)}
    ins_f = {v.name for v in runtime_inputs(fused.model)}
    if ins_o != ins_f:
        extra = sorted(ins_f - ins_o)
        what = f"takes input '{extra[0]}'" if extra else f"lacks input '{sorted(ins_o - ins_f)[0]}'"
        raise ValidationInputError(
            f"{fused.label}: {what} of {original.label}; is it a fusion of that model?"
            if not extra
            else f"{fused.label}: {what}, which {original.label} does not; is it a fusion of "
            "that model?"
        )
    produced_o = _produced(original.model.graph)
    produced_f = _produced(fused.model.graph)
    init_f = {t.name for t in fused.model.graph.initializer}
    inputs_o = {v.name for v in original.model.graph.input}
    nodes = tuple(
        _node_info(n, replaced or {}) for n in fused.model.graph.node if n.domain == DOMAIN
    )
    wanted_o: list[str] = []
    wanted_f: list[str] = []
    for info in nodes:
        for name in info.node.output:
            if name and name in produced_o:
                wanted_o.append(name)
                wanted_f.append(name)
        for name in info.node.input:
            if not name or name in init_f or name in inputs_o:
                continue
            (wanted_o if name in produced_o else wanted_f).append(name)
    topk = _topk_pairs(original.model.graph) | _topk_pairs(fused.model.graph)
    for pair in list(topk.values()):
        for name in (pair.values, pair.indices):
            if name in produced_o and (name in wanted_o or name in outputs):
                for partner in (pair.values, pair.indices):
                    if partner in produced_o and partner in produced_f:
                        wanted_o.append(partner)
                        wanted_f.append(partner)
    expose_o = tuple(dict.fromkeys(n for n in wanted_o if n not in outputs))
    expose_f = tuple(dict.fromkeys(n for n in wanted_f if n in produced_f and n not in outputs))
    if types is None:
        from .ort import skeleton

        types = infer_types(skeleton(original.model))
    precision = lowest_float_upstream(original.model, [*outputs, *expose_o], types)
    specs = tuple(input_specs(original.model, dims or {}, dim_size))
    given = {k: np.asarray(v) for k, v in (inputs or {}).items()}
    has_functions = any(f.domain == DOMAIN for f in fused.model.functions)
    return ValidationPlan(
        original,
        fused,
        specs,
        outputs,
        nodes,
        expose_o,
        expose_f,
        topk,
        precision,
        ranks,
        has_functions,
        given,
    )


def _produced(graph: onnx.GraphProto) -> set[str]:
    return {o for n in graph.node for o in n.output if o}


def _node_info(node: onnx.NodeProto, replaced: Mapping[str, Sequence[str]]) -> FusedNodeInfo:
    from .registry import all_patterns

    patterns = [p.name for p in all_patterns() if any(op.name == node.op_type for op in p.ops)]
    known = tuple(replaced.get(node.name, ()))
    if not known and node.doc_string:
        known = (node.doc_string.splitlines()[0][:200],)
    return FusedNodeInfo(node, node.name, node.op_type, "/".join(patterns), known)


def _topk_pairs(graph: onnx.GraphProto) -> dict[str, TopKPair]:
    pairs: dict[str, TopKPair] = {}
    for node in graph.node:
        attrs = {a.name: a for a in node.attribute}
        topk = (node.domain in ("", "ai.onnx") and node.op_type == "TopK") or (
            node.domain == DOMAIN and "sorted" in attrs
        )
        if topk and len(node.output) >= 2 and node.output[0] and node.output[1]:
            axis = attrs["axis"].i if "axis" in attrs else -1
            is_sorted = attrs["sorted"].i != 0 if "sorted" in attrs else True
            previous = pairs.get(node.output[1])
            if previous is not None:
                is_sorted = is_sorted and previous.is_sorted
            pair = TopKPair(node.output[0], node.output[1], axis, is_sorted)
            pairs[node.output[0]] = pairs[node.output[1]] = pair
    return pairs
