"""Small models for the report tests: one fusion, one near-miss, awkward node names."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: A node name that would end the page's data script if it were embedded unescaped.
TRICKY = "</script><b>conv & 'bn'"


def two_chains(*, named: bool = True) -> onnx.ModelProto:
    """Conv+BN+Relu twice: the first fuses; the second Conv output is also a graph output, so
    conv_bn_relu refuses it (a near-miss naming that value). `named=False` leaves the first
    chain's nodes unnamed (the report must still find them in the original graph)."""
    rng = np.random.default_rng(7)
    c = 3  # odd channel count
    inits = []
    for k in (1, 2):
        inits += [
            numpy_helper.from_array(rng.standard_normal((c, c, 3, 3)).astype(np.float32), f"W{k}"),
            numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), f"s{k}"),
            numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), f"b{k}"),
            numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), f"m{k}"),
            numpy_helper.from_array(rng.uniform(0.1, 1, c).astype(np.float32), f"v{k}"),
        ]

    def name(n: str) -> str:
        return n if named else ""

    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c1"], name=name(TRICKY), pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization", ["c1", "s1", "b1", "m1", "v1"], ["n1"], name=name("bn1")
        ),
        helper.make_node("Relu", ["n1"], ["r1"], name=name("relu1")),
        helper.make_node("Conv", ["r1", "W2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c2", "s2", "b2", "m2", "v2"], ["n2"], name="bn2"),
        helper.make_node("Relu", ["n2"], ["y"], name="relu2"),
    ]
    graph = helper.make_graph(
        nodes,
        "two_chains",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, 7, 5])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c, 7, 5]),
            helper.make_tensor_value_info("c2", TensorProto.FLOAT, ["N", c, 7, 5]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def chain_in_branch() -> onnx.ModelProto:
    """Conv+BN+Relu inside an If's then-branch (reading the outer graph's weights)."""
    model = two_chains()
    graph = model.graph
    c = 3
    branch_nodes = [onnx.NodeProto(), onnx.NodeProto(), onnx.NodeProto()]
    for proto, src in zip(branch_nodes, graph.node[3:6], strict=True):
        proto.CopyFrom(src)
    then_branch = helper.make_graph(
        branch_nodes, "then", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["r1"], ["y_else"])],
        "else",
        [],
        [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, None)],
    )
    del graph.node[3:]
    graph.node.append(
        helper.make_node("If", ["flag"], ["out"], name="if", then_branch=then_branch,
                         else_branch=else_branch)
    )  # fmt: skip
    graph.input.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", c, 7, 5]))
    return model
