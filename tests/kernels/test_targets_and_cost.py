"""Kernels on every shipped target, and the wall-time cost of a functional fused run."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

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


def _openblas() -> ctypes.CDLL | None:
    """numpy's bundled OpenBLAS, if this numpy has one that exposes its thread setting."""
    for lib in sorted((Path(np.__file__).parent.parent / "numpy.libs").glob("*openblas*.so*")):
        dll = ctypes.CDLL(str(lib))
        if hasattr(dll, "scipy_openblas_set_num_threads64_"):
            return dll
    return None


@contextmanager
def _one_blas_thread() -> Iterator[None]:
    """On a busy machine BLAS thread wake-ups make small matmuls erratic, which says nothing
    about the simulator's own overhead: time both sides with one BLAS thread when possible."""
    dll = _openblas()
    if dll is None:
        yield
        return
    before = dll.scipy_openblas_get_num_threads64_()
    dll.scipy_openblas_set_num_threads64_(1)
    try:
        yield
    finally:
        dll.scipy_openblas_set_num_threads64_(before)


def _best(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def test_functional_conv_bn_relu_costs_at_most_20x_its_reference() -> None:
    from fuser.patterns.conv_bn_relu import reference

    m = load_target("ascend910b")
    rng = np.random.default_rng(2)
    c = 64
    inputs = [rng.standard_normal((1, c, 28, 28)).astype(np.float32),
              rng.standard_normal((c, c, 3, 3)).astype(np.float32), None,
              rng.uniform(0.5, 1.5, c).astype(np.float32),
              rng.standard_normal(c).astype(np.float32),
              rng.standard_normal(c).astype(np.float32),
              rng.uniform(0.5, 2, c).astype(np.float32)]  # fmt: skip
    attrs = {"pads": [1, 1, 1, 1], "epsilon": 1e-5, "relu": 1}
    kernel = _k("fuser", "ConvBnRelu")
    got = kernel.run(m, inputs, attrs).outputs[0]
    want = reference(inputs, attrs)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    with _one_blas_thread():
        t_kernel = _best(lambda: kernel.run(m, inputs, attrs, timeline=False))
        t_reference = _best(lambda: reference(inputs, attrs))
    ratio = t_kernel / t_reference
    assert ratio <= 20, f"functional run costs {ratio:.1f}x the numpy reference"
