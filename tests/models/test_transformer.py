"""The transformer builders: LayerNorm variants, exporter quirks, and numerics."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.models import transformer as tf
from fuser.models.inventory import layernorm_outputs
from model_checks import check, op_counts, producer, producer_op, random_inputs, readers, run

DECOMPOSED_VARIANTS = [
    tf.LayerNormStyle(),
    tf.LayerNormStyle(divide="reciprocal"),
    tf.LayerNormStyle(square="mul"),
    tf.LayerNormStyle(noop_casts=True),
    tf.LayerNormStyle(divide="reciprocal", square="mul", noop_casts=True),
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("style", DECOMPOSED_VARIANTS)
def test_decomposed_layernorm_equals_the_op(opset: int, style: tf.LayerNormStyle) -> None:
    """Same seed, same weights: every decomposition computes what LayerNormalization does."""
    feeds = random_inputs(tf.bert())
    reference = run(tf.bert(opset=17), feeds)
    model = tf.bert(opset=opset, ln=style)
    check(model)
    for got, want in zip(run(model, feeds), reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_gpt2_decomposed_equals_op() -> None:
    feeds = random_inputs(tf.gpt2())
    np.testing.assert_allclose(
        run(tf.gpt2(opset=13), feeds)[0], run(tf.gpt2(opset=17), feeds)[0], rtol=1e-4, atol=1e-4
    )


def test_decomposed_ops_as_torchscript_writes_them() -> None:
    ops = op_counts(tf.bert(opset=13))
    assert ops["LayerNormalization"] == 0
    assert ops["Pow"] == 5
    assert ops["Sqrt"] == 5
    assert ops["ReduceMean"] == 10
    ops = op_counts(tf.bert(opset=17))
    assert ops["LayerNormalization"] == 5
    assert ops["Sqrt"] == 0
    ops = op_counts(tf.bert(opset=18, ln=DECOMPOSED_VARIANTS[-1]))
    assert ops["Pow"] == 0
    assert ops["Reciprocal"] == 5
    assert ops["Cast"] == 1 + 2 * 5


def test_opset18_reduce_mean_takes_axes_as_input() -> None:
    model = tf.bert(opset=18, ln=tf.LayerNormStyle())
    means = [n for n in model.graph.node if n.op_type == "ReduceMean"]
    assert len(means) == 10
    assert all(len(n.input) == 2 and [a.name for a in n.attribute] == ["keepdims"] for n in means)
    model = tf.bert(opset=13)
    means = [n for n in model.graph.node if n.op_type == "ReduceMean"]
    assert all(len(n.input) == 1 and {a.name for a in n.attribute} == {"axes", "keepdims"}
               for n in means)  # fmt: skip


def test_noop_casts_keep_the_dtype() -> None:
    for dtype, elem in (("float32", 1), ("float16", 10)):
        model = tf.bert(opset=13, ln=tf.LayerNormStyle(noop_casts=True), dtype=dtype)
        ln_casts = [n for n in model.graph.node if n.op_type == "Cast" and "LayerNorm" in n.name]
        assert len(ln_casts) == 10
        assert all(n.attribute[0].i == elem for n in ln_casts)


def test_bert_layernorm_readers() -> None:
    """Post-LN: LN outputs feed MatMuls, the residual Add and a Shape; the last is an output."""
    model = tf.bert()
    lns = layernorm_outputs(model)
    assert len(lns) == 5
    for out in lns[:-1]:
        kinds = {n.op_type for n in readers(model, out)}
        assert {"MatMul", "Add"} <= kinds
    for out in lns[0:-1:2]:  # embedding LN and each layer's output LN feed Q, K, V
        assert [n.op_type for n in readers(model, out)].count("MatMul") == 3
        assert "Shape" in {n.op_type for n in readers(model, out)}
    assert lns[-1] == "last_hidden_state"


def test_bert_linear_bias_is_first_add_operand() -> None:
    model = tf.bert()
    matmul_adds = [
        n for n in model.graph.node
        if n.op_type == "Add" and any(producer_op(model, v) == "MatMul" for v in n.input)
    ]  # fmt: skip
    assert len(matmul_adds) == 13  # 6 per layer + pooler
    inits = {t.name for t in model.graph.initializer}
    assert all(n.input[0] in inits for n in matmul_adds)


def test_bert_padding_mask_is_used() -> None:
    model = tf.bert()
    feeds = random_inputs(model)
    feeds["attention_mask"][:] = 1
    full = run(model, feeds)[0]
    feeds["attention_mask"][:, -1] = 0
    assert not np.allclose(full, run(model, feeds)[0])


def test_gpt_pre_ln_structure() -> None:
    model = tf.gpt()
    lns = layernorm_outputs(model)
    assert len(lns) == 5
    matmuls_per_ln = [[n.op_type for n in readers(model, out)].count("MatMul") for out in lns]
    assert matmuls_per_ln == [3, 2, 3, 2, 1]
    for out in lns:  # the residual Add reads the LN input, not its output
        assert {n.op_type for n in readers(model, out)} <= {"MatMul", "Shape"}
    for out in lns[:-1]:
        ln_input = producer(model, out).input[0]
        assert "Add" in {n.op_type for n in readers(model, ln_input)}


def test_gpt2_conv1d_is_reshape_gemm_reshape() -> None:
    model = tf.gpt2()
    lns = layernorm_outputs(model)
    for i, out in enumerate(lns[:-1]):
        kinds = sorted(n.op_type for n in readers(model, out))
        # flatten + Conv1D size_out (+ attention dims on ln_1)
        assert kinds == ["Reshape", "Shape", "Shape"][: 3 - i % 2]
        reshape = next(n for n in readers(model, out) if n.op_type == "Reshape")
        flat = next(t for t in model.graph.initializer if t.name == reshape.input[1])
        assert onnx.numpy_helper.to_array(flat).tolist() == [-1, 32]
        gemm = readers(model, reshape.output[0])
        assert [n.op_type for n in gemm] == ["Gemm"]
        assert [n.op_type for n in readers(model, gemm[0].output[0])] == ["Reshape"]
    assert [n.op_type for n in readers(model, lns[-1])] == ["MatMul"]


@pytest.mark.parametrize("builder", [tf.gpt, tf.gpt2])
def test_decoders_are_causal(builder) -> None:  # type: ignore[no-untyped-def]
    model = builder()
    feeds = random_inputs(model)
    before = run(model, feeds)[0]
    feeds["input_ids"][:, -1] = (feeds["input_ids"][:, -1] + 1) % 16
    after = run(model, feeds)[0]
    np.testing.assert_allclose(before[:, :-1], after[:, :-1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(before[:, -1], after[:, -1])


@pytest.mark.parametrize("builder", [tf.bert, tf.gpt, tf.gpt2])
@pytest.mark.parametrize("opset", [13, 17, 18])
def test_float16_and_static_dims(builder, opset: int) -> None:  # type: ignore[no-untyped-def]
    model = builder(opset=opset, dtype="float16")
    check(model)
    assert run(model)[0].dtype == np.float16
    model = builder(opset=opset, batch=1, seq=4)
    inferred = check(model)
    dims = [d.dim_value for d in inferred.graph.output[0].type.tensor_type.shape.dim]
    assert dims[:2] == [1, 4]
    assert run(model)[0].shape[:2] == (1, 4)


def test_layer_count_scales_chains() -> None:
    from fuser.models.inventory import count_chains

    counts = count_chains(tf.bert(layers=4))
    assert counts["layernorm"] == 9
    assert counts["layernorm_matmuls"] == 16
    assert count_chains(tf.gpt(layers=3))["layernorm_matmuls"] == 16
    assert count_chains(tf.gpt2(layers=3))["layernorm_matmul"] == 7


def test_layernorm_op_needs_opset_17() -> None:
    with pytest.raises(ValueError, match="opset >= 17"):
        tf.gpt(opset=13, ln=tf.LayerNormStyle(kind="op"))
