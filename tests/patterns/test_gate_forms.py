"""softmax_topk's grouped gates as the exporters spell them: the group split and the flatten
back written with a 0 (copy the token count) or a -1 (inferred), and a float32 selection bias
on float16 scores (Cast up, the choice in float32, the weights from the float16 scores); each
trap refused with its reason."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from fuser.models.moe_gates import Gate, gate_model
from fuser.patterns.softmax_topk import rows_reshape

from fuser import ort
from fuser.fusedop import DOMAIN
from fuser.testing import assert_equivalent, assert_runs_stock, count_ops, fuse_all, reasons

PATTERN = ["softmax_topk"]


def fused_node(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.domain == DOMAIN]
    return node


def attrs_of(node: onnx.NodeProto) -> dict[str, Any]:
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


# -- the resolver ---------------------------------------------------------------------------------

RESOLVED = [
    # target, inner dims, known token count, allowzero -> dims after the token count
    ([0, 4, -1], [16], None, 0, [4, 4]),
    ([0, 4, 4], [16], None, 0, [4, 4]),
    ([-1, 4, 4], [16], None, 0, [4, 4]),
    ([-1, 4, 4], [16], None, 1, [4, 4]),  # no 0: allowzero changes nothing
    ([0, -1, 2], [16], None, 0, [8, 2]),
    ([0, 0, -1], [16], None, 0, [16, 1]),  # the 0 at index 1 copies the experts
    ([3, 4, -1], [16], 3, 0, [4, 4]),  # the token count itself, when known
    ([0, -1], [4, 4], None, 0, [16]),
    ([-1, 16], [4, 4], None, 0, [16]),
    ([0, 16], [4, 4], None, 0, [16]),
]


@pytest.mark.parametrize(("target", "inner", "tokens", "allowzero", "rest"), RESOLVED)
def test_rows_reshape_resolves(target, inner, tokens, allowzero, rest) -> None:
    assert rows_reshape(target, inner, tokens, allowzero) == rest


UNRESOLVED = [
    ([0, 4, -1], [16], None, 1, "allowzero=1 makes the 0 in [0, 4, -1] a dimension of size 0"),
    ([4, 4, -1], [16], None, 0, "dim 0 of [4, 4, -1] is 4, not the token count (unknown)"),
    ([4, 4, -1], [16], 5, 0, "dim 0 of [4, 4, -1] is 4, not the token count (5)"),
    ([-1, 3, 5], [16], None, 0, "[-1, 3, 5] does not keep the rows (16 values per row"),
    ([0, 3, -1], [16], None, 0, "[0, 3, -1] does not split the 16 values of a row"),
    ([-1, 0], [4, 4], None, 0, "[-1, 0] does not keep the rows (16 values per row, not [4])"),
    ([0, 0, 0, -1], [16], None, 0, "the 0 at index 2 of [0, 0, 0, -1] copies no dim"),
    ([-1, -1, 4], [16], None, 0, "is not a valid shape"),
]


@pytest.mark.parametrize(("target", "inner", "tokens", "allowzero", "why"), UNRESOLVED)
def test_rows_reshape_says_why_not(target, inner, tokens, allowzero, why) -> None:
    found = rows_reshape(target, inner, tokens, allowzero)
    assert isinstance(found, str) and why in found, found


# -- split and flatten spellings -------------------------------------------------------------------

SPELLINGS = {
    "[0, G, -1] / [0, -1]": Gate(split_shape=(0, 4, -1), flat_shape=(0, -1)),
    "[0, G, E/G] / [-1, E]": Gate(split_shape=(0, 4, 4)),
    "[-1, G, E/G] / [0, -1]": Gate(flat_shape=(0, -1)),
    "[0, -1, E/G] / [0, E]": Gate(split_shape=(0, -1, 4), flat_shape=(0, 16)),
    "8 groups [0, 8, -1] / [0, -1], dynamo": Gate(
        groups=(8, 3), split_shape=(0, 8, -1), flat_shape=(0, -1), mask_form="dynamo"
    ),
    "allowzero=1 without a 0": Gate(allowzero=1),
}


@pytest.mark.parametrize("tokens", ["T", 1])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", list(SPELLINGS))
def test_split_and_flatten_spellings_fuse(case: str, dtype: str, tokens: int | str) -> None:
    gate = dataclasses.replace(SPELLINGS[case], dtype=dtype, tokens=tokens)
    model = gate_model(gate, opset=14 if gate.allowzero is not None else 17)
    result = fuse_all(model, PATTERN)
    assert reasons(result) == []
    assert result.report.nodes_after == 1, [n.op_type for n in result.model.graph.node]
    assert gate.groups is not None
    attrs = attrs_of(fused_node(result.model))
    assert (attrs["n_group"], attrs["topk_group"]) == gate.groups
    assert_equivalent(model, result.model, runs=2, dim_size=5)


@pytest.mark.parametrize("kernel", ["reference", "npu"])
def test_spelling_against_onnxruntime_indices_exact(kernel: str) -> None:
    """Rounded logits tie experts and groups; the fused op picks onnxruntime's indices exactly
    (sorted TopK), 37 tokens (a tail at any tile height)."""
    model = gate_model(Gate(split_shape=(0, 4, -1), flat_shape=(0, -1), sorted=1, tokens="T"))
    plain = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    fused = ort.session(fuse_all(model, PATTERN).model, kernel=kernel)
    x = np.round(np.random.default_rng(5).standard_normal((37, 16)) * 2).astype(np.float32)
    x[:2] = 0.0
    (w0, i0), (w1, i1) = plain.run(None, {"x": x}), fused.run(None, {"x": x})
    np.testing.assert_array_equal(i1, i0)
    np.testing.assert_allclose(w1, w0, rtol=1e-5, atol=1e-6)


def test_spellings_run_stock_through_the_function_body() -> None:
    model = gate_model(Gate(split_shape=(0, 4, -1), flat_shape=(0, -1), tokens="T"))
    fused = fuse_all(model, PATTERN).model
    assert assert_runs_stock(model, fused) == ["SoftmaxTopK"]


def test_a_known_token_count_as_dim_0_fuses() -> None:
    model = gate_model(Gate(tokens=6, split_shape=(6, 4, -1), flat_shape=(6, -1)))
    result = fuse_all(model, PATTERN)
    assert result.report.nodes_after == 1
    assert_equivalent(model, result.model, runs=2)


SPLIT_TRAPS = {
    "allowzero=1 with a 0 in the split": (
        Gate(split_shape=(0, 4, -1), allowzero=1),
        "Reshape 'Reshape_2' of the 16 experts of 'Add_1_out0' into groups: allowzero=1 makes "
        "the 0 in [0, 4, -1] a dimension of size 0, not a copy of the input's",
    ),
    "allowzero=1 with a 0 in the flatten": (
        Gate(split_shape=(-1, 4, 4), flat_shape=(0, -1), allowzero=1),
        "Reshape 'Reshape_13' does not flatten the group mask [tokens, 4, 4] back to [tokens, "
        "16] with [0, -1]: allowzero=1 makes the 0 in [0, -1] a dimension of size 0, not a copy "
        "of the input's",
    ),
    "a constant dim 0 on symbolic tokens": (
        Gate(split_shape=(4, 4, -1)),
        "Reshape 'Reshape_2' of the 16 experts of 'Add_1_out0' into groups: dim 0 of "
        "[4, 4, -1] is 4, not the token count (unknown)",
    ),
    "a constant dim 0 that is not the token count": (
        Gate(tokens=5, split_shape=(4, 4, -1)),
        "Reshape 'Reshape_2' of the 16 experts of 'Add_1_out0' into groups: dim 0 of "
        "[4, 4, -1] is 4, not the token count (5)",
    ),
    "groups of one expert": (
        Gate(split_shape=(0, 16, -1), groups=(16, 2)),
        "Reshape 'Reshape_2' splits the 16 experts of 'Add_1_out0' as [0, 16, -1]: groups of 1 "
        "expert have no top-2",
    ),
    "a flatten that mixes the groups": (
        Gate(flat_shape=(-1, 0)),
        "Reshape 'Reshape_13' does not flatten the group mask [tokens, 4, 4] back to [tokens, "
        "16] with [-1, 0]: [-1, 0] does not keep the rows (16 values per row, not [4])",
    ),
}


@pytest.mark.parametrize("case", list(SPLIT_TRAPS))
def test_split_traps_are_refused_with_their_reason(case: str) -> None:
    gate, reason = SPLIT_TRAPS[case]
    model = gate_model(gate, opset=14 if gate.allowzero is not None else 17)
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 0
    assert count_ops(result.model, "TopK") == 3
    assert reasons(result, "softmax_topk") == [reason]


# -- a float32 bias on float16 scores --------------------------------------------------------------

BIAS32 = {
    "groups, renormalized + eps, scaled": Gate(dtype="float16", bias_dtype="float32"),
    "no groups (DeepSeek-V4 style)": Gate(dtype="float16", bias_dtype="float32", groups=None),
    "groups [0, G, -1], fill 0, dynamo": Gate(
        dtype="float16", bias_dtype="float32", split_shape=(0, 4, -1), flat_shape=(0, -1),
        fill=0.0, mask_form="dynamo", renorm="plain",
    ),
    "weights from the float32 Cast": Gate(
        dtype="float16", bias_dtype="float32", gather_from="cast"
    ),
}  # fmt: skip


@pytest.mark.parametrize("tokens", ["T", 1])
@pytest.mark.parametrize("case", list(BIAS32))
def test_float32_bias_on_float16_scores_fuses(case: str, tokens: int | str) -> None:
    gate = dataclasses.replace(BIAS32[case], tokens=tokens)
    model = gate_model(gate)
    result = fuse_all(model, PATTERN)
    assert reasons(result) == []
    assert result.report.nodes_after == 1, [n.op_type for n in result.model.graph.node]
    node = fused_node(result.model)
    attrs = attrs_of(node)
    from_cast = gate.gather_from == "cast"
    assert attrs["to_float32"] == int(from_cast)  # the weights' type: float32 only from the Cast
    types = {v.name: v.type.tensor_type.elem_type for v in result.model.graph.output}
    weights = onnx.TensorProto.FLOAT if from_cast else onnx.TensorProto.FLOAT16
    assert types[node.output[0]] == weights
    bias = next(t for t in result.model.graph.initializer if t.name == node.input[1])
    assert bias.data_type == onnx.TensorProto.FLOAT
    # fp16 scores, fp32 bias: the choice (and the gather) in float32, one Cast back
    assert "float16infloat" in node.overload
    assert_equivalent(model, result.model, runs=2, dim_size=5)
    assert_equivalent(model, result.model, runs=1, dim_size=5, kernel="npu")
    assert assert_runs_stock(model, result.model) == ["SoftmaxTopK"]


@pytest.mark.parametrize("kernel", ["reference", "npu"])
def test_float32_bias_choice_against_onnxruntime_indices_exact(kernel: str) -> None:
    """The bias only tells experts apart in float32 (its steps are below float16's): the
    fused op must choose in float32, as the original does, and gather float16 weights."""
    gate = Gate(dtype="float16", bias_dtype="float32", sorted=1, tokens="T", renorm=None,
                scale=None)  # fmt: skip
    model = gate_model(gate)
    bias = next(t for t in model.graph.initializer if t.name == "e_score_correction_bias")
    bias.CopyFrom(onnx.numpy_helper.from_array(np.arange(16, dtype=np.float32) * 1e-5, bias.name))
    plain = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    fused = ort.session(fuse_all(model, PATTERN).model, kernel=kernel)
    x = np.round(np.random.default_rng(7).standard_normal((29, 16))).astype(np.float16)
    x[:3] = 0.0  # every expert ties but for the bias
    (w0, i0), (w1, i1) = plain.run(None, {"x": x}), fused.run(None, {"x": x})
    np.testing.assert_array_equal(i1, i0)
    np.testing.assert_array_equal(np.sort(i0[0]), [12, 13, 14, 15])
    assert w1.dtype == np.float16
    np.testing.assert_allclose(w1.astype(np.float32), w0.astype(np.float32), atol=1e-3)


def test_float32_bias_on_float64_scores_is_refused() -> None:
    """A Cast of float64 scores to float32 rounds them: the op's float64 chain would choose on
    other values than the original."""
    result = fuse_all(gate_model(Gate(dtype="float64", bias_dtype="float32")), PATTERN)
    assert result.report.summary["softmax_topk"] == 0
    assert reasons(result, "softmax_topk") == [
        "the choice reads Cast 'Cast_1' of the float64 scores to float32 while the weights are "
        "gathered from the uncast scores; SoftmaxTopK takes that only for float16 scores "
        "(whose chain it computes in float32)"
    ]


def test_float32_choice_read_elsewhere_is_refused() -> None:
    """The Cast of the scores (an internal value) also a graph output: refused, never lost."""
    model = gate_model(Gate(dtype="float16", bias_dtype="float32"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("Cast_1_out0", 1, None))
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 0
    (why,) = reasons(result, "softmax_topk")
    assert "Cast_1_out0" in why and "graph output" in why, why


# -- other spellings the real exports write -------------------------------------------------------


def _hub_model(view: str, expand: str, opset: int = 18) -> onnx.ModelProto:
    """DeepSeek-V3's own gate as dynamo writes it: a view of the scores before the bias, the
    mask expanded to Concat(tokens, 4, 4) computed at run time; `view` and `expand` are the
    typed dims of the view and of the Expand's output."""
    bias = ", ".join(f"{0.01 * (j + 1):.2f}" for j in range(16))
    text = f"""<ir_version: 8, opset_import: ["" : {opset}]>
g (float[T, 16] x) => (float[T, 4] w, int64[T, 4] i) <float[T, 16] s, float[{view}] v,
    float[{expand}] e, int64[2] flat = {{-1, 16}}, int64[3] split = {{-1, 4, 4}},
    int64[1] two = {{2}}, int64[1] last = {{-1}}, int64[1] four = {{4}}, int64 zero = {{0}},
    int64[1] k = {{4}}, float fill = {{0.0}}, float[1, 16] bias = {{{bias}}}> {{
  s = Sigmoid(x)
  v = Reshape<allowzero = 1>(s, flat)
  c = Add(v, bias)
  g = Reshape<allowzero = 1>(c, split)
  t2, t2i = TopK<axis = -1>(g, two)
  gs = ReduceSum<keepdims = 0>(t2, last)
  gv, kept = TopK<sorted = 0>(gs, two)
  gshape = Shape(gs)
  zeros = ConstantOfShape(gshape)
  kshape = Shape(kept)
  ones = ConstantOfShape<value = float[1] {{1.0}}>(kshape)
  m = ScatterElements<axis = 1>(zeros, kept, ones)
  u = Unsqueeze(m, last)
  xshape = Shape(x)
  rows = Gather<axis = 0>(xshape, zero)
  tokens = Reshape(rows, last)
  to = Concat<axis = 0>(tokens, four, four)
  e = Expand(u, to)
  ef = Reshape<allowzero = 1>(e, flat)
  keep = Cast<to = 9>(ef)
  drop = Not(keep)
  masked = Where(drop, fill, c)
  tv, i = TopK<sorted = 1>(masked, k)
  w = GatherElements<axis = 1>(s, i)
}}"""
    return onnx.parser.parse_model(text)


def test_view_and_run_time_expand_typed_as_the_rows_fuse() -> None:
    model = _hub_model("T, 16", "T, 4, 4")
    result = fuse_all(model, PATTERN)
    assert reasons(result) == []
    assert result.report.nodes_after == 1, [n.op_type for n in result.model.graph.node]
    assert attrs_of(fused_node(result.model))["mask_value"] == 0.0
    assert_equivalent(model, result.model, runs=2, dim_size=7)
    assert assert_runs_stock(model, result.model) == ["SoftmaxTopK"]


def test_run_time_expand_of_other_rows_is_refused() -> None:
    result = fuse_all(_hub_model("T, 16", "U, 4, 4"), PATTERN)
    assert result.report.summary["softmax_topk"] == 0
    assert reasons(result, "softmax_topk") == [
        "the group mask 'ef' is not one flag per group broadcast to its experts"
    ]


def test_untyped_view_to_a_run_time_shape_is_refused() -> None:
    """The view's shape computed at run time and its output typed as other rows: refused."""
    model = _hub_model("U, 16", "T, 4, 4")
    view = next(n for n in model.graph.node if n.output[0] == "v")
    view.input[1] = "runtime"
    model.graph.node.insert(0, onnx.helper.make_node("Shape", ["x"], ["runtime"]))
    result = fuse_all(model, PATTERN)
    assert reasons(result, "softmax_topk") == [
        "Reshape 'Reshape' of the scores 's' to a shape computed at run time ('runtime'): its "
        "output's shape does not show it keeps [tokens, 16]"
    ]


@pytest.mark.parametrize("eps", [False, True])
def test_float16_sum_in_float32_renormalizes(eps: bool) -> None:
    """dynamo's sum of float16 weights: Cast(float32) -> ReduceSum -> Cast(float16) -> Div."""
    add = "d = Add(tb, eps)" if eps else "d = Relu(eps)"  # no epsilon: Div(v, tb)
    bias = ", ".join(f"{0.01 * (j + 1):.2f}" for j in range(16))
    text = f"""<ir_version: 8, opset_import: ["" : 17]>
g (float16[T, 16] x) => (float16[T, 4] w, int64[T, 4] i) <int64[1] k = {{4}},
    int64[1] last = {{-1}}, float eps32 = {{0.001}}, float[16] bias = {{{bias}}}> {{
  eps = Cast<to = 10>(eps32)
  s = Sigmoid(x)
  s32 = Cast<to = 1>(s)
  c = Add(s32, bias)
  tv, i = TopK(c, k)
  v = GatherElements<axis = 1>(s, i)
  v32 = Cast<to = 1>(v)
  total = ReduceSum(v32, last)
  tb = Cast<to = 10>(total)
  {add}
  w = Div(v, {"d" if eps else "tb"})
}}"""
    model = onnx.parser.parse_model(text)
    result = fuse_all(model, PATTERN)
    assert reasons(result) == []
    left = sorted(n.op_type for n in result.model.graph.node)
    assert left == (["SoftmaxTopK"] if eps else ["Cast", "Relu", "SoftmaxTopK"]), left
    if eps:
        attrs = attrs_of(fused_node(result.model))
        assert attrs["renormalize"] == 1 and attrs["epsilon"] == pytest.approx(0.001, rel=1e-3)
    assert_equivalent(model, result.model, runs=2, dim_size=5)
