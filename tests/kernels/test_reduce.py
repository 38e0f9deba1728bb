"""ReduceMean / ReduceSum / ReduceMax against onnxruntime: axes as attribute and as input,
keepdims, all axes, no-op, tails, dtypes, timing-only mode, capacity."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from fuser.kernels import registry
from fuser.kernels._rows import RowTiling
from fuser.kernels.api import KernelError, TensorMeta, TilingError
from fuser.kernels.npu.machine import load_target
from onnx import TensorProto, helper

M = load_target("ascend910b")
_ELEM = {
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.int32): TensorProto.INT32,
}
OPS = ("ReduceMean", "ReduceSum", "ReduceMax")


def ort_reduce(op: str, x: np.ndarray, axes: list[int] | None, keepdims: int) -> np.ndarray:
    """Opset 18: axes as an input for every reduction."""
    t = _ELEM[x.dtype]
    names = ["x"] + (["axes"] if axes is not None else [])
    node = helper.make_node(op, names, ["y"], keepdims=keepdims)
    inputs = [helper.make_tensor_value_info("x", t, x.shape)]
    if axes is not None:
        inputs.append(helper.make_tensor_value_info("axes", TensorProto.INT64, [len(axes)]))
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", t, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": x} | ({"axes": np.array(axes, np.int64)} if axes is not None else {})
    return sess.run(None, feeds)[0]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(
    ("shape", "axes", "keepdims"),
    [((1, 7, 768), [-1], 1), ((3, 37, 50), [1], 0), ((4, 5, 6), [0, 2], 1), ((9, 33), None, 0)],
)
def test_matches_onnxruntime(op, dtype, shape, axes, keepdims) -> None:
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(dtype)
    kernel = registry.get_kernel("", op)
    axes_in = None if axes is None else np.array(axes, np.int64)
    (y,) = kernel.run(M, [x, axes_in], {"keepdims": keepdims}).outputs
    want = ort_reduce(op, x, axes, keepdims)
    assert y.shape == want.shape
    assert y.dtype == dtype
    tol = 2e-2 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(y.astype(np.float32), want.astype(np.float32), atol=tol, rtol=tol)


def test_axes_as_attribute_ints_and_noop() -> None:
    x = np.random.default_rng(1).integers(-9, 9, size=(6, 7, 8)).astype(np.int32)
    (y,) = registry.get_kernel("", "ReduceSum").run(M, [x], {"axes": [1]}).outputs
    np.testing.assert_array_equal(y, x.sum(axis=1, keepdims=True))
    (y,) = registry.get_kernel("", "ReduceMax").run(M, [x], {"axes": [0, 2], "keepdims": 0}).outputs
    np.testing.assert_array_equal(y, x.max(axis=(0, 2)))
    (y,) = registry.get_kernel("", "ReduceMax").run(M, [x], {"noop_with_empty_axes": 1}).outputs
    np.testing.assert_array_equal(y, x)


def test_tilings_with_tails_agree_and_timing_only_matches() -> None:
    x = np.random.default_rng(2).standard_normal((101, 65)).astype(np.float16)
    kernel = registry.get_kernel("", "ReduceMean")
    want = kernel.run(M, [x], {"axes": [1]}, tiling=RowTiling(1, 0, 1)).outputs[0]
    for t in (RowTiling(7, 1, 48), RowTiling(64, 0, 3)):
        np.testing.assert_array_equal(kernel.run(M, [x], {"axes": [1]}, tiling=t).outputs[0], want)
    f = kernel.run(M, [x, np.array([1])], {}).stats
    t = kernel.run(M, [TensorMeta.of(x), np.array([1])], {}, functional=False).stats
    assert f.cycles == t.cycles
    assert f.gm_read == x.nbytes
    assert f.gm_write == 101 * 2


def test_errors() -> None:
    kernel = registry.get_kernel("", "ReduceSum")
    with pytest.raises(KernelError, match="axes' values"):
        kernel.run(M, [TensorMeta((4, 5), np.float32), TensorMeta((1,), np.int64)], {},
                   functional=False)  # fmt: skip
    with pytest.raises(KernelError, match="out of range"):
        kernel.infer([TensorMeta((4, 5), np.float32)], {"axes": [2]})
    with pytest.raises(TilingError, match="does not fit UB"):
        kernel.run(M, [TensorMeta((1 << 22,), np.float32)], {}, functional=False)
    with pytest.raises(TilingError, match="UB"):
        kernel.check_tiling([TensorMeta((64, 4096), np.float32)], {"axes": [1]},
                            RowTiling(64, 1, 1), M)  # fmt: skip
