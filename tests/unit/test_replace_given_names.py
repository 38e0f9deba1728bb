"""`GraphIndex.replace` given the fused node's inputs and outputs (as `engine._apply` passes
them) leaves the index and, after `write_back`, the graph exactly as reading them back out of
the node does; and the names a rewrite records are the index's own strs."""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.graph import GraphIndex, TypeTable
from fuser.modelio import load_model
from fuser.testing import fusible_pair


def _model(rng: random.Random, n: int) -> onnx.ModelProto:
    """A random DAG of Add/Mul/Relu over `x`, weights shared by a few nodes, some read twice."""
    values, inits, nodes = ["x"], [], []
    for i in range(n):
        a = rng.choice(values[-6:])
        kind = rng.random()
        if kind < 0.35:
            w = f"w{i}" if rng.random() < 0.7 or not inits else rng.choice(inits).name
            if w == f"w{i}":
                inits.append(numpy_helper.from_array(np.full((2,), i, np.float32), w))
            nodes.append(helper.make_node("Add", [a, w], [f"v{i}"], name=f"n{i}"))
        elif kind < 0.5:
            nodes.append(helper.make_node("Mul", [a, a], [f"v{i}"], name=f"n{i}"))  # twice
        else:
            nodes.append(helper.make_node("Relu", [a], [f"v{i}"], name=f"n{i}"))
        values.append(f"v{i}")
    outputs = [helper.make_tensor_value_info(values[-1], TensorProto.FLOAT, [2])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _fuse(index: GraphIndex, rng: random.Random, tries: int, *, given: bool) -> int:
    """Replace random (node, its only reader) pairs by one `fuser` node, the same draws for
    both kinds of call; the pair's other inputs in order, an absent one at the end trimmed."""
    done = 0
    for _ in range(tries):
        if (pair := fusible_pair(index, rng)) is None:
            continue
        members, inputs, outputs = pair
        fused = index.new_node()
        fused.op_type, fused.domain, fused.name = "Pair", "fuser", f"f{done}"
        fused.input.extend(inputs)
        fused.output.extend(outputs)
        names = (inputs, outputs) if given else (None, None)
        index.replace(members, fused, placed=True, inputs=names[0], outputs=names[1])
        done += 1
    return done


def _tables(index: GraphIndex) -> tuple[object, ...]:
    consumers = {k: tuple(v) for k, v in index.consumers.items()}
    # what each live node reads (kept for a node with subgraphs, else its proto's inputs)
    reads = {i: tuple(index._reads_of(i, node)) for i, node in index.nodes.items()}
    return (
        consumers, dict(index.producer), list(index.order), dict(index.pos), reads,
        list(index.initializers), sorted(index.nodes), index.by_kind, dict(index.node_names),
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(10))
def test_given_names_index_and_write_back_as_read_back(seed: int) -> None:
    results = []
    for given in (False, True):
        loaded = load_model(_model(random.Random(seed), 70))
        index = GraphIndex.build(loaded.model.graph, loaded, {"": 17}, TypeTable())
        fused = _fuse(index, random.Random(seed + 100), 60, given=given)
        tables = _tables(index)
        index.write_back()
        results.append((fused, tables, loaded.model.SerializeToString()))
    assert results[0][0] > 5  # the draws fused something
    assert results[0] == results[1]
    model = onnx.load_from_string(results[1][2])
    read = {i for n in model.graph.node for i in n.input}
    assert all(t.name in read for t in model.graph.initializer)  # the dead ones cut off
    defined = {"x"} | {t.name for t in model.graph.initializer}
    for node in model.graph.node:  # every input defined before it is read
        assert all(i in defined for i in node.input), node.name
        defined.update(node.output)


def test_the_names_a_rewrite_records_are_the_index_strs() -> None:
    loaded = load_model(_model(random.Random(3), 30))
    index = GraphIndex.build(loaded.model.graph, loaded, {"": 17}, TypeTable())
    ids = list(index.live_nodes())[:5]
    described = index.describe_all(ids)
    assert described == tuple(index.describe(i) for i in ids)
    assert all(index.node_names[name] is name for name in described)
    nameless = index.node(ids[0])
    nameless.name = ""
    assert index.describe_all(ids[:1]) == (f"{nameless.op_type}#{ids[0]}",)
