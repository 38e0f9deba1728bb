"""layernorm_matmul: LayerNorm (op or decomposed) -> Linears => LayerNormMatMul.

Positive cases count the fusions and the nodes left, and compare the fused model run through
the plugin with the original run by onnxruntime, on seeded inputs that include rows of constant
values (zero variance: where a lost epsilon shows) and symbolic batch/sequence dims. Negative
cases assert that nothing is fused and the reason a user reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from fuser.models import get_example
from fuser.patterns.layernorm_matmul import LAYERNORM_MATMUL, reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser.decide import AlwaysFuse
from fuser.ort import session

PATTERN = "layernorm_matmul"
# The fused op's numpy reference: these tests are about the rewrite; the simulated NPU kernel
# has its own tests (tests/kernels).
KERNEL = "reference"
HIDDEN = 8
SIZES = {"batch": 2, "seq": 5, "tokens": 7}


# -- a tiny graph builder ----------------------------------------------------------------------


@dataclass
class Graph:
    """Nodes and initializers of one test model; names are generated unless given."""

    opset: int = 13
    dtype: Any = np.float32
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    shapes: dict[str, list[int | str]] = field(default_factory=dict)  # where inference has none

    @property
    def elem(self) -> int:
        return helper.np_dtype_to_tensor_dtype(np.dtype(self.dtype))

    def input(self, name: str, shape: Sequence[int | str], elem: int | None = None) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem or self.elem, list(shape)))
        return name

    def const(self, value: Any, name: str, dtype: Any = None) -> str:
        array = np.asarray(value, dtype=dtype or self.dtype)
        self.inits.append(numpy_helper.from_array(array, f"{name}_{len(self.inits)}"))
        return self.inits[-1].name

    def random(self, shape: Sequence[int], name: str, scale: float = 0.3) -> str:
        return self.const(self.rng.standard_normal(shape) * scale, name)

    def op(self, op_type: str, *inputs: str, name: str | None = None, **attrs: Any) -> str:
        name = name or f"{op_type}_{len(self.nodes)}"
        self.nodes.append(
            helper.make_node(op_type, list(inputs), [f"{name}_out"], name=name, **attrs)
        )
        return f"{name}_out"

    def model(self) -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in self.outputs]
        graph = helper.make_graph(self.nodes, "test", self.inputs, outs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        del model.graph.output[:]
        for out in inferred.graph.output:  # the outputs with inferred shapes, or declared ones
            if out.name in self.shapes:
                out = helper.make_tensor_value_info(
                    out.name, out.type.tensor_type.elem_type, self.shapes[out.name]
                )
            model.graph.output.append(out)
        onnx.checker.check_model(model, full_check=True)
        return model


def reduce_mean(g: Graph, x: str, axes: Sequence[int], keepdims: int = 1, name: str = "") -> str:
    if g.opset >= 18:
        return g.op(
            "ReduceMean",
            x,
            g.const(list(axes), "axes", np.int64),
            keepdims=keepdims,
            name=name or None,
        )
    return g.op("ReduceMean", x, axes=list(axes), keepdims=keepdims, name=name or None)


def decomposed_ln(
    g: Graph,
    x: str,
    *,
    square: str = "pow",
    divide: str = "div",
    affine: bool = True,
    exponent: float = 2.0,
    keepdims: int = 1,
    axes: Sequence[int] = (-1,),
    gamma_shape: Sequence[int] = (HIDDEN,),
    eps: float = 1e-5,
    noop_casts: bool = False,
    widen: Any = None,
) -> str:
    """The decomposed LayerNorm as exporters write it below opset 17; returns its output.
    `widen` (a numpy dtype): the variance and division in that type, between Casts, as
    TorchScript writes a float16 LayerNorm."""
    if noop_casts:
        x = g.op("Cast", x, to=g.elem)
    mean = reduce_mean(g, x, axes, keepdims, name="mean")
    d = g.op("Sub", x, mean)
    wide = g.dtype if widen is None else widen
    if widen is not None:
        d = g.op("Cast", d, to=helper.np_dtype_to_tensor_dtype(np.dtype(widen)), name="up")
    two = g.const(exponent, "two", wide)
    sq = g.op("Pow", d, two) if square == "pow" else g.op("Mul", d, d)
    var = reduce_mean(g, sq, axes, keepdims, name="var")
    std = g.op("Sqrt", g.op("Add", var, g.const(eps, "eps", wide)))
    y = g.op("Div", d, std) if divide == "div" else g.op("Mul", d, g.op("Reciprocal", std))
    if widen is not None:
        y = g.op("Cast", y, to=g.elem)
    if not affine:
        return y
    if noop_casts:
        y = g.op("Cast", y, to=g.elem)
    y = g.op("Mul", y, g.const(g.rng.uniform(0.8, 1.2, gamma_shape), "gamma"))
    return g.op("Add", g.const(g.rng.uniform(-0.1, 0.1, gamma_shape), "beta"), y)


def op_ln(g: Graph, x: str, eps: float = 1e-5) -> str:
    gamma = g.const(g.rng.uniform(0.8, 1.2, HIDDEN), "gamma")
    beta = g.const(g.rng.uniform(-0.1, 0.1, HIDDEN), "beta")
    return g.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=eps)


def linear(g: Graph, x: str, n_out: int, *, bias: str = "", name: str = "") -> str:
    """MatMul with a constant weight; bias "" (none), "after" (Add(y, b)) or "first" (Add(b, y))."""
    y = g.op("MatMul", x, g.random([HIDDEN, n_out], "W"), name=name or None)
    if bias == "after":
        return g.op("Add", y, g.random([n_out], "b"))
    if bias == "first":
        return g.op("Add", g.random([n_out], "b"), y)
    return y


def qkv_block(g: Graph, n: str, x: str) -> None:
    """Q, K, V Linears on `n` (two bias orders and none) and a residual Add reading `n`."""
    q = linear(g, n, HIDDEN, bias="first")
    k = linear(g, n, HIDDEN, bias="after")
    v = linear(g, n, 4)
    g.outputs += [q, k, v, g.op("Add", n, x)]


# -- running -----------------------------------------------------------------------------------


def feeds(model: onnx.ModelProto, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Per input: normal values, then every row along the last axis constant (zero variance,
    values exact in binary so the mean is exact too), then wide values."""
    rng = np.random.default_rng(seed)
    runs: list[dict[str, np.ndarray]] = [{}, {}, {}]
    for value in model.graph.input:
        t = value.type.tensor_type
        shape = [
            d.dim_value if d.HasField("dim_value") else SIZES[d.dim_param] for d in t.shape.dim
        ]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        runs[0][value.name] = rng.standard_normal(shape).astype(dtype)
        rows = rng.integers(-8, 8, size=[*shape[:-1], 1]) * 0.25
        runs[1][value.name] = np.broadcast_to(rows, shape).astype(dtype)
        runs[2][value.name] = (rng.standard_normal(shape) * 30 + 5).astype(dtype)
    return runs


