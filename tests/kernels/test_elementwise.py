"""Elementwise and BatchNormalization kernels against onnxruntime."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels._stream import VectorTiling
from fuser.kernels.api import KernelError, TensorMeta, TilingError
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_oracle import MACHINE, assert_close, run_node

BINARY = ["Add", "Sub", "Mul", "Div", "Pow"]
UNARY = ["Sqrt", "Reciprocal", "Relu"]
SHAPE_PAIRS = [
    ((1, 7), (1, 7)),
    ((3, 129, 5), (5,)),
    ((2, 64, 9, 9), (64, 1, 1)),
    ((4, 1, 33), (1, 6, 33)),
    ((1000,), ()),
    ((17,), (3, 17)),
]


def _operands(op: str, shape: tuple[int, ...], dtype: type, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if op in ("Sqrt", "Pow"):
        x = np.abs(x) + 0.1
    if op in ("Reciprocal", "Div"):
        x = np.sign(x) * (np.abs(x) + 0.5)
    return np.asarray(x).astype(dtype)


def _kernel(op: str) -> Any:
    k = registry.get_kernel("", op)
    assert k is not None
    return k


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("sa", "sb"), SHAPE_PAIRS)
@pytest.mark.parametrize("op", BINARY)
def test_binary_matches_onnxruntime(
    op: str, sa: tuple[int, ...], sb: tuple[int, ...], dtype: type
) -> None:
    a = _operands("Pow" if op == "Pow" else "Add", sa, dtype, 1)
    b = _operands(op, sb, dtype, 2)
    if op == "Pow":
        b = (np.random.default_rng(3).integers(0, 3, sb)).astype(dtype)
    got = _kernel(op).run(MACHINE, [a, b], {}).outputs[0]
    assert got.dtype == dtype
    want = run_node(op, [a, b], {})
    assert_close(got, want, np.dtype(dtype), scale=float(np.abs(want).max()) if op != "Pow" else 9)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 3, 1031), (48 * 32 + 1,)])
@pytest.mark.parametrize("op", UNARY)
def test_unary_matches_onnxruntime(op: str, shape: tuple[int, ...], dtype: type) -> None:
    x = _operands(op, shape, dtype, 4)
    got = _kernel(op).run(MACHINE, [x], {}).outputs[0]
    assert_close(got, run_node(op, [x], {}), np.dtype(dtype), scale=2.0)


@pytest.mark.parametrize(
    ("src", "to", "to_dtype"),
    [(np.float32, 10, np.float16), (np.float16, 1, np.float32), (np.float32, 7, np.int64),
     (np.int32, 1, np.float32)],
)  # fmt: skip
def test_cast_matches_onnxruntime(src: type, to: int, to_dtype: type) -> None:
    x = (np.random.default_rng(5).standard_normal((7, 333)) * 100).astype(src)
    got = _kernel("Cast").run(MACHINE, [x], {"to": to}).outputs[0]
    assert got.dtype == to_dtype
    want = run_node("Cast", [x.astype(np.float32) if src == np.float16 else x], {"to": to})
    np.testing.assert_array_equal(got, want)


def test_integer_div_truncates_toward_zero_as_onnx() -> None:
    a = np.array([[-7, 7, -8, 9, 0]], np.int32)
    b = np.array([2, -2, 3, 3, -5], np.int32)
    got = _kernel("Div").run(MACHINE, [a, b], {}).outputs[0]
    np.testing.assert_array_equal(got, run_node("Div", [a, b], {}))


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=4),
    st.integers(1, 1000),  # x 8 elements: three fp32 queues x 2 slots still fit UB
    st.integers(0, 1),
    st.integers(1, 48),
    st.data(),
)
def test_any_fitting_tiling_gives_the_same_numbers(
    shape: list[int], tile: int, db: int, cores: int, data: st.DataObject
) -> None:
    # Broadcast b over a random subset of a's dims.
    b_shape = [d if data.draw(st.booleans()) else 1 for d in shape]
    a = _operands("Add", tuple(shape), np.float32, 6)
    b = _operands("Add", tuple(b_shape), np.float32, 7)
    t = VectorTiling(elems=tile * 8, double_buffer=db, cores=cores)
    run = _kernel("Mul").run(MACHINE, [a, b], {}, tiling=t)
    np.testing.assert_array_equal(run.outputs[0], a * b)
    metas = [TensorMeta.of(a), TensorMeta.of(b)]
    assert _kernel("Mul").run(MACHINE, metas, {}, tiling=t, functional=False).stats == run.stats


def test_too_big_tile_is_refused_with_a_reason() -> None:
    x = np.ones((4, 100), np.float32)
    with pytest.raises(TilingError, match="UB"):
        _kernel("Add").run(MACHINE, [x, x], {}, tiling=VectorTiling(20_000, 1, 4))
    # The same tile fits single-buffered: double buffering counts both slots.
    _kernel("Add").run(MACHINE, [x, x], {}, tiling=VectorTiling(12_000, 0, 4))
    with pytest.raises(TilingError, match="cores"):
        _kernel("Add").run(MACHINE, [x, x], {}, tiling=VectorTiling(64, 1, 49))


def test_unsupported_inputs_say_why() -> None:
    with pytest.raises(KernelError, match="broadcast"):
        _kernel("Add").run(MACHINE, [np.ones((2, 3), np.float32), np.ones(4, np.float32)], {})
    with pytest.raises(KernelError, match="float64"):
        _kernel("Relu").run(MACHINE, [np.ones(3)], {})


def test_tiling_attributes_round_trip() -> None:
    k = _kernel("Add")
    t = VectorTiling(256, 0, 7)
    attrs = k.tiling_to_attrs(t)
    assert attrs == {"tile_elems": 256, "tile_double_buffer": 0, "tile_cores": 7}
    assert k.tiling_from_attrs(attrs) == t
    x = np.ones((3, 1000), np.float32)
    assert k.run(MACHINE, [x, x], attrs).stats.cores == 7
    with pytest.raises(TilingError, match="tile_cores"):
        k.tiling_from_attrs({"tile_elems": 256, "tile_double_buffer": 0})


# -- BatchNormalization -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("shape", [(1, 3, 7, 5), (2, 64, 9, 11), (3, 17), (1, 5, 101)])
def test_batchnorm_matches_onnxruntime(shape: tuple[int, ...], dtype: type) -> None:
    rng = np.random.default_rng(8)
    c = shape[1]
    x = rng.standard_normal(shape).astype(dtype)
    scale, bias, mean = (rng.standard_normal(c).astype(dtype) for _ in range(3))
    var = (rng.random(c) + 0.2).astype(dtype)
    inputs = [x, scale, bias, mean, var]
    got = _kernel("BatchNormalization").run(MACHINE, inputs, {"epsilon": 1e-3}).outputs[0]
    want = run_node("BatchNormalization", inputs, {"epsilon": 1e-3})
    assert_close(got, want, np.dtype(dtype), scale=float(np.abs(want).max()))


def test_batchnorm_timing_only_takes_metas() -> None:
    metas = [TensorMeta((8, 256, 56, 56), np.float16)] + [TensorMeta((256,), np.float16)] * 4
    run = _kernel("BatchNormalization").run(MACHINE, metas, {}, functional=False)
    assert run.outputs == ()
    assert run.stats.gm_write == 8 * 256 * 56 * 56 * 2
    assert run.stats.bound == "memory"
