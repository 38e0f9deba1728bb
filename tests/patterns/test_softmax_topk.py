"""softmax_topk: Softmax -> TopK (-> renormalize) and TopK -> Softmax => fuser.SoftmaxTopK."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from fuser.models import get_example
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser import ort
from fuser.fusedop import DOMAIN
from fuser.testing import assert_equivalent, count_ops, fuse_all, reasons

PATTERN = ["softmax_topk"]


def plugin_session(model: onnx.ModelProto, **kwargs: Any) -> Any:
    """An onnxruntime session whose fused ops run their numpy `reference` (these tests check
    the rewrite and its reference; the NPU kernels have their own tests)."""
    return ort.session(model, kernel="reference", **kwargs)


K = "k = Constant<value = int64[1] {2}>()"
RENORM = """
    ax = Constant<value = int64[1] {-1}>()
    s = ReduceSum<keepdims=1>(t, ax)
    v = Div(t, s)"""


def parse(signature: str, body: str, opset: int = 17) -> onnx.ModelProto:
    """A one-graph model from onnx's text format."""
    text = f'<ir_version: 8, opset_import: ["" : {opset}]>\ng {signature} {{\n{body}\n}}'
    return onnx.parser.parse_model(text)


def fused_node(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.domain == DOMAIN]
    return node


def attrs(node: onnx.NodeProto) -> dict[str, object]:
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


# -- positive -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float", "float16"])
@pytest.mark.parametrize("renorm", [False, True])
def test_softmax_topk_fuses(dtype: str, renorm: bool) -> None:
    out, tail = ("v", RENORM) if renorm else ("t", "")
    model = parse(
        f"({dtype}[N, 8] x) => ({dtype}[N, 2] {out}, int64[N, 2] i)",
        f"p = Softmax<axis=-1>(x)\n{K}\nt, i = TopK<largest=1, sorted=1>(p, k){tail}",
    )
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 1
    assert result.report.nodes_after == 1  # the constants k and axes went with the chain
    node = fused_node(result.model)
    assert node.op_type == "SoftmaxTopK"
    assert attrs(node) == {
        "k": 2, "axis": -1, "order": "softmax_topk", "renormalize": int(renorm), "sorted": 1,
        "to_float32": 0,
    }  # fmt: skip
    # run 1 of the validation makes every row constant: all 8 probabilities tie
    assert_equivalent(model, result.model, runs=3)


def test_cast_to_float32_between_softmax_and_topk() -> None:
    """Mixtral's `softmax(logits, dtype=torch.float)` on fp16: Softmax -> Cast(float) -> TopK."""
    model = parse(
        "(float16[N, 8] x) => (float16[N, 2] w, int64[N, 2] i)",
        f"p = Softmax<axis=-1>(x)\nc = Cast<to=1>(p)\n{K}\n"
        f"t, i = TopK<largest=1, sorted=1>(c, k){RENORM}\nw = Cast<to=10>(v)",
    )
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 1
    assert count_ops(result.model, "Cast") == 1  # the cast back to fp16 is not part of it
    assert attrs(fused_node(result.model))["to_float32"] == 1
    assert_equivalent(model, result.model, runs=3)


def test_noop_cast_is_looked_through() -> None:
    model = parse(
        "(float[N, 8] x) => (float[N, 2] t, int64[N, 2] i)",
        f"p = Softmax(x)\nc = Cast<to=1>(p)\n{K}\nt, i = TopK(c, k)",
    )
    result = fuse_all(model, PATTERN)
    assert result.report.nodes_after == 1
    assert attrs(fused_node(result.model))["to_float32"] == 0
    assert_equivalent(model, result.model)


