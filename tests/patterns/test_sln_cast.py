"""com.microsoft SimplifiedLayerNormalization -> Cast(float16) -> MatMuls with no value_info on
the norm's output, as onnxruntime's transformer optimizer writes such models (issue 8).

onnx has no schema for the contrib op, so shape inference leaves its output untyped; the
pattern takes the type from onnxruntime's schema (X: T, scale: V, Y: V, so Y has the scale's
type) and sees the Cast as the narrowing pass-through (float32 X) or a no-op (float16 X).
Compared with onnxruntime running the original (the op in the ONNX domain, where onnxruntime
serves it). Negatives: a scale whose type nothing says (refused with the reason), a float16
scale on a float32 X (its output is float16: not RmsNormMatMul's one dtype), a widening Cast,
a Cast also read elsewhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from graph_builder import GraphBuilder
from onnx import TensorProto, helper

import fuser
from fuser.compare import compare_values
from fuser.fusedop import DOMAIN
from fuser.ort import session
from fuser.testing import assert_runs_stock, reasons

D = 20
HALF = TensorProto.FLOAT16


class Graph(GraphBuilder):
    """One SLN over x [B, S, D] in `dtype` (scale in `scale_dtype`), nothing declared after."""

    def __init__(self, dtype: Any, scale_dtype: Any = None, scale: str = "") -> None:
        self.dtype = np.dtype(dtype)
        self.rng = np.random.default_rng(0)
        super().__init__()
        gamma = scale or self.const(self.rng.uniform(0.5, 1.5, D), scale_dtype or dtype)
        self.n = self.op(
            "SimplifiedLayerNormalization",
            "x",
            gamma,
            name="sln",
            domain="com.microsoft",
            axis=-1,
            epsilon=1e-6,
        )

    def linear(self, a: str, width: int, dtype: Any = np.float16, bias: bool = False) -> str:
        w = self.const(self.rng.standard_normal((D, width)) / np.sqrt(D), dtype)
        y = self.op("MatMul", a, w)
        if bias:
            y = self.op("Add", y, self.const(self.rng.standard_normal(width) * 0.1, dtype))
        self.outputs.append(y)
        return y

    def model(self) -> onnx.ModelProto:
        x = helper.make_tensor_value_info(
            "x", helper.np_dtype_to_tensor_dtype(self.dtype), ["B", "S", D]
        )
        outs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in self.outputs]
        graph = helper.make_graph(self.nodes, "sln_cast", [x], outs, self.inits)
        domains = {"", "com.microsoft"} | {n.domain for n in self.nodes}
        opsets = [helper.make_opsetid(d, 17 if d == "" else 1) for d in sorted(domains)]
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 8
        model = onnx.shape_inference.infer_shapes(model)
        assert not [v for v in model.graph.value_info if v.name == self.n]  # nothing says it
        return model


def feeds(dtype: Any, seed: int, batch: int) -> dict[str, np.ndarray]:
    """Seeded rows of awkward scale, one of them zero (epsilon alone in the mean square)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 7, D)) * rng.uniform(0.1, 4.0, (batch, 7, 1))
    x[0, 0] = 0
    return {"x": x.astype(dtype)}


