"""softmax_topk's gating forms: sigmoid scores, DeepSeek-V3's selection bias and expert groups,
the gather of the unbiased scores, renormalization with epsilon, the routed scale, TopK ->
Sigmoid and LogSoftmax -> TopK; each trap refused (or left out) with its reason."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from fuser.models.moe_gates import Gate, gate_model

from fuser import ort
from fuser.fusedop import DOMAIN
from fuser.testing import assert_equivalent, count_ops, fuse_all, reasons

PATTERN = ["softmax_topk"]


def fused_attrs(model: onnx.ModelProto) -> dict[str, Any]:
    (node,) = [n for n in model.graph.node if n.domain == DOMAIN]
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


def parse(signature: str, body: str, opset: int = 17) -> onnx.ModelProto:
    text = f'<ir_version: 8, opset_import: ["" : {opset}]>\ng {signature} {{\n{body}\n}}'
    return onnx.parser.parse_model(text)


# -- positive -------------------------------------------------------------------------------------

VARIANTS = {
    "deepseek-v3 ts": (Gate(), {"score": "sigmoid", "n_group": 4, "topk_group": 2,
                                "renormalize": 1, "scale": 2.5}),
    "deepseek-v3 dynamo, fill 0": (
        Gate(mask_form="dynamo", fill=0.0, renorm="plain"),
        {"n_group": 4, "mask_value": 0.0, "renormalize": 1},
    ),
    "bias, no groups": (Gate(groups=None), {"n_group": 1, "renormalize": 1}),
    "groups, no bias": (Gate(bias=None, groups=(8, 3)), {"n_group": 8, "topk_group": 3}),
    "sigmoid top-k, scale only": (
        Gate(bias=None, groups=None, renorm=None, sorted=1), {"renormalize": 0, "scale": 2.5}
    ),
    "softmax + eps": (
        Gate(score="Softmax", bias=None, groups=None, scale=None, sorted=1, epsilon=1e-6),
        {"score": None, "renormalize": 1},
    ),
}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", list(VARIANTS))
def test_gating_variants_fuse_into_one_node(case: str, dtype: str) -> None:
    gate, expected = VARIANTS[case]
    model = gate_model(dataclasses.replace(gate, dtype=dtype))
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 1
    assert reasons(result) == []
    assert result.report.nodes_after == 1, [n.op_type for n in result.model.graph.node]
    attrs = fused_attrs(result.model)
    for name, value in expected.items():
        assert attrs.get(name) == value, (name, attrs)
    epsilon = float(np.dtype(dtype).type(gate.epsilon))  # 1e-20 is 0 in float16: no Add
    if gate.renorm == "eps" and epsilon:
        assert attrs["epsilon"] == pytest.approx(epsilon, rel=1e-6)
    else:
        assert "epsilon" not in attrs
    (node,) = result.model.graph.node
    assert (len(node.input) == 2) == (gate.bias == "const")
    assert_equivalent(model, result.model, runs=3)


def test_symbolic_tokens_and_shape_inference() -> None:
    model = gate_model(Gate(tokens="T"))
    result = fuse_all(model, PATTERN)
    inferred = onnx.shape_inference.infer_shapes(result.model, strict_mode=True)
    shapes = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in inferred.graph.output
    }
    # the exporters' Reshape(-1, E) loses the name T: a symbolic dim, k experts
    assert [(isinstance(s[0], str), s[1]) for s in shapes.values()] == [(True, 4), (True, 4)]
    assert_equivalent(model, result.model, dim_size=7)


@pytest.mark.parametrize("kernel", ["reference", "npu"])
def test_one_token_and_k_equal_to_the_experts(kernel: str) -> None:
    # k = E with a group limit: the dropped groups' experts come last, at their -inf choice.
    model = gate_model(Gate(tokens=1, k=16, sorted=1))
    result = fuse_all(model, PATTERN)
    assert fused_attrs(result.model)["k"] == 16
    assert_equivalent(model, result.model, kernel=kernel)


def sessions(model: onnx.ModelProto, kernel: str) -> tuple[Any, Any]:
    plain = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return plain, ort.session(fuse_all(model, PATTERN).model, kernel=kernel)


@pytest.mark.parametrize("kernel", ["reference", "npu"])
@pytest.mark.parametrize("sorted_", [1, 0])
def test_ties_resolve_as_onnxruntime_does(kernel: str, sorted_: int) -> None:
    """Equal logits and a zero bias tie experts and groups: onnxruntime's TopK keeps the lower
    index (for sorted=0 too, in another order); the fused op picks the same sets."""
    model = gate_model(Gate(sorted=sorted_, bias=None))
    plain, fused = sessions(model, kernel)
    rng = np.random.default_rng(3)
    x = np.round(rng.standard_normal((64, 16))).astype(np.float32)  # many equal logits
    x[0] = 0.5  # every expert and every group tie
    x[1, :8] = 2.0  # groups 0 and 1 tie at the top
    (w0, i0), (w1, i1) = plain.run(None, {"x": x}), fused.run(None, {"x": x})
    if sorted_:
        np.testing.assert_array_equal(i1, i0)
    np.testing.assert_array_equal(np.sort(i1, axis=1), np.sort(i0, axis=1))
    np.testing.assert_array_equal(np.sort(i1[0]), [0, 1, 2, 3])
    order0, order1 = np.argsort(i0, axis=1), np.argsort(i1, axis=1)
    np.testing.assert_allclose(
        np.take_along_axis(w1, order1, 1), np.take_along_axis(w0, order0, 1), rtol=1e-6
    )


K2 = "k = Constant<value = int64[1] {2}>()"


@pytest.mark.parametrize("dtype", ["float", "float16"])
@pytest.mark.parametrize("cast", [False, True])
def test_topk_then_sigmoid(dtype: str, cast: bool) -> None:
    """Llama-4 style: top-k of the logits, then the sigmoid of the k values (maybe in float)."""
    out = "float" if cast else dtype
    tail = "c = Cast<to=1>(t)\nv = Sigmoid(c)" if cast else "v = Sigmoid(t)"
    model = parse(f"({dtype}[N, 8] x) => ({out}[N, 2] v, int64[N, 2] i)",
                  f"{K2}\nt, i = TopK(x, k)\n{tail}")  # fmt: skip
    result = fuse_all(model, PATTERN)
    assert result.report.nodes_after == 1
    attrs = fused_attrs(result.model)
    assert (attrs["order"], attrs["score"]) == ("topk_softmax", "sigmoid")
    assert_equivalent(model, result.model, runs=3)


@pytest.mark.parametrize("dtype", ["float", "float16"])
def test_log_softmax_then_topk(dtype: str) -> None:
    model = parse(f"({dtype}[N, 8] x) => ({dtype}[N, 2] t, int64[N, 2] i)",
                  f"p = LogSoftmax(x)\n{K2}\nt, i = TopK(p, k)")  # fmt: skip
    result = fuse_all(model, PATTERN)
    assert result.report.nodes_after == 1
    assert fused_attrs(result.model)["score"] == "log_softmax"
    assert_equivalent(model, result.model, runs=3)


def test_silu_sigmoid_is_left_alone() -> None:
    """A Sigmoid that feeds no TopK (SiLU) is no gate: no match, no near-miss."""
    model = parse("(float[N, 8] x) => (float[N, 8] y)", "s = Sigmoid(x)\ny = Mul(x, s)")
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 0
    assert reasons(result) == []


# -- traps ----------------------------------------------------------------------------------------

TRAPS = {
    "bias is a graph input": (
        Gate(bias="input"),
        "bias 'bias' of Add 'Add_1' added to the scores is a graph input; SoftmaxTopK needs "
        "a constant selection bias",
    ),
    "groups do not divide the experts": (
        Gate(split=(3, 5)),
        "Reshape 'Reshape_2' of the 16 experts of 'Add_1_out0' into groups: [-1, 3, 5] does "
        "not keep the rows (16 values per row, not [3, 5])",
    ),
    "biased top-k values read": (
        Gate(read_choice_values=True),
        "the values of TopK 'TopK_18' over the biased or group-masked choice 'TopK_18_out0' "
        "are read; SoftmaxTopK gives the unbiased scores",
    ),
    "weights gathered from the biased choice": (
        Gate(gather_from="choice"),
        "GatherElements 'GatherElements_19' gathers from 'Add_1_out0', not the unbiased scores "
        "'Sigmoid_0_out0'",
    ),
}


@pytest.mark.parametrize("case", list(TRAPS))
def test_traps_are_refused_with_a_reason(case: str) -> None:
    gate, reason = TRAPS[case]
    result = fuse_all(gate_model(gate), PATTERN)
    assert result.report.summary["softmax_topk"] == 0
    assert count_ops(result.model, "TopK") == 3
    assert reasons(result, "softmax_topk") == [reason]


def test_softmax_over_the_wrong_axis_is_refused() -> None:
    model = parse("(float[4, 8] x) => (float[4, 2] t, int64[4, 2] i)",
                  f"p = LogSoftmax<axis=0>(x)\n{K2}\nt, i = TopK(p, k)")  # fmt: skip
    result = fuse_all(model, PATTERN)
    assert reasons(result, "softmax_topk") == [
        "LogSoftmax 'LogSoftmax' normalizes axis 0 of 'x', not the last axis (1)"
    ]


@pytest.mark.parametrize(
    ("gate", "note", "renormalize", "scale"),
    [
        # sorted=1: an output computed downstream of an unsorted TopK is in onnxruntime's order
        (Gate(read_normalized=True, sorted=1),
         "scale 'Mul_23' left unfused: the values 'Div_22_out0' are also read elsewhere", 1, None),
        (Gate(read_weights=True, sorted=1),
         "the top-k values 'GatherElements_19_out0' are also a graph output", 0, None),
    ],
)  # fmt: skip
def test_a_scaled_value_read_elsewhere_leaves_the_rest_out(
    gate: Gate, note: str, renormalize: int, scale: float | None
) -> None:
    model = gate_model(gate)
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 1
    (fusion,) = result.report.fusions
    assert any(note in n for n in fusion.notes), fusion.notes
    attrs = fused_attrs(result.model)
    assert attrs["renormalize"] == renormalize
    assert "scale" not in attrs
    assert count_ops(result.model, "Mul") == 1
    assert_equivalent(model, result.model)


@pytest.mark.parametrize("renorm", [None, "plain"])
def test_a_scale_of_one_is_absorbed_without_renormalizing(renorm: str | None) -> None:
    """Regression (fuzz seed 731): a Mul by 1.0 and no renormalization was fused as
    renormalize=1."""
    model = gate_model(Gate(renorm=renorm, scale=1.0, sorted=1))
    result = fuse_all(model, PATTERN)
    assert result.report.nodes_after == 1
    attrs = fused_attrs(result.model)
    assert attrs["renormalize"] == int(renorm is not None)
    assert "scale" not in attrs
    assert_equivalent(model, result.model)


def test_a_scale_that_broadcasts_the_rank_up_is_left_out() -> None:
    model = gate_model(Gate(scale=None, sorted=1))
    out = model.graph.output[0].name
    scale = onnx.numpy_helper.from_array(np.full((1, 1, 1), 2.0, np.float32), "scale3")
    model.graph.initializer.append(scale)
    mul = onnx.helper.make_node("Mul", [out, "scale3"], ["scaled"], name="Mul_rank3")
    model.graph.node.append(mul)
    model.graph.output[0].CopyFrom(
        onnx.helper.make_tensor_value_info("scaled", onnx.TensorProto.FLOAT, [1, "N", 4])
    )
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 1
    assert "scale" not in fused_attrs(result.model)
    assert count_ops(result.model, "Mul") == 1
    assert_equivalent(model, result.model)


def test_a_sigmoid_plus_a_tensor_feeding_no_topk_is_no_near_miss() -> None:
    """A Sigmoid gate added to a residual (no TopK after it) is not a router."""
    model = parse("(float[N, 8] x, float[N, 8] r) => (float[N, 8] y)",
                  "s = Sigmoid(x)\ny = Add(s, r)")  # fmt: skip
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 0
    assert reasons(result) == []
