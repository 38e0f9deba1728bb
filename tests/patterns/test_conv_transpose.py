"""ConvTranspose -> (Identity) -> BN -> (activation) fused into ConvBnRelu with transposed=1:
odd shapes (stride 2 and 3, output_padding, group, dilation, batch 1 and symbolic, odd channels)
in fp32 and fp16 on the reference, the NPU kernel and stock onnxruntime; what is refused says
why."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from fuser.patterns.conv_bn_relu import reference
from onnx import TensorProto, helper, numpy_helper

from fuser.testing import assert_equivalent, assert_runs_stock, count_ops, fuse_all, reasons

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def deconv_model(
    attrs: dict[str, Any],
    *,
    cin: int = 3,
    cout_g: int = 5,
    k: tuple[int, ...] = (3, 3),
    spatial: tuple[Any, ...] = (5, 6),
    dtype: int = F32,
    batch: Any = "N",
    bn: bool = True,
    act: str | None = "Relu",
    identity: bool = False,
    bias: bool = True,
    opset: int = 17,
    seed: int = 0,
) -> onnx.ModelProto:
    """x -> ConvTranspose -> [Identity] -> [BN] -> [act] -> y."""
    rng = np.random.default_rng(seed)
    npd = helper.tensor_dtype_to_np_dtype(dtype)
    group = int(attrs.get("group", 1))
    cout = cout_g * group
    inits = [
        numpy_helper.from_array((rng.standard_normal((cin, cout_g, *k)) * 0.4).astype(npd), "W")
    ]
    ins = ["x", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(cout).astype(npd), "B"))
        ins.append("B")
    nodes = [helper.make_node("ConvTranspose", ins, ["c"], name="deconv", **attrs)]
    value = "c"
    if identity:
        nodes.append(helper.make_node("Identity", [value], ["c_id"], name="id"))
        value = "c_id"
    if bn:
        for name, v in (
            ("scale", rng.uniform(0.5, 1.5, cout)),
            ("bias", rng.standard_normal(cout)),
            ("mean", rng.standard_normal(cout)),
            ("var", rng.uniform(0.2, 1.0, cout)),
        ):
            inits.append(numpy_helper.from_array(v.astype(npd), name))
        nodes.append(
            helper.make_node(
                "BatchNormalization", [value, "scale", "bias", "mean", "var"], ["n"], name="bn"
            )
        )
        value = "n"
    if act is not None:
        nodes.append(helper.make_node(act, [value], ["y"], name="act"))
    else:
        nodes.append(helper.make_node("Identity", [value], ["y"], name="out"))
    graph = helper.make_graph(
        nodes,
        "deconv",
        [helper.make_tensor_value_info("x", dtype, [batch, cin, *spatial])],
        [helper.make_tensor_value_info("y", dtype, None)],
        inits,
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m)


def attrs_of(m: onnx.ModelProto) -> dict[str, Any]:
    [node] = [n for n in m.graph.node if n.op_type == "ConvBnRelu"]
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# (ConvTranspose attributes, cin, cout per group, kernel, spatial)
SHAPES = [
    ({"strides": [2, 2]}, 3, 5, (3, 3), (5, 6)),
    ({"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, 7, 3, (4, 4), (6, 5)),
    ({"strides": [3, 2], "pads": [1, 0, 2, 1], "output_padding": [2, 1]}, 5, 4, (3, 4), (4, 7)),
    (
        {"strides": [2, 3], "group": 3, "dilations": [2, 1], "pads": [0, 1, 1, 0]},
        6,
        3,
        (3, 3),
        (5, 4),
    ),
    ({"strides": [2, 2], "group": 5}, 5, 1, (4, 4), (3, 5)),  # depthwise upsampling
    ({"strides": [3], "dilations": [2], "pads": [3, 1], "output_padding": [1]}, 7, 5, (5,), (9,)),
    ({"pads": [2, 2, 2, 2]}, 3, 2, (3, 3), (5, 5)),  # stride 1, pads cropping past the span
]
IDS = ["s2", "s2-op1-pads", "s3x2-op", "group-dil", "depthwise", "1d-s3-dil", "s1-crop"]


@pytest.mark.parametrize(("attrs", "cin", "cout_g", "k", "spatial"), SHAPES, ids=IDS)
@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
def test_conv_transpose_bn_relu_fuses_and_matches(
    attrs: dict[str, Any], cin: int, cout_g: int, k: tuple[int, ...], spatial: tuple[int, ...],
    dtype: int,
) -> None:  # fmt: skip
    original = deconv_model(attrs, cin=cin, cout_g=cout_g, k=k, spatial=spatial, dtype=dtype)
    result = fuse_all(original)
    assert [n.op_type for n in result.model.graph.node] == ["ConvBnRelu"]
    fused = attrs_of(result.model)
    assert fused["transposed"] == 1 and fused["relu"] == 1
    assert list(fused.get("output_padding", [])) == attrs.get("output_padding", [])
    assert_equivalent(original, result.model)
    assert_equivalent(original, result.model, kernel="npu", runs=1)
    assert_runs_stock(original, result.model, runs=1)


@pytest.mark.parametrize("act", ["Sigmoid", "Tanh", None])
def test_identity_and_other_activations_batch_one(act: str | None) -> None:
    original = deconv_model(
        {"strides": [2, 2], "output_padding": [1, 0]}, batch=1, act=act, identity=True, bias=False
    )
    result = fuse_all(original)
    assert count_ops(result.model, "ConvBnRelu") == 1
    assert count_ops(result.model, "ConvTranspose") == 0
    assert_equivalent(original, result.model, kernel="npu", runs=1)
    assert_runs_stock(original, result.model, runs=1)


def test_conv_transpose_and_activation_without_bn_fuse() -> None:
    original = deconv_model({"strides": [2, 2], "group": 3}, cin=3, cout_g=2, bn=False)
    result = fuse_all(original)
    assert [n.op_type for n in result.model.graph.node] == ["ConvBnRelu"]
    assert_equivalent(original, result.model, kernel="npu", runs=1)
    assert_runs_stock(original, result.model, runs=1)


def test_bn_folds_per_output_channel_within_each_group() -> None:
    """The folded weight equals W scaled along axis 1 of each group's rows (checked against
    the reference on the unfolded chain with a group whose Cout/group differs from Cin/group)."""
    original = deconv_model({"strides": [2, 2], "group": 2}, cin=4, cout_g=3, act=None)
    result = fuse_all(original)
    assert count_ops(result.model, "ConvBnRelu") == 1
    inits = {i.name: numpy_helper.to_array(i) for i in result.model.graph.initializer}
    [node] = [n for n in result.model.graph.node if n.op_type == "ConvBnRelu"]
    w, b = inits[node.input[1]], inits[node.input[2]]
    assert w.shape == (4, 3, 3, 3)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 4, 5, 6))
    orig = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in original.graph.initializer}
    at = {"strides": [2, 2], "group": 2, "transposed": 1}
    [y] = reference([x, orig["W"], orig["B"]], at)
    a = orig["scale"] / np.sqrt(orig["var"] + 1e-5)
    want = (y - orig["mean"].reshape(1, -1, 1, 1)) * a.reshape(1, -1, 1, 1)
    want += orig["bias"].reshape(1, -1, 1, 1)
    [got] = reference([x, w.astype(np.float64), b.astype(np.float64)], at)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_lone_conv_transpose_is_not_fused() -> None:
    original = deconv_model({"strides": [2, 2]}, bn=False, act=None)
    result = fuse_all(original)
    assert count_ops(result.model, "ConvTranspose") == 1
    assert reasons(result) == []


@pytest.mark.parametrize(
    ("attrs", "why"),
    [
        (
            {"strides": [2, 2], "output_shape": [12, 14]},
            "ConvTranspose 'deconv' gives output_shape [12, 14]: ConvBnRelu takes explicit "
            "pads only",
        ),
        (
            {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
            "ConvTranspose 'deconv' has auto_pad=SAME_UPPER: ConvBnRelu takes explicit pads only",
        ),
    ],
    ids=["output_shape", "auto_pad"],
)
def test_what_is_not_resolved_is_a_near_miss(attrs: dict[str, Any], why: str) -> None:
    result = fuse_all(deconv_model(attrs))
    assert count_ops(result.model, "ConvBnRelu") == 0
    assert why in reasons(result)


def test_3d_conv_transpose_is_a_near_miss() -> None:
    result = fuse_all(deconv_model({"strides": [2, 2, 2]}, k=(2, 2, 2), spatial=(3, 3, 3)))
    assert count_ops(result.model, "ConvBnRelu") == 0
    [why] = reasons(result)
    assert why.startswith("3-D convolution (weight 'W')")


def test_symbolic_spatial_infers_unknown_output_dims() -> None:
    original = deconv_model({"strides": [2, 2], "output_padding": [1, 1]}, spatial=("H", 7))
    result = fuse_all(original)
    assert count_ops(result.model, "ConvBnRelu") == 1
    assert_equivalent(original, result.model)
    assert_runs_stock(original, result.model, runs=1)
