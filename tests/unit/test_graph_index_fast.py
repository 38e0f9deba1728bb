"""The index's fast paths give the answers of the slow ones they replace: the already-sorted
build against Kahn's sort, the runtime-dependence sweep against the per-value walk, `anchored`
against a filtered pass over `live_nodes`, and the one-dict `TypeTable` against its mapping
semantics (a proto without a tensor type is known but untyped)."""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.errors import ModelLoadError
from fuser.graph import GraphIndex, TypeTable, ValueType
from fuser.modelio import load_model


def _random_model(seed: int, n_nodes: int) -> onnx.ModelProto:
    """Binary and unary ops over the input 'x', initializers 'w0', 'w1' and an overridable
    'over' (also a graph input), with a RandomNormalLike now and then, wired at random."""
    rng = random.Random(seed)
    values = ["x", "over", "w0", "w1"]
    inits = [numpy_helper.from_array(np.full((2,), i, np.float32), n) for i, n in enumerate(values)]
    nodes = []
    for i in range(n_nodes):
        pick = rng.random()
        if pick < 0.1:
            node = helper.make_node("RandomNormalLike", [rng.choice(values)], [f"v{i}"])
        elif pick < 0.3:
            node = helper.make_node(rng.choice(["Relu", "Neg"]), [rng.choice(values)], [f"v{i}"])
        else:
            pair = [rng.choice(values), rng.choice(values[2:])]
            node = helper.make_node(rng.choice(["Add", "Mul"]), pair, [f"v{i}"])
        nodes.append(node)
        values.append(f"v{i}")
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x", "over")]
    outputs = [helper.make_tensor_value_info(values[-1], TensorProto.FLOAT, [2])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits[1:])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _index(model: onnx.ModelProto) -> GraphIndex:
    loaded = load_model(model)
    return GraphIndex.build(loaded.model.graph, loaded, {"": 17}, TypeTable())


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto] = ()) -> onnx.ModelProto:  # type: ignore[assignment]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, [2])
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("seed", range(4))
def test_a_shuffled_graph_is_sorted_and_a_sorted_one_kept(seed: int) -> None:
    model = _random_model(seed, 50)
    sorted_index = _index(model)
    assert sorted_index.order == list(range(50)) and not sorted_index.modified
    shuffled = onnx.ModelProto()
    shuffled.CopyFrom(model)
    nodes = list(shuffled.graph.node)
    random.Random(seed).shuffle(nodes)
    del shuffled.graph.node[:]
    shuffled.graph.node.extend(nodes)
    index = _index(shuffled)
    assert index.modified
    seen = {"x", "over", "w0", "w1"}
    for node_id in index.live_nodes():  # every value read is produced before
        node = index.node(node_id)
        assert set(node.input) <= seen, node.output[0]
        seen.update(node.output)
    assert sorted(index.order) == list(range(50))  # type: ignore[type-var]
    assert all(index.pos[i] == slot for slot, i in enumerate(index.live_nodes()))


def test_a_value_read_as_initializer_and_produced_later_is_ordered_by_its_producer() -> None:
    # 'w' is an initializer and also the output of the second node: the first node's read
    # depends on that producer, so the fast path must not take the given order as sorted.
    w = numpy_helper.from_array(np.ones((2,), np.float32), "w")
    nodes = [
        helper.make_node("Add", ["x", "w"], ["a"]),
        helper.make_node("Relu", ["x"], ["w"]),
    ]
    index = _index(_model(nodes, [w]))
    assert index.order == [1, 0]


def test_dangling_input_cycle_and_double_producer_are_named() -> None:
    dangling = [helper.make_node("Relu", ["nowhere"], ["a"])]
    with pytest.raises(ModelLoadError, match=r"'nowhere'.*dangling"):
        _index(_model(dangling))
    cycle = [helper.make_node("Add", ["x", "a"], ["a"])]
    with pytest.raises(ModelLoadError, match="reads its own output 'a'"):
        _index(_model(cycle))
    twice = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["a"])]
    with pytest.raises(ModelLoadError, match="'a' is produced by two nodes"):
        _index(_model(twice))


