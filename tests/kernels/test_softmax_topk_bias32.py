"""SoftmaxTopK's kernel on float16 scores with a float32 selection bias (the choice in float32,
the weights in float16) against the op's reference, tiles with tails."""

from __future__ import annotations

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels.api import TensorMeta
from fuser.kernels.npu.machine import load_target
from fuser.kernels.softmax_topk import SoftmaxTopKTiling as Rows
from fuser.patterns import softmax_topk as softmax_topk_pattern

M = load_target("ascend910b")
KERNEL = registry.get_kernel("fuser", "SoftmaxTopK")
BASE = {"axis": -1, "order": "softmax_topk", "renormalize": 0, "to_float32": 0}

CASES = [
    # shape, attrs beyond k: 37 and 1 rows, 24 and 40 experts (no multiple of 16), k = E
    ((37, 24), {"k": 4, "score": "sigmoid", "n_group": 4, "topk_group": 2, "renormalize": 1,
                "epsilon": 1e-6, "scale": 2.5}),
    ((1, 40), {"k": 6, "score": "sigmoid", "n_group": 8, "topk_group": 3, "mask_value": 0.0}),
    ((53, 16), {"k": 16, "score": "sigmoid", "renormalize": 1}),
    ((29, 12), {"k": 3, "score": "softmax"}),
]  # fmt: skip


def _inputs(shape: tuple[int, int], seed: int, ties: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if ties:  # equal logits: only the float32 bias (steps below float16's) tells experts apart
        x = np.round(x)
    bias = (np.arange(shape[-1]) * 1e-5 if ties else rng.random(shape[-1]) * 0.2).astype(np.float32)
    return [x.astype(np.float16), bias]


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("tiling", [None, Rows(7, 1, 5), Rows(1, 0, 3), Rows(16, 1, 48)])
@pytest.mark.parametrize(("shape", "attrs"), CASES)
def test_float32_bias_on_float16_matches_reference(shape, attrs, tiling, ties) -> None:
    inputs = _inputs(shape, sum(shape), ties)
    v, i, _ = KERNEL.run(M, inputs, attrs, tiling=tiling).outputs
    rv, ri, _ = softmax_topk_pattern.reference(inputs, {**BASE, **attrs})
    np.testing.assert_array_equal(i, ri)
    assert v.dtype == rv.dtype == np.float16
    np.testing.assert_allclose(v.astype(np.float32), rv.astype(np.float32), atol=2e-3, rtol=2e-3)


def test_the_bias_decides_in_float32() -> None:
    """With every logit equal the choice is the bias's top-k: steps of 1e-5 that a float16
    Add would round away (the kernel adds in float32, as the original does)."""
    inputs = _inputs((5, 16), 0, True)
    inputs[0][:] = 0.0
    _, i, _ = KERNEL.run(M, inputs, {"k": 4, "score": "sigmoid"}).outputs
    np.testing.assert_array_equal(np.sort(i, axis=1), np.tile([12, 13, 14, 15], (5, 1)))
    # in float16 the choice sigmoid(0) + bias would be 0.5 for every expert: all tied
    assert len(set((np.float16(0.5) + inputs[1].astype(np.float16)).tolist())) == 1


def test_the_float32_bias_row_is_read_once_per_core() -> None:
    x, bias = _inputs((64, 24), 1, False)
    attrs = {"k": 4, "score": "sigmoid", "n_group": 4, "topk_group": 2}
    metas = [TensorMeta.of(x), TensorMeta.of(bias)]
    tiling = Rows(8, 1, 4)
    run = KERNEL.run(M, metas, attrs, tiling=tiling, functional=False).stats
    assert run.gm_read == x.nbytes + 4 * 24 * 4
    assert run.gm_write == 64 * 4 * (2 + 8)
