"""The cost model decides each distinct match once per run (`CostModelDecider.decide`'s memo,
keyed by `_signature`): a layer repeated with the same shapes and attributes is priced once,
a layer that differs in a weight shape, an attribute or an input shape is priced again."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuser.api import fuse
from fuser.costmodel import CostModelDecider
from fuser.decide import Decision
from fuser.graph import GraphIndex
from fuser.pattern import Match


class Counting(CostModelDecider):
    def _decide(self, graph: GraphIndex, match: Match) -> Decision:
        self._memo.setdefault("decided", []).append(match.nodes)
        return super()._decide(graph, match)


def conv_chain(layers: list[tuple[int, int, int]], batch: str | int = "N") -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu per (cin, cout, pad) layer, one after another."""
    rng = np.random.default_rng(7)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    x = "x"
    size = 9
    for i, (cin, cout, pad) in enumerate(layers):
        w = rng.standard_normal((cout, cin, 3, 3)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        for part in ("scale", "bias", "mean"):
            inits.append(numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32),
                                                 f"{part}{i}"))  # fmt: skip
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 2, cout).astype(np.float32),
                                             f"var{i}"))  # fmt: skip
        nodes += [
            helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[pad] * 4, name=f"conv{i}"),
            helper.make_node(
                "BatchNormalization",
                [f"c{i}", f"scale{i}", f"bias{i}", f"mean{i}", f"var{i}"],
                [f"b{i}"],
                name=f"bn{i}",
            ),
            helper.make_node("Relu", [f"b{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        x = f"r{i}"
        size = size + 2 * pad - 2
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, layers[0][0], 9, 9])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [batch, layers[-1][1], size, size])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def decided(model: onnx.ModelProto) -> tuple[list[Any], int]:
    decider = Counting.for_target("ascend910b", cache=False)
    result = fuse(model, decider=decider)
    return decider._memo.get("decided", []), len(result.report.fusions)


def test_a_repeated_layer_is_decided_once() -> None:
    # Layers 0 and 1 see the same input shape, weight shape and attributes; 2 has 6 outputs.
    calls, fusions = decided(conv_chain([(4, 4, 1), (4, 4, 1), (4, 6, 1)]))
    assert fusions == 3
    assert len(calls) == 2


def test_an_attribute_or_an_input_shape_makes_another_decision() -> None:
    # Same weights' shapes; layer 1 pads 0 (an attribute), so layer 2 sees a 7x7 input.
    calls, fusions = decided(conv_chain([(4, 4, 1), (4, 4, 0), (4, 4, 1)]))
    assert fusions == 3
    assert len(calls) == 3
    # A static batch of 1 still repeats: one decision for the two equal layers.
    calls, _ = decided(conv_chain([(5, 5, 1), (5, 5, 1)], batch=1))
    assert len(calls) == 1
