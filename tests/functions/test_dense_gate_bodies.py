"""SoftmaxTopK's dense form (Llama-4's router) runs through its function body in a plain
onnxruntime session and equals the original, at every opset with ScatterElements; unfused it
is plain ONNX computing the same."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime
import pytest
from fuser.models.moe_gates import DenseGate, dense_gate_model

import fuser
from fuser.fusedop import DOMAIN
from fuser.testing import assert_runs_stock, fuse_all

CASES = {
    "torchscript": DenseGate(),
    "dynamo top-3 of 15": DenseGate(fill_form="Expand", casts=False, experts=15, k=3),
    "fill 0": DenseGate(fill=0.0, k=2),
    "float32 values": DenseGate(cast_back=False, transpose=False),
}


def _fused(model: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.NodeProto]:
    fused = fuse_all(model, ["softmax_topk"]).model
    (node,) = [n for n in fused.graph.node if n.domain == DOMAIN]
    return fused, node


@pytest.mark.parametrize("opset", [11, 14, 18])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", list(CASES))
def test_dense_body_runs_stock(case: str, dtype: str, opset: int) -> None:
    gate = dataclasses.replace(CASES[case], dtype=dtype)
    model = dense_gate_model(gate, opset=opset)
    fused, node = _fused(model)
    f32 = "_f32" if dtype == "float16" and not gate.cast_back else ""
    # below opset 12 (no Constant by reference) k and fill are written in and named
    fill = "" if opset >= 12 else f"_k{gate.k}_fill{float(gate.fill)!r}"
    assert node.overload == f"topk_softmax_sigmoid_dense{f32}{fill}"
    assert (DOMAIN, node.overload) in {(f.domain, f.overload) for f in fused.functions}
    assert assert_runs_stock(model, fused, dim_size=9) == ["SoftmaxTopK"]


@pytest.mark.parametrize("case", list(CASES))
def test_unfuse_gives_plain_onnx_equal_to_the_original(case: str) -> None:
    gate = CASES[case]
    model = dense_gate_model(gate)
    fused, _ = _fused(model)
    plain = fuser.unfuse(fused).model
    assert not [n for n in plain.graph.node if n.domain == DOMAIN]
    x = np.random.default_rng(4).standard_normal((11, gate.experts)).astype(np.float32)
    x[0] = 1.0  # ties: the lower experts
    (a,), (b,) = (
        onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )
        for m in (model, plain)
    )
    np.testing.assert_array_equal(b, a)
