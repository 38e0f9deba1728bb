"""Noise-aware comparison: no false alarm where the original is ill-conditioned, still caught
where the fused model changes the maths; unsorted TopK compared as (value, index) pairs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from fuser.api import validate
from fuser.compare import compare_topk, compare_values
from fuser.testing import fuse_all

HIDDEN = 768


def _layernorm(eps: float) -> onnx.ModelProto:
    """A decomposed LayerNorm -> MatMul, and an unfused LayerNorm elsewhere (a graph output)."""
    model = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[B, S, {HIDDEN}] x) => (float[B, S, 8] y, float[B, S, {HIDDEN}] z) {{
        mean = ReduceMean <axes = [-1]> (x)
        d = Sub(x, mean)
        sq = Mul(d, d)
        var = ReduceMean <axes = [-1]> (sq)
        ve = Add(var, eps)
        sd = Sqrt(ve)
        n = Div(d, sd)
        s = Mul(n, gamma)
        ln = Add(s, beta)
        y = MatMul(ln, w)
        mean2 = ReduceMean <axes = [-1]> (x)
        d2 = Sub(x, mean2)
        sq2 = Mul(d2, d2)
        var2 = ReduceMean <axes = [-1]> (sq2)
        ve2 = Add(var2, eps)
        sd2 = Sqrt(ve2)
        z = Div(d2, sd2)
    }}
    """)
    rng = np.random.default_rng(0)
    for name, value in (
        ("eps", np.array(eps, np.float32)),
        ("gamma", rng.standard_normal(HIDDEN).astype(np.float32)),
        ("beta", rng.standard_normal(HIDDEN).astype(np.float32)),
        ("w", rng.standard_normal((HIDDEN, 8)).astype(np.float32)),
    ):
        model.graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    return model


@pytest.mark.parametrize("eps", [1e-5, 1e-12])
def test_constant_row_layernorm_fused_passes_and_with_a_dropped_epsilon_fails(eps: float) -> None:
    """Run 1 feeds constant rows: the original's mean rounds, 1/sqrt(eps) amplifies it (the
    fused node differed by 3e-4 of scale at 1e-5, by 0.46 at 1e-12, before the float64 truth)."""
    original = _layernorm(eps)
    result = fuse_all(original)
    assert [n.op_type for n in result.model.graph.node].count("LayerNormMatMul") == 1
    assert validate(original, result, kernel="reference", runs=3).ok
    dropped = onnx.ModelProto()
    dropped.CopyFrom(result.model)
    node = next(n for n in dropped.graph.node if n.domain == "fuser")
    for attr in node.attribute:
        if attr.name == "epsilon":
            attr.f = 0.0
    checked = validate(original, dropped, kernel="reference", runs=3)
    assert not checked.ok
    assert {f.run for f in checked.failures if f.node == node.name} == {1}  # the constant rows


def test_the_float64_truth_is_what_lets_an_exact_fusion_pass() -> None:
    """Against the original alone (no truth), the same fusion is a false alarm."""
    expected = np.array([53.13, 1.0], np.float32)  # the original's rounding, amplified
    fused = np.array([21.85, 1.0], np.float32)
    truth = np.array([22.0, 1.0])
    assert not compare_values(expected, fused).ok
    assert compare_values(expected, fused, truth=truth).ok
    # far from the truth too: still a mismatch
    assert not compare_values(expected, np.array([150.0, 1.0], np.float32), truth=truth).ok
    # NaN where the original is finite is never excused
    assert not compare_values(expected, np.array([np.nan, 1.0], np.float32), truth=truth).ok


def test_unsorted_topk_compares_as_value_index_pairs() -> None:
    values = np.array([[0.5, 0.3, 0.2], [0.9, 0.05, 0.04]], np.float32)
    indices = np.array([[4, 0, 2], [1, 3, 0]], np.int64)
    order = np.array([[2, 0, 1], [1, 2, 0]])
    shuffled_v, shuffled_i = (np.take_along_axis(a, order, 1) for a in (values, indices))
    v, i = compare_topk((values, shuffled_v), (indices, shuffled_i), axis=-1, is_sorted=False)
    assert v.ok and i.ok
    # sorted=1: the same permutation is a mismatch
    v, i = compare_topk((values, shuffled_v), (indices, shuffled_i), axis=-1, is_sorted=True)
    assert not v.ok
    # a wrong index with the right value is caught
    wrong = shuffled_i.copy()
    wrong[0, 0] = 3
    v, i = compare_topk((values, shuffled_v), (indices, wrong), axis=-1, is_sorted=False)
    assert v.ok and not i.ok and "indices differ beyond ties" in i.detail


def test_topk_ties_are_judged_by_value() -> None:
    values = np.array([[0.4, 0.4, 0.2]], np.float32)
    v, i = compare_topk(
        (values, values),
        (np.array([[1, 3, 0]]), np.array([[3, 1, 0]])),
        axis=-1,
        is_sorted=True,
    )
    assert v.ok and i.ok
    # a tie at the cut (last group) passes only where the original's own choice moves
    cut = np.array([[0.5, 0.2]], np.float32)
    pairs = (np.array([[2, 5]]), np.array([[2, 6]]))
    _, strict = compare_topk((cut, cut), pairs, axis=-1, is_sorted=True)
    assert not strict.ok
    moved = np.array([[2, 6]])
    _, loose = compare_topk((cut, cut), pairs, axis=-1, is_sorted=True, perturbed_indices=moved)
    assert loose.ok


def test_a_sorted_0_topk_model_validates_against_its_reordered_self() -> None:
    """onnxruntime returns sorted=0 results in heap order, the fused reference sorted."""
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[T, 16] logits) => (float[T, 5] v, int64[T, 5] i) {
        p = Softmax <axis = -1> (logits)
        v, i = TopK <axis = -1, sorted = 0> (p, k)
    }
    """
    original = onnx.parser.parse_model(text)
    original.graph.initializer.append(onnx.numpy_helper.from_array(np.array([5], np.int64), "k"))
    result = fuse_all(original)
    assert any(n.op_type == "SoftmaxTopK" for n in result.model.graph.node)
    import onnxruntime

    sess = onnxruntime.InferenceSession(original.SerializeToString())
    x = np.random.default_rng(0).standard_normal((9, 16)).astype(np.float32)
    v, _ = sess.run(None, {"logits": x})
    assert not np.array_equal(v, -np.sort(-v, axis=-1))  # heap order: position-wise would fail
    assert validate(original, result, kernel="reference", runs=3, dim_size=9).ok
