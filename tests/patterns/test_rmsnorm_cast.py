"""RMSNorm in float32 -> Cast(float16) -> MatMuls (autocast / mixed-precision exports) =>
RmsNormMatMul with `matmul_type` (issue 8): statistics and N in float32, the Linears in
float16. One Cast per Linear (QKV) or one Cast for all (gate/up); the decomposed form and
the RMSNormalization op. Trap negatives: a Cast to a non-float type or to
float64 is no pass-through, a Cast whose output something else reads is a near miss."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from graph_builder import GraphBuilder
from onnx import TensorProto, helper

import fuser
from fuser.fusedop import DOMAIN
from fuser.testing import assert_runs_stock, reasons

D = 24
HALF = TensorProto.FLOAT16


class Graph(GraphBuilder):
    def __init__(self, opset: int = 13, seed: int = 0) -> None:
        self.opset, self.rng = opset, np.random.default_rng(seed)
        super().__init__()

    def half_linear(self, a: str, width: int, bias: bool) -> str:
        w = self.const(self.rng.standard_normal((D, width)) * 0.2, np.float16)
        y = self.op("MatMul", a, w)
        if bias:
            y = self.op("Add", y, self.const(self.rng.standard_normal(width) * 0.1, np.float16))
        self.outputs.append(y)
        return y

    def model(self) -> onnx.ModelProto:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", D])
        outs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in self.outputs]
        graph = helper.make_graph(self.nodes, "rms_cast", [x], outs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8
        return onnx.shape_inference.infer_shapes(model)


def rms(g: Graph, form: str) -> str:
    gamma = g.const(g.rng.uniform(0.5, 1.5, D))
    if form == "op":  # opset 23
        return g.op("RMSNormalization", "x", gamma, axis=-1, epsilon=1e-6)
    ms = g.op("ReduceMean", g.op("Pow", "x", g.const(2.0)), axes=[-1], keepdims=1)
    r = g.op("Sqrt", g.op("Add", ms, g.const(1e-6)))
    return g.op("Mul", gamma, g.op("Mul", "x", g.op("Reciprocal", r)))  # gamma first: Llama


def fused(model: onnx.ModelProto) -> tuple[fuser.FusionResult, list[onnx.NodeProto]]:
    result = fuser.fuse(model)
    return result, [n for n in result.model.graph.node if n.domain == DOMAIN]


def attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("form", ["decomposed", "op"])
@pytest.mark.parametrize(("shared", "widths"), [(False, (32, 16, 16)), (True, (40, 40))])
def test_rmsnorm_cast_float16_linears_fuse(form: str, shared: bool, widths: tuple[int]) -> None:
    """QKV behind one Cast each (as autocast writes them), gate/up behind one shared Cast; a
    residual reads N in float32 (then N is output too)."""
    g = Graph(23 if form == "op" else 13)
    n = rms(g, form)
    one = g.op("Cast", n, to=HALF) if shared else ""
    for i, width in enumerate(widths):
        g.half_linear(one or g.op("Cast", n, to=HALF), width, bias=i == 0)
    g.outputs.append(g.op("Add", n, "x", name="residual"))
    model = g.model()
    result, nodes = fused(model)
    assert reasons(result) == []
    (node,) = nodes
    assert node.op_type == "RmsNormMatMul"
    assert attrs(node)["matmul_type"] == HALF
    assert attrs(node)["has_bias"] == [1] + [0] * (len(widths) - 1)
    assert not [n for n in result.model.graph.node if n.op_type == "Cast"]  # all inside
    assert node.output[0]  # N, for the residual
    (record,) = result.report.fusions
    assert record.prediction is not None  # priced on the NPU: the kernel runs this form
    assert record.prediction.fused_cycles < record.prediction.unfused_cycles
    for kernel in ("reference", "npu"):
        assert fuser.validate(model, result, kernel=kernel).ok
    assert assert_runs_stock(model, result.model) == ["RmsNormMatMul"]
    assert node.overload.endswith("_tofloat16_" + "_".join(["mmb"] + ["mm"] * (len(widths) - 1)))


def test_cast_to_an_integer_type_is_no_pass_through() -> None:
    g = Graph()
    n = rms(g, "decomposed")
    g.outputs.append(g.op("Cast", n, to=TensorProto.INT32, name="to_int"))
    w = g.const(g.rng.standard_normal((D, 8)))
    g.outputs.append(g.op("MatMul", n, w, name="direct"))
    result, (node,) = fused(g.model())
    assert "matmul_type" not in attrs(node)
    assert node.output[0]  # N is output for the Cast, which stays outside
    assert [n.name for n in result.model.graph.node if n.op_type == "Cast"] == ["to_int"]
    (record,) = result.report.fusions
    assert "normalized also output, for 'to_int' (Cast)" in record.notes
    assert fuser.validate(g.model(), result, kernel="reference").ok


def test_cast_to_float64_is_no_pass_through() -> None:
    """Widening is not autocast's narrowing: the float64 MatMul stays outside, reading N."""
    g = Graph()
    n = rms(g, "decomposed")
    wide = g.op("Cast", n, to=TensorProto.DOUBLE, name="to_double")
    w64 = g.const(g.rng.standard_normal((D, 8)), np.float64)
    g.outputs.append(g.op("MatMul", wide, w64, name="in_double"))
    g.outputs.append(g.op("MatMul", n, g.const(g.rng.standard_normal((D, 8))), name="direct"))
    result, (node,) = fused(g.model())
    assert "matmul_type" not in attrs(node)
    assert len(attrs(node)["has_bias"]) == 1
    left = {n.name for n in result.model.graph.node if n.domain != DOMAIN}
    assert left == {"to_double", "in_double"}
    (record,) = result.report.fusions
    assert "normalized also output, for 'to_double' (Cast)" in record.notes


def test_cast_output_read_elsewhere_is_a_near_miss() -> None:
    g = Graph()
    n = rms(g, "decomposed")
    c = g.op("Cast", n, to=HALF, name="to_half")
    g.half_linear(c, 8, bias=False)
    g.outputs.append(g.op("Relu", c, name="other"))
    result, nodes = fused(g.model())
    assert not nodes
    (reason,) = reasons(result)
    assert "Cast 'to_half' of the normalized value" in reason
    assert "also read by 'other' (Relu)" in reason


def test_linears_in_two_dtypes_fuse_the_direct_ones_and_report_the_others() -> None:
    g = Graph()
    n = rms(g, "decomposed")
    g.outputs.append(g.op("MatMul", n, g.const(g.rng.standard_normal((D, 8))), name="direct"))
    g.half_linear(g.op("Cast", n, to=HALF, name="to_half"), 8, bias=True)
    model = g.model()
    result, (node,) = fused(model)
    assert "matmul_type" not in attrs(node)
    assert len(attrs(node)["has_bias"]) == 1
    (record,) = result.report.fusions
    assert any("for Linears in another dtype than the others" in m for m in record.notes)
    assert fuser.validate(model, result, kernel="reference").ok
