"""`GraphIndex.constant` on random graphs: the memo of runtime-dependent values gives the same
answers as the cone walk alone, and asking about a value that depends on a graph input never
walks its cone (which made a pass over a deep graph quadratic up to the cone limit)."""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.graph import GraphIndex, TypeTable
from fuser.modelio import load_model


def _random_model(seed: int, n_nodes: int) -> onnx.ModelProto:
    """Adds and Muls over a graph input, initializers (one of them overridable: also a graph
    input), a RandomNormalLike and Constant nodes, wired at random."""
    rng = random.Random(seed)
    values = ["x", "w0", "w1", "over"]
    inits = [numpy_helper.from_array(np.full((2,), 1.5 + i, np.float32), f"w{i}") for i in range(2)]
    inits.append(numpy_helper.from_array(np.ones((2,), np.float32), "over"))
    nodes = []
    for i in range(n_nodes):
        kind = rng.random()
        out = f"v{i}"
        if kind < 0.1:
            value = numpy_helper.from_array(np.full((2,), float(i), np.float32))
            nodes.append(helper.make_node("Constant", [], [out], value=value))
        elif kind < 0.15:
            nodes.append(helper.make_node("RandomNormalLike", [rng.choice(values)], [out]))
        else:
            op = rng.choice(["Add", "Mul"])
            nodes.append(helper.make_node(op, [rng.choice(values), rng.choice(values)], [out]))
        values.append(out)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x", "over")]
    outputs = [helper.make_tensor_value_info(values[-1], TensorProto.FLOAT, [2])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _index(model: onnx.ModelProto) -> GraphIndex:
    loaded = load_model(model)
    return GraphIndex.build(loaded.model.graph, loaded, {"": 17}, TypeTable())


def _by_cone_walk(index: GraphIndex, name: str) -> np.ndarray | None:
    """The answer of the cone walk alone (what `constant` computed before the memo)."""
    if name in index.initializers:
        return None if name in index.graph_inputs else index.constant(name)
    cone = index._constant_cone(name)
    return None if cone is None else index._evaluate(cone, name)


@pytest.mark.parametrize("seed", range(6))
def test_constant_agrees_with_the_cone_walk_on_random_graphs(seed: int) -> None:
    model = _random_model(seed, 60)
    names = [o for n in model.graph.node for o in n.output]
    memo, walk = _index(model), _index(model)
    rng = random.Random(seed)
    rng.shuffle(names)  # ask in any order: the memo must not depend on it
    constants = 0
    for name in names:
        got, want = memo.constant(name), _by_cone_walk(walk, name)
        assert (got is None) == (want is None), name
        if got is not None:
            constants += 1
            np.testing.assert_array_equal(got, want)
    assert 0 < constants < len(names)  # the graphs hold both kinds


def test_a_deep_runtime_value_is_refused_without_walking_its_cone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 300
    reads = ["x", *(f"r{i}" for i in range(n - 1))]
    nodes = [helper.make_node("Relu", [reads[i]], [f"r{i}"]) for i in range(n)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info(f"r{n - 1}", TensorProto.FLOAT, [2])
    model = helper.make_model(
        helper.make_graph(nodes, "chain", [x], [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    index = _index(model)
    walked: list[str] = []
    original = GraphIndex._constant_cone

    def counting(self: GraphIndex, name: str) -> list[int] | None:
        walked.append(name)
        return original(self, name)

    monkeypatch.setattr(GraphIndex, "_constant_cone", counting)
    assert all(index.constant(f"r{i}") is None for i in reversed(range(n)))
    assert walked == []