def assert_same(original: onnx.ModelProto, fused: onnx.ModelProto, tolerance: float = 1e-4) -> None:
    """Every output of the fused model (plugin) matches the original (onnxruntime) within
    `tolerance` relative to the output's scale, and is finite where the original is."""
    onnx.checker.check_model(fused, full_check=True)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    ref = onnxruntime.InferenceSession(
        original.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    got = session(fused, kernel=KERNEL)
    for inputs in feeds(original):
        expected = ref.run(None, inputs)
        actual = got.run(None, inputs)
        for info, e, a in zip(original.graph.output, expected, actual, strict=True):
            assert e.shape == a.shape, info.name
            assert np.isfinite(e).all(), f"{info.name}: the original is not finite on these inputs"
            assert np.isfinite(a).all(), f"{info.name}: the fused model is not finite"
            scale = max(1.0, float(np.abs(e.astype(np.float64)).max()))
            err = float(np.abs(e.astype(np.float64) - a.astype(np.float64)).max())
            assert err <= tolerance * scale, f"{info.name}: max abs error {err} (scale {scale})"


def fuse(model: onnx.ModelProto) -> fuser.api.FusionResult:
    """This pattern alone, every valid match fused (no cost-model veto)."""
    return fuser.fuse(model, patterns=[PATTERN], decider=AlwaysFuse())


def fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "fuser"]


def reasons(result: fuser.api.FusionResult) -> list[str]:
    return [r.reason for r in result.report.rejected if r.pattern == PATTERN]


def attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# -- positive ----------------------------------------------------------------------------------


def test_decomposed_qkv_with_residual_is_one_node_with_four_outputs() -> None:
    g = Graph(opset=13)
    x = g.input("x", ["batch", "seq", HIDDEN])
    n = decomposed_ln(g, x)
    qkv_block(g, n, x)
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}
    (node,) = fused_nodes(result.model)
    assert node.op_type == "LayerNormMatMul"
    assert list(node.output) == [n, *g.outputs[:3]]  # normalized (read by the residual), Q, K, V
    assert attrs(node)["has_bias"] == [1, 1, 0]
    assert attrs(node)["stash_type"] == 0
    assert attrs(node)["axis"] == -1
    # 9 LayerNorm nodes + 3 MatMuls + 2 bias Adds become 1; the residual Add stays.
    assert result.report.nodes_before == 15
    assert result.report.nodes_after == 2
    assert_same(model, result.model)


@pytest.mark.parametrize(
    ("opset", "style"),
    [
        (13, {"square": "mul"}),
        (13, {"divide": "reciprocal"}),
        (13, {"affine": False}),
        (13, {"noop_casts": True}),
        (17, {}),
        (18, {"square": "mul", "divide": "reciprocal", "noop_casts": True}),
        (18, {"axes": (1, 2), "gamma_shape": (5, HIDDEN)}),
        (13, {"axes": (-2, -1), "gamma_shape": (1, 5, HIDDEN)}),
    ],
)
def test_decomposed_variants(opset: int, style: dict[str, Any]) -> None:
    g = Graph(opset=opset)
    x = g.input("x", ["batch", 5, HIDDEN])
    n = decomposed_ln(g, x, **style)
    g.outputs += [linear(g, n, 6, bias="first"), linear(g, n, 3)]
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}, reasons(result)
    assert len(result.model.graph.node) == 1  # no reader besides the MatMuls: no normalized
    (node,) = fused_nodes(result.model)
    assert node.output[0] == ""
    assert attrs(node)["axis"] == -len(style.get("axes", (-1,)))
    assert_same(model, result.model)


