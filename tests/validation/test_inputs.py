"""Inputs a model accepts: symbolic and -1 dims, sizes by name, index bounds, masks, rank 0."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from fuser.api import validate
from fuser.errors import ValidationInputError
from fuser.validate_inputs import input_specs, make_feeds, symbolic_dims

EMBEDDING = """
<ir_version: 8, opset_import: ["" : 17]>
g (int64[batch, seq] input_ids, int64[batch, seq] token_type_ids, int64[batch, seq] attention_mask)
    => (float[batch, seq, 4] y) {
    a = Gather(words, input_ids)
    t64 = Cast <to = 7> (token_type_ids)
    b = Gather(types, t64)
    m = Cast <to = 1> (attention_mask)
    mu = Unsqueeze(m, axes)
    s = Add(a, b)
    y = Mul(s, mu)
}
"""


def _embedding_model() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    model = onnx.parser.parse_model(EMBEDDING)
    for name, value in (
        ("words", rng.standard_normal((30, 4)).astype(np.float32)),
        ("types", rng.standard_normal((2, 4)).astype(np.float32)),
        ("axes", np.array([-1], np.int64)),
    ):
        model.graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    return model


def test_indices_stay_below_the_gathered_table_and_masks_are_0_1() -> None:
    model = _embedding_model()
    specs = {s.name: s for s in input_specs(model, {"seq": 7}, 3)}
    assert specs["token_type_ids"].high == 2  # the 2-row table, through a Cast
    assert specs["attention_mask"].high == 2
    assert specs["input_ids"].shape == (3, 7)
    for run in range(3):
        feeds = make_feeds(list(specs.values()), run=run, rank=0, seed=0)
        assert feeds["token_type_ids"].max() < 2 and set(np.unique(feeds["attention_mask"])) <= {
            0,
            1,
        }
    # the original and an identical "fused" copy validate (onnxruntime used to raise on index 3)
    assert validate(model, model, kernel="reference", dims={"seq": 7}).ok


def test_negative_and_empty_dims_are_symbolic() -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 5] x) => (float[N, 5] y) { y = Relu(x) }
    """)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[0].Clear()
    dims[0].dim_value = -1  # PaddleOCR's dynamic dims
    dims[1].Clear()  # an empty dim
    out = model.graph.output[0].type.tensor_type.shape.dim
    out[0].Clear()
    (spec,) = input_specs(model, {}, 4)
    assert spec.shape == (4, 4)
    assert symbolic_dims(model) == ["x[0]", "x[1]"]
    assert validate(model, model, kernel="reference", dim_size=4).ok


def test_rank_0_inputs_work() -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float x, float[3] v) => (float[3] y) { y = Mul(v, x) }
    """)
    feeds = make_feeds(input_specs(model, {}, 3), run=1, rank=0, seed=0)
    assert isinstance(feeds["x"], np.ndarray) and feeds["x"].shape == ()
    assert validate(model, model, kernel="reference").ok


def test_dim_sizes_below_1_are_refused() -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 5] x) => (float[N, 5] y) { y = Relu(x) }
    """)
    with pytest.raises(ValidationInputError, match="--dim N=0: sizes must be at least 1"):
        validate(model, model, kernel="reference", dims={"N": 0})
    with pytest.raises(ValidationInputError, match="--dim-size -1: must be at least 1"):
        validate(model, model, kernel="reference", dim_size=-1)


def test_an_original_that_fails_on_generated_inputs_is_named_with_what_to_give() -> None:
    """A VAD model's `sr` must be a real sample rate: the original is blamed, not the fused."""
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[batch, 4] x, int64[1] sr) => (float[batch, 4] y) {
        r = Reshape(x, sr)
        y = Relu(x)
    }
    """)
    with pytest.raises(ValidationInputError) as info:
        validate(model, model, kernel="reference")
    message = str(info.value)
    assert "the original model fails on the generated inputs" in message
    assert "sr[1] int64" in message and "--input" in message and "batch" in message
    assert "\n" not in message


def test_wrong_given_input_shapes_are_fuser_errors() -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 5] x) => (float[2, 5] y) { y = Relu(x) }
    """)
    with pytest.raises(ValidationInputError, match="rank 1 given"):
        validate(model, model, kernel="reference", inputs={"x": np.ones(5, np.float32)})
    with pytest.raises(ValidationInputError, match=r"x: shape \[2, 4\] given, the model takes"):
        validate(model, model, kernel="reference", inputs={"x": np.ones((2, 4), np.float32)})
    with pytest.raises(ValidationInputError, match="no model input named 'z'"):
        validate(model, model, kernel="reference", inputs={"z": np.ones(5, np.float32)})


def test_progress_is_reported_up_to_the_last_step() -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 5] x) => (float[N, 5] y) { y = Relu(x) }
    """)
    seen: list[tuple[int, int]] = []
    assert validate(
        model, model, kernel="reference", runs=2, progress=lambda d, t: seen.append((d, t))
    ).ok
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == seen[-1][1] == 6  # 3 steps per run
