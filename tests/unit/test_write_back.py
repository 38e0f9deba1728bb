"""`GraphIndex.replace` then `write_back` on random graphs: the graph ends up holding exactly
the live nodes in the index's topological order, the index points at the graph's own messages
(later edits land in the model), dead initializers are gone and the others keep their order."""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.graph import GraphIndex, TypeTable
from fuser.modelio import load_model
from fuser.testing import fusible_pair


def _random_model(rng: random.Random, n: int) -> onnx.ModelProto:
    values = ["x"]
    inits = []
    nodes = []
    for i in range(n):
        a = rng.choice(values)
        if rng.random() < 0.4:
            w = f"w{i}"
            inits.append(numpy_helper.from_array(np.full((2,), i, np.float32), w))
            nodes.append(helper.make_node("Add", [a, w], [f"v{i}"], name=f"n{i}"))
        else:
            nodes.append(helper.make_node("Relu", [a], [f"v{i}"], name=f"n{i}"))
        values.append(f"v{i}")
    rng.shuffle(nodes)  # the index sorts them
    outputs = [helper.make_tensor_value_info(values[-1], TensorProto.FLOAT, [2])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _fuse_random_pairs(index: GraphIndex, rng: random.Random, tries: int) -> int:
    """Replace random (node, its only reader) pairs by one `fuser` node; returns how many."""
    done = 0
    for _ in range(tries):
        if (pair := fusible_pair(index, rng)) is None:
            continue
        (first, second), inputs, outputs = pair
        fused = onnx.NodeProto(
            op_type="Pair", domain="fuser", name=f"f{done}", input=inputs,
            output=outputs,
        )  # fmt: skip
        index.replace([first, second], fused)
        done += 1
    return done


@pytest.mark.parametrize("seed", range(8))
def test_write_back_holds_the_live_nodes_in_order(seed: int) -> None:
    rng = random.Random(seed)
    loaded = load_model(_random_model(rng, 80))
    graph = loaded.model.graph
    initializers_before = [t.name for t in graph.initializer]
    index = GraphIndex.build(graph, loaded, {"": 17}, TypeTable())
    assert _fuse_random_pairs(index, rng, 40) > 0
    expected = [index.node(i).SerializeToString() for i in index.live_nodes()]
    index.write_back()
    assert [n.SerializeToString() for n in graph.node] == expected
    for position, node_id in enumerate(index.live_nodes()):
        assert index.node(node_id) is graph.node[position]  # the graph's own message
    defined = {"x"} | {t.name for t in graph.initializer}
    for node in graph.node:  # topological
        assert all(i in defined for i in node.input), node.name
        defined.update(node.output)
    kept = [t.name for t in graph.initializer]
    assert kept == [n for n in initializers_before if n in index.initializers]
    # an edit after write_back lands in the model
    some = next(index.live_nodes())
    index.node(some).doc_string = "edited"
    assert graph.node[0].doc_string == "edited"
    index.write_back()  # again: nothing changes
    assert [n.SerializeToString() for n in graph.node][1:] == expected[1:]


def _chain_model(n: int) -> onnx.ModelProto:
    """x -> Add(w0) -> Add(w1) -> ... : node i reads initializer w{i}."""
    inits = [numpy_helper.from_array(np.full((2,), i, np.float32), f"w{i}") for i in range(n)]
    nodes = [
        helper.make_node("Add", ["x" if i == 0 else f"v{i - 1}", f"w{i}"], [f"v{i}"], name=f"n{i}")
        for i in range(n)
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info(f"v{n - 1}", TensorProto.FLOAT, [2])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("every", [1, 2, 3, 7])
def test_write_back_cuts_the_dead_initializers_wherever_they_lie(every: int) -> None:
    """Pairs fused every `every`-th pair leave their two weights dead and read a new one: few
    runs of dead tensors (every=1: one) or more than write_back cuts one by one (every=2, 3:
    it sorts); either way the others stay, in their order, the new ones after them."""
    n = 200
    loaded = load_model(_chain_model(n))
    graph = loaded.model.graph
    index = GraphIndex.build(graph, loaded, {"": 17}, TypeTable())
    made = []
    for pair in range(0, n // 2, every):
        first, second = 2 * pair, 2 * pair + 1
        new = numpy_helper.from_array(np.full((2,), -pair, np.float32), f"new{pair}")
        made.append(new.name)
        fused = onnx.NodeProto(
            op_type="Pair", domain="fuser", name=f"f{pair}",
            input=["x" if first == 0 else f"v{first - 1}", new.name], output=[f"v{second}"],
        )  # fmt: skip
        index.replace([first, second], fused, [new])
    index.write_back()
    fused_pairs = set(range(0, n // 2, every))
    expected = [f"w{i}" for i in range(n) if i // 2 not in fused_pairs] + made
    assert [t.name for t in graph.initializer] == expected
    assert list(index.initializers) == expected  # the index holds them in the graph's order
