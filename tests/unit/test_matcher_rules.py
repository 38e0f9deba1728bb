"""The universal matcher rules, each with its reason asserted, using a small test-only pattern.

The pattern fuses Mul -> Add into `fuser.TestMulAdd` and may export the Mul result, so every
rule (escape, export, cycle, overlap, dtype, subgraphs) can be exercised directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from fuser import engine
from fuser.decide import AlwaysFuse
from fuser.errors import ModelLoadError
from fuser.fusedop import FusedOp, Param, TensorInfo, register
from fuser.graph import GraphIndex
from fuser.modelio import load_model
from fuser.pattern import Match, Rejection

F32 = TensorProto.FLOAT


def _infer(
    inputs: Sequence[TensorInfo | None], attrs: Mapping[str, Any]
) -> list[TensorInfo | None]:
    return [inputs[0], inputs[0]]


def _reference(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any]
) -> tuple[np.ndarray, ...]:
    a, b, c = inputs
    assert a is not None and b is not None and c is not None
    return (a * b + c, a * b)


MUL_ADD = register(
    FusedOp(
        name="TestMulAdd",
        doc="test op: a*b + c",
        attributes=(),
        inputs=(Param("A", "T", ""), Param("B", "T", ""), Param("C", "T", "")),
        outputs=(Param("Y", "T", ""), Param("P", "T", "", "optional")),
        type_constraints=(("T", ("tensor(float)",), "float only"),),
        infer=_infer,
        reference=_reference,
    )
)


@dataclass(frozen=True)
class MulAdd:
    exportable: bool = True
    shape_source: bool = False
    name: str = "mul_add"
    description: str = "test"
    anchors: tuple[tuple[str, str], ...] = (("", "Mul"),)
    ops: tuple[FusedOp, ...] = (MUL_ADD,)

    def match(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None:
        mul = graph.node(node_id)
        adds = [
            r
            for r in graph.readers(mul.output[0])
            if graph.node(r).op_type == "Add" and graph.node(r).input[0] == mul.output[0]
        ]
        if not adds:
            return None
        add = graph.node(adds[0])
        return Match(
            self.name,
            MUL_ADD,
            (node_id, adds[0]),
            (mul.input[0], mul.input[1], add.input[1]),
            (add.output[0], ""),
            {},
            exportable={mul.output[0]: 1} if self.exportable else {},
            shape_sources={mul.output[0]: mul.input[0]} if self.shape_source else {},
        )


def run(model: onnx.ModelProto, pattern: Any) -> tuple[onnx.ModelProto, engine.PassLog]:
    loaded = load_model(model)
    log = engine.run_passes(loaded, [pattern], AlwaysFuse(), engine.infer_types(loaded.model))
    return loaded.model, log


def model_of(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model(text)


HEADER = '<ir_version: 8, opset_import: ["" : 17]>\n'


def test_simple_match_fuses() -> None:
    model = model_of(
        HEADER
        + """g (float[N] a, float[N] b, float[N] c) => (float[N] y) {
        p = Mul(a, b)
        y = Add(p, c)
    }"""
    )
    out, log = run(model, MulAdd())
    assert [n.op_type for n in out.graph.node] == ["TestMulAdd"]
    assert len(log.fusions) == 1 and not log.rejected


def test_escaping_value_is_exported_when_the_pattern_allows() -> None:
    model = model_of(
        HEADER
        + """g (float[N] a, float[N] b, float[N] c) => (float[N] y, float[N] z) {
        p = Mul(a, b)
        y = Add(p, c)
        z = Neg(p)
    }"""
    )
    out, _ = run(model, MulAdd())
    fused = out.graph.node[0]
    assert fused.op_type == "TestMulAdd" and list(fused.output) == ["y", "p"]
    assert [n.op_type for n in out.graph.node] == ["TestMulAdd", "Neg"]


def test_escaping_value_blocks_when_the_pattern_cannot_export() -> None:
    model = model_of(
        HEADER
        + """g (float[N] a, float[N] b, float[N] c) => (float[N] y, float[N] z) {
        p = Mul(a, b)
        y = Add(p, c)
        z = Neg(p)
    }"""
    )
    out, log = run(model, MulAdd(exportable=False))
    assert [n.op_type for n in out.graph.node] == ["Mul", "Add", "Neg"]
    (rejected,) = log.rejected
    assert rejected.reason == (
        "internal value 'p' is also read by 'Neg#2' (Neg) outside the match, "
        "and TestMulAdd cannot output it"
    )
    assert rejected.value == "p"


def test_internal_graph_output_blocks_without_export() -> None:
    model = model_of(
        HEADER
        + """g (float[N] a, float[N] b, float[N] c) => (float[N] y, float[N] p) {
        p = Mul(a, b)
        y = Add(p, c)
    }"""
    )
    _, log = run(model, MulAdd(exportable=False))
    assert (
        log.rejected[0].reason
        == "internal value 'p' is a graph output, and TestMulAdd cannot output it"
    )


def test_rewrite_that_would_create_a_cycle_is_refused() -> None:
    # Add reads t = Neg(p): fusing Mul and Add would make the fused node feed itself through Neg.
    model = model_of(
        HEADER
        + """g (float[N] a, float[N] b) => (float[N] y) {
        p = Mul(a, b)
        t = Neg(p)
        y = Add(p, t)
    }"""
    )
    # Add's second input (t) comes from outside and depends on the Mul: a cycle after fusion.
    out, log = run(model, MulAdd())
    assert [n.op_type for n in out.graph.node] == ["Mul", "Neg", "Add"]
    assert log.rejected[0].reason.startswith("fusing would create a cycle: value 't'")


def test_topological_order_is_kept_when_the_fused_node_moves() -> None:
    # The residual reader of p sits between Mul and Add; after fusion it must follow the fused node.
    model = model_of(
        HEADER
        + """g (float[N] a, float[N] b, float[N] c) => (float[N] y, float[N] z) {
        p = Mul(a, b)
        z = Neg(p)
        y = Add(p, c)
    }"""
    )
    out, _ = run(model, MulAdd())
    assert [n.op_type for n in out.graph.node] == ["TestMulAdd", "Neg"]
    onnx.checker.check_model(out)


def test_overlapping_matches_are_refused_with_the_earlier_fusion_named() -> None:
    @dataclass(frozen=True)
    class GreedyAdd:
        """Claims Mul -> Add -> Add chains, anchored at the second Add (so it sees a fused node)."""

        name: str = "greedy"
        description: str = "test"
        anchors: tuple[tuple[str, str], ...] = (("", "Add"),)
        ops: tuple[FusedOp, ...] = (MUL_ADD,)

        def match(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None:
            add = graph.node(node_id)
            src = graph.producer.get(add.input[0])
            if src is None:
                return None
            return Match(
                self.name,
                MUL_ADD,
                (src, node_id),
                (add.input[0], add.input[0], add.input[1]),
                (add.output[0], ""),
                {},
            )

    model = model_of(
        HEADER
        + """g (float[N] a, float[N] b, float[N] c) => (float[N] y) {
        p = Mul(a, b)
        q = Add(p, c)
        y = Add(q, c)
    }"""
    )
    loaded = load_model(model)
    log = engine.run_passes(
        loaded, [MulAdd(), GreedyAdd()], AlwaysFuse(), engine.infer_types(loaded.model)
    )
    assert len(log.fusions) == 1
    assert log.rejected[0].reason.startswith("overlaps an earlier fusion")


def test_unsupported_dtype_is_refused() -> None:
    model = model_of(
        HEADER
        + """g (double[N] a, double[N] b, double[N] c) => (double[N] y) {
        p = Mul(a, b)
        y = Add(p, c)
    }"""
    )
    _, log = run(model, MulAdd())
    assert log.rejected[0].reason == "'a' is float64, which TestMulAdd does not support"


def test_subgraphs_are_matched_and_outer_values_count_as_readers() -> None:
    model = model_of(
        HEADER
        + """g (float[N] a, float[N] b, float[N] c, bool cond) => (float[N] y, float[N] w) {
        p = Mul(a, b)
        w = Add(p, c)
        y = If(cond) <
            then_branch = t () => (float[N] r) { m = Mul(a, c)  r = Add(m, p) },
            else_branch = e () => (float[N] r) { r = Neg(p) }
        >
    }"""
    )
    out, log = run(model, MulAdd())
    # outer Mul -> Add: p is read inside the If bodies, so it is exported, not lost
    assert out.graph.node[0].op_type == "TestMulAdd" and list(out.graph.node[0].output) == [
        "w",
        "p",
    ]
    then_branch = next(a.g for a in out.graph.node[1].attribute if a.name == "then_branch")
    assert [n.op_type for n in then_branch.node] == ["TestMulAdd"]
    assert {f.graph for f in log.fusions} == {"", "If.then_branch"}
    onnx.checker.check_model(out)


def test_a_cycle_in_the_input_is_a_clear_error() -> None:
    graph = helper.make_graph(
        [
            helper.make_node("Neg", ["b"], ["a"], name="n1"),
            helper.make_node("Neg", ["a"], ["b"], name="n2"),
        ],
        "g",
        [],
        [helper.make_tensor_value_info("a", F32, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelLoadError, match="cycle through node 'n1'"):
        run(model, MulAdd())


def test_a_dangling_input_is_a_clear_error() -> None:
    graph = helper.make_graph(
        [helper.make_node("Neg", ["nowhere"], ["a"], name="n1")],
        "g",
        [],
        [helper.make_tensor_value_info("a", F32, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelLoadError, match=r"node 'n1' reads 'nowhere'.*dangling"):
        run(model, MulAdd())


def test_long_chain_fuses_every_pair() -> None:
    """Many matches in one pass: each is applied and the order stays topological.

    (Linear scaling is measured in benchmarks/fuse_speed.py, not asserted on wall time here.)
    """
    nodes, prev = [], "x"
    for i in range(2000):
        nodes.append(helper.make_node("Mul", [prev, "k"], [f"p{i}"]))
        nodes.append(helper.make_node("Add", [f"p{i}", "k"], [f"s{i}"]))
        prev = f"s{i}"
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", F32, [4]),
            helper.make_tensor_value_info("k", F32, [4]),
        ],
        [helper.make_tensor_value_info(prev, F32, [4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out, log = run(model, MulAdd())
    assert len(log.fusions) == 2000 and len(out.graph.node) == 2000
    onnx.checker.check_model(out)


def test_shape_readers_are_repointed_instead_of_exporting_the_value() -> None:
    model = model_of(
        HEADER
        + """g (float[N] a, float[N] b, float[N] c) => (float[N] y, int64[1] s) {
        p = Mul(a, b)
        s = Shape(p)
        y = Add(p, c)
    }"""
    )
    out, log = run(model, MulAdd(shape_source=True))
    # the Shape no longer depends on the match, so it may come first
    fused = next(n for n in out.graph.node if n.op_type == "TestMulAdd")
    shape = next(n for n in out.graph.node if n.op_type == "Shape")
    assert list(fused.output) == ["y"]  # p is not output just for its dims
    assert list(shape.input) == ["a"]
    assert log.fusions[0].notes == ("Shape 'Shape#1' reads 'a' (same shape) instead of 'p'",)
    onnx.checker.check_model(out)


def test_other_readers_still_need_the_export() -> None:
    model = model_of(
        HEADER
        + """g (float[N] a, float[N] b, float[N] c)
        => (float[N] y, int64[1] s, float[N] z) {
        p = Mul(a, b)
        s = Shape(p)
        z = Neg(p)
        y = Add(p, c)
    }"""
    )
    out, _ = run(model, MulAdd(shape_source=True))
    fused = next(n for n in out.graph.node if n.op_type == "TestMulAdd")
    assert list(fused.output) == ["y", "p"]
    assert list(next(n for n in out.graph.node if n.op_type == "Shape").input) == ["a"]