def in_onnx_domain(model: onnx.ModelProto) -> onnx.ModelProto:
    """The original as onnxruntime runs it: its SLN in the ONNX domain."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        if node.domain == "com.microsoft":
            node.domain = ""
    return copy


def fuse(model: onnx.ModelProto) -> tuple[fuser.FusionResult, list[onnx.NodeProto]]:
    result = fuser.fuse(model, cache=False)
    return result, [n for n in result.model.graph.node if n.domain == DOMAIN]


def attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(("shared", "widths"), [(False, (24, 8, 8)), (True, (16, 16))])
def test_sln_cast_linears_fuse_and_match_onnxruntime(
    dtype: Any, shared: bool, widths: tuple[int, ...]
) -> None:
    """QKV behind one Cast each, gate/up behind one shared Cast; float32 X (the Cast narrows:
    matmul_type float16) and float16 X (the Cast is a no-op)."""
    g = Graph(dtype)
    one = g.op("Cast", g.n, to=HALF) if shared else ""
    for i, width in enumerate(widths):
        g.linear(one or g.op("Cast", g.n, to=HALF), width, bias=i == 0)
    model = g.model()
    result, nodes = fuse(model)
    assert reasons(result) == []
    (node,) = nodes
    assert node.op_type == "RmsNormMatMul" and len(result.model.graph.node) == 1
    a = attrs(node)
    assert a["has_bias"] == [1] + [0] * (len(widths) - 1)
    assert a["round_before_scale"] == 0 and a["stash_type"] == 1
    if np.dtype(dtype) == np.float32:
        assert a["matmul_type"] == HALF
    else:
        assert "matmul_type" not in a  # float16 -> float16: nothing to cast
    (record,) = result.report.fusions
    assert record.prediction is not None  # priced: the kernel runs this form
    assert record.prediction.fused_cycles < record.prediction.unfused_cycles

    original = onnxruntime.InferenceSession(
        in_onnx_domain(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    for seed, batch in ((0, 2), (1, 1)):
        x = feeds(dtype, seed, batch)
        expected = original.run(None, x)
        for kernel in ("reference", "npu"):
            got = session(result.model, kernel=kernel).run(None, x)
            for e, y in zip(expected, got, strict=True):
                assert y.dtype == np.float16 and y.shape == e.shape
                found = compare_values(e, y)
                assert found.ok, f"{kernel}, seed {seed}: {found}"
    assert assert_runs_stock(in_onnx_domain(model), in_onnx_domain(result.model)) == [
        "RmsNormMatMul"
    ]


def test_a_scale_of_unknown_type_is_refused_with_the_reason() -> None:
    """The scale comes from an op nothing has a schema for: the norm's output type, and so
    what the Cast does to it, is genuinely unknown."""
    g = Graph(np.float32, scale="made")
    g.nodes.insert(
        0, helper.make_node("MakeScale", ["x"], ["made"], name="make", domain="com.example")
    )
    g.linear(g.op("Cast", g.n, to=HALF, name="to_half"), 8)
    result, nodes = fuse(g.model())
    assert nodes == []
    assert (
        "Cast 'to_half' of the normalized value 'sln' feeds a Linear (output 'MatMul_3'), but "
        "the element type of 'sln' is unknown (no value_info, no schema to infer it), so the "
        "Cast cannot be checked to narrow it or to be a no-op" in reasons(result)
    )


def test_a_float16_scale_on_a_float32_input_is_refused() -> None:
    """onnxruntime gives Y the scale's type (checked: float16 here), RmsNormMatMul gives N X's."""
    g = Graph(np.float32, scale_dtype=np.float16)
    g.linear(g.op("Cast", g.n, to=HALF), 8)
    model = g.model()
    ran = onnxruntime.InferenceSession(
        in_onnx_domain(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    assert ran.run(None, feeds(np.float32, 0, 1))[0].dtype == np.float16
    result, nodes = fuse(model)
    assert nodes == []
    assert (
        "SimplifiedLayerNormalization 'sln' takes a float16 scale 'c0' on a float32 input, so "
        "its output is float16; RmsNormMatMul takes X and gamma in one dtype" in reasons(result)
    )


def test_a_widening_cast_is_no_pass_through() -> None:
    """Cast to float64 is not autocast's narrowing: that MatMul stays outside, reading N; the
    direct MatMul fuses."""
    g = Graph(np.float32)
    wide = g.op("Cast", g.n, to=TensorProto.DOUBLE, name="to_double")
    g.linear(wide, 8, np.float64)
    g.linear(g.n, 8, np.float32)
    result, (node,) = fuse(g.model())
    assert "matmul_type" not in attrs(node) and len(attrs(node)["has_bias"]) == 1
    assert [n.name for n in result.model.graph.node if n.op_type == "Cast"] == ["to_double"]
    assert node.output[0]  # N, for the Cast left outside


def test_a_cast_also_read_elsewhere_is_a_near_miss() -> None:
    g = Graph(np.float32)
    half = g.op("Cast", g.n, to=HALF, name="to_half")
    g.linear(half, 8)
    g.outputs.append(g.op("Relu", half, name="relu"))
    result, nodes = fuse(g.model())
    assert nodes == []
    assert any(
        "Cast 'to_half' of the normalized value 'sln' is also read by 'relu' (Relu)" in r
        for r in reasons(result)
    ), reasons(result)
