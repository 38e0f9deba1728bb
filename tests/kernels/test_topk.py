"""TopK kernel against onnxruntime: ties, largest/smallest, axes, tails, dtypes, timing mode."""

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
KERNEL = registry.get_kernel("", "TopK")
_ELEM = {
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.int64): TensorProto.INT64,
}


def ort_topk(x: np.ndarray, k: int, axis: int, largest: int) -> list[np.ndarray]:
    t = _ELEM[x.dtype]
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest, sorted=1)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", t, x.shape),
         helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("v", t, None),
         helper.make_tensor_value_info("i", TensorProto.INT64, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x, "k": np.array([k], np.int64)})


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize(
    ("shape", "k", "axis"), [((1, 64), 2, -1), ((3, 37, 50), 5, 1), ((33, 17), 17, 0), ((9,), 1, 0)]
)
def test_matches_onnxruntime_with_ties(
    shape: tuple[int, ...], k: int, axis: int, largest: int, dtype: type
) -> None:
    rng = np.random.default_rng(sum(shape) + k)
    # Few distinct values: many ties, so the lower-index-first rule is exercised.
    x = rng.integers(-3, 4, size=shape).astype(dtype)
    v, i = KERNEL.run(M, [x, np.array([k])], {"axis": axis, "largest": largest}).outputs
    ov, oi = ort_topk(x, k, axis, largest)
    np.testing.assert_array_equal(v, ov)
    np.testing.assert_array_equal(i, oi)
    assert i.dtype == np.int64


def test_all_equal_row_returns_lowest_indices_in_order() -> None:
    x = np.ones((2, 10), np.float32)
    _, i = KERNEL.run(M, [x, np.array([4])], {}).outputs
    np.testing.assert_array_equal(i, [[0, 1, 2, 3], [0, 1, 2, 3]])


def test_int64_and_tail_tilings() -> None:
    x = np.random.default_rng(3).integers(-50, 50, size=(77, 31)).astype(np.int64)
    want = ort_topk(x, 6, -1, 1)
    for t in (RowTiling(5, 0, 4), RowTiling(16, 1, 48)):
        v, i = KERNEL.run(M, [x, np.array([6])], {}, tiling=t).outputs
        np.testing.assert_array_equal(v, want[0])
        np.testing.assert_array_equal(i, want[1])


def test_timing_only_needs_k_value_and_matches_cycles() -> None:
    x = np.random.default_rng(4).standard_normal((200, 64)).astype(np.float16)
    f = KERNEL.run(M, [x, np.array([8])], {}).stats
    t = KERNEL.run(M, [TensorMeta.of(x), np.array([8])], {}, functional=False).stats
    assert f.cycles == t.cycles
    with pytest.raises(KernelError, match="k's value"):
        KERNEL.run(M, [TensorMeta.of(x), TensorMeta((1,), np.int64)], {}, functional=False)


def test_bad_k_and_capacity() -> None:
    x = TensorMeta((4, 10), np.float32)
    with pytest.raises(KernelError, match="outside"):
        KERNEL.run(M, [x, np.array([11])], {}, functional=False)
    with pytest.raises(TilingError, match="UB"):
        KERNEL.run(M, [TensorMeta((4096, 4096), np.float32), np.array([2])], {},
                   tiling=RowTiling(64, 1, 8), functional=False)  # fmt: skip