@pytest.mark.parametrize("dtype", ["float", "float16"])
@pytest.mark.parametrize("cast", [False, True])
def test_topk_then_softmax(dtype: str, cast: bool) -> None:
    """Mistral's router: TopK on the logits, then softmax of the k values (maybe in float)."""
    out_type = "float" if cast else dtype
    softmax_in = "c = Cast<to=1>(t)\nv = Softmax<axis=-1>(c)" if cast else "v = Softmax(t)"
    model = parse(
        f"({dtype}[N, 8] x) => ({out_type}[N, 2] v, int64[N, 2] i)",
        f"{K}\nt, i = TopK<axis=-1>(x, k)\n{softmax_in}",
    )
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 1
    assert result.report.nodes_after == 1
    node = fused_node(result.model)
    assert attrs(node)["order"] == "topk_softmax"
    assert attrs(node)["to_float32"] == int(cast and dtype != "float")
    assert_equivalent(model, result.model, runs=3)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_ties_keep_the_lower_index_first(dtype: type) -> None:
    name = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    type_name = {1: "float", 10: "float16"}[name]
    model = parse(
        f"({type_name}[N, 6] x) => ({type_name}[N, 3] t, int64[N, 3] i)",
        "p = Softmax(x)\nk = Constant<value = int64[1] {3}>()\nt, i = TopK(p, k)",
    )
    x = np.array(
        [[1, 3, 3, 0, 3, 2], [5, 5, 5, 5, 5, 5], [0, 2, 1, 2, 1, 1], [-1, -1, 4, -1, 4, -1]],
        dtype=dtype,
    )
    result = fuse_all(model, PATTERN)
    expected = plugin_session(model).run(None, {"x": x})
    actual = plugin_session(result.model).run(None, {"x": x})
    np.testing.assert_array_equal(actual[1], [[1, 2, 4], [0, 1, 2], [1, 3, 2], [2, 4, 0]])
    np.testing.assert_array_equal(actual[1], expected[1])
    np.testing.assert_allclose(actual[0], expected[0], rtol=1e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_ties_on_many_random_inputs(dtype: type) -> None:
    """Small integer logits tie often; indices must equal the original's exactly."""
    type_name = {np.float32: "float", np.float16: "float16"}[dtype]
    model = parse(
        f"({type_name}[N, 7] x) => ({type_name}[N, 3] v, int64[N, 3] i)",
        f"p = Softmax(x)\nk = Constant<value = int64[1] {{3}}>()\nt, i = TopK(p, k){RENORM}",
    )
    # A session that ran a plugin op must be freed when the test ends: one freed late (at
    # interpreter exit, or by the cyclic GC in another test's rank thread) segfaults in
    # onnxruntime-extensions 0.15. hypothesis keeps `check` alive, so `check` reaches the
    # sessions through a list emptied at the end rather than through a closure.
    sessions = [plugin_session(model), plugin_session(fuse_all(model, PATTERN).model)]

    @settings(max_examples=25, deadline=None)
    @given(st.lists(st.lists(st.integers(-2, 2), min_size=7, max_size=7), min_size=1, max_size=6))
    def check(rows: list[list[int]]) -> None:
        x = {"x": np.array(rows, dtype=dtype)}
        (v0, i0), (v1, i1) = (s.run(None, x) for s in sessions)
        np.testing.assert_array_equal(i1, i0)
        np.testing.assert_allclose(v1, v0, rtol=1e-3)

    try:
        check()
    finally:
        sessions.clear()


def test_unsorted_topk_gives_the_same_set() -> None:
    """sorted=0: ONNX leaves the order of the k results open; the sets must be equal."""
    model = parse(
        "(float[N, 16] x) => (float[N, 5] t, int64[N, 5] i)",
        "p = Softmax(x)\nk = Constant<value = int64[1] {5}>()\nt, i = TopK<sorted=0>(p, k)",
    )
    result = fuse_all(model, PATTERN)
    assert attrs(fused_node(result.model))["sorted"] == 0
    x = np.random.default_rng(1).standard_normal((7, 16)).astype(np.float32)
    (t0, i0), (t1, i1) = (plugin_session(m).run(None, {"x": x}) for m in (model, result.model))
    by_index0, by_index1 = np.argsort(i0, axis=1), np.argsort(i1, axis=1)
    np.testing.assert_array_equal(np.sort(i0, axis=1), np.sort(i1, axis=1))
    np.testing.assert_allclose(
        np.take_along_axis(t0, by_index0, 1), np.take_along_axis(t1, by_index1, 1), rtol=1e-6
    )


def test_softmax_output_read_elsewhere_is_exported_as_probs() -> None:
    model = parse(
        "(float16[N, 8] x) => (float16[N, 2] v, int64[N, 2] i, float16[N, 8] p2)",
        f"p = Softmax(x)\n{K}\nt, i = TopK(p, k){RENORM}\np2 = Mul(p, p)",
    )
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 1
    node = fused_node(result.model)
    assert list(node.output) == ["v", "i", "p"]
    assert_equivalent(model, result.model, runs=3)


def test_renormalization_left_out_when_topk_values_are_read_elsewhere() -> None:
    model = parse(
        "(float[N, 8] x) => (float[N, 2] v, int64[N, 2] i, float[N, 2] t)",
        f"p = Softmax(x)\n{K}\nt, i = TopK(p, k){RENORM}",
    )
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 1
    assert count_ops(result.model, "Div") == 1
    (fusion,) = result.report.fusions
    assert "left unfused: the top-k values 't' are also a graph output" in fusion.notes[0]
    assert_equivalent(model, result.model)


def test_old_opsets_with_axes_attributes() -> None:
    """Opset 11: Softmax coerces to 2-D at axis (here the last), ReduceSum axes attribute."""
    model = parse(
        "(float[N, 8] x) => (float[N, 2] v, int64[N, 2] i)",
        f"p = Softmax<axis=1>(x)\n{K}\nt, i = TopK(p, k)\n"
        "s = ReduceSum<axes=[-1], keepdims=1>(t)\nv = Div(t, s)",
        opset=11,
    )
    result = fuse_all(model, PATTERN)
    assert result.report.nodes_after == 1
    assert attrs(fused_node(result.model))["renormalize"] == 1
    assert_equivalent(model, result.model)


def test_opset_9_topk_with_k_attribute() -> None:
    model = parse(
        "(float[N, 8] x) => (float[N, 2] t, int64[N, 2] i)",
        "p = Softmax<axis=1>(x)\nt, i = TopK<k=2>(p)",
        opset=9,
    )
    result = fuse_all(model, PATTERN)
    assert result.report.nodes_after == 1
    assert attrs(fused_node(result.model))["k"] == 2
    assert_equivalent(model, result.model)


def test_double_softmax_is_refused_the_npu_kernel_takes_no_double() -> None:
    model = parse(
        "(double[N, 8] x) => (float[N, 2] t, int64[N, 2] i)",
        f"p = Softmax(x)\nc = Cast<to=1>(p)\n{K}\nt, i = TopK(c, k)",
    )
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 0
    assert reasons(result) == ["'x' is float64, which SoftmaxTopK does not support"]


def test_symbolic_dims_and_shape_inference() -> None:
    model = parse(
        "(float16[B, S, 8] x) => (float16[B, S, 2] t, int64[B, S, 2] i)",
        f"p = Softmax(x)\n{K}\nt, i = TopK(p, k)",
    )
    result = fuse_all(model, PATTERN)
    inferred = onnx.shape_inference.infer_shapes(result.model, strict_mode=True)
    shapes = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*inferred.graph.value_info, *inferred.graph.output]
    }
    assert shapes["t"] == shapes["i"] == ["B", "S", 2]
    assert_equivalent(model, result.model, dim_size=5)


