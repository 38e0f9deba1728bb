"""A fused model runs in a plain onnxruntime session (nothing registered) through its function
bodies, and equals the original: every family, every variant, float32 and float16, symbolic
shapes. (AllGatherMatMul needs a communicator for its AllGather: tests/functions/test_unfuse.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest

import fuser
from fuser.fusedop import DOMAIN
from fuser.testing import assert_runs_stock, fuse_all

DTYPES = ["float32", "float16"]


def fused_nodes(model: onnx.ModelProto, op: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == op]


def check(original: onnx.ModelProto, op: str, variant: str, **kw: Any) -> onnx.ModelProto:
    """Fuse, check the fused node and its body are there, and run it stock against the original."""
    fused = fuse_all(original).model
    nodes = fused_nodes(fused, op)
    assert nodes, f"nothing fused into {op}"
    assert {n.overload for n in nodes} == {variant}
    assert (op, variant) in {(f.name, f.overload) for f in fused.functions if f.domain == DOMAIN}
    assert assert_runs_stock(original, fused, **kw) == [op]
    return fused


# -- ConvBnRelu --------------------------------------------------------------------------------

CONVS: dict[str, dict[str, Any]] = {
    "pads-strides": {"kernel_shape": [3, 3], "pads": [1, 0, 1, 2], "strides": [2, 1]},
    "dilated-grouped": {"kernel_shape": [3, 3], "dilations": [2, 1], "group": 3},
    "same-upper": {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
    "1d": {"kernel_shape": [3], "pads": [1, 0], "strides": [2]},
}


def conv_bn(graph: Any, dtype: str, conv: str, bn: str, relu: bool, bias: bool) -> onnx.ModelProto:
    g = graph(dtype, 13)
    one_d = conv == "1d"
    x = g.input("x", ["N", 3, "H"] if one_d else ["N", 3, "H", 7])
    cout, cin = 6, 1 if "grouped" in conv else 3
    w = g.random([cout, cin, 3] if one_d else [cout, cin, 3, 3], "w")
    inputs = [x, w] + ([g.random([cout], "b")] if bias else [])
    y = g.op("Conv", *inputs, **CONVS[conv])
    if bn == "folded":
        params = [
            g.random([cout], "scale", 1.0),
            g.random([cout], "beta"),
            g.random([cout], "mean"),
        ]
        params.append(g.const(g.rng.uniform(0.5, 2.0, cout), "var"))
    else:  # computed at run time: BN stays an input of the fused op
        raw = [g.input(n, [cout]) for n in ("s", "t", "m", "v")]
        var = g.op("Add", g.op("Mul", raw[3], raw[3]), g.const(0.5, "half"))
        params = [raw[0], raw[1], raw[2], var]
    y = g.op("BatchNormalization", y, *params, epsilon=1e-3)
    g.outputs.append(g.op("Relu", y) if relu else y)
    return g.model()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bn", ["folded", "bn"])
@pytest.mark.parametrize("conv", list(CONVS))
def test_conv_bn_relu(graph: Any, dtype: str, conv: str, bn: str, relu: bool) -> None:
    bias = conv in ("pads-strides", "1d")  # with and without a Conv bias, across the variants
    model = conv_bn(graph, dtype, conv, bn, relu, bias)
    check(model, "ConvBnRelu", bn + ("_relu" if relu else ""), dim_size=6)


# -- LayerNormMatMul ---------------------------------------------------------------------------

HIDDEN, SEQ = 12, 5


def layer_norm(g: Any, x: str, form: str, affine: bool, axis: int) -> str:
    shape = [HIDDEN] if axis == -1 else [SEQ, HIDDEN]
    gamma = g.random(shape, "gamma", 1.0) if affine else ""
    beta = g.random(shape, "beta") if affine else ""
    if form == "op":
        ins = [x, gamma or g.const(np.ones(shape), "ones")] + ([beta] if beta else [])
        return g.op("LayerNormalization", *ins, axis=axis, epsilon=1e-5)
    axes = list(range(axis, 0))
    wide = form == "widened"  # TorchScript's float16 form: variance in float64 between Casts

    def mean(v: str) -> str:
        if g.opset >= 18:
            return g.op("ReduceMean", v, g.const(axes, "axes", np.int64), keepdims=1)
        return g.op("ReduceMean", v, axes=axes, keepdims=1)

    d = g.op("Sub", x, mean(x))
    dd = g.op("Cast", d, to=onnx.TensorProto.DOUBLE) if wide else d
    dtype = np.float64 if wide else None
    var = mean(g.op("Pow", dd, g.const(2.0, "two", dtype)))
    n = g.op("Div", dd, g.op("Sqrt", g.op("Add", var, g.const(1e-5, "eps", dtype))))
    if wide:
        n = g.op("Cast", n, to=g.elem)
    if affine:
        n = g.op("Add", g.op("Mul", n, gamma), beta)
    return n


def ln_model(
    graph: Any,
    dtype: str,
    form: str,
    opset: int,
    affine: bool,
    axis: int,
    linears: str,
    residual: bool,
) -> onnx.ModelProto:
    g = graph(dtype, opset)
    x = g.input("x", ["B", SEQ, HIDDEN])
    n = layer_norm(g, x, form, affine, axis)
    for i, kind in enumerate(linears.split("+")):
        width = 7 + 2 * i
        if kind == "gemm":  # GPT-2's Conv1D: Reshape -> Gemm with transB, alpha, beta
            flat = g.op("Reshape", n, g.const([-1, HIDDEN], "shape", np.int64))
            w, c = g.random([width, HIDDEN], "wt"), g.random([width], "c")
            g.outputs.append(g.op("Gemm", flat, w, c, transB=1, alpha=0.5, beta=2.0))
            continue
        y = g.op("MatMul", n, g.random([HIDDEN, width], "w"))
        g.outputs.append(g.op("Add", y, g.random([width], "b")) if kind == "mmb" else y)
    if residual:
        g.outputs.append(g.op("Add", n, x))
    return g.model()


LN_CASES = [
    # form, opset, affine, axis, linears, residual, variant (after the dtype parts)
    ("decomposed", 13, True, -1, "mmb+mm", False, "scale_bias_mmb_mm"),
    ("decomposed", 18, False, -1, "mm+mmb+mmb", True, "mm_mmb_mmb"),
    ("decomposed", 13, True, -2, "mmb", True, "scale_bias_mmb"),
    ("decomposed", 13, True, -1, "gemm+mm", False, "scale_bias_mmbf_mm"),
    ("op", 17, True, -1, "mm+gemm", True, "scale_bias_mm_mmbf"),
    ("op", 18, False, -2, "mmb", False, "scale_mmb"),
    ("op", 17, True, -1, "mmb+mmb+mm", False, "scale_bias_mmb_mmb_mm"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LN_CASES, ids=lambda c: f"{c[0]}{c[1]}-{c[6]}")
def test_layernorm_matmul(graph: Any, dtype: str, case: tuple[Any, ...]) -> None:
    form, opset, affine, axis, linears, residual, tail = case
    model = ln_model(graph, dtype, form, opset, affine, axis, linears, residual)
    # statistics in float32 at least whatever stash_type (as onnxruntime's kernel, which also
    # runs the decomposed chain), so float16 and float32 bodies both compute them in float32
    check(model, "LayerNormMatMul", f"{dtype}_statsfloat32_{tail}")


def test_layernorm_matmul_widened_float16_statistics_in_float32(graph: Any) -> None:
    model = ln_model(graph, "float16", "widened", 13, True, -1, "mmb", False)
    fused = check(model, "LayerNormMatMul", "float16_statsfloat32_scale_bias_mmb")
    (body,) = [f for f in fused.functions if f.name == "LayerNormMatMul"]
    casts = [n for n in body.node if n.op_type == "Cast"]
    assert [onnx.helper.get_attribute_value(c.attribute[0]) for c in casts] == [1, 10]


# -- SoftmaxTopK -------------------------------------------------------------------------------


def softmax_topk(
    graph: Any,
    dtype: str,
    opset: int,
    order: str,
    renorm: bool,
    sorted_: int,
    to_float32: bool,
    probs: bool,
) -> onnx.ModelProto:
    g = graph(dtype, opset)
    x = g.input("x", ["N", 3, 7])
    k = g.const([3], "k", np.int64)

    def cast(v: str) -> str:
        return g.op("Cast", v, to=onnx.TensorProto.FLOAT) if to_float32 else v

    if order == "softmax_topk":
        p = g.op("Softmax", x, axis=-1)
        values, indices = g.op("TopK", cast(p), k, n_out=2, sorted=sorted_)
        if probs:
            g.outputs.append(g.op("Mul", p, p))
    else:
        top, indices = g.op("TopK", x, k, n_out=2, sorted=sorted_)
        values = g.op("Softmax", cast(top), axis=-1)
    if renorm:
        if opset >= 13:
            total = g.op("ReduceSum", values, g.const([-1], "ax", np.int64), keepdims=1)
        else:
            total = g.op("ReduceSum", values, axes=[-1], keepdims=1)
        values = g.op("Div", values, total)
    g.outputs[:0] = [values, indices]
    return g.model()


SOFTMAX_CASES = [
    # order, opset, renorm, sorted, to_float32, probs read outside
    ("softmax_topk", 13, False, 1, False, False),
    ("softmax_topk", 13, True, 1, False, True),
    ("softmax_topk", 11, True, 1, True, False),
    ("softmax_topk", 18, False, 0, True, True),
    ("topk_softmax", 13, False, 1, False, False),
    ("topk_softmax", 13, True, 0, True, False),
    ("topk_softmax", 11, True, 1, False, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=lambda c: "-".join(map(str, c)))
def test_softmax_topk(graph: Any, dtype: str, case: tuple[Any, ...]) -> None:
    order, opset, renorm, sorted_, to_float32, probs = case
    model = softmax_topk(graph, dtype, opset, order, renorm, sorted_, to_float32, probs)
    cast = to_float32 and dtype != "float32"  # a Cast to the type it has is looked through
    parts = [order, "f32" if cast else "", "renorm" if renorm else ""]
    if renorm and opset < 13:
        parts.append("axis-1")  # ReduceSum's axes are an attribute there: written in
    if opset < 12:
        parts.insert(len(parts) - int(renorm and opset < 13), "k3")  # no Constant by reference
    if order == "softmax_topk" and not probs:
        parts.append("noprobs")
    check(model, "SoftmaxTopK", "_".join(p for p in parts if p))


def test_fused_nodes_in_if_branches_run_stock_and_unfuse() -> None:
    """Bodies serve fused nodes inside subgraphs too (one function for both branches)."""
    from onnx import TensorProto, helper, numpy_helper

    import fuser

    def branch(name: str) -> onnx.GraphProto:
        k = numpy_helper.from_array(np.array([2], np.int64), f"{name}_k")
        nodes = [
            helper.make_node("Softmax", ["x"], [f"{name}_p"], axis=-1),
            helper.make_node("TopK", [f"{name}_p", f"{name}_k"], [f"{name}_v", f"{name}_i"]),
        ]
        out = helper.make_tensor_value_info(f"{name}_v", TensorProto.FLOAT, ["N", 2])
        return helper.make_graph(nodes, name, [], [out], [k])

    node = helper.make_node("If", ["c"], ["y"], then_branch=branch("a"), else_branch=branch("b"))
    inputs = [
        helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 7]),
    ]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])
    graph = helper.make_graph([node], "g", inputs, [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    fused = fuse_all(model).model
    branches = [a.g for a in fused.graph.node[0].attribute]
    assert [[n.overload for n in b.node] for b in branches] == [["softmax_topk_noprobs"]] * 2
    assert [f.overload for f in fused.functions] == ["softmax_topk_noprobs"]
    stock = onnxruntime.InferenceSession(fused.SerializeToString())
    reference = onnxruntime.InferenceSession(model.SerializeToString())
    x = np.random.default_rng(3).standard_normal((5, 7)).astype(np.float32)
    for c in (True, False):
        feeds = {"c": np.array(c), "x": x}
        np.testing.assert_array_equal(stock.run(None, feeds)[0], reference.run(None, feeds)[0])
    plain = fuser.unfuse(fused)
    assert all(n.domain != DOMAIN for b in plain.model.graph.node[0].attribute for n in b.g.node)
    assert fuser.validate(model, plain).ok


@pytest.mark.parametrize(
    ("form", "opset", "variant"),
    [
        ("op", 17, "float64_statsfloat64_scale_bias_mmb"),
        # a double epsilon 1e-5 that float32 cannot hold travels as the node's last input
        ("decomposed", 13, "float64_statsfloat64_epsinput_scale_bias_mmb"),
        ("decomposed", 18, "float64_statsfloat64_epsinput_scale_bias_mmb"),
    ],
)
def test_layernorm_matmul_double_runs_stock_in_double(
    graph: Any, form: str, opset: int, variant: str
) -> None:
    """A double LayerNorm fuses (issue 8: its NPU kernel refuses double, so it is fused
    unpriced) and its body computes in double, the epsilon exactly as the original holds it."""
    model = ln_model(graph, "float64", form, opset, True, -1, "mmb", False)
    fused = check(model, "LayerNormMatMul", variant)
    (node,) = fused_nodes(fused, "LayerNormMatMul")
    if "epsinput" in variant:
        eps = next(t for t in fused.graph.initializer if t.name == node.input[-1])
        assert onnx.numpy_helper.to_array(eps).dtype == np.float64
        assert float(onnx.numpy_helper.to_array(eps).reshape(-1)[0]) == 1e-5


@pytest.mark.parametrize(("form", "opset"), [("decomposed", 13), ("decomposed", 18), ("op", 17)])
def test_float16_layernorm_body_keeps_statistics_in_float32_on_edge_rows(
    graph: Any, form: str, opset: int
) -> None:
    """A float16 row [300, -300, 0, ...] squares past float16's range, and a constant row must
    normalize to exactly 0. onnxruntime's kernel (which also runs the decomposed chain) keeps
    the statistics in float32, and so does every float16 body, decomposed original or not:
    it casts X to float32 first. (On the CPU provider float16 Reduce* run in float32 anyway,
    so the edge rows agree either way there; the Cast is what other runtimes see.)"""
    model = ln_model(graph, "float16", form, opset, True, -1, "mmb", True)
    fused = fuse_all(model).model
    (body,) = [f for f in fused.functions if f.name == "LayerNormMatMul"]
    first = body.node[0]
    assert (first.op_type, list(first.input)) == ("Cast", ["X"])
    assert onnx.helper.get_attribute_value(first.attribute[0]) == onnx.TensorProto.FLOAT
    x = np.zeros((2, SEQ, HIDDEN), np.float16)
    x[0, 0, :2] = [300, -300]
    x[1] = 7.0
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    actual = onnxruntime.InferenceSession(fused.SerializeToString()).run(None, {"x": x})
    for e, a in zip(expected, actual, strict=True):
        assert np.isfinite(e).all()
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a.astype(np.float32), e.astype(np.float32), rtol=1e-2, atol=1e-2)


# -- a variant the model's opset cannot write as a body: refused at decision time -----------


def test_no_body_at_the_models_opset_is_a_near_miss_not_an_error(graph: Any) -> None:
    model = ln_model(graph, "float32", "decomposed", 10, True, -1, "mmb", False)
    for result in (fuse_all(model), fuser.fuse(model, cache=False)):
        assert result.report.summary["layernorm_matmul"] == 0
        (miss,) = [r for r in result.report.rejected if r.pattern == "layernorm_matmul"]
        assert "no ONNX function body at opset 10" in miss.reason
        assert "--no-functions" in miss.reason
        # what was written still runs in stock onnxruntime: nothing fused, nothing lost
        onnxruntime.InferenceSession(result.model.SerializeToString())
    bare = fuse_all(model, functions=False)
    assert bare.report.summary["layernorm_matmul"] == 1 and not bare.model.functions


def test_a_body_the_opset_allows_is_not_refused(graph: Any) -> None:
    model = ln_model(graph, "float32", "decomposed", 13, True, -1, "mmb", False)
    result = fuse_all(model)
    assert result.report.summary["layernorm_matmul"] == 1 and result.model.functions