@pytest.mark.parametrize("opset", [17, 18])
def test_layernormalization_op_with_shape_reader(opset: int) -> None:
    g = Graph(opset=opset)
    x = g.input("x", ["batch", "seq", HIDDEN])
    n = op_ln(g, x)
    g.outputs += [linear(g, n, 6, bias="after"), linear(g, n, 6, bias="first"), g.op("Shape", n)]
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}
    (node,) = fused_nodes(result.model)
    # the Shape reads X (same shape) instead, so the normalized value is not written out for it
    assert node.output[0] == ""
    shape = next(n for n in result.model.graph.node if n.op_type == "Shape")
    assert list(shape.input) == [x]
    assert attrs(node)["stash_type"] == 1
    assert [n.op_type for n in result.model.graph.node] == ["LayerNormMatMul", "Shape"]
    assert_same(model, result.model)


def test_gpt2_reshape_gemm_folds_trans_b_alpha_beta() -> None:
    g = Graph(opset=13)
    x = g.input("x", ["batch", "seq", HIDDEN])
    n = decomposed_ln(g, x)
    flat = g.op("Reshape", n, g.const([-1, HIDDEN], "flat", np.int64))
    w = g.random([12, HIDDEN], "W")  # transB: [N, K]
    y = g.op("Gemm", flat, w, g.random([1, 12], "C"), transB=1, alpha=0.5, beta=2.0)
    plain = g.op("Reshape", n, g.const([-1, HIDDEN], "flat", np.int64))
    z = g.op("Gemm", plain, g.random([HIDDEN, 4], "W2"), g.random([4], "C2"))
    g.outputs += [y, z, g.op("Shape", n)]
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}
    (node,) = fused_nodes(result.model)
    assert attrs(node)["flatten"] == [1, 1]
    assert attrs(node)["has_bias"] == [1, 1]
    folded = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    assert folded[node.input[3]].shape == (HIDDEN, 12)  # W' = alpha * W^T
    assert folded[node.input[4]].shape == (12,)  # b' = beta * C, as a row
    assert_same(model, result.model)


def torchscript_conv1d(g: Graph, n: str, n_out: int, *, share_with: str = "") -> str:
    """HF GPT-2 `Conv1D` as the TorchScript exporter writes it: `x.view(-1, x.size(-1))` with
    the view's shape computed from `Shape(x)`, then Gemm, then the view back to
    `x.size()[:-1] + (nf,)`, also from Shape."""
    i64 = np.int64
    last = g.op(
        "Slice",
        g.op("Shape", n, name="view_shape"),
        g.const([-1], "s", i64),
        g.const([np.iinfo(i64).max], "e", i64),
        g.const([0], "a", i64),
    )
    last = g.op("Unsqueeze", g.op("Squeeze", last, g.const([0], "a", i64)), g.const([0], "a", i64))
    target = g.op("Concat", g.const([-1], "minus1", i64), last, axis=0, name="view_target")
    if share_with:  # another view with the same computed shape
        g.outputs.append(g.op("Reshape", share_with, target, name="other_view"))
    flat = g.op("Reshape", n, target, name="view")
    y = g.op("Gemm", flat, g.random([HIDDEN, n_out], "W"), g.random([n_out], "C"))
    lead = g.op("Slice", g.op("Shape", n), g.const([0], "s", i64), g.const([-1], "e", i64))
    size_out = g.op("Concat", lead, g.const([n_out], "nf", i64), axis=0)
    return g.op("Reshape", y, size_out)


@pytest.mark.parametrize("opset", [13, 17])
def test_torchscript_gpt2_conv1d_with_computed_view_shape(opset: int) -> None:
    g = Graph(opset=opset)
    x = g.input("x", ["batch", "seq", HIDDEN])
    n = decomposed_ln(g, x) if opset < 17 else op_ln(g, x)
    g.outputs.append(g.op("Add", torchscript_conv1d(g, n, 3 * HIDDEN), g.const(1.0, "one")))
    g.shapes[g.outputs[-1]] = ["batch", "seq", 3 * HIDDEN]
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}, reasons(result)
    (node,) = fused_nodes(result.model)
    assert attrs(node)["flatten"] == [1]
    names = {n.name for n in result.model.graph.node}
    assert not names & {"view_shape", "view_target", "view"}  # the view's shape went with it
    # the Shape giving the view back its leading dims now reads X (same shape), so the
    # normalized value is not written out just for its dims
    assert node.output[0] == ""
    shapes = [s for s in result.model.graph.node if s.op_type == "Shape"]
    assert shapes
    assert all(list(s.input) == [x] for s in shapes)
    assert_same(model, result.model)


def test_computed_view_shape_without_known_rank() -> None:
    """Shape inference knows nothing of `x` here; the view's [-1, size(-1)] is still read, and
    the last dim taken from gamma."""
    g = Graph(opset=17)
    shape = g.input("shape", ["rank"], TensorProto.INT64)
    x = g.op("Reshape", g.input("x0", ["batch", "seq", HIDDEN]), shape)  # rank unknown
    n = op_ln(g, x)
    y = torchscript_conv1d(g, n, 6)
    g.outputs.append(y)
    g.shapes[y] = ["batch", "seq", 6]
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}, reasons(result)
    assert attrs(fused_nodes(result.model)[0])["flatten"] == [1]
    x0 = np.random.default_rng(2).standard_normal((2, 5, HIDDEN)).astype(np.float32)
    inputs = {"x0": x0, "shape": np.array([5, 2, HIDDEN], np.int64)}
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, inputs)[0]
    actual = session(result.model, kernel=KERNEL).run(None, inputs)[0]
    assert float(np.abs(expected - actual).max()) <= 1e-4 * max(1.0, float(np.abs(expected).max()))


