"""The CNN builders contain the Conv+BN features their docstrings list."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.models import cnn
from fuser.models.inventory import count_chains
from model_checks import check, op_counts, producer, readers, run


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _convs(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "Conv"]


def _initializer_shape(model: onnx.ModelProto, name: str) -> list[int]:
    return next(list(t.dims) for t in model.graph.initializer if t.name == name)


@pytest.mark.parametrize("builder", [cnn.resnet, cnn.mobilenet, cnn.cnn_edge, cnn.conv1d])
def test_float16_builds_and_runs(builder) -> None:  # type: ignore[no-untyped-def]
    model = builder(dtype="float16")
    check(model)
    out = run(model)
    assert out[0].dtype == np.float16


@pytest.mark.parametrize("builder", [cnn.resnet, cnn.mobilenet, cnn.cnn_edge, cnn.conv1d])
def test_static_batch(builder) -> None:  # type: ignore[no-untyped-def]
    model = builder(batch=3)
    check(model)
    assert run(model)[0].shape[0] == 3


def test_resnet_structure() -> None:
    model = cnn.resnet()
    convs = _convs(model)
    assert all(len(c.input) == 2 for c in convs)  # torch ResNets have bias-free convs
    channels = {_initializer_shape(model, c.input[1])[0] for c in convs}
    assert {7, 21} <= channels  # odd channel counts
    assert op_counts(model)["Add"] == 3  # residual Adds
    # Conv+BN without Relu feeds the residual Add directly; the shortcut is the block input
    # (MaxPool or the previous block's Relu) or a projection Conv+BN.
    for add in (n for n in model.graph.node if n.op_type == "Add"):
        assert producer(model, add.input[0]).op_type == "BatchNormalization"
        assert producer(model, add.input[1]).op_type in {"BatchNormalization", "Relu", "MaxPool"}


def test_resnet_blocks_are_configurable() -> None:
    blocks = (cnn.BlockSpec("basic", 8), cnn.BlockSpec("bottleneck", 16, 2))
    model = cnn.resnet(blocks=blocks, image_size=16)
    check(model)
    run(model)
    # stem 1 + basic 1 + bottleneck 2 Relu chains; basic 1 + bottleneck 1 + shortcut 1 plain.
    assert count_chains(model)["conv_bn_relu"] == 4
    assert count_chains(model)["conv_bn"] == 3


def test_mobilenet_depthwise_and_same_upper() -> None:
    model = cnn.mobilenet()
    depthwise = [c for c in _convs(model) if _attr(c, "group", 1) != 1]
    assert len(depthwise) == 3
    for conv in depthwise:
        w_shape = _initializer_shape(model, conv.input[1])
        assert _attr(conv, "group") == w_shape[0]
        assert w_shape[1] == 1
        assert _attr(conv, "auto_pad") == b"SAME_UPPER"
    assert all(len(c.input) == 3 for c in _convs(model))  # every conv has a bias


def test_cnn_edge_cases() -> None:
    model = cnn.cnn_edge()
    convs = _convs(model)
    # 1. a Conv output is also a graph output, and still feeds its BN
    assert convs[0].output[0] == "conv1"
    assert "conv1" in [o.name for o in model.graph.output]
    assert [n.op_type for n in readers(model, "conv1")] == ["BatchNormalization"]
    bns = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    # 2. BN scale computed at run time from the graph input `gate`
    scale2 = producer(model, bns[1].input[1])
    assert scale2.op_type == "Mul"
    assert producer(model, scale2.input[1]).input == ["gate"]
    # 3. BN scale = Mul of two initializers
    inits = {t.name for t in model.graph.initializer}
    scale3 = producer(model, bns[2].input[1])
    assert scale3.op_type == "Mul"
    assert set(scale3.input) <= inits
    assert _attr(bns[2], "epsilon") == pytest.approx(1e-3)
    # 4. BN bias from a Constant node, variance from ConstantOfShape
    assert producer(model, bns[3].input[2]).op_type == "Constant"
    assert producer(model, bns[3].input[4]).op_type == "ConstantOfShape"
    assert _attr(convs[3], "auto_pad") == b"SAME_UPPER"
    # 5. depthwise strided conv without bias, BN without Relu read by Sigmoid and Mul
    assert _attr(convs[4], "group") == 8
    assert len(convs[4].input) == 2
    assert sorted(n.op_type for n in readers(model, bns[4].output[0])) == ["Mul", "Sigmoid"]


def test_cnn_edge_runtime_bn_scale_matters() -> None:
    model = cnn.cnn_edge()
    feeds = {"input": np.ones((2, 3, 16, 16), np.float32), "gate": np.zeros(8, np.float32)}
    a = run(model, feeds)[1]
    assert model.graph.output[1].name == "output"
    feeds["gate"] = np.full(8, 3.0, np.float32)
    assert not np.allclose(a, run(model, feeds)[1])


def test_conv1d_is_one_dimensional() -> None:
    model = cnn.conv1d()
    convs = _convs(model)
    assert all(len(_attr(c, "kernel_shape")) == 1 for c in convs)  # type: ignore[arg-type]
    assert any(_attr(c, "dilations") == [2] for c in convs)
    assert any(_attr(c, "auto_pad") == b"SAME_UPPER" for c in convs)
    out = run(model)[0]
    assert out.shape == (2, 12, 10)  # ceil(19 / 2) with the symbolic length L = 19


def test_same_call_same_bytes_different_seed_different_weights() -> None:
    assert cnn.resnet(seed=1).SerializeToString() == cnn.resnet(seed=1).SerializeToString()
    assert cnn.resnet(seed=1).SerializeToString() != cnn.resnet(seed=2).SerializeToString()
