"""The activation ops' own vector kernels against onnxruntime, and their price: the same rows
as the fused ConvBnRelu epilogue runs for them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels.api import KernelError, TensorMeta
from fuser.patterns.conv_activation import VECTOR_OPS
from kernel_oracle import MACHINE, assert_close, run_node

# (op, attrs, the activation whose rows it costs)
OPS: list[tuple[str, dict[str, Any], str]] = [
    ("Sigmoid", {}, "Sigmoid"),
    ("Tanh", {}, "Tanh"),
    ("LeakyRelu", {"alpha": 0.07}, "LeakyRelu"),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.6}, "HardSigmoid"),
    ("HardSwish", {}, "HardSwish"),
    ("Gelu", {}, "Gelu"),
    ("Gelu", {"approximate": "tanh"}, "GeluTanh"),
]


@pytest.mark.parametrize(("op", "attrs", "act"), OPS, ids=[o[2] for o in OPS])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("shape", [(1, 3, 7, 5), (2, 33, 17)], ids=["tail", "odd"])
def test_activation_kernel_matches_onnxruntime(
    op: str, attrs: dict[str, Any], act: str, dtype: type, shape: tuple[int, ...]
) -> None:
    kernel = registry.get_kernel("", op)
    assert kernel is not None
    x = (np.random.default_rng(0).standard_normal(shape) * 3).astype(dtype)
    run = kernel.run(MACHINE, [x], attrs)
    assert run.outputs[0].dtype == dtype
    assert_close(run.outputs[0], run_node(op, [x], attrs, opset=20), np.dtype(dtype))
    # priced on the Vector unit with the fused epilogue's instruction rows
    timing = kernel.run(MACHINE, [TensorMeta.of(x)], attrs, functional=False)
    assert timing.stats == run.stats
    per_elem = sum(MACHINE.vector_cost(o, np.dtype(dtype))[0] for o in VECTOR_OPS[act])
    assert run.stats.pipe_busy["VECTOR"] >= per_elem * x.size


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_clip_with_bounds_as_inputs_and_as_attributes(dtype: type) -> None:
    kernel = registry.get_kernel("", "Clip")
    assert kernel is not None
    x = (np.random.default_rng(1).standard_normal((2, 5, 9)) * 4).astype(dtype)
    lo, hi = np.array(0, dtype), np.array(6, dtype)
    got = kernel.run(MACHINE, [x, lo, hi], {}).outputs[0]
    assert_close(got, run_node("Clip", [x, lo, hi], {}, opset=13), np.dtype(dtype))
    got = kernel.run(MACHINE, [x], {"min": -1.0, "max": 2.0}).outputs[0]
    assert_close(got, np.clip(x.astype(np.float32), -1, 2), np.dtype(dtype))
    with pytest.raises(KernelError, match="one bound as an input"):
        kernel.run(MACHINE, [x, None, hi], {})


def test_float64_is_refused() -> None:
    kernel = registry.get_kernel("", "Sigmoid")
    assert kernel is not None
    with pytest.raises(KernelError, match="float16 or float32"):
        kernel.run(MACHINE, [np.ones(4)], {})