def test_view_shape_read_elsewhere_leaves_that_gemm_unfused() -> None:
    g = Graph(opset=17)
    x = g.input("x", ["batch", "seq", HIDDEN])
    n = op_ln(g, x)
    y = torchscript_conv1d(g, n, 4, share_with=x)
    g.outputs += [y, linear(g, n, 5)]
    g.shapes[y] = ["batch", "seq", 4]
    g.shapes["other_view_out"] = ["rows", HIDDEN]
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}
    (record,) = result.report.fusions
    assert record.notes == (
        "left unfused: the target shape of Reshape 'view' is computed by 'view_target', which is "
        "also read elsewhere, so the Reshape cannot be fused away",
        "normalized also output, for 'view' (Reshape)",
        "Shape 'view_shape' reads 'x' (same shape) instead of 'LayerNormalization_0_out'",
        "Shape 'Shape_9' reads 'x' (same shape) instead of 'LayerNormalization_0_out'",
    )
    assert attrs(fused_nodes(result.model)[0])["flatten"] == [0]
    assert_same(model, result.model)


def test_noop_cast_between_layernorm_and_linears_is_looked_through() -> None:
    g = Graph(opset=17)
    x = g.input("x", ["batch", "seq", HIDDEN])
    n = op_ln(g, x)
    same = g.op("Cast", n, to=TensorProto.FLOAT, name="noop")
    widen = g.op("Cast", n, to=TensorProto.DOUBLE, name="widen")  # not a no-op: a reader
    g.outputs += [linear(g, same, 4, bias="after"), linear(g, same, 2), widen]
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}
    (node,) = fused_nodes(result.model)
    assert node.output[0] == n
    assert [n.name for n in result.model.graph.node if n.op_type == "Cast"] == ["widen"]
    assert_same(model, result.model)


def test_static_reshape_to_rows_times_hidden_is_a_flatten() -> None:
    g = Graph(opset=17)
    n = op_ln(g, g.input("x", [2, 5, HIDDEN]))
    flat = g.op("Reshape", n, g.const([10, HIDDEN], "shape", np.int64))
    g.outputs.append(g.op("Gemm", flat, g.random([HIDDEN, 3], "W"), g.random([3], "C")))
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}
    assert len(result.model.graph.node) == 1
    assert_same(model, result.model)


def test_gemm_on_2d_layernorm_output() -> None:
    g = Graph(opset=17)
    x = g.input("x", ["tokens", HIDDEN])
    n = op_ln(g, x)
    g.outputs.append(g.op("Gemm", n, g.random([HIDDEN, 5], "W"), g.random([5], "C"), alpha=2.0))
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}
    assert attrs(fused_nodes(result.model)[0])["flatten"] == [0]
    assert_same(model, result.model)


@pytest.mark.parametrize("eps", [1e-12, 1e-30, 0.0])
def test_epsilon_is_kept_exactly(eps: float) -> None:
    """A tiny epsilon is not zero: on zero-variance rows 0 / sqrt(eps) is 0, 0 / 0 is NaN."""
    g = Graph(opset=13)
    x = g.input("x", ["batch", "seq", HIDDEN])
    n = decomposed_ln(g, x, eps=eps)
    g.outputs.append(linear(g, n, 4, bias="after"))
    model = g.model()
    result = fuse(model)
    (node,) = fused_nodes(result.model)
    assert attrs(node)["epsilon"] == float(np.float32(eps))
    constant_rows = feeds(model)[1]
    out = session(result.model, kernel=KERNEL).run(None, constant_rows)[0]
    if eps > 0:
        assert np.isfinite(out).all()
        assert_same(model, result.model)
    else:
        assert np.isnan(out).all()  # as the original: 0 / sqrt(0)


@pytest.mark.parametrize("kind", ["op", "decomposed"])
def test_float16(kind: str) -> None:
    g = Graph(opset=17, dtype=np.float16)
    x = g.input("x", ["batch", "seq", HIDDEN])
    n = op_ln(g, x) if kind == "op" else decomposed_ln(g, x, divide="reciprocal")
    qkv_block(g, n, x)
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}
    assert_same(model, result.model, tolerance=1e-2)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    opset=st.sampled_from([13, 17, 18]),
    as_op=st.booleans(),
    square=st.sampled_from(["pow", "mul"]),
    divide=st.sampled_from(["div", "reciprocal"]),
    affine=st.booleans(),
    noop_casts=st.booleans(),
    biases=st.lists(st.sampled_from(["", "after", "first"]), min_size=1, max_size=3),
    shape_reader=st.booleans(),
    residual=st.booleans(),
)
def test_any_exporter_variant_fuses_into_one_node(
    opset: int,
    as_op: bool,
    square: str,
    divide: str,
    affine: bool,
    noop_casts: bool,
    biases: list[str],
    shape_reader: bool,
    residual: bool,
) -> None:
    g = Graph(opset=opset)
    x = g.input("x", ["batch", "seq", HIDDEN])
    if as_op and opset >= 17:
        n = op_ln(g, x)
    else:
        n = decomposed_ln(g, x, square=square, divide=divide, affine=affine, noop_casts=noop_casts)
    g.outputs += [linear(g, n, 3 + i, bias=b) for i, b in enumerate(biases)]
    if shape_reader:
        g.outputs.append(g.op("Shape", n))
    if residual:
        g.outputs.append(g.op("Add", x, n))
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}, reasons(result)
    (node,) = fused_nodes(result.model)
    # a Shape reader is re-pointed to X; only a residual reader needs the normalized output
    assert node.output[0] == (n if residual else "")
    assert attrs(node)["has_bias"] == [1 if b else 0 for b in biases]
    assert len(result.model.graph.node) == 1 + shape_reader + residual
    assert_same(model, result.model)


