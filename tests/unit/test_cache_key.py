"""Tuning-cache keys of nodes whose attributes are tensors (ConstantOfShape's `value`)."""

from __future__ import annotations

import numpy as np
import onnx

from fuser.tuning_cache import CacheKey


def _key(value: float) -> CacheKey:
    tensor = onnx.numpy_helper.from_array(np.array([value], np.float32), "value")
    return CacheKey.make("ai.onnx::ConstantOfShape", [(2,)], "float32", "t", {"value": tensor})


def test_a_tensor_attribute_is_digested_by_its_bytes() -> None:
    assert _key(0.0) == _key(0.0)
    assert _key(0.0).attrs != _key(1.0).attrs
