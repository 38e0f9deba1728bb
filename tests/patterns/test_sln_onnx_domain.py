"""SimplifiedLayerNormalization in the ONNX domain (where onnxruntime registers it and its
transformer optimizer writes it) -> MatMuls, directly or behind autocast's Cast(float16): fused
like the com.microsoft spelling, and, since onnxruntime runs the original, validated end to end
on both kernels; the fused model loads in stock onnxruntime. Negatives keep the node with the
reason: a float16 scale on a float32 X, another axis, stash_type=0 in float16, inv_std_var
read outside."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from graph_builder import GraphBuilder
from onnx import TensorProto, helper

import fuser
from fuser.api import validate
from fuser.fusedop import DOMAIN
from fuser.testing import assert_runs_stock, reasons

D = 20
HALF = TensorProto.FLOAT16


class Graph(GraphBuilder):
    """x [B, S, D] in `dtype` -> one ONNX-domain SLN 'sln' (scale in `scale_dtype`)."""

    def __init__(self, dtype: Any, scale_dtype: Any = None, outputs: int = 1, **attrs: Any) -> None:
        self.dtype = np.dtype(dtype)
        self.rng = np.random.default_rng(5)
        super().__init__()
        gamma = self.const(self.rng.uniform(0.5, 1.5, D), scale_dtype or dtype)
        names = ["sln", "inv"][:outputs]
        attrs = {"axis": -1, "epsilon": 1e-6, "stash_type": 1, **attrs}
        self.nodes.append(
            helper.make_node(
                "SimplifiedLayerNormalization", ["x", gamma], names, name="sln", **attrs
            )
        )
        self.outputs += names[1:]

    def linear(self, a: str, width: int, dtype: Any, bias: bool = False) -> str:
        w = self.const(self.rng.standard_normal((D, width)) / np.sqrt(D), dtype)
        y = self.op("MatMul", a, w)
        if bias:
            y = self.op("Add", y, self.const(self.rng.standard_normal(width) * 0.1, dtype))
        self.outputs.append(y)
        return y

    def model(self, opset: int = 17) -> onnx.ModelProto:
        x = helper.make_tensor_value_info(
            "x", helper.np_dtype_to_tensor_dtype(self.dtype), ["B", "S", D]
        )
        # Outputs untyped, as the optimizer leaves the norm's value: only inference types them.
        outs = [onnx.ValueInfoProto(name=o) for o in self.outputs]
        graph = helper.make_graph(self.nodes, "sln_onnx", [x], outs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        return model


def fused(model: onnx.ModelProto) -> tuple[fuser.FusionResult, list[onnx.NodeProto]]:
    result = fuser.fuse(model, cache=False)
    return result, [n for n in result.model.graph.node if n.domain == DOMAIN]


def attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("opset", [14, 18])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("cast", [False, True])
def test_onnx_domain_sln_linears_fuse_and_validate(opset: int, dtype: Any, cast: bool) -> None:
    """QKV-like MatMuls (one with a bias) on N, or each behind its own Cast(float16)."""
    g = Graph(dtype)
    mm_dtype = np.float16 if cast else dtype
    for i, width in enumerate((24, 8, 8)):
        a = g.op("Cast", "sln", to=HALF) if cast else "sln"
        g.linear(a, width, mm_dtype, bias=i == 0)
    model = g.model(opset)
    result, nodes = fused(model)
    assert reasons(result) == []
    (node,) = nodes
    assert node.op_type == "RmsNormMatMul" and len(result.model.graph.node) == 1
    a = attrs(node)
    assert a["has_bias"] == [1, 0, 0] and a["epsilon"] == pytest.approx(1e-6)
    assert a["round_before_scale"] == 0 and a["stash_type"] == 1
    assert a.get("matmul_type") == (HALF if cast and np.dtype(dtype) == np.float32 else None)
    for kernel in ("reference", "npu"):
        checked = validate(model, result, kernel=kernel, dims={"B": 2, "S": 7})
        assert checked.ok, [c.message() for c in checked.failures]
        assert checked.kernel == kernel
        assert {c.node for c in checked.nodes if c.mode == "isolated"} == {node.name}
    assert assert_runs_stock(model, result.model) == ["RmsNormMatMul"]


def test_a_float16_scale_on_a_float32_input_is_refused() -> None:
    """Shape inference now types N float16 (the scale's type, as onnxruntime does)."""
    g = Graph(np.float32, scale_dtype=np.float16)
    g.linear(g.op("Cast", "sln", to=HALF), 8, np.float16)
    result, nodes = fused(g.model())
    assert nodes == []
    assert (
        "SimplifiedLayerNormalization 'sln' takes a float16 scale 'c0' on a float32 input, so "
        "its output is float16; RmsNormMatMul takes X and gamma in one dtype" in reasons(result)
    )


def test_another_axis_is_refused() -> None:
    g = Graph(np.float32, axis=1)
    g.linear("sln", 8, np.float32)
    result, nodes = fused(g.model())
    assert nodes == []
    assert (
        "SimplifiedLayerNormalization 'sln' normalizes from axis 1 of a rank-3 input; "
        "RmsNormMatMul normalizes the last axis only" in reasons(result)
    )


def test_float16_stash_type_0_is_refused() -> None:
    g = Graph(np.float16, stash_type=0)
    g.linear("sln", 8, np.float16)
    result, nodes = fused(g.model())
    assert nodes == []
    assert (
        "SimplifiedLayerNormalization 'sln' has stash_type=0 on a float16 input: "
        "onnxruntime's rounding there is not modeled" in reasons(result)
    )


def test_inv_std_var_read_outside_keeps_the_node() -> None:
    g = Graph(np.float32, outputs=2)
    g.linear("sln", 8, np.float32)
    model = g.model()
    result, nodes = fused(model)
    assert nodes == []
    assert "internal value 'inv' is a graph output, and RmsNormMatMul cannot output it" in (
        reasons(result)
    )
    assert [n.op_type for n in result.model.graph.node] == [
        "SimplifiedLayerNormalization",
        "MatMul",
    ]