def test_inside_an_if_branch_with_weights_from_the_outer_graph() -> None:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((HIDDEN, 4)).astype(np.float32), "W"),
        numpy_helper.from_array(np.ones(HIDDEN, np.float32), "g"),
        numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "b"),
    ]
    then_nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], epsilon=1e-6),
        helper.make_node("MatMul", ["n", "W"], ["y_then"]),
    ]
    y_then = helper.make_tensor_value_info("y_then", TensorProto.FLOAT, ["tokens", 4])
    then = helper.make_graph(then_nodes, "then", [], [y_then])
    y_else = helper.make_tensor_value_info("y_else", TensorProto.FLOAT, ["tokens", 4])
    other = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y_else"])], "else", [], [y_else]
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        "branchy",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", HIDDEN]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens", 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}
    (record,) = result.report.fusions
    assert record.graph == "If.then_branch"
    x = np.random.default_rng(1).standard_normal((7, HIDDEN)).astype(np.float32)
    feeds_ = {"c": np.array(True), "x": x}
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds_)[0]
    actual = session(result.model, kernel=KERNEL).run(None, feeds_)[0]
    assert float(np.abs(expected - actual).max()) <= 1e-4 * max(1.0, float(np.abs(expected).max()))


@pytest.mark.parametrize("widen", [np.float32, np.float64])
def test_torchscript_float16_layernorm_with_wide_variance(widen: Any) -> None:
    """TorchScript below opset 17 writes a float16 LayerNorm with the mean in float16 and the
    variance in float64 (Cast after the Sub, Cast back after the Div): fused with stash_type=1,
    and the report says so."""
    g = Graph(opset=13, dtype=np.float16)
    x = g.input("x", ["batch", "seq", HIDDEN])
    qkv_block(g, decomposed_ln(g, x, widen=widen), x)
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}, reasons(result)
    (node,) = fused_nodes(result.model)
    assert attrs(node)["stash_type"] == 1
    assert attrs(node)["epsilon"] == float(np.float32(1e-5))
    (record,) = result.report.fusions
    assert record.notes[0].startswith("statistics in float32 (stash_type=1); the original computes")
    assert "Cast 'up'" in record.notes[0]
    assert_same(model, result.model, tolerance=1e-2)


def test_fusing_twice_changes_nothing() -> None:
    g = Graph(opset=13)
    x = g.input("x", ["batch", "seq", HIDDEN])
    qkv_block(g, decomposed_ln(g, x), x)
    once = fuse(g.model()).model
    twice = fuse(once)
    assert twice.report.summary.get(PATTERN, 0) == 0
    assert twice.model.SerializeToString() == once.SerializeToString()


# -- negative ----------------------------------------------------------------------------------


def refused(model: onnx.ModelProto) -> list[str]:
    result = fuse(model)
    assert result.report.summary.get(PATTERN, 0) == 0
    assert not fused_nodes(result.model)
    return reasons(result)


def one_linear(g: Graph, n: str) -> onnx.ModelProto:
    g.outputs.append(linear(g, n, 4, bias="after"))
    return g.model()


def test_refuses_exponent_3() -> None:
    g = Graph()
    n = decomposed_ln(g, g.input("x", ["batch", "seq", HIDDEN]), exponent=3.0)
    (reason,) = refused(one_linear(g, n))
    assert "raises to 3; the variance needs exactly 2" in reason


def test_refuses_keepdims_0() -> None:
    # [8, 8] input: Sub(x, mean[8]) is a valid graph, but broadcasts the mean along the wrong axis.
    g = Graph()
    n = decomposed_ln(g, g.input("x", [HIDDEN, HIDDEN]), keepdims=0)
    (reason,) = refused(one_linear(g, n))
    assert "ReduceMean 'mean' has keepdims=0; the statistic must keep its axis" in reason


def test_refuses_axes_not_trailing() -> None:
    g = Graph(opset=18)
    n = decomposed_ln(g, g.input("x", ["batch", 5, HIDDEN]), axes=(1,), gamma_shape=(HIDDEN,))
    (reason,) = refused(one_linear(g, n))
    assert "ReduceMean 'mean' averages over axes [-2] of a rank-3 input" in reason
    assert "needs the trailing axes" in reason


def test_refuses_gamma_broadcasting_over_a_non_normalized_axis() -> None:
    g = Graph()
    n = decomposed_ln(g, g.input("x", ["batch", 5, HIDDEN]), gamma_shape=(5, 1))
    (reason,) = refused(one_linear(g, n))
    assert reason.startswith("gamma 'gamma_")
    assert "varies along axis 1, which is not normalized (only the last 1 are)" in reason


def test_refuses_mean_that_is_a_graph_output() -> None:
    g = Graph()
    n = decomposed_ln(g, g.input("x", ["batch", "seq", HIDDEN]))
    g.outputs.append("mean_out")
    (reason,) = refused(one_linear(g, n))
    assert (
        reason
        == "internal value 'mean_out' is a graph output, and LayerNormMatMul cannot output it"
    )


