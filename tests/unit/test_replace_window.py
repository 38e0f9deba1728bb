"""`GraphIndex.replace` skips the window search when it can prove the result (every value the
fused node reads comes from before its first member: no cycle; members filling their window:
nothing to move). Whatever path it takes, the order it leaves must be the general rule's: the
window's other nodes that do not read the members first, the fused node, then those that do,
and a rewrite that would close a cycle is refused. Checked on random graphs, rewrite after
rewrite on one index, with chains (contiguous and not) and pairs far apart."""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.graph import GraphIndex, TypeTable
from fuser.modelio import load_model


def _random_model(rng: random.Random, n_nodes: int) -> onnx.ModelProto:
    values = ["x", "w"]
    nodes = []
    for i in range(n_nodes):
        if rng.random() < 0.4:
            node = helper.make_node("Neg", [rng.choice(values[-6:])], [f"v{i}"], name=f"n{i}")
        else:
            pair = [rng.choice(values[-6:]), rng.choice(values)]
            node = helper.make_node("Add", pair, [f"v{i}"], name=f"n{i}")
        nodes.append(node)
        values.append(f"v{i}")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info(values[-1], TensorProto.FLOAT, [2])
    w = numpy_helper.from_array(np.ones(2, np.float32), "w")
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _expected_window(index: GraphIndex, members: set[int], fused_inputs: set[str]):
    """(lo, the window's nodes as the general rule orders them, with None for the fused node),
    or None when the rewrite would close a cycle."""
    lo = min(index.pos[m] for m in members)
    hi = max(index.pos[m] for m in members)
    after, back_edge = index.descendants_in_window(members, fused_inputs)
    if back_edge is not None:
        return None
    window = [i for i in index.order[lo : hi + 1] if i is not None and i not in members]
    before = [i for i in window if i not in set(after)]
    return lo, [*before, None, *after]


@pytest.mark.parametrize("seed", range(12))
def test_every_rewrite_leaves_the_general_rules_order(seed: int) -> None:
    rng = random.Random(seed)
    loaded = load_model(_random_model(rng, 40))
    index = GraphIndex.build(loaded.model.graph, loaded, {"": 17}, TypeTable())
    paths = {"chain": 0, "gap": 0, "cycle": 0}
    for step in range(25):
        live = [i for i in index.live_nodes() if index.node(i).domain == ""]
        first = rng.choice(live)
        readers = [r for r in index.readers(index.node(first).output[0]) if r in live]
        if not readers:
            continue
        second = rng.choice(readers)
        members = {first, second}
        produced = {o for m in members for o in index.node(m).output}
        inputs = list(dict.fromkeys(i for m in sorted(members) for i in index.node(m).input))
        inputs = [i for i in inputs if i not in produced]
        outputs = [o for m in sorted(members) for o in index.node(m).output]
        expected = _expected_window(index, members, set(inputs))
        fused = helper.make_node("Fused", inputs, outputs, name=f"f{step}", domain="test")
        if expected is None:
            paths["cycle"] += 1
            with pytest.raises(AssertionError, match="cycle"):
                index.replace(members, fused)
            continue
        gap = abs(index.pos[first] - index.pos[second]) > 1
        paths["gap" if gap else "chain"] += 1
        lo, window = expected
        fused_id = index.replace(members, fused)
        got = list(index.order[lo : lo + len(window)])
        # (a node the rewrite left without readers, the fused one included, is dropped)
        placed = [fused_id if i is None else i for i in window]
        want = [i if i in index.pos else None for i in placed]
        assert got == want
        seen = {"x", "w"}  # and the whole order stays topological
        for node_id in index.live_nodes():
            assert all(i in seen for i in index.node(node_id).input if i)
            seen.update(index.node(node_id).output)
    assert paths["chain"] and paths["gap"]  # both paths taken by this seed's rewrites


def test_a_cycle_through_an_outside_node_is_refused_not_contracted() -> None:
    """a -> Neg -> b, and the pair (a's producer, b's reader): fused, the node would read
    what it produces through Neg, so replace refuses whatever its fast path would say."""
    nodes = [
        helper.make_node("Neg", ["x"], ["a"], name="p"),
        helper.make_node("Neg", ["a"], ["b"], name="outside"),
        helper.make_node("Add", ["a", "b"], ["y"], name="q"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph(nodes, "g", [x], [y])
    loaded = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    index = GraphIndex.build(loaded.model.graph, loaded, {"": 17}, TypeTable())
    fused = helper.make_node("Fused", ["x", "b"], ["a", "y"], name="f", domain="test")
    with pytest.raises(AssertionError, match="cycle through 'b'"):
        index.replace({0, 2}, fused)
