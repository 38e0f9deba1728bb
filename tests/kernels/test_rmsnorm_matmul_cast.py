"""RmsNormMatMul with `matmul_type` (autocast: RMSNorm in float32, Cast(float16), MatMuls in
float16) against the op's reference: tails and odd widths, both core layouts, explicit tilings
(block resident or streamed), the normalized output emitted, the staged chain, timing-only
mode, the cost model against the simulator, and GM traffic with X in float32."""

from __future__ import annotations

import numpy as np
import pytest
from fuser.kernels import registry, search
from fuser.kernels.api import TensorMeta
from fuser.kernels.layernorm_matmul import LayerNormMatMulTiling as T
from fuser.kernels.npu.machine import load_target
from fuser.patterns.rmsnorm_matmul import reference
from onnx import TensorProto

KERNEL = registry.get_kernel("fuser", "RmsNormMatMul")
B910 = load_target("ascend910b")
C910 = load_target("ascend910")
HALF = TensorProto.FLOAT16


def make(shape, ns, has_bias, *, seed=0, gamma=True, stash=0, emit=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    x.reshape(-1, shape[-1])[0] = 0  # a zero row: epsilon alone keeps it finite
    ins = [x, rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32) if gamma else None]
    for n, hb in zip(ns, has_bias, strict=True):
        ins.append((rng.standard_normal((shape[-1], n)) / np.sqrt(shape[-1])).astype(np.float16))
        if hb:
            ins.append(rng.standard_normal(n).astype(np.float16))
    attrs = {"epsilon": 1e-6, "stash_type": stash, "round_before_scale": 1,
             "has_bias": list(has_bias), "flatten": [0] * len(ns), "matmul_type": HALF,
             "emit_normalized": emit}  # fmt: skip
    return ins, attrs


def check(outs, ins, attrs) -> None:
    want = reference(ins, attrs)
    assert len(outs) == len(want)
    assert outs[0].dtype == np.float32  # N stays in X's dtype
    np.testing.assert_array_equal(outs[0], want[0])
    for got, ref in zip(outs[1:], want[1:], strict=True):
        assert got.shape == ref.shape
        assert got.dtype == ref.dtype == np.float16
        # the Cube accumulates the float16 rows in float32, the reference in float64
        np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), atol=2e-2,
                                   rtol=2e-2)  # fmt: skip


CASES = [
    ((1, 7, 96), (40, 33, 33), (0, 0, 0), True),  # QKV, one token block with a tail
    ((2, 37, 80), (50, 50), (1, 0), True),  # gate/up
    ((3, 5, 13), (20,), (1,), False),  # odd width, no gamma
]


@pytest.mark.parametrize("machine", [B910, C910], ids=["910b", "910"])
@pytest.mark.parametrize("emit", [0, 1])
@pytest.mark.parametrize(("shape", "ns", "hb", "gamma"), CASES)
def test_cast_matmuls_match_reference(machine, emit, shape, ns, hb, gamma) -> None:
    ins, attrs = make(shape, ns, hb, seed=len(ns), gamma=gamma, emit=emit)
    check(KERNEL.run(machine, ins, attrs).outputs, ins, attrs)


@pytest.mark.parametrize(
    "tiling",
    [
        T(16, 1, 1, 16, 32, 16, 1, 0, 2),
        T(32, 3, 3, 48, 64, 32, 0, 1, 24),  # streamed from the workspace
        T(48, 2, 5, 32, 96, 96, 1, 1, 5),
        T(16, 1, 8, 32, 64, 32, 1, 1, 24, staged=1),  # the unfused chain, Cast kernel included
    ],
)
def test_explicit_tilings_with_tails(tiling: T) -> None:
    ins, attrs = make((3, 29, 96), (70, 45), (1, 1), seed=7)
    for machine in (B910, C910):
        for emit in (0, 1):
            run = KERNEL.run(machine, ins, attrs | {"emit_normalized": emit}, tiling=tiling)
            check(run.outputs, ins, attrs)
            metas = [None if a is None else TensorMeta.of(a) for a in ins]
            timing = KERNEL.run(
                machine, metas, attrs | {"emit_normalized": emit}, tiling=tiling, functional=False
            ).stats
            assert timing.cycles == run.stats.cycles


def test_x_is_read_in_float32_and_the_linears_write_float16() -> None:
    ins, attrs = make((2, 50, 64), (96,), (1,))
    x, gamma, w, b = ins
    tiling = T(32, 1, 8, 96, 64, 64, 1, 1, 24)
    st = KERNEL.run(B910, ins, attrs, tiling=tiling).stats
    blocks = -(-100 // 32)
    params = blocks * 2 * gamma.nbytes + blocks * b.nbytes
    assert st.gm_read == x.nbytes + w.nbytes * blocks + params
    assert st.gm_write == 100 * 96 * 2  # float16 Y
    emitted = KERNEL.run(B910, ins, attrs | {"emit_normalized": 1}, tiling=tiling).stats
    assert emitted.gm_write == st.gm_write + x.nbytes  # N in float32


def test_cost_model_tracks_the_simulator() -> None:
    x, g = TensorMeta((1, 256, 1024), np.float32), TensorMeta((1024,), np.float32)
    w = TensorMeta((1024, 1024), np.float16)
    metas = [x, g, w, w, w]
    _, attrs = make((1, 2, 8), (4, 4, 4), (0, 0, 0))
    best = search.search("fuser", "RmsNormMatMul", metas, attrs, B910).best
    sim = KERNEL.run(B910, metas, attrs, tiling=best.tiling, functional=False).stats.cycles
    assert abs(best.cycles - sim) / sim < 0.25
    # the float16 Linears cost less than float32 ones would: the Cast is priced, not ignored
    as32 = dict(attrs, matmul_type=0)
    w32 = TensorMeta((1024, 1024), np.float32)
    best32 = search.search("fuser", "RmsNormMatMul", [x, g, w32, w32, w32], as32, B910).best
    assert best.cycles < best32.cycles