def test_refuses_variance_read_elsewhere() -> None:
    g = Graph()
    n = decomposed_ln(g, g.input("x", ["batch", "seq", HIDDEN]))
    g.outputs.append(g.op("Sqrt", "var_out", name="other"))
    (reason,) = refused(one_linear(g, n))
    assert "internal value 'var_out' is also read by 'other' (Sqrt) outside the match" in reason


def test_refuses_layernormalization_whose_mean_is_read() -> None:
    g = Graph(opset=17)
    x = g.input("x", ["batch", "seq", HIDDEN])
    gamma, beta = g.const(np.ones(HIDDEN), "gamma"), g.const(np.zeros(HIDDEN), "beta")
    ln = helper.make_node("LayerNormalization", [x, gamma, beta], ["n", "mu", "inv"], name="ln")
    g.nodes.append(ln)
    g.outputs += ["mu"]
    (reason,) = refused(one_linear(g, "n"))
    assert reason == "internal value 'mu' is a graph output, and LayerNormMatMul cannot output it"


def test_refuses_statistics_over_different_axes() -> None:
    g = Graph()
    x = g.input("x", ["batch", 5, HIDDEN])
    mean = reduce_mean(g, x, [-1], name="mean")
    d = g.op("Sub", x, mean)
    var = reduce_mean(g, g.op("Mul", d, d), [-2, -1], name="var")
    n = g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const(1e-5, "eps"))))
    (reason,) = refused(one_linear(g, n))
    assert reason == "ReduceMeans 'mean' and 'var' average over different axes"


def test_refuses_non_constant_weight() -> None:
    g = Graph()
    n = decomposed_ln(g, g.input("x", ["batch", "seq", HIDDEN]))
    w = g.input("w", [HIDDEN, 4])
    g.outputs.append(g.op("MatMul", n, w, name="proj"))
    (reason,) = refused(g.model())
    assert reason == "weight 'w' of MatMul 'proj' is a graph input, not a constant"


def test_refuses_overridable_initializer_weight() -> None:
    g = Graph(opset=17)
    n = op_ln(g, g.input("x", ["batch", "seq", HIDDEN]))
    g.outputs.append(linear(g, n, 4, name="proj"))
    model = g.model()
    weight = model.graph.node[-1].input[1]
    model.graph.input.append(helper.make_tensor_value_info(weight, TensorProto.FLOAT, [HIDDEN, 4]))
    (reason,) = refused(model)
    assert reason.startswith(f"weight '{weight}' of MatMul 'proj' is an overridable graph input")


def test_refuses_normalized_value_as_right_operand() -> None:
    g = Graph(opset=17)
    n = op_ln(g, g.input("x", ["batch", HIDDEN, HIDDEN]))
    g.outputs.append(g.op("MatMul", g.random([HIDDEN, HIDDEN], "A"), n, name="left"))
    (reason,) = refused(g.model())
    assert f"normalized value '{n}' is the right operand of MatMul 'left'" in reason


def test_reshape_that_does_not_flatten_is_refused() -> None:
    g = Graph(opset=17)
    n = op_ln(g, g.input("x", [2, 4, HIDDEN]))
    flat = g.op("Reshape", n, g.const([4, 2 * HIDDEN], "shape", np.int64), name="fold")
    g.outputs.append(g.op("Gemm", flat, g.random([2 * HIDDEN, 3], "W")))
    (reason,) = refused(g.model())
    assert "Reshape 'fold' to [4, 16] does not only flatten the leading dims" in reason


def test_unfused_matmul_is_noted_and_normalized_exported() -> None:
    g = Graph(opset=17)
    x = g.input("x", ["batch", "seq", HIDDEN])
    n = op_ln(g, x)
    g.outputs += [
        linear(g, n, 4),
        g.op("MatMul", n, g.op("Relu", g.input("w", [HIDDEN, 2]), name="wact"), name="dyn"),
    ]
    model = g.model()
    result = fuse(model)
    assert result.report.summary == {PATTERN: 1}
    (record,) = result.report.fusions
    expected = "weight 'wact_out' of MatMul 'dyn' is computed at run time, not a constant"
    assert record.notes == (
        f"left unfused: {expected}",
        "normalized also output, for 'dyn' (MatMul)",
    )
    assert fused_nodes(result.model)[0].output[0] == n
    assert_same(model, result.model)


@pytest.mark.parametrize("exponent", [2.0, 3.0])
def test_layernorm_without_linear_is_not_a_near_miss(exponent: float) -> None:
    """Whatever its constants: with no Linear after it, it is not this pattern."""
    g = Graph(opset=13)
    x = g.input("x", ["batch", "seq", HIDDEN])
    g.outputs.append(g.op("Relu", decomposed_ln(g, x, exponent=exponent)))
    result = fuse(g.model())
    assert result.report.summary.get(PATTERN, 0) == 0
    assert reasons(result) == []


# -- the fused op on its own -------------------------------------------------------------------


def test_reference_and_inference_agree_on_shapes() -> None:
    x = np.random.default_rng(1).standard_normal((2, 3, HIDDEN)).astype(np.float32)
    w0 = np.ones((HIDDEN, 5), np.float32)
    w1 = np.ones((HIDDEN, 2), np.float32)
    b1 = np.zeros(2, np.float32)
    a = {"axis": -1, "epsilon": 1e-5, "stash_type": 1, "has_bias": [0, 1], "flatten": [0, 1]}
    n, y0, y1 = reference([x, None, None, w0, w1, b1], a)
    assert (n.shape, y0.shape, y1.shape) == ((2, 3, HIDDEN), (2, 3, 5), (6, 2))
    infos = [
        fuser.fusedop.TensorInfo(TensorProto.FLOAT, s)
        for s in [("b", 3, HIDDEN), None, None, (HIDDEN, 5), (HIDDEN, 2), (2,)]
    ]
    infos[1] = infos[2] = None
    out = LAYERNORM_MATMUL.infer(infos, a)
    assert [o.shape for o in out if o] == [("b", 3, HIDDEN), ("b", 3, 5), (None, 2)]


