"""The report's node counts, taken from the main graph's index (`engine.indexed_count`), are
`count_nodes` of the model before and after the passes, subgraphs included."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser import engine


def _chain(prefix: str, x: str, out: str) -> list[onnx.NodeProto]:
    """LayerNormalization -> MatMul -> Relu over `x`, reading the outer g, b, w."""
    return [
        helper.make_node("LayerNormalization", [x, "g", "b"], [f"{prefix}n"], name=f"{prefix}ln"),
        helper.make_node("MatMul", [f"{prefix}n", "w"], [f"{prefix}m"], name=f"{prefix}mm"),
        helper.make_node("Relu", [f"{prefix}m"], [out], name=f"{prefix}relu"),
    ]


def _model() -> onnx.ModelProto:
    """A chain in the main graph and one in an If branch (itself holding an If), beside a
    node of another domain: each fusion is counted where it happens."""
    rng = np.random.default_rng(7)
    inits = [
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), "g"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
        numpy_helper.from_array(rng.standard_normal((8, 5)).astype(np.float32), "w"),
    ]
    out = helper.make_tensor_value_info
    inner = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["i"], name="neg")], "inner", [], [out("i", 1, [2, 8])]
    )
    then = helper.make_graph(
        [
            *_chain("t_", "x", "t"),
            helper.make_node("If", ["c"], ["nested"], then_branch=inner, else_branch=inner),
        ],
        "then",
        [],
        [out("t", TensorProto.FLOAT, [2, 5]), out("nested", TensorProto.FLOAT, [2, 8])],
    )
    other = helper.make_graph(
        [
            helper.make_node("Identity", ["x"], ["e0"], name="id"),
            helper.make_node("Slice", ["e0", "s0", "s5", "s1"], ["e"], name="slice"),
        ],
        "else",
        [],
        [out("e", TensorProto.FLOAT, [2, 5]), out("e0", TensorProto.FLOAT, [2, 8])],
    )
    for name, value in [("s0", [0]), ("s5", [5]), ("s1", [1])]:
        inits.append(numpy_helper.from_array(np.array(value, np.int64), name))
    nodes = [
        *_chain("m_", "x", "y"),
        helper.make_node("If", ["c"], ["z", "zz"], name="if", then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [out("x", TensorProto.FLOAT, [2, 8]), out("c", TensorProto.BOOL, [])],
        [out("y", TensorProto.FLOAT, [2, 5]), out("z", TensorProto.FLOAT, [2, 5])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_report_counts_are_count_nodes_before_and_after() -> None:
    model = _model()
    onnx.checker.check_model(model)
    result = fuser.fuse(model, cache=False)
    assert result.report.summary.get("layernorm_matmul") == 2  # main graph and branch
    # main 4; then: 3 + If + two inner Negs; else 2. Each LayerNorm+MatMul pair: one node.
    assert result.report.nodes_before == engine.count_nodes(model.graph) == 12
    assert result.report.nodes_after == engine.count_nodes(result.model.graph) == 10
