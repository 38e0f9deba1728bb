"""conv_bn_relu's activations: each op and decomposed form fuses (and computes the same in
onnxruntime, on the reference and on the NPU kernel, and through its body in stock
onnxruntime), each trap that blocks it is a near-miss with its reason."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.testing import assert_equivalent, assert_runs_stock, count_ops, fuse_all, reasons

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
# An activation form: (nodes reading "a" and writing "y", extra initializers).
Form = Callable[[int, int], tuple[list[onnx.NodeProto], list[onnx.TensorProto]]]


def _c(name: str, value: float, dtype: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, helper.tensor_dtype_to_np_dtype(dtype)), name)


def relu(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return [helper.make_node("Relu", ["a"], ["y"], name="act")], []


def clip6(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    if opset < 11:
        return [helper.make_node("Clip", ["a"], ["y"], name="act", min=0.0, max=6.0)], []
    return [helper.make_node("Clip", ["a", "lo", "hi"], ["y"], name="act")], [
        _c("lo", 0.0, dt),
        _c("hi", 6.0, dt),
    ]


def clip_max_only(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return [helper.make_node("Clip", ["a", "", "hi"], ["y"], name="act")], [_c("hi", 1.5, dt)]


def clip_castlike(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    # The dynamo exporter: bounds stored as float32 scalars, CastLike'd to x's dtype.
    return [
        helper.make_node("CastLike", ["lo32", "a"], ["lo"], name="cl_lo"),
        helper.make_node("CastLike", ["hi32", "a"], ["hi"], name="cl_hi"),
        helper.make_node("Clip", ["a", "lo", "hi"], ["y"], name="act"),
    ], [_c("lo32", -0.5, F32), _c("hi32", 6.0, F32)]


def leaky(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return [helper.make_node("LeakyRelu", ["a"], ["y"], name="act", alpha=0.2)], []


def hardsigmoid(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return [helper.make_node("HardSigmoid", ["a"], ["y"], name="act", alpha=0.3, beta=0.4)], []


def hardswish_op(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return [helper.make_node("HardSwish", ["a"], ["y"], name="act")], []


def hardswish_mul(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    # What TorchScript writes for nn.Hardswish below opset 14.
    return [
        helper.make_node("HardSigmoid", ["a"], ["h"], name="act", alpha=1 / 6, beta=0.5),
        helper.make_node("Mul", ["a", "h"], ["y"], name="mul"),
    ], []


def silu(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return [
        helper.make_node("Sigmoid", ["a"], ["s"], name="act"),
        helper.make_node("Mul", ["s", "a"], ["y"], name="mul"),
    ], []


def sigmoid(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return [helper.make_node("Sigmoid", ["a"], ["y"], name="act")], []


def tanh(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return [helper.make_node("Tanh", ["a"], ["y"], name="act")], []


def gelu_op(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return [helper.make_node("Gelu", ["a"], ["y"], name="act")], []


def gelu_tanh_op(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return [helper.make_node("Gelu", ["a"], ["y"], name="act", approximate="tanh")], []


def gelu_torchscript(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    # ((x * (Erf(x / 1.4142135) + 1)) * 0.5), as torch.onnx (TorchScript) writes it.
    return [
        helper.make_node("Div", ["a", "sqrt2"], ["d"], name="act"),
        helper.make_node("Erf", ["d"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["p"], name="add"),
        helper.make_node("Mul", ["a", "p"], ["m"], name="mul"),
        helper.make_node("Mul", ["m", "half"], ["y"], name="mul2"),
    ], [_c("sqrt2", math.sqrt(2), dt), _c("one", 1.0, dt), _c("half", 0.5, dt)]


def gelu_onnx_order(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    # (x * 0.5) * (1 + Erf(x * 1/sqrt2)), the order of ONNX's own Gelu function.
    return [
        helper.make_node("Mul", ["a", "half"], ["h"], name="act"),
        helper.make_node("Mul", ["rsqrt2", "a"], ["d"], name="scale"),
        helper.make_node("Erf", ["d"], ["e"], name="erf"),
        helper.make_node("Add", ["one", "e"], ["p"], name="add"),
        helper.make_node("Mul", ["h", "p"], ["y"], name="mul2"),
    ], [_c("rsqrt2", 1 / math.sqrt(2), dt), _c("one", 1.0, dt), _c("half", 0.5, dt)]


def gelu_half_last(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    # x * ((1 + Erf(x / sqrt2)) * 0.5)
    return [
        helper.make_node("Div", ["a", "sqrt2"], ["d"], name="act"),
        helper.make_node("Erf", ["d"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["p"], name="add"),
        helper.make_node("Mul", ["p", "half"], ["q"], name="mul"),
        helper.make_node("Mul", ["a", "q"], ["y"], name="mul2"),
    ], [_c("sqrt2", math.sqrt(2), dt), _c("one", 1.0, dt), _c("half", 0.5, dt)]


def gelu_dynamo(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    # x * (0.5 * (Erf(x / sqrt2) + 1)), as the dynamo exporter writes it at opset 18.
    return [
        helper.make_node("Div", ["a", "sqrt2"], ["d"], name="act"),
        helper.make_node("Erf", ["d"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["p"], name="add"),
        helper.make_node("Mul", ["half", "p"], ["q"], name="mul"),
        helper.make_node("Mul", ["a", "q"], ["y"], name="mul2"),
    ], [_c("sqrt2", math.sqrt(2), dt), _c("one", 1.0, dt), _c("half", 0.5, dt)]


def _tanh_tail(dt: int, cube: list[onnx.NodeProto], k: float = 0.044715) -> tuple[
    list[onnx.NodeProto], list[onnx.TensorProto]
]:  # fmt: skip
    return [
        *cube,
        helper.make_node("Mul", ["k", "cube"], ["kc"], name="mul_k"),
        helper.make_node("Add", ["a", "kc"], ["inner"], name="add_x"),
        helper.make_node("Mul", ["sqrt2pi", "inner"], ["z"], name="mul_c"),
        helper.make_node("Tanh", ["z"], ["t"], name="tanh"),
        helper.make_node("Add", ["one", "t"], ["p"], name="add1"),
        helper.make_node("Mul", ["a", "p"], ["m"], name="mul_x"),
        helper.make_node("Mul", ["half", "m"], ["y"], name="mul_half"),
    ], [_c("k", k, dt), _c("sqrt2pi", math.sqrt(2 / math.pi), dt), _c("one", 1.0, dt),
        _c("half", 0.5, dt), _c("three", 3.0, dt)]  # fmt: skip


def gelu_tanh_torchscript(
    dt: int, opset: int
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    # x^3 as x * (x * x), as torch.onnx (TorchScript) writes nn.GELU(approximate="tanh").
    return _tanh_tail(dt, [
        helper.make_node("Mul", ["a", "a"], ["sq"], name="act"),
        helper.make_node("Mul", ["a", "sq"], ["cube"], name="mul_cube"),
    ])  # fmt: skip


def gelu_tanh_pow(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    # x^3 as Pow(x, 3), as the dynamo exporter writes it.
    return _tanh_tail(dt, [helper.make_node("Pow", ["a", "three"], ["cube"], name="act")])


def gelu_tanh_wrong(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return _tanh_tail(dt, [helper.make_node("Pow", ["a", "three"], ["cube"], name="act")], 0.05)


def model(
    form: Form,
    *,
    dtype: int = F32,
    opset: int = 17,
    bn: bool = True,
    identity: bool = False,
    extra_outputs: tuple[str, ...] = (),
    seed: int = 0,
    cin: int = 3,
    cout: int = 5,
    batch: Any = "N",
) -> onnx.ModelProto:
    """x -> Conv -> [Identity] -> BN -> [Identity] -> form -> y."""
    rng = np.random.default_rng(seed)
    npd = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [
        numpy_helper.from_array((rng.standard_normal((cout, cin, 3, 3)) * 0.4).astype(npd), "W"),
        numpy_helper.from_array(rng.standard_normal(cout).astype(npd), "B"),
    ]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1])]
    value = "c"
    if identity:
        nodes.append(helper.make_node("Identity", [value], ["c_id"], name="id_conv"))
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
    if identity:
        nodes.append(helper.make_node("Identity", [value], ["n_id"], name="id_bn"))
        value = "n_id"
    act_nodes, act_inits = form(dtype, opset)
    for node in act_nodes:
        for i, name in enumerate(node.input):
            if name == "a":
                node.input[i] = value
    nodes += act_nodes
    inits += act_inits
    outputs = [helper.make_tensor_value_info("y", dtype, None)]
    outputs += [helper.make_tensor_value_info(n, dtype, None) for n in extra_outputs]
    inputs = [helper.make_tensor_value_info("x", dtype, [batch, cin, "H", 7])]
    if any("hi_in" in n.input for n in nodes):
        inputs.append(helper.make_tensor_value_info("hi_in", dtype, []))
    graph = helper.make_graph(
        nodes,
        "conv_act",
        inputs,
        outputs,
        inits,
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10 if opset >= 21 else 8
    return onnx.shape_inference.infer_shapes(m)


def fused_node(m: onnx.ModelProto) -> onnx.NodeProto:
    [node] = [n for n in m.graph.node if n.op_type == "ConvBnRelu"]
    return node


def attrs_of(node: onnx.NodeProto) -> dict[str, Any]:
    out = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in out.items()}


# (form, opset, expected activation attribute, alpha, beta)
CASES = [
    (relu, 17, None, None, None),
    (clip6, 9, "Clip", 0.0, 6.0),
    (clip6, 13, "Clip", 0.0, 6.0),
    (clip_max_only, 13, "Clip", -math.inf, 1.5),
    (clip_castlike, 18, "Clip", -0.5, 6.0),
    (leaky, 17, "LeakyRelu", 0.2, None),
    (hardsigmoid, 17, "HardSigmoid", 0.3, 0.4),
    (hardswish_op, 14, "HardSwish", 1 / 6, 0.5),
    (hardswish_mul, 13, "HardSwish", 1 / 6, 0.5),
    (silu, 17, "Silu", None, None),
    (sigmoid, 17, "Sigmoid", None, None),
    (tanh, 17, "Tanh", None, None),
    (gelu_op, 20, "Gelu", None, None),
    (gelu_tanh_op, 20, "GeluTanh", None, None),
    (gelu_torchscript, 13, "Gelu", None, None),
    (gelu_onnx_order, 17, "Gelu", None, None),
    (gelu_half_last, 17, "Gelu", None, None),
    (gelu_dynamo, 18, "Gelu", None, None),
    (gelu_tanh_torchscript, 13, "GeluTanh", None, None),
    (gelu_tanh_pow, 18, "GeluTanh", None, None),
]
IDS = [f"{c[0].__name__}-op{c[1]}" for c in CASES]


@pytest.mark.parametrize(("form", "opset", "act", "alpha", "beta"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
def test_each_activation_form_fuses_into_one_node(
    form: Form, opset: int, act: str | None, alpha: float | None, beta: float | None, dtype: int
) -> None:
    original = model(form, dtype=dtype, opset=opset)
    result = fuse_all(original)
    assert [n.op_type for n in result.model.graph.node] == ["ConvBnRelu"]
    attrs = attrs_of(fused_node(result.model))
    if act is None:
        assert attrs["relu"] == 1 and "activation" not in attrs
    else:
        assert attrs["activation"] == act and attrs["relu"] == 0
    if alpha is not None:
        assert attrs["alpha"] == pytest.approx(alpha, rel=1e-6)
    if beta is not None:
        assert attrs["beta"] == pytest.approx(beta, rel=1e-6)
    assert_equivalent(original, result.model)
    assert_equivalent(original, result.model, kernel="npu", runs=1)
    assert_runs_stock(original, result.model, runs=1)


@pytest.mark.parametrize("form", [silu, clip_castlike, gelu_torchscript], ids=lambda f: f.__name__)
def test_identity_between_conv_bn_and_activation_is_looked_through(form: Form) -> None:
    original = model(form, opset=18, identity=True)
    result = fuse_all(original)
    assert [n.op_type for n in result.model.graph.node] == ["ConvBnRelu"]
    assert_equivalent(original, result.model)


@pytest.mark.parametrize("form", [relu, silu, clip6, hardswish_op], ids=lambda f: f.__name__)
def test_conv_and_activation_without_bn_fuse(form: Form) -> None:
    original = model(form, opset=14, bn=False, batch=1)
    result = fuse_all(original)
    node = fused_node(result.model)
    assert list(node.input) == ["x", "W", "B"]  # weights as they were: nothing to fold
    assert count_ops(result.model, "Conv") == 0
    assert_equivalent(original, result.model)
    assert_runs_stock(original, result.model, runs=1)


def test_a_lone_conv_is_not_fused() -> None:
    def nothing(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
        return [helper.make_node("Add", ["a", "a"], ["y"], name="add")], []

    result = fuse_all(model(nothing, bn=False))
    assert count_ops(result.model, "ConvBnRelu") == 0
    assert reasons(result) == []


# -- traps: each leaves the activation out, and says why at the activation's node ----------


def prelu(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    slope = numpy_helper.from_array(
        np.full((5, 1, 1), 0.1, helper.tensor_dtype_to_np_dtype(dt)), "slope"
    )
    return [helper.make_node("PRelu", ["a", "slope"], ["y"], name="act")], [slope]


def mish(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return [helper.make_node("Mish", ["a"], ["y"], name="act")], []


def clip_runtime(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    # the max bound is a graph input (`hi_in`): not a constant
    return [
        helper.make_node("Abs", ["hi_in"], ["hi"], name="abs"),
        helper.make_node("Clip", ["a", "", "hi"], ["y"], name="act"),
    ], []


def silu_read_twice(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    nodes, inits = silu(dt, opset)
    return [*nodes, helper.make_node("Neg", ["s"], ["z"], name="neg")], inits


def gelu_wrong_constant(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    nodes, inits = gelu_torchscript(dt, opset)
    inits[0] = _c("sqrt2", 1.5, dt)
    return nodes, inits


@pytest.mark.parametrize(
    ("form", "opset", "extra", "reason", "kept"),
    [
        (prelu, 17, (), "'act': PRelu (learned slope) is not one of ConvBnRelu's activations",
         ["PRelu"]),
        (mish, 18, (), "'act': Mish is not one of ConvBnRelu's activations", ["Mish"]),
        (clip_runtime, 13, (), "Clip 'act' max bound 'hi' is computed at run time, not a "
         "constant", ["Abs", "Clip"]),
        (relu, 17, ("n",), "Relu 'act' left unfused: its input 'n' is a graph output", ["Relu"]),
        (silu_read_twice, 17, ("z",), "Sigmoid 'act' left unfused: its input 'n' is also read by "
         "'mul'", ["Sigmoid", "Mul", "Neg"]),
        (gelu_wrong_constant, 13, (), "Mul 'mul' left unfused: it looks like the erf GELU but "
         "is not x * 0.5 * (1 + Erf(x / sqrt2)) with constant factors of exactly those values",
         ["Div", "Erf", "Add", "Mul", "Mul"]),
        (gelu_tanh_wrong, 18, (), "Pow 'act' left unfused: its input 'n' is also read by "
         "'add_x', 'mul_x'", ["Pow", "Mul", "Add", "Mul", "Tanh", "Add", "Mul", "Mul"]),
    ],
    ids=["prelu", "mish", "clip-runtime-bound", "act-input-is-output", "silu-sigmoid-read-twice",
         "gelu-wrong-constant", "tanh-gelu-wrong-constant"],
)  # fmt: skip
def test_activation_traps_are_near_misses_with_the_reason(
    form: Form, opset: int, extra: tuple[str, ...], reason: str, kept: list[str]
) -> None:
    original = model(form, opset=opset, extra_outputs=extra)
    result = fuse_all(original)
    # Conv + BN still fuse; the activation stays, and its node says why.
    assert [n.op_type for n in result.model.graph.node] == ["ConvBnRelu", *kept]
    assert "activation" not in attrs_of(fused_node(result.model))
    assert reasons(result) == [reason]
    [record] = result.report.rejected
    assert record.pattern == "conv_bn_relu"
    assert_equivalent(original, result.model)


def test_castlike_bound_read_elsewhere_blocks_the_clip() -> None:
    def form(dt: int, opset: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
        nodes, inits = clip_castlike(dt, opset)
        return [*nodes, helper.make_node("Neg", ["hi"], ["z"], name="neg")], inits

    result = fuse_all(model(form, opset=18, extra_outputs=("z",)))
    assert reasons(result) == ["Clip 'act' max bound 'hi' is read elsewhere too"]
    assert count_ops(result.model, "Clip") == 1


def test_conv_transpose_with_bn_fuses_and_output_shape_is_a_near_miss() -> None:
    """ConvTranspose -> BN fuses (transposed=1; more in test_conv_transpose.py); one giving
    output_shape is refused with the reason."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((3, 4, 2, 2)).astype(np.float32), "W")]
    for name in ("scale", "bias", "mean", "var"):
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 1, 4).astype(np.float32), name))

    def build(**extra: Any) -> onnx.ModelProto:
        nodes = [
            helper.make_node(
                "ConvTranspose", ["x", "W"], ["c"], name="deconv", strides=[2, 2], **extra
            ),
            helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["y"]),
        ]
        graph = helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", F32, [1, 3, 5, 5])],
            [helper.make_tensor_value_info("y", F32, None)], inits,
        )  # fmt: skip
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    original = build()
    result = fuse_all(original)
    assert count_ops(result.model, "ConvBnRelu") == 1
    assert count_ops(result.model, "ConvTranspose") == 0
    assert_equivalent(original, result.model)
    result = fuse_all(build(output_shape=[10, 10]))
    assert count_ops(result.model, "ConvBnRelu") == 0
    [why] = reasons(result)
    assert why == (
        "ConvTranspose 'deconv' gives output_shape [10, 10]: ConvBnRelu takes explicit pads only"
    )


def test_old_relu_attribute_model_still_runs() -> None:
    """A model written before `activation` existed (relu=1, no activation) runs, unfuses and
    validates as it did."""
    original = model(relu)
    result = fuse_all(original)
    node = fused_node(result.model)
    assert attrs_of(node)["relu"] == 1
    for a in list(node.attribute):
        if a.name in ("activation", "alpha", "beta"):
            node.attribute.remove(a)
    assert_equivalent(original, result.model)
    assert_equivalent(original, result.model, kernel="npu", runs=1)


def test_relu_with_another_activation_is_a_clear_error() -> None:
    from fuser.patterns.conv_activation import from_attributes

    with pytest.raises(ValueError, match="relu=1 conflicts with activation 'Silu'"):
        from_attributes({"relu": 1, "activation": "Silu"})
    with pytest.raises(ValueError, match="unknown activation 'Swish'"):
        from_attributes({"activation": "Swish"})
