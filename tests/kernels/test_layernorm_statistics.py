"""LayerNorm statistics (shifted one pass: y = x - x0, mean(y), mean(y^2)) against float64 and
onnxruntime's LayerNormalization kernel (the arbiter of the ONNX semantics): on rows where a
naive one-pass variance cancels catastrophically, the fused ops' reference and the NPU kernel
stay at least as close to the float64 truth as onnxruntime does."""

from __future__ import annotations

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels.npu.machine import load_target
from fuser.patterns.layernorm_matmul import layer_norm
from test_layernorm import ort_layernorm

M = load_target("ascend910b")
KERNEL = registry.get_kernel("", "LayerNormalization")


def _rows(kind: str, width: int) -> np.ndarray:
    rng = np.random.default_rng(width + len(kind))
    x = rng.standard_normal((24, width))
    if kind == "offset":  # a large common offset: E[x^2] - E[x]^2 loses it all in float32
        x += 1000.0
    elif kind == "outlier first":  # the shift x0 itself far from the row's mean
        x[:, 0] = rng.uniform(30, 60, 24) * rng.choice([-1, 1], 24)
    elif kind == "offset and outlier":
        x += 300.0
        x[:, 0] -= 40.0
    elif kind == "constant":
        x = np.repeat(rng.uniform(-3, 3, 24)[:, None], width, axis=1)
    return x.astype(np.float32)


def _truth(x: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    d = x64 - x64.mean(axis=-1, keepdims=True)
    return d / np.sqrt((d * d).mean(axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("kind", ["offset", "outlier first", "offset and outlier", "constant"])
@pytest.mark.parametrize("width", [7, 768])
def test_statistics_at_least_as_accurate_as_onnxruntime(kind: str, width: int) -> None:
    eps = float(np.float32(1e-12 if kind == "constant" else 1e-5))
    x = _rows(kind, width)
    ones = np.ones(width, np.float32)
    truth = _truth(x, eps)
    ort_err = float(np.abs(ort_layernorm(x, ones, None, -1)[0] - truth).max())
    ours = layer_norm(x, None, None, -1, eps, 1)
    kernel = KERNEL.run(M, [x, None, None], {"axis": -1, "epsilon": eps}).outputs[0]
    np.testing.assert_array_equal(kernel, ours)  # the kernel computes the reference, op for op
    err = float(np.abs(ours - truth).max())
    # float32 resolution of values of a few units; onnxruntime's own error where it is larger
    assert err <= max(2 * ort_err, 4e-6), (err, ort_err)
    if kind == "constant":
        assert not ours.any()  # shifted values are exact zeros: exactly 0, as in exact arithmetic


def test_float16_rows_keep_float32_statistics() -> None:
    """[300, -300, 0, 0] squares past float16's range: the statistics are float32."""
    x = np.array([[300, -300, 0, 0], [60000, 60001, 60002, 60003]], np.float16)
    ours = layer_norm(x, None, None, -1, 1e-5, 0)
    truth = _truth(x, 1e-5)
    np.testing.assert_allclose(ours.astype(np.float64), truth, atol=2e-3)