@pytest.mark.parametrize("seed", range(6))
def test_the_runtime_sweep_agrees_with_the_walk(seed: int) -> None:
    model = _random_model(seed, 80)
    names = [o for n in model.graph.node for o in n.output]
    swept, walked = _index(model), _index(model)
    walked._runtime_swept = True  # never sweeps: every answer from the walk
    rng = random.Random(seed)
    rng.shuffle(names)
    answers = [swept._runtime_dependent(name) for name in names]
    assert answers == [walked._runtime_dependent(name) for name in names]
    assert True in answers and False in answers  # both kinds present


def test_anchored_is_a_filtered_pass_in_topological_order() -> None:
    model = _random_model(3, 60)
    nodes = list(model.graph.node)
    nodes.reverse()  # out of order: the index sorts, and anchored follows its order
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    index = _index(model)
    kinds = [("", "Mul"), ("", "Relu")]
    want = [i for i in index.live_nodes() if ("", index.node(i).op_type) in kinds]
    assert index.anchored(kinds) == want and want
    gone = want[len(want) // 2]
    index.nodes.pop(gone)  # as a rewrite leaves it: out of nodes and pos
    index.order[index.pos.pop(gone)] = None
    assert index.anchored(kinds) == [i for i in want if i != gone]


def test_type_table_keeps_the_first_proto_and_knows_untyped_values() -> None:
    table = TypeTable()
    typed = helper.make_tensor_value_info("a", TensorProto.FLOAT16, ["n", 3, None])
    table.add_proto("a", typed)
    table.add_proto("a", helper.make_tensor_value_info("a", TensorProto.FLOAT, [1]))  # ignored
    untyped = onnx.ValueInfoProto(name="u")
    table.add_protos([untyped, numpy_helper.from_array(np.zeros((4, 5), np.int64), "w")])
    assert table.get("a") == ValueType(TensorProto.FLOAT16, ("n", 3, None))
    assert table["a"] is table.get("a")  # converted once, then kept
    assert "u" in table and table.get("u") is None and table.elem_type("u") is None
    with pytest.raises(KeyError):
        table["u"]
    assert table.elem_type("w") == TensorProto.INT64
    assert table.get("w") == ValueType(TensorProto.INT64, (4, 5))
    assert table.get("missing") is None and "missing" not in table
    table["a"] = ValueType(TensorProto.FLOAT, (2,))
    assert table.elem_type("a") == TensorProto.FLOAT
    del table["w"]
    assert sorted(table) == ["a", "u"] and len(table) == 2


def test_type_table_keeps_a_copy_of_each_value_info_type_not_the_proto() -> None:
    """The table keeps each value info's type as bytes, so the inferred value infos (one per
    value of the graph) can be freed: a change to the proto after adding it is not seen."""
    graph = onnx.GraphProto()
    graph.value_info.append(helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["b", 7]))
    graph.value_info.append(helper.make_tensor_value_info("y", TensorProto.INT8, []))
    table = TypeTable()
    table.add_protos(graph.value_info)
    table.add_proto("z", helper.make_tensor_value_info("z", TensorProto.DOUBLE, None))
    graph.value_info[0].type.tensor_type.elem_type = TensorProto.FLOAT
    graph.value_info[0].type.tensor_type.shape.dim[1].dim_value = 9
    del graph.value_info[:]
    assert table.elem_type("x") == TensorProto.FLOAT16
    assert table.get("x") == ValueType(TensorProto.FLOAT16, ("b", 7))
    assert table.get("y") == ValueType(TensorProto.INT8, ())
    assert table.get("z") == ValueType(TensorProto.DOUBLE, None)