# -- the models/ builders: every instance fused, outputs unchanged -----------------------------


@pytest.mark.parametrize(
    ("example", "fused", "linears"),
    [
        ("bert", 4, 8),  # opset 13, decomposed: 2*layers chains, 4*layers Linears
        ("bert17", 4, 8),
        ("bert18", 4, 8),  # opset 18: axes as input, Reciprocal, Mul(d, d), no-op Casts
        ("gpt", 5, 11),  # pre-LN, Q/K/V and gate/up on one LN
        ("gpt-noaffine", 5, 11),
        ("gpt2", 5, 5),  # LN -> Reshape -> Gemm, decomposed at opset 13
        ("gpt2-ln", 5, 5),
    ],
)
def test_models(example: str, fused: int, linears: int) -> None:
    model = get_example(example)
    result = fuse(model)
    assert result.report.summary == {PATTERN: fused}
    # A pooler head ([CLS] Gather -> dense) is a near miss with its reason, nothing else.
    pooler = "takes part of the normalized value"
    assert [r for r in reasons(result) if not (r.startswith("Gather ") and pooler in r)] == []
    assert sum(len(attrs(n)["has_bias"]) for n in fused_nodes(result.model)) == linears
    validation = fuser.validate(model, result.model, kernel=KERNEL)
    assert validation.ok, validation.to_dict()


# -- models exported by PyTorch (tests/data/exported, see its README) --------------------------

EXPORTED = Path(__file__).resolve().parent.parent / "data" / "exported"


@pytest.mark.parametrize(
    ("file", "fused", "linears", "flatten", "missed"),
    [
        ("bert-ts13.onnx", 4, 8, 0, ""),  # HF BERT, TorchScript: decomposed LN, MatMul + Add
        ("bert-dynamo18.onnx", 4, 8, 0, ""),  # dynamo: LayerNormalization op
        # HF GPT-2 Conv1D: view shape computed from Shape(n). ln_f -> view(-1, seq, hidden) ->
        # lm_head: the view's dims come from input_ids' shape, so TorchScript's (whose shape
        # inference names every dim apart) cannot be proven to keep ln_f's shape; the dynamo
        # export's can (the same symbolic dims before and after): fused.
        ("gpt2-ts14.onnx", 4, 4, 4, "Reshape '/model/transformer/Reshape_5' before MatMul"),
        ("gpt2-dynamo18.onnx", 5, 5, 4, ""),
        ("mixtral-dynamo18.onnx", 0, 0, 0, ""),  # RMSNorm: not a LayerNorm, and no near miss
    ],
)
def test_pytorch_exports(file: str, fused: int, linears: int, flatten: int, missed: str) -> None:
    model = onnx.load(str(EXPORTED / file))
    result = fuse(model)
    assert result.report.summary.get(PATTERN, 0) == fused
    assert [r[: len(missed)] for r in reasons(result)] == ([missed] if missed else [])
    nodes = fused_nodes(result.model)
    assert sum(len(attrs(n)["has_bias"]) for n in nodes) == linears
    assert sum(sum(attrs(n)["flatten"]) for n in nodes) == flatten
    validation = fuser.validate(model, result.model, kernel=KERNEL)
    assert validation.ok, validation.to_dict()


# -- pass-through forms: autocast's Cast(float16), identity Reshape (issue 8 item 3) ---------


def autocast_block(g: Graph, n: str, *, casts: int = 3, shared_cast: bool = False) -> list[str]:
    """Linears in float16 on the float32 LayerNorm output `n`, each behind its own
    Cast(float16) as autocast writes them (or one Cast shared by all); returns the outputs."""
    outs = []
    shared = g.op("Cast", n, to=TensorProto.FLOAT16) if shared_cast else ""
    for i in range(casts):
        a = shared or g.op("Cast", n, to=TensorProto.FLOAT16)
        w = g.const(g.rng.standard_normal([HIDDEN, 4 + i]) * 0.3, "W16", np.float16)
        y = g.op("MatMul", a, w)
        if i % 2 == 0:
            y = g.op("Add", y, g.const(g.rng.standard_normal(4 + i) * 0.1, "b16", np.float16))
        outs.append(y)
    return outs


@pytest.mark.parametrize(("form", "opset"), [("decomposed", 13), ("op", 17)])
@pytest.mark.parametrize("shared_cast", [False, True])
def test_autocast_layernorm_cast_float16_matmuls_fuse(
    form: str, opset: int, shared_cast: bool
) -> None:
    g = Graph(opset=opset)
    x = g.input("x", ["batch", "seq", HIDDEN])
    n = decomposed_ln(g, x) if form == "decomposed" else op_ln(g, x)
    g.outputs += [*autocast_block(g, n, shared_cast=shared_cast), g.op("Add", n, x)]
    model = g.model()
    result = fuse(model)
    assert reasons(result) == []
    (node,) = fused_nodes(result.model)
    assert attrs(node)["matmul_type"] == TensorProto.FLOAT16
    assert len(attrs(node)["has_bias"]) == 3
    assert not [n for n in result.model.graph.node if n.op_type == "Cast"]  # all inside
    assert_same(model, result.model, tolerance=1e-2)
    for kernel in ("reference", "npu"):
        assert fuser.validate(model, result.model, kernel=kernel).ok


