"""conv_bn_relu: when folding BN into the Conv weights is not possible, BN stays as inputs of the
fused op, with the reason in the fusion's notes (non-finite folded values, or values that
overflow the weight's dtype), and everything else folds as before."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.testing import assert_equivalent, fuse_all

# A refused fold says why in the report; numpy must not also warn on the user's terminal.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def _model(
    dtype: int, scale: np.ndarray, var: np.ndarray, epsilon: float, seed: int = 3
) -> onnx.ModelProto:
    """x[1, 3, 5, 7] -> Conv(W[c, 3, 3, 3], B) -> BN(scale, bias, mean, var) -> Relu."""
    rng = np.random.default_rng(seed)
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    cout = scale.shape[0]
    inits = [
        numpy_helper.from_array(rng.standard_normal((cout, 3, 3, 3)).astype(np_dtype), "W"),
        numpy_helper.from_array(rng.standard_normal(cout).astype(np_dtype), "B"),
        numpy_helper.from_array(scale.astype(np_dtype), "scale"),
        numpy_helper.from_array(rng.standard_normal(cout).astype(np_dtype), "bias"),
        numpy_helper.from_array(rng.standard_normal(cout).astype(np_dtype), "mean"),
        numpy_helper.from_array(var.astype(np_dtype), "var"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization",
            ["c", "scale", "bias", "mean", "var"],
            ["n"],
            name="bn",
            epsilon=epsilon,
        ),
        helper.make_node("Relu", ["n"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "fold_limits",
        [helper.make_tensor_value_info("x", dtype, [1, 3, 5, 7])],
        [helper.make_tensor_value_info("y", dtype, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def _fused(model: onnx.ModelProto) -> tuple[onnx.NodeProto, tuple[str, ...], list[str]]:
    result = fuse_all(model)
    nodes = [n for n in result.model.graph.node if n.op_type == "ConvBnRelu"]
    assert len(nodes) == 1
    (record,) = result.report.fusions
    initializers = [t.name for t in result.model.graph.initializer]
    return nodes[0], record.notes, initializers


def test_negative_variance_keeps_bn_as_inputs() -> None:
    """var + epsilon < 0 in one channel (of 5): sqrt gives NaN, so nothing is folded."""
    var = np.array([0.5, 0.2, -1.0, 0.9, 0.3])
    model = _model(TensorProto.FLOAT, np.ones(5), var, 1e-5)
    node, notes, initializers = _fused(model)
    assert list(node.input) == ["x", "W", "B", "scale", "bias", "mean", "var"]
    assert "BN kept as inputs: folding gives non-finite weights (var + epsilon <= 0?)" in notes
    assert not any(name.endswith("_bn_folded") for name in initializers)


def test_float16_overflow_keeps_bn_as_inputs() -> None:
    """scale / sqrt(var + eps) ~ 6e5 in one channel: finite in float64 (where folding is
    computed), beyond float16's 65504 once cast back to the weight's dtype."""
    scale = np.array([1.0, 0.5, 600.0, 1.5])
    var = np.array([0.5, 1.0, 1e-6, 0.25])
    model = _model(TensorProto.FLOAT16, scale, var, 1e-7)
    node, notes, initializers = _fused(model)
    assert list(node.input) == ["x", "W", "B", "scale", "bias", "mean", "var"]
    assert "BN kept as inputs: folded weights overflow float16" in notes
    assert not any(name.endswith("_bn_folded") for name in initializers)


def test_float16_in_range_folds() -> None:
    """The same model with every channel in float16's range folds into W', B'."""
    scale = np.array([1.0, 0.5, 2.0, 1.5])
    var = np.array([0.5, 1.0, 0.7, 0.25])
    model = _model(TensorProto.FLOAT16, scale, var, 1e-5)
    node, notes, initializers = _fused(model)
    assert list(node.input) == ["x", "conv.W_bn_folded", "conv.B_bn_folded"]
    assert not any(note.startswith("BN kept") for note in notes)
    assert {"conv.W_bn_folded", "conv.B_bn_folded"} <= set(initializers)
    assert_equivalent(model, fuse_all(model).model)
