"""SoftmaxTopK's gating variants run through their function bodies in a plain onnxruntime
session and equal the original (one FunctionProto per variant, told apart by overload), and
unfuse back to plain ONNX that computes the same."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime
import pytest
from fuser.models.moe_gates import Gate, gate_model

import fuser
from fuser.fusedop import DOMAIN
from fuser.testing import assert_runs_stock, fuse_all

CASES = {
    "deepseek-ts": (Gate(), "softmax_topk_sigmoid_bias_group4of2maskninf_renorm_eps_scale"),
    "deepseek-dynamo-fill0": (
        Gate(mask_form="dynamo", fill=0.0, renorm="plain", scale=None),
        "softmax_topk_sigmoid_bias_group4of2mask0p0_renorm",
    ),
    "bias-only": (Gate(groups=None, renorm=None, scale=None), "softmax_topk_sigmoid_bias"),
    "groups-only": (
        Gate(bias=None, renorm="plain"), "softmax_topk_sigmoid_group4of2maskninf_renorm_scale"
    ),
    "sigmoid-topk": (Gate(bias=None, groups=None, renorm=None, scale=None), "softmax_topk_sigmoid"),
    "softmax-eps": (
        Gate(score="Softmax", bias=None, groups=None, scale=None, epsilon=1e-6),
        "softmax_topk_renorm_eps",
    ),
}  # fmt: skip


def _fused(model: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.NodeProto]:
    fused = fuse_all(model).model
    (node,) = [n for n in fused.graph.node if n.domain == DOMAIN]
    return fused, node


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", list(CASES))
def test_gating_body_runs_stock(case: str, dtype: str, opset: int) -> None:
    gate, variant = CASES[case]
    if dtype == "float16" and gate.renorm == "eps" and not np.float16(gate.epsilon):
        variant = variant.replace("_eps", "")  # 1e-20 is 0 in float16: no Add
    if dtype == "float16" and (gate.bias or gate.groups):  # the selection runs in float32
        variant = variant.replace("_sigmoid_", "_sigmoid_float16infloat_", 1)
    model = gate_model(dataclasses.replace(gate, dtype=dtype, sorted=1), opset=opset)
    fused, node = _fused(model)
    assert node.overload == f"{variant}_noprobs"
    assert (DOMAIN, node.overload) in {(f.domain, f.overload) for f in fused.functions}
    assert assert_runs_stock(model, fused, dim_size=9) == ["SoftmaxTopK"]


def test_opset_11_group_limit_uses_attribute_axes() -> None:
    model = gate_model(Gate(sorted=1), opset=11)
    fused, node = _fused(model)
    # opset 11: no Constant by reference, ReduceSum/Unsqueeze axes as attributes
    assert node.overload.startswith("softmax_topk_sigmoid_bias_group4of2maskninf_renorm")
    assert assert_runs_stock(model, fused, dim_size=5) == ["SoftmaxTopK"]


def test_one_function_per_variant() -> None:
    """Two gates of one variant share a body; a third of another variant gets its own."""
    a = gate_model(Gate(sorted=1, seed=1))
    b = gate_model(Gate(sorted=1, seed=2, scale=1.5))  # same structure: the scale by reference
    c = gate_model(Gate(sorted=1, groups=None))
    merged = onnx.compose.merge_models(
        onnx.compose.add_prefix(a, "a/"), onnx.compose.add_prefix(b, "b/"), io_map=[]
    )
    merged = onnx.compose.merge_models(merged, onnx.compose.add_prefix(c, "c/"), io_map=[])
    fused = fuse_all(merged).model
    assert sorted(n.overload for n in fused.graph.node if n.domain == DOMAIN) == [
        "softmax_topk_sigmoid_bias_group4of2maskninf_renorm_eps_scale_noprobs",
        "softmax_topk_sigmoid_bias_group4of2maskninf_renorm_eps_scale_noprobs",
        "softmax_topk_sigmoid_bias_renorm_eps_scale_noprobs",
    ]
    assert len([f for f in fused.functions if f.domain == DOMAIN]) == 2
    assert assert_runs_stock(merged, fused) == ["SoftmaxTopK"]


@pytest.mark.parametrize("case", list(CASES))
def test_unfuse_gives_plain_onnx_equal_to_the_original(case: str) -> None:
    gate, _ = CASES[case]
    model = gate_model(dataclasses.replace(gate, sorted=1))
    fused, _ = _fused(model)
    plain = fuser.unfuse(fused).model
    assert not [n for n in plain.graph.node if n.domain == DOMAIN]
    x = np.random.default_rng(4).standard_normal((11, gate.experts)).astype(np.float32)
    runs = [
        onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )
        for m in (model, plain)
    ]
    np.testing.assert_array_equal(runs[1][1], runs[0][1])
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-6, atol=1e-7)
