"""Committed exports from real PyTorch exporters: load, check, run, match PyTorch, and show the
chains and exporter quirks tests/data/exported/README.md says they show."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from fuser.models.inventory import count_chains, layernorm_outputs
from model_checks import check, producer_op, readers, session

DATA = Path(__file__).resolve().parent.parent / "data" / "exported"

RMS_MIXTRAL = {"rmsnorm": 3, "rmsnorm_matmul": 2, "rmsnorm_matmuls": 4}
# Structural chain counts (fuser.models.inventory) per fixture; absent keys are 0.
EXPECTED: dict[str, dict[str, int]] = {
    "cnn-ts13": {"conv_bn_relu": 5, "conv_bn": 3},
    "cnn-dynamo18": {"conv_bn_relu": 5, "conv_bn": 3},
    "bert-ts13": {"layernorm": 5, "layernorm_matmul": 4, "layernorm_matmuls": 8},
    "bert-dynamo18": {"layernorm": 5, "layernorm_matmul": 4, "layernorm_matmuls": 8},
    "bert-fp16-ts13": {"layernorm": 5, "layernorm_matmul": 4, "layernorm_matmuls": 8},
    "gpt2-ts14": {"layernorm": 5, "layernorm_matmul": 4, "layernorm_matmuls": 4},
    "gpt2-dynamo18": {"layernorm": 5, "layernorm_matmul": 4, "layernorm_matmuls": 4},
    "mixtral-dynamo18": RMS_MIXTRAL | {"softmax_topk": 1},
    "mixtral-fp16-dynamo18": RMS_MIXTRAL | {"softmax_topk": 1},
    "router-fp16-ts14": {"softmax_topk": 1},
    "router-fp16-dynamo18": {"softmax_topk": 1},
    "llama-ts14": {"rmsnorm": 5, "rmsnorm_matmul": 5, "rmsnorm_matmuls": 11},
    "llama-fp16-dynamo18": {"rmsnorm": 5, "rmsnorm_matmul": 5, "rmsnorm_matmuls": 11},
    "qwen3-fp16-ts14": {"rmsnorm": 5, "rmsnorm_matmul": 3, "rmsnorm_matmuls": 6},
    # Sigmoid routers: no Softmax -> TopK chain for the structural inventory.
    "deepseekv3-router-ts14": {},
    "deepseekv3-router-dynamo18": {},
    "qwen2moe-dynamo18": {
        "rmsnorm": 3,
        "rmsnorm_matmul": 3,
        "rmsnorm_matmuls": 7,
        "softmax_topk": 1,
    },
}
VIT = {"layernorm": 5, "layernorm_matmul": 4, "layernorm_matmuls": 8}
EXPECTED |= {"vit-autocast-ts14": VIT, "vit-autocast-dynamo18": VIT, "vit-dynamo18": VIT}

# MobileNetV2 and EfficientNet-style (issue 8): every Conv+BN is followed by ReLU6 / SiLU or
# nothing (count_chains counts Relu only, so they show as conv_bn).
CNN_ACT = {
    "mobilenetv2-ts13": {"conv_bn": 52},
    "mobilenetv2-dynamo18": {"conv_bn": 52},
    "efficientnet-ts13": {"conv_bn": 152},
    "efficientnet-dynamo18": {"conv_bn": 152},
}
EXPECTED |= CNN_ACT


def _load(name: str) -> onnx.ModelProto:
    return onnx.load(str(DATA / f"{name}.onnx"))


def _node(model: onnx.ModelProto, op_type: str) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.op_type == op_type]
    return node


def test_every_committed_fixture_is_listed() -> None:
    files = {p.stem for p in DATA.glob("*.onnx")}
    assert files == set(EXPECTED)
    assert files == {p.stem for p in DATA.glob("*.npz")}
    readme = (DATA / "README.md").read_text()
    assert all(f"`{name}.onnx`" in readme for name in files)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_checks_runs_and_matches_pytorch(name: str) -> None:
    path = DATA / f"{name}.onnx"
    assert path.stat().st_size < 1_000_000
    model = _load(name)
    check(model)
    reference = np.load(DATA / f"{name}.npz")
    feeds = {k.removeprefix("in_"): reference[k] for k in reference.files if k.startswith("in_")}
    outputs = session(model).run(None, feeds)
    tol = 2e-2 if "fp16" in name or "autocast" in name else 1e-4
    for i, got in enumerate(outputs):
        np.testing.assert_allclose(got, reference[f"out_{i}"], rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_chain_counts(name: str) -> None:
    counts = count_chains(_load(name))
    assert {k: v for k, v in counts.items() if v} == EXPECTED[name]


def test_torchscript_keeps_batchnorm_with_preserve() -> None:
    model = _load("cnn-ts13")
    assert sum(n.op_type == "BatchNormalization" for n in model.graph.node) == 8
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in convs]
    assert sum(a.get("group") == 12 for a in attrs) == 1  # depthwise
    assert sum(len(a["kernel_shape"]) == 1 for a in attrs) == 1  # Conv1d


def test_dynamo_unoptimized_computes_conv_bias_at_run_time() -> None:
    model = _load("cnn-dynamo18")
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    computed = [n for n in convs if producer_op(model, n.input[2]) == "Expand"]
    assert len(computed) == 6  # every bias-free nn.Conv2d


def test_layernorm_forms() -> None:
    ts = _load("bert-ts13")
    assert not any(n.op_type == "LayerNormalization" for n in ts.graph.node)
    assert sum(n.op_type == "Pow" for n in ts.graph.node) == 5
    dynamo = _load("bert-dynamo18")
    assert sum(n.op_type == "LayerNormalization" for n in dynamo.graph.node) == 5
    # float16: the variance is computed in float64 between Casts (Sub -> Cast -> Pow ...)
    half = _load("bert-fp16-ts13")
    casts = [n for n in half.graph.node if n.op_type == "Cast" and "LayerNorm" in n.name]
    assert sorted(n.attribute[0].i for n in casts) == [10] * 5 + [11] * 5


@pytest.mark.parametrize("name", ["gpt2-ts14", "gpt2-dynamo18"])
def test_gpt2_conv1d_is_reshape_gemm(name: str) -> None:
    model = _load(name)
    lns = layernorm_outputs(model)
    for out in lns[:-1]:
        (reshape,) = [n for n in readers(model, out) if n.op_type == "Reshape"]
        assert [n.op_type for n in readers(model, reshape.output[0])] == ["Gemm"]
    (reshape,) = readers(model, lns[-1])  # ln_f -> Reshape -> MatMul (lm_head)
    assert [n.op_type for n in readers(model, reshape.output[0])] == ["MatMul"]


def test_mixtral_router_renormalizes_and_qwen_does_not() -> None:
    mixtral = _load("mixtral-dynamo18")
    topk = _node(mixtral, "TopK")
    assert producer_op(mixtral, topk.input[0]) == "Softmax"
    assert sorted(n.op_type for n in readers(mixtral, topk.output[0])) == ["Div", "ReduceSum"]
    qwen = _load("qwen2moe-dynamo18")
    topk = _node(qwen, "TopK")
    assert [n.op_type for n in readers(qwen, topk.output[0])] == ["Reshape"]
    k = next(t for t in qwen.graph.initializer if t.name == topk.input[1])
    assert onnx.numpy_helper.to_array(k).tolist() == [4]


def test_where_the_float32_cast_sits() -> None:
    # transformers 5: router_logits.float() -> Cast before the Softmax
    mixtral = _load("mixtral-fp16-dynamo18")
    topk = _node(mixtral, "TopK")
    assert producer_op(mixtral, topk.input[0]) == "Softmax"
    softmax_input = next(n for n in mixtral.graph.node if topk.input[0] in n.output).input[0]
    assert producer_op(mixtral, softmax_input) == "Cast"
    # softmax(dtype=float) on float16: Softmax -> Cast(float32) -> TopK, with both exporters
    for name in ("router-fp16-ts14", "router-fp16-dynamo18"):
        model = _load(name)
        (cast,) = readers(model, _node(model, "Softmax").output[0])
        assert cast.op_type == "Cast"
        assert cast.attribute[0].i == onnx.TensorProto.FLOAT
        assert [n.op_type for n in readers(model, cast.output[0])] == ["TopK"]


# -- MobileNetV2 / EfficientNet-style: Conv + BN + activation (issue 8) -----------------------

# (fixture, activations the fused nodes carry: ReLU6 as Clip(0, 6), SiLU; none = a linear
# bottleneck / projection), with the real cost model deciding
CNN_FUSED = {
    "mobilenetv2-ts13": {"Clip": 35, "": 17},
    "mobilenetv2-dynamo18": {"Clip": 35, "": 17},
    "efficientnet-ts13": {"Silu": 152, "Sigmoid": 50, "": 50},
    "efficientnet-dynamo18": {"Silu": 152, "Sigmoid": 50, "": 50},
}


@pytest.mark.parametrize("name", sorted(CNN_FUSED))
def test_every_conv_bn_chain_fuses_with_its_activation(name: str) -> None:
    import fuser
    from fuser.fusedop import DOMAIN

    model = _load(name)
    chains = sum(n.op_type == "BatchNormalization" for n in model.graph.node)
    # before: how many Conv+BN chains have an activation reading the BN output
    with_act = [
        n for n in model.graph.node
        if n.op_type == "BatchNormalization"
        and {r.op_type for r in readers(model, n.output[0])} & {"Clip", "Sigmoid", "Mul"}
    ]  # fmt: skip
    result = fuser.fuse(model)
    fused = [n for n in result.model.graph.node if n.domain == DOMAIN]
    acts: dict[str, int] = {}
    for n in fused:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        act = attrs.get("activation", b"").decode()
        acts[act] = acts.get(act, 0) + 1
    assert acts == CNN_FUSED[name]
    # no Conv or BN is left, and no activation op reads a fused node's output
    left = {n.op_type for n in result.model.graph.node if n.domain != DOMAIN}
    assert not left & {"Conv", "BatchNormalization", "Clip", "Sigmoid"}
    outputs = {o for n in fused for o in n.output}
    separate = [
        n for n in result.model.graph.node if n.domain != DOMAIN and set(n.input) & outputs
        and n.op_type in ("Clip", "Sigmoid", "Mul", "Relu")
        and not (n.op_type == "Mul" and all(i in outputs for i in n.input[:2]))
    ]  # fmt: skip
    # the squeeze-excite gate y * sigmoid(...) multiplies two fused outputs: not an activation
    assert separate == []
    assert len(with_act) == (35 if "mobilenet" in name else 102) and chains > len(with_act)
    assert not [r for r in result.report.rejected if r.pattern == "conv_bn_relu"]
    assert fuser.validate(model, result, runs=1).ok


# -- DeepSeek-V3 routers (gating lane) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "epsilon"), [("deepseekv3-router-ts14", True), ("deepseekv3-router-dynamo18", False)]
)
def test_deepseekv3_router_fuses_every_topk(name: str, epsilon: bool) -> None:
    """Sigmoid + bias + group limit + top-k + gather + renormalize + scale: the router's three
    TopKs (group top-2, top groups, top-k) all go into one SoftmaxTopK, with default flags."""
    from fuser.api import fuse, validate

    model = _load(name)
    assert sum(n.op_type == "TopK" for n in model.graph.node) == 3
    result = fuse(model, cache=False)
    assert result.report.summary["softmax_topk"] == 1
    assert not [n for n in result.model.graph.node if n.op_type in ("TopK", "Sigmoid", "Where")]
    (node,) = [n for n in result.model.graph.node if n.domain == "fuser"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["score"] == b"sigmoid"
    assert (attrs["n_group"], attrs["topk_group"], attrs["k"]) == (4, 2, 4)
    assert attrs["mask_value"] == float("-inf")
    assert attrs["renormalize"] == 1
    assert attrs["scale"] == pytest.approx(2.5)
    assert ("epsilon" in attrs) == epsilon  # the dynamo exporter drops the + 1e-20
    assert node.input[1].endswith("e_score_correction_bias")
    assert validate(model, result).ok


@pytest.mark.parametrize("name", ["vit-autocast-ts14", "vit-autocast-dynamo18"])
def test_autocast_vit_casts_its_float32_layernorms_to_float16_linears(name: str) -> None:
    """LayerNorm in float32 -> Cast(float16) -> q/k/v MatMuls: the form fuser fuses with
    matmul_type (every LayerNorm that a Linear reads, through the Cast)."""
    from fuser.api import fuse

    model = _load(name)
    lns = layernorm_outputs(model)
    for out in lns[:-1]:
        (cast,) = readers(model, out)
        assert cast.op_type == "Cast" and cast.attribute[0].i == onnx.TensorProto.FLOAT16
        assert {n.op_type for n in readers(model, cast.output[0])} == {"MatMul"}
    fused = [n for n in fuse(model, cache=False).model.graph.node if n.domain == "fuser"]
    assert len(fused) == 4
    for node in fused:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["matmul_type"] == onnx.TensorProto.FLOAT16


# -- Llama-4 routers (llama4 lane) ---------------------------------------------------------------

# A Sigmoid router, not Softmax -> TopK: nothing for the structural inventory.
EXPECTED |= {name: {} for name in ("llama4-router-ts14", "llama4-router-dynamo18",
                                   "llama4-router-fp16-dynamo18")}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "k", "casts"),
    [("llama4-router-ts14", 1, 2), ("llama4-router-dynamo18", 2, 0),
     ("llama4-router-fp16-dynamo18", 1, 2)],
)  # fmt: skip
def test_llama4_router_fuses_into_one_dense_node(name: str, k: int, casts: int) -> None:
    """TopK -> fill (-inf) -> ScatterElements -> [Cast] -> Sigmoid [-> Cast]: one SoftmaxTopK
    with dense=1 whose values the Transpose reads, with default flags."""
    from fuser.api import fuse, validate

    model = _load(name)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("ScatterElements") == 1 and ops.count("Cast") == casts
    assert ops.count("ConstantOfShape") + ops.count("Expand") == 1
    result = fuse(model, cache=False)
    assert result.report.summary["softmax_topk"] == 1
    left = [n.op_type for n in result.model.graph.node]
    assert not {"TopK", "ScatterElements", "Sigmoid", "Cast", "ConstantOfShape", "Expand",
                "Shape"} & set(left), left  # fmt: skip
    (node,) = [n for n in result.model.graph.node if n.domain == "fuser"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["order"], attrs["score"], attrs["dense"], attrs["k"]) == (
        b"topk_softmax",
        b"sigmoid",
        1,
        k,
    )
    assert "fill" not in attrs and attrs["to_float32"] == 0  # -inf; Cast back absorbed
    (transpose,) = [n for n in result.model.graph.node if n.op_type == "Transpose"]
    assert transpose.input[0] == node.output[0]
    assert validate(model, result).ok


# -- gateforms: grouped gates as other exports spell them ------------------------------------------

# Sigmoid routers: nothing for the structural inventory (tests in test_exported_gate_forms.py).
GATE_FORMS = ("deepseekv4-router-fp16-ts14", "deepseekv4-router-fp16-dynamo18",
              "deepseekv3-hub-gate-ts14", "deepseekv3-hub-gate-dynamo18")  # fmt: skip
EXPECTED |= {name: {} for name in GATE_FORMS}
