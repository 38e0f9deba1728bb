"""conv_bn_relu: what it fuses (checked numerically in onnxruntime) and what it refuses, and why."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from fuser.testing import assert_equivalent, count_ops, fuse_all, reasons

F32 = TensorProto.FLOAT


def conv_bn_model(
    *,
    cin: int = 3,
    cout: int = 5,
    kernel: Sequence[int] = (3, 3),
    spatial: Sequence[Any] = ("H", 9),
    batch: Any = "N",
    conv_attrs: dict[str, Any] | None = None,
    bias: bool = True,
    relu: bool = True,
    epsilon: float = 1e-3,
    dtype: int = F32,
    seed: int = 0,
    bn_from_input: bool = False,
    extra_outputs: Sequence[str] = (),
    group: int = 1,
) -> onnx.ModelProto:
    """x -> Conv -> BatchNormalization -> (Relu) -> y, all parameters random."""
    rng = np.random.default_rng(seed)
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    w = rng.standard_normal((cout, cin // group, *kernel)).astype(np_dtype)
    inits = [numpy_helper.from_array(w, "W")]
    conv_inputs = ["x", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(cout).astype(np_dtype), "B"))
        conv_inputs.append("B")
    params = {
        "scale": rng.uniform(0.5, 1.5, cout),
        "bias": rng.standard_normal(cout),
        "mean": rng.standard_normal(cout),
        "var": rng.uniform(0.05, 1.0, cout),
    }
    graph_inputs = [helper.make_tensor_value_info("x", dtype, [batch, cin, *spatial])]
    nodes = [
        helper.make_node("Conv", conv_inputs, ["c"], name="conv", group=group, **(conv_attrs or {}))
    ]
    if bn_from_input:
        # scale is computed at run time: s = scale_in * 1, so BN cannot be folded
        graph_inputs.append(helper.make_tensor_value_info("scale_in", dtype, [cout]))
        inits.append(numpy_helper.from_array(np.ones(cout, np_dtype), "one"))
        nodes.append(helper.make_node("Mul", ["scale_in", "one"], ["scale"], name="scale_mul"))
        params.pop("scale")
    inits += [numpy_helper.from_array(v.astype(np_dtype), k) for k, v in params.items()]
    nodes.append(
        helper.make_node(
            "BatchNormalization",
            ["c", "scale", "bias", "mean", "var"],
            ["n"],
            name="bn",
            epsilon=epsilon,
        )
    )
    out = "n"
    if relu:
        nodes.append(helper.make_node("Relu", ["n"], ["y"], name="relu"))
        out = "y"
    outputs = [helper.make_tensor_value_info(out, dtype, None)]
    outputs += [helper.make_tensor_value_info(name, dtype, None) for name in extra_outputs]
    graph = helper.make_graph(nodes, "conv_bn", graph_inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def test_conv_bn_relu_fuses_to_one_node_and_matches_onnxruntime() -> None:
    model = conv_bn_model()
    result = fuse_all(model)
    assert result.report.summary["conv_bn_relu"] == 1
    assert [n.op_type for n in result.model.graph.node] == ["ConvBnRelu"]
    node = result.model.graph.node[0]
    assert node.domain == "fuser"
    assert len(node.input) == 3  # BN folded into W and B
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["relu"] == 1
    # the registered schema makes onnx's strictest check and shape inference accept the result
    onnx.checker.check_model(result.model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(result.model, strict_mode=True)
    (y,) = inferred.graph.output
    dims = [d.dim_value or d.dim_param for d in y.type.tensor_type.shape.dim]
    # H - 2 has no symbol of its own (as for onnx's Conv); the known dims must be exact
    assert dims[0] == "N" and dims[1] == 5 and dims[3] == 7
    assert not isinstance(dims[2], int)
    assert_equivalent(model, result.model)


def test_folded_weights_are_new_tensors_and_old_ones_dropped() -> None:
    model = conv_bn_model()
    result = fuse_all(model)
    names = {t.name for t in result.model.graph.initializer}
    assert not names & {"W", "B", "scale", "bias", "mean", "var"}
    assert len(names) == 2
    # the input model is untouched
    assert [n.op_type for n in model.graph.node] == ["Conv", "BatchNormalization", "Relu"]


def test_without_relu_the_fused_op_does_not_apply_it() -> None:
    model = conv_bn_model(relu=False)
    result = fuse_all(model)
    node = result.model.graph.node[0]
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["relu"] == 0
    # negative outputs survive: a fused op that applied Relu anyway would fail here
    res = assert_equivalent(model, result.model)
    assert res.ok


def test_epsilon_is_honored() -> None:
    # with tiny variances, epsilon dominates; a fold that ignored it would be far off
    model = conv_bn_model(epsilon=0.5)
    for tensor in model.graph.initializer:
        if tensor.name == "var":
            tensor.CopyFrom(numpy_helper.from_array(np.full(5, 1e-6, np.float32), "var"))
    result = fuse_all(model)
    assert result.report.summary["conv_bn_relu"] == 1
    assert_equivalent(model, result.model)


@pytest.mark.parametrize(
    ("conv_attrs", "kernel", "spatial", "group", "cin", "cout"),
    [
        ({"strides": [2, 2], "pads": [1, 0, 2, 1]}, (3, 3), (11, 8), 1, 3, 5),
        ({"dilations": [2, 1], "pads": [2, 1, 2, 1]}, (3, 3), (9, 9), 1, 4, 6),
        ({"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (3, 3), (10, 7), 1, 3, 4),
        ({"auto_pad": "SAME_LOWER"}, (2, 2), (7, 7), 1, 3, 4),
        ({"auto_pad": "VALID"}, (3, 1), (6, 5), 1, 2, 3),
        ({"pads": [1, 1, 1, 1]}, (3, 3), (8, 8), 7, 7, 7),  # depthwise, odd channels
        ({"pads": [0, 0, 0, 0]}, (1, 1), (5, 5), 2, 6, 4),  # grouped 1x1
        ({"strides": [2], "pads": [1, 2]}, (3,), (13,), 1, 3, 5),  # 1-D
    ],
)
def test_conv_variants(
    conv_attrs: dict[str, Any],
    kernel: tuple[int, ...],
    spatial: tuple[int, ...],
    group: int,
    cin: int,
    cout: int,
) -> None:
    model = conv_bn_model(
        conv_attrs=conv_attrs,
        kernel=kernel,
        spatial=spatial,
        group=group,
        cin=cin,
        cout=cout,
        batch=1,
    )
    result = fuse_all(model)
    assert result.report.summary["conv_bn_relu"] == 1
    assert_equivalent(model, result.model)


def test_conv_without_bias() -> None:
    model = conv_bn_model(bias=False)
    result = fuse_all(model)
    assert count_ops(result.model, "ConvBnRelu", "fuser") == 1
    assert_equivalent(model, result.model)


def test_float16() -> None:
    model = conv_bn_model(dtype=TensorProto.FLOAT16)
    result = fuse_all(model)
    assert count_ops(result.model, "ConvBnRelu") == 1
    assert_equivalent(model, result.model)


def test_runtime_bn_parameters_become_inputs() -> None:
    model = conv_bn_model(bn_from_input=True)
    result = fuse_all(model)
    fused = [n for n in result.model.graph.node if n.op_type == "ConvBnRelu"]
    assert len(fused) == 1
    assert list(fused[0].input)[3:] == ["scale", "bias", "mean", "var"]
    assert any("BN kept as inputs" in note for f in result.report.fusions for note in f.notes)
    assert_equivalent(model, result.model)


def test_constant_node_and_constant_of_shape_parameters_fold() -> None:
    model = conv_bn_model()
    graph = model.graph
    keep = [t for t in graph.initializer if t.name not in ("mean", "var")]
    mean = next(t for t in graph.initializer if t.name == "mean")
    del graph.initializer[:]
    graph.initializer.extend(keep)
    shape = numpy_helper.from_array(np.array([5], np.int64), "shape5")
    graph.node.insert(0, helper.make_node("Constant", [], ["mean"], name="mean_const", value=mean))
    graph.node.insert(
        0, helper.make_node("Constant", [], ["shape"], name="shape_const", value=shape)
    )
    graph.node.insert(
        1,
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["var"],
            name="var_fill",
            value=numpy_helper.from_array(np.array([0.25], np.float32), "v"),
        ),
    )
    result = fuse_all(model)
    assert [n.op_type for n in result.model.graph.node] == ["ConvBnRelu"]
    assert_equivalent(model, result.model)


def test_shared_weight_is_copied_not_changed() -> None:
    model = conv_bn_model(relu=False)
    graph = model.graph
    graph.node.append(helper.make_node("Conv", ["x", "W"], ["c2"], name="conv_plain"))
    graph.output.append(helper.make_tensor_value_info("c2", F32, [None] * 4))
    result = fuse_all(model)
    w_before = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "W"))
    w_after = numpy_helper.to_array(
        next(t for t in result.model.graph.initializer if t.name == "W")
    )
    np.testing.assert_array_equal(w_before, w_after)
    assert count_ops(result.model, "ConvBnRelu") == 1
    assert_equivalent(model, result.model)


# -- refusals --------------------------------------------------------------------------------------


def test_training_mode_bn_is_refused() -> None:
    model = conv_bn_model()
    bn = model.graph.node[1]
    bn.attribute.append(helper.make_attribute("training_mode", 1))
    result = fuse_all(model)
    assert result.report.summary["conv_bn_relu"] == 0
    assert any("training mode" in r for r in reasons(result))


def test_conv_output_read_elsewhere_blocks_the_fusion() -> None:
    model = conv_bn_model(extra_outputs=["c"])
    result = fuse_all(model)
    assert result.report.summary["conv_bn_relu"] == 0
    assert reasons(result) == [
        "internal value 'c' is a graph output, and ConvBnRelu cannot output it"
    ]
    assert result.report.rejected[0].value == "c"


def test_bn_output_read_elsewhere_leaves_relu_out() -> None:
    model = conv_bn_model(extra_outputs=["n"])
    result = fuse_all(model)
    assert [n.op_type for n in result.model.graph.node] == ["ConvBnRelu", "Relu"]
    notes = [n for f in result.report.fusions for n in f.notes]
    assert notes == ["Relu 'relu' left unfused: its input 'n' is a graph output"]
    # ... and the Relu is a near-miss of its own, with the same reason and value.
    assert reasons(result) == notes
    assert result.report.rejected[0].value == "n"
    assert_equivalent(model, result.model)


def test_3d_conv_is_refused() -> None:
    model = conv_bn_model(kernel=(1, 1, 1), spatial=(3, 3, 3), batch=1)
    result = fuse_all(model)
    assert result.report.summary["conv_bn_relu"] == 0
    assert any("3-D convolution" in r for r in reasons(result))


def test_integer_typed_parameter_dtype_mismatch_is_refused() -> None:
    # run-time BN parameters of another dtype than the Conv input cannot share the fused op's T
    model = conv_bn_model(bn_from_input=True, dtype=TensorProto.DOUBLE)
    graph = model.graph
    for t in graph.initializer:
        if t.name == "bias":
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), "bias"))
    result = fuse_all(model)
    assert result.report.summary["conv_bn_relu"] == 0
    assert any("dtype differs" in r for r in reasons(result))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cin=st.integers(1, 6),
    cout=st.integers(1, 7),
    k=st.integers(1, 4),
    stride=st.integers(1, 3),
    dilation=st.integers(1, 2),
    pad=st.integers(0, 2),
    size=st.integers(4, 12),
    depthwise=st.booleans(),
    relu=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_conv_shapes_stay_equivalent(
    cin: int,
    cout: int,
    k: int,
    stride: int,
    dilation: int,
    pad: int,
    size: int,
    depthwise: bool,
    relu: bool,
    seed: int,
) -> None:
    if (k - 1) * dilation + 1 > size + 2 * pad:
        return  # no output position: not a valid Conv
    group = cin if depthwise else 1
    cout = cin if depthwise else cout
    model = conv_bn_model(
        cin=cin,
        cout=cout,
        kernel=(k, k),
        spatial=(size, size + 1),
        group=group,
        relu=relu,
        seed=seed,
        batch=2,
        conv_attrs={
            "strides": [stride, stride],
            "dilations": [dilation, dilation],
            "pads": [pad, pad, pad, pad],
        },
    )
    result = fuse_all(model)
    assert count_ops(result.model, "ConvBnRelu") == 1
    assert_equivalent(model, result.model, runs=1, seed=seed)
