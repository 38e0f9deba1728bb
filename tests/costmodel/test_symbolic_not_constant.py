"""Pricing a node at symbolic shapes looks up no value whose inferred shape has a symbolic dim:
it is computed at run time, and is small only because its dims are priced small (the first
such question made `graph.constant` sweep the whole graph). Small static constants, such as
TopK's k, are still read by value."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.check_infer import infer_types
from fuser.costmodel import CostModelDecider
from fuser.graph import GraphIndex
from fuser.modelio import load_model


def model() -> onnx.ModelProto:
    """x [batch, 5] -> Mul by a [5] constant -> Softmax -> TopK (k a constant of 3)."""
    rng = np.random.default_rng(11)
    inits = [
        numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([3], np.int64), "k"),
    ]
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["m"], name="mul"),
        helper.make_node("Softmax", ["m"], ["p"], name="softmax", axis=-1),
        helper.make_node("TopK", ["p", "k"], ["v", "i"], name="topk"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5])
    outs = [
        helper.make_tensor_value_info("v", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("i", TensorProto.INT64, None),
    ]
    graph = helper.make_graph(nodes, "g", [x], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("size", [1, 4])
def test_symbolic_values_are_not_looked_up_static_constants_are(
    monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    loaded = load_model(model())
    graph = GraphIndex.build(loaded.model.graph, loaded, {"": 17}, infer_types(loaded.model)[""])
    asked: list[str] = []
    original = GraphIndex.constant

    def constant(self: GraphIndex, name: str) -> Any:
        asked.append(name)
        return original(self, name)

    monkeypatch.setattr(GraphIndex, "constant", constant)
    decider = CostModelDecider.for_target("ascend910b", cache=False, symbolic_size=size)
    by_name = {n.name: n for n in loaded.model.graph.node}
    prices = [decider.price_node(graph, by_name[n])[0] for n in ("mul", "softmax", "topk")]
    assert all(p > 0 for p in prices)
    assert "k" in asked and "w" in asked  # static and small: read by value
    assert not {"x", "m", "p"} & set(asked), asked  # [batch, 5]: computed at run time
