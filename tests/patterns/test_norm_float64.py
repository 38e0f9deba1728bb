"""Float64 LayerNorm and RMSNorm -> Linears (issue 8): fused, with a double epsilon that float32
cannot hold carried exactly as the fused node's last input (`exact_epsilon=1`).

The NPU has no float64 unit, so the kernels refuse double and the cost model leaves the fusion
unpriced (fused, no predicted win); the fused model runs in onnxruntime through the plugin's
reference and through its function body (stock onnxruntime, and after `unfuse`), and equals
the original's float64 run to a few units in the last place. The rows are chosen so that an
epsilon rounded to float32 would show: the variance is of the order of epsilon, where a
relative change of 2.5e-8 in epsilon moves the output by ~1e-8, a million times the tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser.fusedop import DOMAIN
from fuser.ort import NodeFailedError, session
from fuser.testing import reasons

D = 13  # an odd width: no lane-aligned shortcut
TOLERANCE = 1e-12  # relative to the output's scale: summation order differs, nothing else


class Graph:
    """A float64 test graph (onnx.helper), names generated, weights seeded."""

    def __init__(self, opset: int = 13, seed: int = 0) -> None:
        self.opset, self.rng = opset, np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[str] = []

    def input(self, name: str, shape: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.DOUBLE, list(shape)))
        return name

    def const(self, value: Any, name: str, dtype: Any = np.float64) -> str:
        if any(t.name == name for t in self.inits):  # the same constant again (e.g. "two")
            return name
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, name: str = "", **attrs: Any) -> str:
        name = name or f"{op_type}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=name, **attrs))
        return name

    def mean(self, x: str, name: str = "") -> str:
        if self.opset >= 18:
            axes = self.const([-1], f"axes_{len(self.inits)}", np.int64)
            return self.op("ReduceMean", x, axes, keepdims=1, name=name)
        return self.op("ReduceMean", x, axes=[-1], keepdims=1, name=name)

    def linear(self, n: str, width: int, bias: bool = False) -> str:
        w = self.const(self.rng.standard_normal((D, width)) * 0.3, f"w_{len(self.inits)}")
        y = self.op("MatMul", n, w)
        if bias:
            y = self.op("Add", y, self.const(self.rng.standard_normal(width), f"b_{y}"))
        self.outputs.append(y)
        return y

    def model(self) -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in self.outputs]
        graph = helper.make_graph(self.nodes, "f64", self.inputs, outs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8
        return onnx.shape_inference.infer_shapes(model)


def layer_norm(
    g: Graph, x: str, eps: str, square: str = "Pow", divide: str = "Div", tag: str = ""
) -> str:
    d = g.op("Sub", x, g.mean(x, f"mean{tag}"))
    sq = g.op("Pow", d, g.const(2.0, "two")) if square == "Pow" else g.op("Mul", d, d)
    ve = g.op("Add", g.mean(sq, f"var{tag}"), eps, name=f"add_eps{tag}")
    std = g.op("Sqrt", ve)
    n = g.op("Div", d, std) if divide == "Div" else g.op("Mul", d, g.op("Reciprocal", std))
    gamma = g.const(g.rng.uniform(0.5, 1.5, D), f"gamma_{len(g.inits)}")
    beta = g.const(g.rng.standard_normal(D), f"beta_{len(g.inits)}")
    return g.op("Add", g.op("Mul", n, gamma), beta)


def rms_norm(g: Graph, x: str, eps: str, square: str = "Pow", gamma: bool = True) -> str:
    sq = g.op("Pow", x, g.const(2.0, "two")) if square == "Pow" else g.op("Mul", x, x)
    ve = g.op("Add", g.mean(sq, "ms"), eps, name="add_eps")
    n = g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", ve)))
    if gamma:
        n = g.op("Mul", n, g.const(g.rng.uniform(0.5, 1.5, D), f"gamma_{len(g.inits)}"))
    return n


def feeds(model: onnx.ModelProto, norm: str, seed: int) -> dict[str, np.ndarray]:
    """Rows whose variance (LN) or mean square (RMS) is of the order of epsilon, where the
    epsilon's last bits show; the symbolic dim is 1 on odd seeds (batch 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for value in model.graph.input:
        dims = [d.dim_value or (1 if seed % 2 else 3) for d in value.type.tensor_type.shape.dim]
        offset = 2.0 if norm == "ln" else 0.0  # LN: a common offset the centring removes
        out[value.name] = offset + 3e-3 * rng.standard_normal(dims)
    return out


def ort_run(model: onnx.ModelProto, x: dict[str, np.ndarray], plugin: bool) -> list[np.ndarray]:
    if plugin:
        sess = session(model, kernel="reference")
    else:
        sess = onnxruntime.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
    return sess.run(None, x)


def assert_close(actual: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == np.float64
        scale = float(np.abs(e).max())
        err = float(np.abs(a - e).max())
        assert err <= TOLERANCE * scale, f"max error {err:.3g} at scale {scale:.3g}"


def fused_node(model: onnx.ModelProto, op: str) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.domain == DOMAIN]
    assert node.op_type == op
    return node


def attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def check_exact(original: onnx.ModelProto, op: str, norm: str, eps: float) -> onnx.ModelProto:
    """Fuse with the cost model, check the node carries epsilon exactly, and run it four ways
    against the original's float64 run in onnxruntime."""
    result = fuser.fuse(original)
    node = fused_node(result.model, op)
    got = attrs(node)
    assert got["exact_epsilon"] == 1
    assert got["epsilon"] == pytest.approx(float(np.float32(eps)), abs=0)
    carried = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    for c in result.model.graph.node:
        if c.op_type == "Constant":
            carried[c.output[0]] = numpy_helper.to_array(c.attribute[0].t)
    value = carried[node.input[-1]]
    assert value.dtype == np.float64
    assert value.size == 1
    assert float(value.reshape(-1)[0]) == eps  # bit-exact, not float32's 1e-5
    (record,) = result.report.fusions
    assert record.prediction is None  # no NPU win claimed: the kernel takes no double
    assert any("no float64 unit" in n for n in record.notes), record.notes
    plain = fuser.unfuse(result.model).model
    assert not [n for n in plain.graph.node if n.domain == DOMAIN]
    for seed in range(3):
        x = feeds(original, norm, seed)
        expected = ort_run(original, x, plugin=False)
        assert_close(ort_run(result.model, x, plugin=True), expected)  # the reference
        assert_close(ort_run(result.model, x, plugin=False), expected)  # the function body
        assert_close(ort_run(plain, x, plugin=False), expected)  # unfused again
    assert fuser.validate(original, result, kernel="reference").ok
    return result.model


# -- LayerNorm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
@pytest.mark.parametrize(
    ("opset", "square", "divide", "shape"),
    [
        (13, "Pow", "Div", ["B", 5, D]),
        (18, "Mul", "Reciprocal", ["B", D]),
        (17, "Pow", "Reciprocal", [1, 3, 2, D]),
    ],
)
def test_float64_layernorm_fuses_with_its_epsilon_exact(
    eps: float, opset: int, square: str, divide: str, shape: list[int | str]
) -> None:
    g = Graph(opset)
    n = layer_norm(g, g.input("x", shape), g.const(eps, "eps"), square, divide)
    for width, bias in ((7, True), (5, False), (11, True)):  # QKV of odd widths
        g.linear(n, width, bias)
    fused = check_exact(g.model(), "LayerNormMatMul", "ln", eps)
    node = fused_node(fused, "LayerNormMatMul")
    assert node.overload == "float64_statsfloat64_epsinput_scale_bias_mmb_mm_mmb"
    assert attrs(node)["has_bias"] == [1, 0, 1]


def test_rounding_the_epsilon_to_float32_would_be_seen() -> None:
    """The tolerance separates exact from float32-rounded: the same fused node with
    `epsilon` (float32's 1e-5) as the value it adds misses the original by far more."""
    g = Graph()
    n = layer_norm(g, g.input("x", ["B", 5, D]), g.const(1e-5, "eps"))
    g.linear(n, 7)
    original = g.model()
    fused = fuser.fuse(original).model
    node = fused_node(fused, "LayerNormMatMul")
    del node.input[-1]
    for a in node.attribute:
        if a.name == "exact_epsilon":
            a.i = 0
    x = feeds(original, "ln", 0)
    expected = ort_run(original, x, plugin=False)
    with pytest.raises(AssertionError, match="max error"):
        assert_close(ort_run(fused, x, plugin=True), expected)


def test_float64_epsilon_float32_holds_stays_an_attribute() -> None:
    """2**-20 is exact in float32: no input, and the node is as before (no exact_epsilon)."""
    g = Graph()
    n = layer_norm(g, g.input("x", ["B", 5, D]), g.const(2.0**-20, "eps"))
    g.linear(n, 7)
    result = fuser.fuse(g.model())
    node = fused_node(result.model, "LayerNormMatMul")
    assert "exact_epsilon" not in attrs(node)
    assert attrs(node)["epsilon"] == 2.0**-20
    assert list(node.input) == ["x", node.input[1], node.input[2], node.input[3]]
    assert fuser.validate(g.model(), result, kernel="reference").ok


def test_float64_epsilon_as_a_constant_node_and_shape_1() -> None:
    """An epsilon of shape [1] is passed on as it is; a [1, 1] one becomes a 0-d initializer."""
    for shape, reused in (([1], True), ([1, 1], False)):
        g = Graph()
        eps = g.op(
            "Constant",
            name="eps_const",
            value=numpy_helper.from_array(np.full(shape, 1e-6), "v"),
        )
        n = layer_norm(g, g.input("x", ["B", 5, D]), eps)
        g.linear(n, 7, bias=True)
        fused = check_exact(g.model(), "LayerNormMatMul", "ln", 1e-6)
        last = fused_node(fused, "LayerNormMatMul").input[-1]
        assert (last == "eps_const") is reused


