"""A float32 Llama exported under mixed precision (`llama(autocast=True)`: every Linear behind
Cast(float16), its output Cast back): each RMSNorm fuses with its float16 Linears through the
Casts (issue 8), priced on the NPU, and the fused model validates on the reference and the
simulated kernel and in stock onnxruntime through its bodies."""

from __future__ import annotations

import pytest
from fuser.models.llama import llama
from onnx import TensorProto

import fuser
from fuser.fusedop import DOMAIN
from fuser.testing import assert_runs_stock


@pytest.mark.parametrize("opset", [14, 18])
def test_autocast_llama_fuses_every_rmsnorm_through_its_casts(opset: int) -> None:
    layers = 2
    model = llama(layers=layers, autocast=True, opset=opset, seed=opset)
    casts = sum(n.op_type == "Cast" for n in model.graph.node)
    result = fuser.fuse(model)
    nodes = [n for n in result.model.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in nodes] == ["RmsNormMatMul"] * (2 * layers + 1)
    linears = [len(f.attributes["has_bias"]) for f in result.report.fusions]
    assert linears == [3, 2] * layers + [1]  # QKV, gate/up per layer, lm_head
    assert all(f.attributes["matmul_type"] == TensorProto.FLOAT16 for f in result.report.fusions)
    assert all(f.prediction is not None for f in result.report.fusions)
    # the Cast(float16) before each fused Linear is inside its node; the others stay
    assert sum(n.op_type == "Cast" for n in result.model.graph.node) == casts - sum(linears)
    for kernel in ("reference", "npu"):
        checked = fuser.validate(model, result, kernel=kernel, runs=2)
        assert checked.ok, [c.message() for c in checked.failures]
    assert set(assert_runs_stock(model, result.model, runs=2)) == {"RmsNormMatMul"}
