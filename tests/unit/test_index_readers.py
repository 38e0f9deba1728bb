"""`GraphIndex.consumers` keeps a value's readers as a tuple while few and a dict once many:
through builds, replaces (with the dead nodes they cut off) and rewires, each value's readers
are the live nodes that read it, each once, in the order they came to read it, and a value
that was read keeps its (then empty) entry."""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.graph import GraphIndex, TypeTable
from fuser.modelio import load_model


def _fan_out_model(seed: int, n_nodes: int) -> onnx.ModelProto:
    """Add/Mul/Relu over a few values, some read by many nodes (past the tuple's limit), some
    nodes reading one value twice."""
    rng = random.Random(seed)
    values = ["x", "w0", "w1"]
    inits = [numpy_helper.from_array(np.full((2,), i, np.float32), f"w{i}") for i in range(2)]
    nodes = []
    for i in range(n_nodes):
        hub = values[: 3 + i // 8]  # early values are read again and again
        if rng.random() < 0.2:
            node = helper.make_node("Relu", [rng.choice(hub)], [f"v{i}"])
        else:
            first = rng.choice(hub)
            second = first if rng.random() < 0.15 else rng.choice(values)
            node = helper.make_node(rng.choice(["Add", "Mul"]), [first, second], [f"v{i}"])
        nodes.append(node)
        values.append(f"v{i}")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info(values[-1], TensorProto.FLOAT, [2])
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _expected(index: GraphIndex, arrival: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each value's live readers in `arrival` order (the order they came to read it)."""
    live = {i: [n for n in index.nodes[i].input if n] for i in index.nodes}
    return {
        name: [r for r in ids if r in live and name in live[r]] for name, ids in arrival.items()
    }


def _check(index: GraphIndex, arrival: dict[str, list[int]]) -> None:
    for name, readers in _expected(index, arrival).items():
        found = index.consumers[name]  # a value once read keeps its entry
        assert list(found) == readers, name
        assert index.readers(name) == readers
        if len(readers) <= 1:
            assert type(found) is tuple or len(found) == len(readers)


def _arrive(arrival: dict[str, list[int]], name: str, node_id: int) -> None:
    ids = arrival.setdefault(name, [])
    if node_id not in ids:
        ids.append(node_id)


@pytest.mark.parametrize("seed", range(6))
def test_readers_stay_exact_through_replaces_and_rewires(seed: int) -> None:
    rng = random.Random(seed)
    loaded = load_model(_fan_out_model(seed, 80))
    index = GraphIndex.build(loaded.model.graph, loaded, {"": 17}, TypeTable())
    arrival: dict[str, list[int]] = {}
    for node_id in sorted(index.nodes):
        for name in index.nodes[node_id].input:
            _arrive(arrival, name, node_id)
    assert any(type(r) is dict for r in index.consumers.values())  # the many-readers form
    assert any(type(r) is tuple and len(r) > 1 for r in index.consumers.values())
    _check(index, arrival)
    for _ in range(25):
        live = sorted(index.nodes)
        node_id = rng.choice(live)
        node = index.nodes[node_id]
        if node.output[0] in index.graph_outputs:
            continue
        if rng.random() < 0.3:  # rewire a reader of this node's output to read 'x' instead
            readers = index.readers(node.output[0])
            if readers:
                reader = rng.choice(readers)
                index.rewire_input(reader, node.output[0], "x")
                _arrive(arrival, "x", reader)
        else:  # replace it by a node that reads only its first input: the second may die
            fused = helper.make_node("Keep", [node.input[0]], [node.output[0]], domain="test")
            new_id = index.replace([node_id], fused)
            _arrive(arrival, node.input[0], new_id)
        _check(index, arrival)
    assert len(index.nodes) < 80  # some rewrites cut off dead producers


def test_a_placed_node_that_would_make_a_cycle_leaves_the_graph_as_it_was() -> None:
    # a -> b -> c, with c reading a too: fusing a and c around b would feed b's output back
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="A"),
        helper.make_node("Neg", ["a"], ["b"], name="B"),
        helper.make_node("Add", ["a", "b"], ["c"], name="C"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [c]), opset_imports=[helper.make_opsetid("", 17)]
    )
    loaded = load_model(model)
    index = GraphIndex.build(loaded.model.graph, loaded, {"": 17}, TypeTable())
    before = loaded.model.graph.SerializeToString()
    fused = index.new_node()
    fused.CopyFrom(helper.make_node("AC", ["x", "b"], ["c"], domain="test"))
    with pytest.raises(AssertionError, match="cycle through 'b'"):
        index.replace([0, 2], fused, placed=True)
    assert loaded.model.graph.SerializeToString() == before


def _branch(value: str, out: str) -> onnx.GraphProto:
    """A branch that reads `value` from the enclosing graph."""
    y = helper.make_tensor_value_info(out, TensorProto.FLOAT, [2])
    return helper.make_graph([helper.make_node("Identity", [value], [out])], out, [], [y])


@pytest.mark.parametrize("shuffled", [False, True])
def test_what_a_subgraph_reads_leaves_its_readers_with_the_node(shuffled: bool) -> None:
    # `c` (If) reads `cond` as an input and `a` and `b` only through its branches; `d` reads `c`
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="A"),
        helper.make_node("Neg", ["x"], ["b"], name="B"),
        helper.make_node(
            "If", ["cond"], ["c"], name="C",
            then_branch=_branch("a", "t"), else_branch=_branch("b", "e"),
        ),
        helper.make_node("Abs", ["c"], ["d"], name="D"),
        helper.make_node("Add", ["d", "a"], ["y"], name="Y"),
    ]  # fmt: skip
    if shuffled:  # read before produced: the build sorts by what each node reads
        nodes = [nodes[3], nodes[2], nodes[4], nodes[0], nodes[1]]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
        helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
    ]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    loaded = load_model(model)
    index = GraphIndex.build(loaded.model.graph, loaded, {"": 17}, TypeTable())
    by_name = {index.nodes[i].name: i for i in index.nodes}
    assert [index.nodes[i].name for i in index.live_nodes()] == ["A", "B", "C", "D", "Y"]
    assert index.readers("a") == [by_name["C"], by_name["Y"]]
    assert index.readers("b") == [by_name["C"]]
    # D and its If fused into a node reading only `cond`: the If's branch reads go with it,
    # and `b`, read by nothing else, dies with its producer B
    fused = helper.make_node("CD", ["cond"], ["d"], domain="test")
    new_id = index.replace([by_name["C"], by_name["D"]], fused)
    assert index.readers("a") == [by_name["Y"]]
    assert index.readers("b") == []
    assert by_name["B"] not in index.nodes
    assert index.readers("cond") == [new_id]
    index.rewire_input(by_name["Y"], "a", "x")  # A is now read by nothing
    assert index.readers("x") == [by_name["A"], by_name["Y"]]
    assert index.readers("a") == []