def test_type_table_converts_each_distinct_type_once() -> None:
    """Values of equal types (most of a large model) share one conversion and one ValueType;
    values of other types, untyped values and initializers keep their own answers."""
    graph = onnx.GraphProto()
    for name, elem, shape in [
        ("a", TensorProto.FLOAT, ["n", 3]),
        ("b", TensorProto.FLOAT, ["n", 3]),
        ("c", TensorProto.FLOAT, ["n", 4]),
        ("d", TensorProto.FLOAT16, ["n", 3]),
    ]:
        graph.value_info.append(helper.make_tensor_value_info(name, elem, shape))
    graph.value_info.extend([onnx.ValueInfoProto(name="u"), onnx.ValueInfoProto(name="v")])
    table = TypeTable()
    table.add_protos(graph.value_info)
    tensors = [
        numpy_helper.from_array(np.zeros((2, 3), dtype), n)
        for n, dtype in [("w0", np.float32), ("w1", np.float32), ("w2", np.int64)]
    ]
    table.add_protos(tensors)
    assert table.get("a") == ValueType(TensorProto.FLOAT, ("n", 3))
    assert table.get("b") is table.get("a")
    assert table.get("c") == ValueType(TensorProto.FLOAT, ("n", 4))
    assert table.get("d") == ValueType(TensorProto.FLOAT16, ("n", 3))
    assert table.get("u") is None and table.get("v") is None and "v" in table
    assert table.get("w0") == ValueType(TensorProto.FLOAT, (2, 3))
    assert table.get("w1") is table.get("w0")
    assert table.get("w2") == ValueType(TensorProto.INT64, (2, 3))


def test_add_tensors_returns_them_by_name_and_keeps_known_types() -> None:
    """`add_tensors` gives the index its initializers and the table their types, except where
    a value info came first (as `add_protos` in that order would)."""
    table = TypeTable()
    table.add_proto("w", helper.make_tensor_value_info("w", TensorProto.FLOAT, ["n"]))
    tensors = [numpy_helper.from_array(np.zeros((5,), np.float32), n) for n in ("w", "k")]
    by_name = table.add_tensors(tensors)
    assert list(by_name) == ["w", "k"] and by_name["k"] is tensors[1]
    assert table.get("w") == ValueType(TensorProto.FLOAT, ("n",))
    assert table.get("k") == ValueType(TensorProto.FLOAT, (5,))


def test_the_runtime_sweep_judges_subgraph_and_custom_nodes_as_the_walk() -> None:
    """The sweep reads op types only for the kinds that may be dependent whatever their
    inputs: an If (a subgraph), a custom-domain node without one, a RandomNormalLike."""
    w = numpy_helper.from_array(np.ones((2,), np.float32), "w")
    branch = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["b_out"])],
        "branch",
        [],
        [helper.make_tensor_value_info("b_out", TensorProto.FLOAT, [2])],
    )
    cond = numpy_helper.from_array(np.array(True), "cond")
    nodes = [
        helper.make_node("Neg", ["w"], ["c0"]),  # constant
        helper.make_node("If", ["cond"], ["c1"], then_branch=branch, else_branch=branch),
        helper.make_node("Add", ["c0", "c1"], ["c2"]),  # dependent through the If
        helper.make_node("Scale", ["c0"], ["c3"], domain="custom"),  # custom, no subgraph
        helper.make_node("RandomNormalLike", ["c3"], ["c4"]),
        helper.make_node("Relu", ["c3"], ["c5"]),
    ]
    model = _model(nodes, [w, cond])
    swept, walked = _index(model), _index(model)
    walked._runtime_swept = True
    names = ["c0", "c1", "c2", "c3", "c4", "c5"]
    answers = [swept._runtime_dependent(n) for n in reversed(names)][::-1]
    assert answers == [walked._runtime_dependent(n) for n in names]
    assert answers == [False, True, True, False, True, False]
