"""Softmax kernel against onnxruntime: axes, tails, fp16/fp32, tilings, capacity, timing mode."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from fuser.kernels import registry
from fuser.kernels._rows import RowTiling
from fuser.kernels.api import TensorMeta, TilingError
from fuser.kernels.npu.machine import load_target
from onnx import TensorProto, helper

M = load_target("ascend910b")
KERNEL = registry.get_kernel("", "Softmax")
_ELEM = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float32): TensorProto.FLOAT}


def ort_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    t = _ELEM[x.dtype]
    node = helper.make_node("Softmax", ["x"], ["y"], axis=axis)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", t, x.shape)],
        [helper.make_tensor_value_info("y", t, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(
    ("shape", "axis"), [((1, 64), -1), ((3, 37, 50), 1), ((5, 129), 0), ((2, 3, 17), -1), ((7,), 0)]
)
def test_matches_onnxruntime(shape: tuple[int, ...], axis: int, dtype: type) -> None:
    x = np.random.default_rng(len(shape) * 7 + axis).standard_normal(shape).astype(dtype)
    y = KERNEL.run(M, [x], {"axis": axis}).outputs[0]
    tol = 2e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(y.astype(np.float32), ort_softmax(x, axis), atol=tol, rtol=tol)
    assert y.dtype == dtype


def test_tail_tiles_and_single_buffer_give_same_numbers() -> None:
    x = np.random.default_rng(1).standard_normal((101, 33)).astype(np.float32)
    want = ort_softmax(x, -1)
    for t in (RowTiling(1, 0, 3), RowTiling(7, 1, 48), RowTiling(64, 1, 2)):
        np.testing.assert_allclose(KERNEL.run(M, [x], {}, tiling=t).outputs[0], want, atol=1e-6)


def test_timing_only_has_the_same_cycles() -> None:
    x = np.random.default_rng(2).standard_normal((300, 70)).astype(np.float16)
    f = KERNEL.run(M, [x], {}).stats
    t = KERNEL.run(M, [TensorMeta.of(x)], {}, functional=False).stats
    assert f.cycles == t.cycles
    assert f.gm_read == x.nbytes
    assert f.gm_write == x.nbytes


def test_tile_too_big_for_ub_is_refused_with_reason() -> None:
    meta = TensorMeta((64, 4096), np.float32)
    with pytest.raises(TilingError, match="UB"):
        KERNEL.check_tiling([meta], {}, RowTiling(64, 1, 1), M)
    with pytest.raises(TilingError, match="cores"):
        KERNEL.check_tiling([meta], {}, RowTiling(1, 1, 1000), M)


def test_row_too_long_for_ub_has_no_default_tiling() -> None:
    with pytest.raises(TilingError, match="does not fit UB"):
        KERNEL.default_tiling([TensorMeta((2, 1 << 20), np.float32)], {}, M)
