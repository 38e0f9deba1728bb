"""MoE builders: router structure, dtype casts, and numerics against a numpy MoE."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.models.moe import moe, qwen_router
from model_checks import check, op_counts, producer, random_inputs, readers, run


def _init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def _attr_i(node: onnx.NodeProto, name: str) -> int:
    return next(a.i for a in node.attribute if a.name == name)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _reference(model: onnx.ModelProto, x: np.ndarray, *, top_k: int, order: str,
               renormalize: bool) -> np.ndarray:  # fmt: skip
    """Mixtral/Qwen MoE written with loops over tokens: what the graph must compute."""
    tokens = x.reshape(-1, x.shape[-1]).astype(np.float64)
    logits = tokens @ _init(model, "/gate/weight")
    w1, w3, w2 = (_init(model, f"/experts/{n}") for n in ("w1", "w3", "w2"))
    out = np.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        if order == "softmax_topk":
            probs = _softmax(logits[t])
            chosen = np.argsort(-probs, kind="stable")[:top_k]
            weights = probs[chosen]
            if renormalize:
                weights = weights / weights.sum()
        else:
            chosen = np.argsort(-logits[t], kind="stable")[:top_k]
            weights = _softmax(logits[t][chosen])
        for e, w in zip(chosen, weights, strict=True):
            g, u = tokens[t] @ w1[e], tokens[t] @ w3[e]
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ w2[e])
    return out.reshape(x.shape)


@pytest.mark.parametrize(
    ("options", "top_k", "order", "renormalize"),
    [
        ({}, 2, "softmax_topk", True),
        ({"renormalize": False, "combine": "scatter"}, 2, "softmax_topk", False),
        ({"order": "topk_softmax"}, 2, "topk_softmax", False),
        ({"experts": 6, "top_k": 3, "combine": "scatter"}, 3, "softmax_topk", True),
    ],
)
def test_moe_matches_numpy(options: dict, top_k: int, order: str, renormalize: bool) -> None:
    model = moe(**options)
    check(model)
    feeds = random_inputs(model)
    got = run(model, feeds)[0]
    want = _reference(model, feeds["hidden_states"], top_k=top_k, order=order,
                      renormalize=renormalize)  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_router_chain_structure() -> None:
    model = moe()
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    assert producer(model, softmax.input[0]).op_type == "MatMul"
    (topk,) = readers(model, softmax.output[0])
    assert topk.op_type == "TopK"
    div, total = sorted(readers(model, topk.output[0]), key=lambda n: n.op_type)
    assert (div.op_type, total.op_type) == ("Div", "ReduceSum")
    assert div.input[0] == topk.output[0]
    assert div.input[1] == total.output[0]
    assert _attr_i(total, "keepdims") == 1
    assert "router_logits" in [o.name for o in model.graph.output]


def test_qwen_router_has_no_renormalization_and_a_shared_expert() -> None:
    model = qwen_router()
    check(model)
    run(model)
    topk = next(n for n in model.graph.node if n.op_type == "TopK")
    k = _init(model, topk.input[1])
    assert k.tolist() == [4]
    assert [n.op_type for n in readers(model, topk.output[0])] == ["ScatterElements"]
    assert op_counts(model)["Sigmoid"] == 3  # two SiLUs + the shared-expert gate


def test_softmax_cast_to_float32_between_softmax_and_topk() -> None:
    model = moe(dtype="float16", softmax_cast=True)
    check(model)
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    (cast,) = readers(model, softmax.output[0])
    assert cast.op_type == "Cast"
    assert cast.attribute[0].i == onnx.TensorProto.FLOAT
    assert readers(model, cast.output[0])[0].op_type == "TopK"
    out = run(model)[0]
    assert out.dtype == np.float16
    # fp16 model vs fp32 model with the same weights agree to fp16 precision.
    feeds = random_inputs(model)
    ref = run(moe(), {"hidden_states": feeds["hidden_states"].astype(np.float32)})[0]
    np.testing.assert_allclose(run(model, feeds)[0], ref, rtol=0.05, atol=0.02)


def test_topk_softmax_order() -> None:
    model = moe(order="topk_softmax")
    topk = next(n for n in model.graph.node if n.op_type == "TopK")
    assert producer(model, topk.input[0]).op_type == "MatMul"
    assert [n.op_type for n in readers(model, topk.output[0])] == ["Softmax"]


def test_static_dims_and_bad_arguments() -> None:
    model = moe(batch=2, seq=3)
    inferred = check(model)
    dims = [d.dim_value for d in inferred.graph.output[1].type.tensor_type.shape.dim]
    assert dims == [6, 4]
    with pytest.raises(ValueError, match="top_k"):
        moe(top_k=5)
