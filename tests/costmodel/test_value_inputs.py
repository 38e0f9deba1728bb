"""The unfused side times a node once per shapes, attributes and the values of the inputs its
kernel reads (`Kernel.value_inputs`): a LayerNorm repeated with other weights is timed once,
a TopK with another constant k again (its kernel reads k)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from fuser.kernels.api import Kernel
from fuser.kernels.registry import get_kernel
from onnx import TensorProto, helper, numpy_helper

from fuser.check_infer import infer_types
from fuser.costmodel import CostModelDecider
from fuser.graph import GraphIndex
from fuser.modelio import load_model


def model() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.standard_normal(13).astype(np.float32), name)
        for name in ("s1", "b1", "s2", "b2")
    ]
    inits += [numpy_helper.from_array(np.array([k], np.int64), f"k{k}") for k in (2, 5)]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "s1", "b1"], ["y1"], name="ln1", axis=-1),
        helper.make_node("LayerNormalization", ["x", "s2", "b2"], ["y2"], name="ln2", axis=-1),
        helper.make_node("TopK", ["x", "k2"], ["v2", "i2"], name="top2"),
        helper.make_node("TopK", ["x", "k5"], ["v5", "i5"], name="top5"),
    ]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y1", "y2")]
    outs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("v2", "v5")]
    outs += [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in ("i2", "i5")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [7, 13])], outs, inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def counted(monkeypatch: pytest.MonkeyPatch, kernel: Kernel) -> list[Any]:
    calls: list[Any] = []
    original = type(kernel).run

    def run(self: Kernel, machine: Any, inputs: Any, attrs: Any, **kw: Any) -> Any:
        calls.append([x.tolist() if isinstance(x, np.ndarray) else None for x in inputs[1:]])
        return original(self, machine, inputs, attrs, **kw)

    monkeypatch.setattr(type(kernel), "run", run)
    return calls


def test_a_layernorm_with_other_weights_is_timed_once_a_topk_with_another_k_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loaded = load_model(model())
    graph = GraphIndex.build(loaded.model.graph, loaded, {"": 17}, infer_types(loaded.model)[""])
    decider = CostModelDecider.for_target("ascend910b", cache=False)
    ln, topk = get_kernel("", "LayerNormalization"), get_kernel("", "TopK")
    assert ln is not None and topk is not None
    assert ln.value_inputs == frozenset() and topk.value_inputs is None
    ln_runs, topk_runs = counted(monkeypatch, ln), counted(monkeypatch, topk)
    by_name = {n.name: n for n in loaded.model.graph.node}
    first = decider.price_node(graph, by_name["ln1"])
    second = decider.price_node(graph, by_name["ln2"])
    assert first == second and len(ln_runs) == 1
    two, five = (
        decider.price_node(graph, by_name["top2"]),
        decider.price_node(graph, by_name["top5"]),
    )
    assert [r[0] for r in topk_runs] == [[2], [5]]  # each k timed, with its value
    assert two[0] > 0 and five[0] > 0
