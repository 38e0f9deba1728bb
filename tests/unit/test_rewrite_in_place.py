"""A rewrite puts its fused node and new tensors into the graph proto as it is made, and the
index keeps the graph's copies, not the caller's (which held, until write_back, a protobuf
arena per message: most of a large CNN's growth during its pass). write_back then only
orders and cuts: the live nodes in topological order, the input's kept initializers in their
order followed by the new ones still read, in the order they were made."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuser.graph import GraphIndex, TypeTable
from fuser.modelio import load_model


def _chain(n: int) -> onnx.ModelProto:
    """x -> Add(w0) -> Add(w1) -> ... (n Adds), each with its own 3-element weight."""
    nodes, inits, last = [], [], "x"
    for i in range(n):
        inits.append(numpy_helper.from_array(np.full((3,), i, np.float32), f"w{i}"))
        nodes.append(helper.make_node("Add", [last, f"w{i}"], [f"v{i}"], name=f"add{i}"))
        last = f"v{i}"
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info(last, TensorProto.FLOAT, [3])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _fuse(index: GraphIndex, members: list[int], name: str) -> tuple[int, onnx.NodeProto]:
    """Fuse `members` (a chain) into one node reading a new tensor `name`.w."""
    first, last = index.node(members[0]), index.node(members[-1])
    weight = numpy_helper.from_array(np.arange(3, dtype=np.float32), index.unique_value_name(name))
    fused = onnx.NodeProto(
        op_type="Sum", domain="fuser", name=name, input=[first.input[0], weight.name],
        output=list(last.output),
    )  # fmt: skip
    return index.replace(members, fused, [weight]), fused


def _in(message: onnx.NodeProto | onnx.TensorProto, field: object) -> bool:
    return any(element is message for element in field)  # type: ignore[attr-defined]


def test_the_fused_node_and_tensor_are_the_graphs_own_as_soon_as_made():
    loaded = load_model(_chain(6))
    graph = loaded.model.graph
    index = GraphIndex.build(graph, loaded, {"": 17}, TypeTable())
    fused_id, given = _fuse(index, [0, 1, 2], "f")
    held = index.node(fused_id)
    assert held is not given and _in(held, graph.node)  # a message of the graph, before write_back
    assert held.SerializeToString() == given.SerializeToString()
    given.doc_string = "edited by the caller afterwards"
    assert held.doc_string == ""  # the caller's message is not the graph's
    tensor = index.initializers[given.input[1]]
    assert _in(tensor, graph.initializer)
    assert index.types[tensor.name].shape == (3,)


def test_write_back_keeps_the_new_tensors_still_read_in_the_order_made():
    loaded = load_model(_chain(8))
    graph = loaded.model.graph
    index = GraphIndex.build(graph, loaded, {"": 17}, TypeTable())
    a, _ = _fuse(index, [0, 1], "a")  # reads a new tensor: dropped when `c` absorbs `a`
    b, _ = _fuse(index, [4, 5], "b")
    c, _ = _fuse(index, [a, 2, 3], "c")
    expected_nodes = [index.node(i).SerializeToString() for i in index.live_nodes()]
    index.write_back()
    assert [n.SerializeToString() for n in graph.node] == expected_nodes
    assert [n.name for n in graph.node] == ["c", "b", "add6", "add7"]
    assert [t.name for t in graph.initializer] == ["w6", "w7", "b", "c"]
    assert index.node(c) is graph.node[0] and index.node(b) is graph.node[1]
    defined = {"x"} | {t.name for t in graph.initializer}
    for node in graph.node:  # every read defined, in order
        assert all(name in defined for name in node.input), node.name
        defined.update(node.output)
