"""Kernels on every shipped target, and the wall-time cost of a functional fused run."""

from __future__ import annotations

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels.api import Kernel
from fuser.kernels.npu.machine import SHIPPED_TARGETS, load_target
from kernel_oracle import assert_close, run_node


def _k(domain: str, op: str) -> Kernel:
    k = registry.get_kernel(domain, op)
    assert k is not None
    return k


@pytest.mark.parametrize("target", SHIPPED_TARGETS)
def test_kernels_run_correctly_on_every_target(target: str) -> None:
    m = load_target(target)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 24, 15, 13)).astype(np.float16)
    w = rng.standard_normal((40, 24, 3, 3)).astype(np.float16)
    b = rng.standard_normal(40).astype(np.float16)
    conv = _k("", "Conv").run(m, [x, w, b], {"pads": [1, 1, 1, 1]})
    assert_close(conv.outputs[0], run_node("Conv", [x, w, b], {"pads": [1, 1, 1, 1]}),
                 np.dtype(np.float16), 15)  # fmt: skip
    assert conv.stats.cores <= m.cube_cores
    y = _k("", "Add").run(m, [x, x], {})
    np.testing.assert_array_equal(y.outputs[0], x + x)
    assert y.stats.cores <= m.vector_cores


def test_a_smaller_chip_takes_longer_for_the_same_work() -> None:
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((1, 64, 28, 28)).astype(np.float16),
              rng.standard_normal((64, 64, 3, 3)).astype(np.float16)]  # fmt: skip
    attrs = {"pads": [1, 1, 1, 1], "relu": 1}
    us = {
        t: _k("fuser", "ConvBnRelu").run(load_target(t), inputs, attrs, functional=False).stats.us
        for t in ("ascend910b", "ascend310p")
    }
    assert us["ascend310p"] > us["ascend910b"]
