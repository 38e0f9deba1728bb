"""softmax_topk's dense form (Llama-4's router): TopK -> ScatterElements into a constant row ->
[Cast float32] -> Sigmoid [-> Cast back] fuses as SoftmaxTopK dense=1, in the TorchScript and
the dynamo form, fp32 and fp16, any float32 fill; each trap refused with its reason."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from fuser.models.moe_gates import DenseGate, dense_gate_model
from onnx import TensorProto

from fuser import ort
from fuser.fusedop import DOMAIN
from fuser.testing import assert_equivalent, count_ops, fuse_all, reasons

PATTERN = ["softmax_topk"]


def fused_node(model: onnx.ModelProto) -> tuple[onnx.NodeProto, dict[str, Any]]:
    (node,) = [n for n in model.graph.node if n.domain == DOMAIN]
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return node, {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


def parse(signature: str, body: str, opset: int = 18) -> onnx.ModelProto:
    text = f'<ir_version: 8, opset_import: ["" : {opset}]>\ng {signature} {{\n{body}\n}}'
    return onnx.parser.parse_model(text)


# -- positive -------------------------------------------------------------------------------------

FORMS = {
    "torchscript": DenseGate(),
    "dynamo": DenseGate(fill_form="Expand", casts=False),
    "dynamo, casts": DenseGate(fill_form="Expand"),
    "top-3 of 15, no transpose": DenseGate(experts=15, k=3, transpose=False),
    "k = experts": DenseGate(experts=5, k=5),
    "indices read too": DenseGate(k=2, read_indices=True),
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_dense_router_fuses_into_one_node(form: str, dtype: str) -> None:
    gate = dataclasses.replace(FORMS[form], dtype=dtype)
    model = dense_gate_model(gate, opset=14 if gate.fill_form == "ConstantOfShape" else 18)
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 1
    assert reasons(result) == []
    node, attrs = fused_node(result.model)
    assert (attrs["order"], attrs["score"], attrs["dense"], attrs["k"]) == (
        "topk_softmax", "sigmoid", 1, gate.k
    )  # fmt: skip
    # the Cast back of the fp16 sigmoid is the op's own rounding: values are T
    assert attrs["to_float32"] == 0 and "fill" not in attrs
    left = [n.op_type for n in result.model.graph.node if n.domain != DOMAIN]
    assert left == (["Transpose"] if gate.transpose else [])
    outputs = {o.name for o in result.model.graph.output}
    assert (node.output[1] in outputs) == gate.read_indices
    for kernel in ("reference", "npu"):
        assert_equivalent(model, result.model, kernel=kernel, runs=2)


@pytest.mark.parametrize("kernel", ["reference", "npu"])
def test_one_token_and_symbolic_tokens(kernel: str) -> None:
    for tokens, size in ((1, 1), ("T", 7)):
        model = dense_gate_model(DenseGate(tokens=tokens, k=2, experts=9))
        result = fuse_all(model, PATTERN)
        assert result.report.summary["softmax_topk"] == 1
        inferred = onnx.shape_inference.infer_shapes(result.model, strict_mode=True)
        (out,) = inferred.graph.output
        assert out.type.tensor_type.shape.dim[0].dim_value == 9  # transposed [E, tokens]
        assert_equivalent(model, result.model, kernel=kernel, dim_size=size)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("fill", [0.0, -1e4, float("inf"), -2.5])
def test_another_constant_fill_is_carried_exactly(fill: float, dtype: str) -> None:
    """sigmoid(fill) everywhere no expert was chosen (0.5 for a zero fill): still the chain."""
    model = dense_gate_model(DenseGate(fill=fill, dtype=dtype, k=2), opset=18)
    result = fuse_all(model, PATTERN)
    _, attrs = fused_node(result.model)
    assert attrs["fill"] == fill
    assert_equivalent(model, result.model, kernel="npu", runs=2)
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(dtype)
    (got,) = ort.session(result.model, kernel="reference").run(None, {"x": x})
    with np.errstate(over="ignore"):
        expected = np.float32(1 / (1 + np.exp(-np.float64(fill)))).astype(dtype)
    assert (got == expected).sum() == 3 * 14  # [E, tokens]: 14 unchosen experts per token


def test_sigmoid_left_in_float32_keeps_to_float32() -> None:
    """fp16 row -> Cast(float32) -> Sigmoid, no Cast back: float32 values (to_float32=1)."""
    model = dense_gate_model(DenseGate(dtype="float16", k=2, cast_back=False, transpose=False))
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    result = fuse_all(model, PATTERN)
    assert result.report.nodes_after == 1
    _, attrs = fused_node(result.model)
    assert attrs["to_float32"] == 1
    assert_equivalent(model, result.model, kernel="npu")


def test_float64_keeps_its_cast_back() -> None:
    """float64 -> Cast(float32) -> Sigmoid -> Cast(float64): the float32 detour rounds, so the
    Cast back is not the op's own rounding and stays out of the match (SoftmaxTopK then refuses
    float64 X, as every SoftmaxTopK form does)."""
    model = dense_gate_model(DenseGate(dtype="float64", fill=0.0, transpose=False))
    result = fuse_all(model, PATTERN)
    (rejected,) = result.report.rejected
    assert rejected.reason == "'x' is float64, which SoftmaxTopK does not support"
    assert rejected.nodes[-2:] == ("Cast_4", "Sigmoid_5")  # not the Cast back, Cast_6


def test_rank_three_logits_scatter_along_the_last_axis() -> None:
    model = parse(
        "(float[B, S, 6] x) => (float[B, S, 6] s)",
        "k = Constant<value = int64[1] {2}>()\nt, i = TopK<axis = -1>(x, k)\nsh = Shape(x)\n"
        "m = Constant<value = float {-inf}>()\nf = Expand(m, sh)\n"
        "r = ScatterElements<axis = 2>(f, i, t)\ns = Sigmoid(r)",
    )
    result = fuse_all(model, PATTERN)
    assert result.report.nodes_after == 1
    for kernel in ("reference", "npu"):
        assert_equivalent(model, result.model, kernel=kernel)


@pytest.mark.parametrize("kernel", ["reference", "npu"])
def test_ties_choose_the_lower_expert_as_onnxruntime(kernel: str) -> None:
    """Equal logits: TopK keeps the lower index; the dense rows choose exactly onnxruntime's
    experts (the sigmoid itself may differ in the last float32 bit)."""
    model = dense_gate_model(DenseGate(k=3, transpose=False))
    plain = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    fused = ort.session(fuse_all(model, PATTERN).model, kernel=kernel)
    rng = np.random.default_rng(5)
    x = np.round(rng.standard_normal((32, 16))).astype(np.float32)  # many equal logits
    x[0] = 1.0  # every expert ties: experts 0, 1, 2
    (want,), (got,) = plain.run(None, {"x": x}), fused.run(None, {"x": x})
    np.testing.assert_array_equal(got != 0, want != 0)
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
    assert np.flatnonzero(got[0]).tolist() == [0, 1, 2]


# TopK(x, 2) and a float32 -inf row shaped as x, as the parse-built cases share them
ROW = (
    "k = Constant<value = int64[1] {2}>()\nt, i = TopK(x, k)\nsh = Shape(x)\n"
    "f = ConstantOfShape<value = float[1] {-inf}>(sh)\n"
)

# -- traps ----------------------------------------------------------------------------------------

TRAPS = {
    "NaN fill": (
        DenseGate(fill=float("nan")),
        "the fill 'ConstantOfShape_2_out0' of ScatterElements 'ScatterElements_3' is NaN",
    ),
    "scatter into the logits": (
        DenseGate(fill_form="logits"),
        "ScatterElements 'ScatterElements_1' writes into 'x', not a constant fill shaped as the "
        "logits 'x' (ConstantOfShape or Expand of a scalar over Shape('x'))",
    ),
    "scatter axis 0": (
        DenseGate(scatter_axis=0),
        "ScatterElements 'ScatterElements_3' scatters along axis 0, TopK 'TopK_0' selects "
        "along axis 1",
    ),
    "other indices": (
        DenseGate(indices_from="other"),
        "ScatterElements 'ScatterElements_4' scatters at 'TopK_1_out1', not at the indices of "
        "TopK 'TopK_0' ('TopK_0_out1')",
    ),
    "top-k values read": (
        DenseGate(read_values=True),
        "the values 'TopK_0_out0' of TopK 'TopK_0' are also a graph output; SoftmaxTopK's "
        "dense form outputs only the scattered row",
    ),
    "largest=0": (DenseGate(largest=0), "TopK 'TopK_0' selects the smallest values (largest=0)"),
    "reduction add": (
        DenseGate(reduction="add"),
        "ScatterElements 'ScatterElements_3' has reduction=add: the dense row is not a plain write",
    ),
    "Cast to float16": (
        DenseGate(cast_to=TensorProto.FLOAT16),
        "Cast 'Cast_4' before Sigmoid 'Sigmoid_5' converts the scattered row to float16; only "
        "a Cast to float32 (or to the same type) is looked through",
    ),
    "float64 fill float32 cannot hold": (
        DenseGate(dtype="float64", fill=0.1),
        "the fill 0.1 of 'ConstantOfShape_2_out0' is not a float32 value (the fill attribute "
        "is float32)",
    ),
}


@pytest.mark.parametrize("case", list(TRAPS))
def test_traps_are_refused_with_a_reason(case: str) -> None:
    gate, reason = TRAPS[case]
    model = dense_gate_model(gate, opset=18)
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 0
    assert count_ops(result.model, "ScatterElements") == 1
    assert reasons(result, "softmax_topk") == [reason]


def test_scattered_updates_that_are_not_topk_values_are_refused() -> None:
    model = parse(
        "(float[N, 8] x, float[N, 2] u) => (float[N, 8] s)",
        ROW + "r = ScatterElements<axis = 1>(f, i, u)\ns = Sigmoid(r)\n",
    )
    result = fuse_all(model, PATTERN)
    assert reasons(result, "softmax_topk") == [
        "ScatterElements 'ScatterElements' writes 'u', not the values of TopK 'TopK' whose "
        "indices it scatters at"
    ]


def test_a_scattered_row_read_elsewhere_is_refused() -> None:
    model = parse(
        "(float[N, 8] x) => (float[N, 8] s, float[N, 8] r)",
        ROW + "r = ScatterElements<axis = 1>(f, i, t)\ns = Sigmoid(r)\n",
    )
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 0
    assert reasons(result, "softmax_topk") == [
        "internal value 'r' is a graph output, and SoftmaxTopK cannot output it"
    ]


@pytest.mark.filterwarnings("error::RuntimeWarning")  # validate on an output holding -inf
def test_a_shared_fill_stays_for_its_other_reader() -> None:
    """The -inf row also read elsewhere: fused without it (it stays for its reader)."""
    model = parse(
        "(float[N, 8] x) => (float[N, 8] s, float[N, 8] f)",
        ROW + "r = ScatterElements<axis = 1>(f, i, t)\ns = Sigmoid(r)\n",
    )
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 1
    assert count_ops(result.model, "ConstantOfShape") == 1
    assert_equivalent(model, result.model)


def test_a_sigmoid_of_an_unrelated_scatter_is_no_near_miss() -> None:
    model = parse(
        "(float[N, 8] x, int64[N, 2] i, float[N, 2] u) => (float[N, 8] s)",
        "r = ScatterElements<axis = 1>(x, i, u)\ns = Sigmoid(r)",
    )
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 0
    assert reasons(result) == []


def test_a_shape_of_the_scattered_row_reads_the_logits_instead() -> None:
    """The row has X's shape: a Shape reading it is re-pointed to X, and the rest fuses."""
    model = parse(
        "(float[N, 8] x) => (float[N, 8] s, int64[2] d)",
        ROW + "r = ScatterElements<axis = 1>(f, i, t)\ns = Sigmoid(r)\nd = Shape(r)\n",
    )
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 1
    (shape,) = [n for n in result.model.graph.node if n.op_type == "Shape"]
    assert list(shape.input) == ["x"]
    assert_equivalent(model, result.model)
