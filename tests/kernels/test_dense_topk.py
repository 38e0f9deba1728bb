"""SoftmaxTopK's dense form (Llama-4: TopK -> ScatterElements into `fill` -> Sigmoid) against
the op's reference and onnxruntime: tails (odd expert counts, one token, k = E), fp16/fp32, any
tiling; the cost model against the simulator; GM bytes of the dense row; errors."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from fuser.kernels import registry
from fuser.kernels.api import KernelError, TensorMeta, TilingError
from fuser.kernels.npu.machine import load_target
from fuser.kernels.softmax_topk import SoftmaxTopKTiling as Rows
from fuser.models.moe_gates import DenseGate, dense_gate_model
from fuser.patterns import softmax_topk as softmax_topk_pattern

M = load_target("ascend910b")
KERNEL = registry.get_kernel("fuser", "SoftmaxTopK")
DENSE = {"order": "topk_softmax", "score": "sigmoid", "dense": 1}


def _attrs(k: int, **extra: object) -> dict[str, object]:
    return {"k": k, "axis": -1, "renormalize": 0, "to_float32": 0, **DENSE, **extra}


CASES = [
    # shape, k, extra attributes: odd experts, one token, k = E, rank 3, another fill
    ((37, 15), 3, {}),
    ((1, 16), 1, {}),
    ((9, 7), 7, {}),
    ((3, 5, 11), 2, {}),
    ((64, 16), 1, {"fill": 0.0}),
    ((13, 33), 4, {"fill": -2.5, "to_float32": 1}),
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("shape", "k", "extra"), CASES)
@pytest.mark.parametrize("tiling", [None, Rows(1, 0, 1), Rows(4, 1, 3), Rows(16, 1, 48)])
def test_dense_matches_reference(shape, k, extra, dtype, tiling) -> None:
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(dtype)
    attrs = _attrs(k, **extra)
    v, i, p = KERNEL.run(M, [x], attrs, tiling=tiling).outputs
    rv, ri, _ = softmax_topk_pattern.reference([x], attrs)
    np.testing.assert_array_equal(i, ri)
    assert v.shape == x.shape and v.dtype == rv.dtype
    assert v.dtype == (np.float32 if extra.get("to_float32") else dtype)
    tol = 1e-3 if dtype == np.float16 and v.dtype == dtype else 1e-6
    np.testing.assert_allclose(v.astype(np.float32), rv.astype(np.float32), atol=tol, rtol=tol)
    # exactly k experts per token carry sigmoid(top); the others sigmoid(fill), bit for bit
    fill = float(extra.get("fill", float("-inf")))
    with np.errstate(over="ignore"):
        rest = np.float32(1 / (1 + np.exp(-np.float64(np.float32(dtype(fill))))))
    chosen = np.zeros(x.shape, bool)
    np.put_along_axis(chosen, i, True, axis=-1)
    assert (v[~chosen].astype(np.float32) == rest.astype(v.dtype)).all()
    assert p.size == 0


def test_dense_against_onnxruntime_with_ties() -> None:
    """The oracle: the exported chain run by onnxruntime on rounded logits (many ties)."""
    model = dense_gate_model(DenseGate(experts=15, k=3, transpose=False))
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    x = np.round(np.random.default_rng(4).standard_normal((41, 15)) * 2).astype(np.float32)
    x[:2] = 0.5  # every expert of a token ties: the three lowest win
    (want,) = session.run(None, {"x": x})
    got, _, _ = KERNEL.run(M, [x], _attrs(3), tiling=Rows(7, 1, 5)).outputs
    np.testing.assert_array_equal(got != 0, want != 0)
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
    assert np.flatnonzero(got[0]).tolist() == [0, 1, 2]


@pytest.mark.parametrize(("shape", "k", "extra"), CASES)
@pytest.mark.parametrize("tiling", [Rows(1, 0, 1), Rows(3, 1, 48), Rows(16, 1, 7), Rows(8, 1, 4)])
def test_dense_cost_model_agrees_with_the_simulator(shape, k, extra, tiling) -> None:
    """Priced as the simulator runs it (the SoftmaxTopK gating test's bounds), and the GM
    bytes: in rows x E, out the dense row of E values and k int64 indices per row."""
    from fuser.kernels.search import model_for

    model = model_for("fuser", "SoftmaxTopK")
    assert model is not None
    metas = [TensorMeta(shape, np.dtype(np.float32))]
    attrs = _attrs(k, **extra)
    predicted = model.cost(metas, attrs, tiling, M)
    run = KERNEL.run(M, metas, attrs, tiling=tiling, functional=False).stats
    assert predicted == pytest.approx(run.cycles, rel=0.03 if tiling.rows >= 8 else 0.12)
    rows = int(np.prod(shape)) // shape[-1]
    assert run.gm_read == metas[0].nbytes
    assert run.gm_write == rows * (shape[-1] * 4 + k * 8)


def test_the_dense_row_is_priced() -> None:
    """Writing the whole row (and selecting the k scores into it) costs more than the k values
    of plain TopK -> Sigmoid: more vector work, more GM bytes."""
    meta = [TensorMeta((4096, 128), np.dtype(np.float32))]
    plain = {"k": 1, "order": "topk_softmax", "score": "sigmoid"}
    t = Rows(16, 1, 48)
    a = KERNEL.run(M, meta, plain, tiling=t, functional=False).stats
    b = KERNEL.run(M, meta, {**plain, "dense": 1}, tiling=t, functional=False).stats
    assert b.cycles > a.cycles
    assert b.gm_write - a.gm_write == 4096 * 128 * 4 - 4096 * 4


def test_dense_errors() -> None:
    meta = [TensorMeta((4, 10), np.dtype(np.float32))]
    for bad in ({"order": "softmax_topk"}, {"score": "softmax"}, {"renormalize": 1},
                {"scale": 2.0}):  # fmt: skip
        with pytest.raises(KernelError, match="dense=1 needs order topk_softmax and score"):
            KERNEL.infer(meta, {**_attrs(2), **bad})
    with pytest.raises(TilingError, match="staged schedule runs only the softmax chain"):
        KERNEL.check_tiling(meta, _attrs(2), Rows(1, 1, 48, staged=1), M)