@pytest.mark.parametrize(
    ("example", "renormalize", "to_float32", "order"),
    [
        ("moe", 1, 0, "softmax_topk"),
        ("moe-fp16", 1, 1, "softmax_topk"),
        ("qwen-router", 0, 0, "softmax_topk"),
        ("topk-softmax-router", 0, 0, "topk_softmax"),
    ],
)
def test_moe_routers(example: str, renormalize: int, to_float32: int, order: str) -> None:
    model = get_example(example)
    result = fuse_all(model, PATTERN)
    assert result.report.summary["softmax_topk"] == 1
    assert reasons(result, "softmax_topk") == []
    node = fused_node(result.model)
    assert (attrs(node)["renormalize"], attrs(node)["to_float32"]) == (renormalize, to_float32)
    assert attrs(node)["order"] == order
    assert count_ops(result.model, "TopK") == count_ops(result.model, "Softmax") == 0
    assert_equivalent(model, result.model, runs=3)


# -- negative -------------------------------------------------------------------------------------


NEGATIVE = {
    "largest=0": (
        "(float[N, 8] x) => (float[N, 2] t)",
        f"p = Softmax(x)\n{K}\nt, i = TopK<largest=0>(p, k)",
        17,
        "selects the smallest values (largest=0)",
    ),
    "topk on another axis": (
        "(float[4, 8] x) => (float[2, 8] t)",
        f"p = Softmax(x)\n{K}\nt, i = TopK<axis=0>(p, k)",
        17,
        "works on axis 0, not the last axis (1), but the softmax is on the last axis",
    ),
    "k not constant": (
        "(float[N, 8] x, int64[1] k) => (float[N, 2] t)",
        "p = Softmax(x)\nt, i = TopK(p, k)",
        17,
        "k 'k' of TopK 'TopK' is an overridable graph input",
    ),
    "k computed": (
        "(float[N, 8] x) => (float[N, M] t)",
        "p = Softmax(x)\nsh = Shape<start=0, end=1>(x)\nt, i = TopK(p, sh)",
        17,
        "k 'sh' of TopK 'TopK' is computed at run time",
    ),
    "softmax not on the last axis": (
        "(float[N, 8, 4] x) => (float[N, 8, 2] t)",
        f"p = Softmax<axis=1>(x)\n{K}\nt, i = TopK<axis=1>(p, k)",
        17,
        "normalizes axis 1 of 'x', not the last axis (2)",
    ),
    "opset 11 softmax coerced to 2-D": (
        "(float[N, 3, 8] x) => (float[N, 3, 2] t)",
        f"p = Softmax<axis=1>(x)\n{K}\nt, i = TopK(p, k)",
        11,
        "normalizes dims 1..2 of 'x' together (coerced 2-D at axis 1)",
    ),
    "opset 11 softmax of unknown rank": (
        "(float[N, 8] x, int64[R] shape) => (float t)",  # Reshape to a run-time rank
        f"y = Reshape(x, shape)\np = Softmax(y)\n{K}\nt, i = TopK(p, k)",
        11,
        "reads 'y' of unknown rank: cannot prove it is a last-axis softmax",
    ),
    "cast to double": (
        "(float[N, 8] x) => (double[N, 2] t)",
        f"p = Softmax(x)\nc = Cast<to=11>(p)\n{K}\nt, i = TopK(c, k)",
        17,
        "converts to float64",
    ),
}


@pytest.mark.parametrize("case", list(NEGATIVE))
def test_near_misses_are_refused_with_a_reason(case: str) -> None:
    signature, body, opset, reason = NEGATIVE[case]
    result = fuse_all(parse(signature, body, opset), PATTERN)
    assert result.report.summary["softmax_topk"] == 0
    (found,) = reasons(result, "softmax_topk")
    assert reason in found
