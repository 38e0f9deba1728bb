"""LayerNormalization kernel against onnxruntime (opset 17) and the fused ops' layer_norm."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from fuser.kernels import registry
from fuser.kernels._rows import RowTiling
from fuser.kernels.api import KernelError, TensorMeta, TilingError
from fuser.kernels.npu.machine import load_target
from fuser.patterns.layernorm_matmul import layer_norm
from onnx import TensorProto, helper

M = load_target("ascend910b")
KERNEL = registry.get_kernel("", "LayerNormalization")
_ELEM = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float32): TensorProto.FLOAT}


def ort_layernorm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, axis: int):
    t = _ELEM[x.dtype]
    names = ["x", "s"] + (["b"] if bias is not None else [])
    node = helper.make_node("LayerNormalization", names, ["y", "mean", "inv"], axis=axis)
    inputs = [helper.make_tensor_value_info("x", t, x.shape),
              helper.make_tensor_value_info("s", t, scale.shape)]  # fmt: skip
    if bias is not None:
        inputs.append(helper.make_tensor_value_info("b", t, bias.shape))
    outputs = [helper.make_tensor_value_info("y", t, None)]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("mean", "inv")]
    graph = helper.make_graph([node], "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": x, "s": scale} | ({"b": bias} if bias is not None else {})
    return sess.run(None, feeds)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(
    ("shape", "axis", "with_bias"),
    [((1, 7, 768), -1, True), ((3, 37, 50), -1, False), ((4, 5, 6), 1, True), ((33,), 0, True)],
)
def test_matches_onnxruntime(shape, axis, with_bias, dtype) -> None:
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(dtype)
    scale = rng.standard_normal(shape[axis:]).astype(dtype)
    bias = rng.standard_normal(shape[axis:]).astype(dtype) if with_bias else None
    y, mean, inv = KERNEL.run(M, [x, scale, bias], {"axis": axis}).outputs
    oy, omean, oinv = ort_layernorm(x, scale, bias, axis)
    tol = 1e-2 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(y.astype(np.float32), oy.astype(np.float32), atol=tol, rtol=tol)
    np.testing.assert_allclose(mean, omean.reshape(mean.shape), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(inv, oinv.reshape(inv.shape), atol=1e-4, rtol=1e-4)
    assert y.dtype == dtype
    assert mean.dtype == np.float32


@pytest.mark.parametrize("stash_type", [0, 1])
def test_matches_the_fused_ops_layer_norm_exactly(stash_type: int) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 17, 40)).astype(np.float16)
    scale = rng.standard_normal((40,)).astype(np.float16)
    attrs = {"axis": -1, "epsilon": 1e-3, "stash_type": stash_type}
    for t in (RowTiling(1, 0, 5), RowTiling(16, 1, 48)):
        y = KERNEL.run(M, [x, scale, None], attrs, tiling=t).outputs[0]
        np.testing.assert_array_equal(y, layer_norm(x, scale, None, -1, 1e-3, stash_type))


def test_scale_with_leading_ones_broadcasts() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 9, 24)).astype(np.float32)
    scale = rng.standard_normal((1, 1, 24)).astype(np.float32)
    y = KERNEL.run(M, [x, scale], {}).outputs[0]
    np.testing.assert_allclose(y, layer_norm(x, scale.reshape(24), None, -1, 1e-5, 1), atol=1e-6)


def test_timing_only_same_cycles_and_stats_copied_only_when_asked() -> None:
    x = np.random.default_rng(4).standard_normal((300, 256)).astype(np.float16)
    scale = np.ones(256, np.float16)
    f = KERNEL.run(M, [x, scale], {}).stats
    t = KERNEL.run(M, [TensorMeta.of(x), TensorMeta.of(scale)], {}, functional=False).stats
    assert f.cycles == t.cycles
    assert f.gm_write == x.nbytes
    with_stats = KERNEL.run(M, [x, scale], {"emit_stats": 1}).stats
    assert with_stats.gm_write == x.nbytes + 2 * 300 * 4


def test_errors() -> None:
    x = TensorMeta((4, 10), np.float32)
    with pytest.raises(KernelError, match="broadcast"):
        KERNEL.infer([x, TensorMeta((3,), np.float32)], {})
    with pytest.raises(KernelError, match="float16 or float32"):
        KERNEL.infer([TensorMeta((4, 10), np.float64)], {})
    with pytest.raises(TilingError, match="UB"):
        KERNEL.check_tiling([TensorMeta((64, 8192), np.float32)], {}, RowTiling(64, 1, 1), M)
