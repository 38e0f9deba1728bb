"""Validation's comparison rules: dtype-aware tolerance, exact integers, NaN positions."""

from __future__ import annotations

import numpy as np
import onnx

from fuser.validation import compare, lowest_float_upstream


def test_float32_tolerance_is_relative_to_output_scale() -> None:
    expected = np.array([1000.0, -2.0], np.float32)
    assert compare("y", expected, expected + np.float32(0.05), None, None).ok  # 5e-5 of scale
    assert not compare("y", expected, expected + np.float32(0.5), None, None).ok


def test_integer_outputs_must_match_exactly() -> None:
    a = np.array([3, 1, 2], np.int64)
    result = compare("idx", a, np.array([3, 2, 1], np.int64), None, None)
    assert not result.ok and result.detail == "2 elements differ"


def test_nan_positions_must_agree() -> None:
    a = np.array([np.nan, 1.0], np.float32)
    assert compare("y", a, a.copy(), None, None).ok
    assert not compare("y", a, np.array([1.0, 1.0], np.float32), None, None).ok


def test_float32_output_of_float16_values_gets_float16_tolerance() -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float16[4] x, float[4] z) => (float[4] y, float[4] w) {
        s = Softmax(x)
        y = Cast <to = 1> (s)
        w = Relu(z)
    }
    """)
    assert lowest_float_upstream(model, ["y", "w"]) == {"y": "float16", "w": "float32"}
    expected = np.array([0.5, 0.25, 0.125, 0.125], np.float32)
    off = expected + np.float32(1e-3)
    assert compare("y", expected, off, None, None, "float16").ok
    assert not compare("y", expected, off, None, None, "float32").ok


def test_string_outputs_compare_exactly() -> None:
    a = np.array(["a", "b", "c"], dtype=object)
    assert compare("s", a, a.copy(), None, None).ok
    result = compare("s", a, np.array(["a", "x", "c"], dtype=object), None, None)
    assert not result.ok and result.detail == "1 elements differ" and result.worst_index == (1,)