def test_float64_epsilon_shared_by_two_layernorms_and_read_elsewhere() -> None:
    """One epsilon initializer read by two LayerNorms and by an unrelated Add: both fuse, each
    reads the same exact value, and the unrelated reader keeps it."""
    g = Graph()
    x = g.input("x", ["B", 5, D])
    eps = g.const(1e-5, "eps")
    n1 = layer_norm(g, x, eps)
    g.linear(n1, 7)
    h = g.op("Add", x, g.op("Sigmoid", x))
    n2 = layer_norm(g, h, eps, tag="2")
    g.linear(n2, 9, bias=True)
    g.outputs.append(g.op("Add", x, eps, name="other"))
    original = g.model()
    result = fuser.fuse(original)
    nodes = [n for n in result.model.graph.node if n.domain == DOMAIN]
    assert len(nodes) == 2
    assert all(n.input[-1] == "eps" for n in nodes)
    assert "eps" in {t.name for t in result.model.graph.initializer}
    x_feed = feeds(original, "ln", 1)
    assert_close(ort_run(result.model, x_feed, plugin=True), ort_run(original, x_feed, False))


@pytest.mark.parametrize("norm", ["ln", "rms"])
def test_float64_epsilon_not_a_constant_is_refused(norm: str) -> None:
    g = Graph()
    eps = g.input("eps", [])
    x = g.input("x", ["B", 5, D])
    n = layer_norm(g, x, eps) if norm == "ln" else rms_norm(g, x, eps)
    g.linear(n, 7)
    result = fuser.fuse(g.model())
    assert not [n for n in result.model.graph.node if n.domain == DOMAIN]
    assert "epsilon 'eps' of 'add_eps' is a graph input, not a constant" in reasons(result)


@pytest.mark.parametrize("norm", ["ln", "rms"])
def test_float64_epsilon_computed_at_run_time_is_refused(norm: str) -> None:
    g = Graph()
    x = g.input("x", ["B", 5, D])
    eps = g.op("Mul", g.const(1e-5, "eps0"), g.op("ReduceMax", x, keepdims=0), name="eps")
    n = layer_norm(g, x, eps) if norm == "ln" else rms_norm(g, x, eps)
    g.linear(n, 7)
    result = fuser.fuse(g.model())
    assert not [n for n in result.model.graph.node if n.domain == DOMAIN]
    assert "epsilon 'eps' of 'add_eps' is computed at run time, not a constant" in reasons(result)


@pytest.mark.parametrize("norm", ["ln", "rms"])
def test_float64_variance_plus_epsilon_read_elsewhere_is_refused(norm: str) -> None:
    g = Graph()
    x = g.input("x", ["B", 5, D])
    n = (
        layer_norm(g, x, g.const(1e-5, "eps"))
        if norm == "ln"
        else rms_norm(g, x, g.const(1e-5, "eps"))
    )
    g.linear(n, 7)
    g.outputs.append(g.op("Log", "add_eps", name="reader"))
    result = fuser.fuse(g.model())
    assert not [n for n in result.model.graph.node if n.domain == DOMAIN]
    op = "LayerNormMatMul" if norm == "ln" else "RmsNormMatMul"
    assert (
        f"internal value 'add_eps' is also read by 'reader' (Log) outside the match, and {op} "
        "cannot output it" in reasons(result)
    )


def test_float64_on_the_npu_kernel_is_refused_with_the_way_out() -> None:
    g = Graph()
    n = layer_norm(g, g.input("x", ["B", 5, D]), g.const(1e-5, "eps"))
    g.linear(n, 7)
    original = g.model()
    result = fuser.fuse(original)
    with pytest.raises(NodeFailedError, match="no float64 unit"):
        session(result.model, kernel="npu").run(None, feeds(original, "ln", 0))
    # `fuser validate` runs such a node on its reference instead and says so
    # (tests/validation/test_npu_fallback.py)


# -- RMSNorm -----------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
@pytest.mark.parametrize(
    ("opset", "square", "gamma", "shape"),
    [(13, "Pow", True, ["B", 5, D]), (18, "Mul", False, ["B", D]), (18, "Pow", True, [1, 1, D])],
)
def test_float64_rmsnorm_fuses_with_its_epsilon_exact(
    eps: float, opset: int, square: str, gamma: bool, shape: list[int | str]
) -> None:
    g = Graph(opset)
    n = rms_norm(g, g.input("x", shape), g.const(eps, "eps"), square, gamma)
    for width, bias in ((7, False), (9, False), (3, True)):  # gate/up/down-like, odd widths
        g.linear(n, width, bias)
    fused = check_exact(g.model(), "RmsNormMatMul", "rms", eps)
    node = fused_node(fused, "RmsNormMatMul")
    scale = "_scale" if gamma else ""
    assert node.overload == f"float64_statsfloat64_epsinput{scale}_mm_mm_mmb"
    assert attrs(node)["stash_type"] == 0
