"""`_conv_act_walk.find` on the reader arrangements its shortcuts decide (one reader that is
no activation, x * Sigmoid(x) as two readers) and on their near neighbours, which the general
walk decides: each answer asserted, with the readers listed in every order the graph allows
(a value's readers come in its nodes' order, which the shortcuts must not depend on)."""

from __future__ import annotations

import itertools
import random

import onnx
import pytest
from fuser.patterns import _conv_act_walk as walk
from onnx import TensorProto, helper

from fuser import engine
from fuser.graph import GraphIndex
from fuser.modelio import load_model

# The reader forms of value "v" (a Conv output), each with its nodes and extra graph outputs.
_Form = tuple[list[onnx.NodeProto], list[str]]


def _index(readers: list[onnx.NodeProto], outputs: list[str]) -> GraphIndex:
    conv = helper.make_node("Conv", ["x", "w"], ["v"], name="conv")
    graph = helper.make_graph(
        [conv, *readers],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        initializer=[helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 1, 1], [0.5] * 12)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    loaded = load_model(model)
    types = engine.infer_types(loaded.model)[""]
    return GraphIndex.build(loaded.model.graph, loaded, engine.opset_map(loaded.model), types)


def _ids(index: GraphIndex, *names: str) -> tuple[int, ...]:
    by_name = {node.name: i for i, node in index.nodes.items()}
    return tuple(by_name[n] for n in names)


def _orders(nodes: list[onnx.NodeProto]) -> list[list[onnx.NodeProto]]:
    """The topological orders of `nodes` (all read v or each other): every permutation in
    which each node comes after the producers of its inputs, shuffled with a fixed seed."""
    made = {o for n in nodes for o in n.output}
    valid = []
    for perm in itertools.permutations(nodes):
        seen = {"v"}
        ok = True
        for node in perm:
            if any(i in made and i not in seen for i in node.input):
                ok = False
                break
            seen.update(node.output)
        if ok:
            valid.append(list(perm))
    random.Random(7).shuffle(valid)
    return valid


def _sig(name: str = "sig", out: str = "s") -> onnx.NodeProto:
    return helper.make_node("Sigmoid", ["v"], [out], name=name)


@pytest.mark.parametrize("operands", [["v", "s"], ["s", "v"]], ids=["x*s", "s*x"])
def test_silu_is_found_whatever_the_readers_order(operands: list[str]) -> None:
    form = [_sig(), helper.make_node("Mul", operands, ["y"], name="mul")]
    for order in _orders(form):
        index = _index(order, ["y"])
        found = walk.find(index, "v")
        assert isinstance(found, walk.Found)
        assert found.activation.name == "Silu"
        assert found.nodes == _ids(index, "sig", "mul")
        assert found.out == "y"


@pytest.mark.parametrize(
    ("form", "outputs", "reason"),
    [
        # v itself is read outside the form (as a graph output)
        ([_sig(), helper.make_node("Mul", ["v", "s"], ["y"], name="mul")], ["y", "v"],
         "Silu 'sig' left unfused: its input 'v' is a graph output"),
        # the Sigmoid's output has another reader besides the Mul
        ([_sig(), helper.make_node("Mul", ["v", "s"], ["y"], name="mul"),
          helper.make_node("Neg", ["s"], ["z"], name="neg")], ["y", "z"],
         "Sigmoid 'sig' left unfused: its input 'v' is also read by 'mul'"),
        # the Sigmoid's output is a graph output
        ([_sig(), helper.make_node("Mul", ["v", "s"], ["y"], name="mul")], ["y", "s"],
         "Sigmoid 'sig' left unfused: its input 'v' is also read by 'mul'"),
    ],
    ids=["v-is-output", "sigmoid-read-twice", "sigmoid-is-output"],
)  # fmt: skip
def test_silu_near_misses_are_refused_with_the_reason(
    form: list[onnx.NodeProto], outputs: list[str], reason: str
) -> None:
    for order in _orders(form):
        index = _index(order, outputs)
        found = walk.find(index, "v")
        assert isinstance(found, walk.Refused)
        assert found.reason == reason


@pytest.mark.parametrize(
    "form",
    [
        # a Mul of v by something else than its Sigmoid (a gate), beside a Sigmoid of v
        [_sig(), helper.make_node("Mul", ["v", "g"], ["y"], name="mul"),
         helper.make_node("Relu", ["x"], ["g0"], name="r"),
         helper.make_node("Conv", ["g0", "w"], ["g"], name="conv_g")],
        # v times v beside a Sigmoid of v: no SiLU
        [_sig(), helper.make_node("Mul", ["v", "v"], ["y"], name="mul")],
        # a Sigmoid of v and an Add reading the Sigmoid and v
        [_sig(), helper.make_node("Add", ["v", "s"], ["y"], name="add")],
    ],
    ids=["mul-by-gate", "v-times-v", "add-not-mul"],
)  # fmt: skip
def test_two_readers_that_are_not_silu_are_not_found_as_silu(form: list[onnx.NodeProto]) -> None:
    for order in _orders(form):
        index = _index(order, ["y"])
        found = walk.find(index, "v")
        assert not (isinstance(found, walk.Found) and found.activation.name == "Silu")
        assert isinstance(found, walk.Refused)  # a Sigmoid of v is left unfused, and says why


@pytest.mark.parametrize(
    ("reader", "expected"),
    [
        (helper.make_node("Add", ["v", "v"], ["y"], name="add"), None),
        (helper.make_node("Concat", ["v", "v"], ["y"], name="cat", axis=1), None),
        (helper.make_node("Relu", ["v"], ["y"], name="act", domain="custom"), None),
        (helper.make_node("Relu", ["v"], ["y"], name="act"), "Relu"),
        (helper.make_node("LeakyRelu", ["v"], ["y"], name="act", alpha=0.25), "LeakyRelu"),
    ],
    ids=["add", "concat", "custom-domain-relu", "relu", "leaky"],
)
def test_a_lone_reader_is_an_activation_only_if_it_is_one(
    reader: onnx.NodeProto, expected: str | None
) -> None:
    index = _index([reader], ["y"])
    found = walk.find(index, "v")
    if expected is None:
        assert found is None
    else:
        assert isinstance(found, walk.Found)
        assert found.activation.name == expected
        assert found.nodes == _ids(index, "act")