def test_cast_value_read_elsewhere_is_a_near_miss() -> None:
    g = Graph(opset=17)
    x = g.input("x", ["batch", "seq", HIDDEN])
    n = op_ln(g, x)
    c = g.op("Cast", n, to=TensorProto.FLOAT16, name="to_half")
    w = g.const(g.rng.standard_normal([HIDDEN, 4]), "W16", np.float16)
    g.outputs += [g.op("MatMul", c, w), g.op("Relu", c, name="other")]
    result = fuse(g.model())
    assert not fused_nodes(result.model)
    (reason,) = reasons(result)
    assert "Cast 'to_half' of the normalized value" in reason
    assert "also read by 'other' (Relu)" in reason


def test_linears_in_two_dtypes_fuse_the_direct_ones_and_report_the_others() -> None:
    g = Graph(opset=17)
    x = g.input("x", ["batch", "seq", HIDDEN])
    n = op_ln(g, x)
    g.outputs += [linear(g, n, 4), *autocast_block(g, n, casts=1)]
    model = g.model()
    result = fuse(model)
    (node,) = fused_nodes(result.model)
    assert attrs(node).get("matmul_type", 0) == 0 and len(attrs(node)["has_bias"]) == 1
    (record,) = result.report.fusions
    assert any("for Linears in another dtype than the others" in m for m in record.notes)
    assert_same(model, result.model, tolerance=1e-2)


def test_reshape_keeping_the_shape_is_looked_through_and_one_moving_the_axis_is_refused() -> None:
    g = Graph(opset=17)
    x = g.input("x", ["batch", "seq", HIDDEN])
    same = g.op("Reshape", op_ln(g, x), g.const([0, 0, HIDDEN], "keep", np.int64))
    g.outputs += [linear(g, same, 4)]
    model = g.model()
    result = fuse(model)
    assert len(fused_nodes(result.model)) == 1, reasons(result)
    assert not [n for n in result.model.graph.node if n.op_type == "Reshape"]
    assert_same(model, result.model)

    g = Graph(opset=17)
    x = g.input("x", [2, 4, HIDDEN])
    moved = g.op("Reshape", op_ln(g, x), g.const([2, HIDDEN, 4], "moved", np.int64), name="mv")
    g.outputs += [g.op("MatMul", moved, g.random([4, 3], "W"))]
    result = fuse(g.model())
    assert not fused_nodes(result.model)
    (reason,) = reasons(result)
    assert "Reshape 'mv' to [2, 8, 4] does not only flatten the leading dims" in reason


@pytest.mark.parametrize("select", ["gather", "slice", "transpose_conv"])
def test_part_of_the_normalized_value_before_a_linear_is_a_near_miss(select: str) -> None:
    """ViT/BERT's [CLS] pooler head (Gather), a Slice, a Transpose -> Conv (issue 8 item 6)."""
    g = Graph(opset=17)
    x = g.input("x", [2, 5, HIDDEN])
    n = op_ln(g, x)
    if select == "gather":
        part = g.op("Gather", n, g.const(0, "cls", np.int64), axis=1, name="pick")
        g.outputs += [g.op("Gemm", part, g.random([HIDDEN, 3], "W"), name="head")]
    elif select == "slice":
        starts, ends = g.const([0], "s", np.int64), g.const([1], "e", np.int64)
        part = g.op("Slice", n, starts, ends, g.const([1], "a", np.int64), name="pick")
        g.outputs += [g.op("MatMul", part, g.random([HIDDEN, 3], "W"), name="head")]
    else:
        part = g.op("Transpose", n, perm=[0, 2, 1], name="pick")
        w = g.random([4, HIDDEN, 1], "Wc")
        g.outputs += [g.op("Conv", part, w, name="head")]
    result = fuse(g.model())
    assert not fused_nodes(result.model)
    (reason,) = reasons(result)
    assert reason.startswith(f"{graph_op(select)} 'pick' takes part of the normalized value")
    assert "before" in reason and "'head'" in reason


def graph_op(select: str) -> str:
    return {"gather": "Gather", "slice": "Slice", "transpose_conv": "Transpose"}[select]


@pytest.mark.parametrize("exponent", [0.5, 0.25])
def test_sqrt_written_as_pow_one_half(exponent: float) -> None:
    g = Graph(opset=13)
    x = g.input("x", ["batch", "seq", HIDDEN])
    g.outputs += [linear(g, decomposed_ln(g, x), 4)]
    model = g.model()
    (sqrt,) = [n for n in model.graph.node if n.op_type == "Sqrt"]
    half = numpy_helper.from_array(np.array(exponent, np.float32), "half")
    model.graph.initializer.append(half)
    sqrt.op_type, sqrt.name = "Pow", "root"
    sqrt.input.append("half")
    result = fuse(model)
    if exponent == 0.5:
        assert len(fused_nodes(result.model)) == 1, reasons(result)
        assert_same(model, result.model)
    else:
        assert not fused_nodes(result.model)
        (reason,) = reasons(result)
        assert "Pow 'root' raises the variance to 0.25" in reason
