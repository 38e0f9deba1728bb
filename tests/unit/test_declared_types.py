"""A model that declares a shape its nodes do not compute (onnxruntime warns and runs it):
the fusion over that value is refused as a near-miss naming the value, never a crash."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import fuser


def conv_bn_relu_model(declared: list[int]) -> onnx.ModelProto:
    """Conv(3->5, 3x3) -> BN -> Relu -> Identity on a [1,3,7,9] input; the Relu's output 'r'
    is declared as `declared` in value_info (its true shape is [1,5,5,7])."""
    rng = np.random.default_rng(7)

    def init(name: str, values: np.ndarray) -> onnx.TensorProto:
        return numpy_helper.from_array(values.astype(np.float32), name)

    inits = [
        init("W", rng.standard_normal([5, 3, 3, 3])),
        init("s", rng.standard_normal([5])),
        init("b", rng.standard_normal([5])),
        init("m", rng.standard_normal([5])),
        init("v", rng.uniform(0.5, 2.0, [5])),
    ]
    nodes = [
        helper.make_node("Conv", ["X", "W"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("Identity", ["r"], ["Y"], name="id"),
    ]
    graph = helper.make_graph(
        nodes,
        "declared",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 3, 7, 9])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 5, 5, 7])],
        inits,
        value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, declared)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_wrong_declared_shape_is_a_near_miss_naming_the_value() -> None:
    model = conv_bn_relu_model([1, 5, 4, 7])
    # onnxruntime runs it (the premise: fuser must accept what onnxruntime runs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal([1, 3, 7, 9]).astype(np.float32)
    assert session.run(None, {"X": x})[0].shape == (1, 5, 5, 7)

    result = fuser.fuse(model, patterns="conv_bn_relu", cache=False, force=True)

    assert result.report.fusions == ()
    assert [n.op_type for n in result.model.graph.node] == ["Conv", "BatchNormalization", "Relu",
                                                           "Identity"]  # fmt: skip
    (miss,) = [r for r in result.report.rejected if r.value == "r"]
    assert "declares float32[1,5,4,7] for 'r'" in miss.reason
    assert "infers float32[1,5,5,7]" in miss.reason
    assert "conv" in miss.nodes


def test_the_same_model_declaring_the_true_shape_fuses() -> None:
    result = fuser.fuse(conv_bn_relu_model([1, 5, 5, 7]), patterns="conv_bn_relu", cache=False,
                        force=True)  # fmt: skip
    assert [f.op for f in result.report.fusions] == ["ConvBnRelu"]
    assert not [r for r in result.report.rejected if r.value == "r"]
