"""MatMul and Gemm kernels against onnxruntime."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels.api import Kernel, KernelError, TensorMeta, TilingError
from fuser.kernels.matmul import MatMulTiling
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_oracle import MACHINE, assert_close, run_node


def _k(op: str) -> Kernel:
    k = registry.get_kernel("", op)
    assert k is not None
    return k


MATMUL_SHAPES = [
    ((64,), (64, 33)),
    ((5, 70), (70,)),
    ((1, 17), (17, 1)),
    ((2, 1, 37, 70), (3, 70, 50)),
    ((4, 129, 96), (96, 200)),
    ((300, 257), (257, 130)),
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("sa", "sb"), MATMUL_SHAPES)
def test_matmul_matches_onnxruntime(sa: tuple[int, ...], sb: tuple[int, ...], dtype: type) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal(sa).astype(dtype)
    b = rng.standard_normal(sb).astype(dtype)
    got = _k("MatMul").run(MACHINE, [a, b], {}).outputs[0]
    assert got.dtype == dtype
    assert_close(got, run_node("MatMul", [a, b], {}), np.dtype(dtype), math.sqrt(sa[-1]))


GEMM_CASES: list[
    tuple[tuple[int, int], tuple[int, int], tuple[int, ...] | None, dict[str, Any]]
] = [
    ((40, 30), (30, 50), None, {}),
    ((30, 40), (50, 30), (50,), {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0}),
    ((17, 33), (33, 19), (17, 1), {"beta": -1.0}),
    ((17, 33), (19, 33), (17, 19), {"transB": 1, "alpha": 3.0}),
    ((1, 768), (768, 1000), (1, 1000), {}),
    ((5, 6), (6, 7), (), {"beta": 0.25}),
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("sa", "sb", "sc", "attrs"), GEMM_CASES)
def test_gemm_matches_onnxruntime(
    sa: tuple[int, int],
    sb: tuple[int, int],
    sc: tuple[int, ...] | None,
    attrs: dict[str, Any],
    dtype: type,
) -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal(sa).astype(dtype)
    b = rng.standard_normal(sb).astype(dtype)
    inputs = [a, b] if sc is None else [a, b, np.asarray(rng.standard_normal(sc)).astype(dtype)]
    got = _k("Gemm").run(MACHINE, inputs, attrs).outputs[0]
    k = sa[0] if attrs.get("transA") else sa[1]
    assert_close(got, run_node("Gemm", inputs, attrs), np.dtype(dtype), 3 * math.sqrt(k))


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from([16, 32, 48, 128]), st.sampled_from([16, 32, 64, 256]),
    st.sampled_from([16, 64, 128, 512]), st.sampled_from([8, 16, 64, 128]),
    st.integers(0, 1), st.integers(1, 24),
)  # fmt: skip
def test_any_fitting_tiling_gives_the_same_numbers(
    tm: int, tn: int, tk: int, tk0: int, db: int, cores: int
) -> None:
    rng = np.random.default_rng(2)
    a = rng.standard_normal((2, 77, 300)).astype(np.float32)
    b = rng.standard_normal((300, 90)).astype(np.float32)
    t = MatMulTiling(tm, tn, tk, min(tk0, tk), db, db, db, cores)
    refusal = _refusal(a, b, t)
    if refusal is not None:
        # A refused tiling must say which buffer overflows.
        assert any(f"bytes of {lv} " in refusal for lv in ("L1", "L0A", "L0B", "L0C")), refusal
        return
    run = _k("MatMul").run(MACHINE, [a, b], {}, tiling=t)
    np.testing.assert_allclose(run.outputs[0], a @ b, rtol=1e-4, atol=1e-4)
    metas = [TensorMeta.of(a), TensorMeta.of(b)]
    assert _k("MatMul").run(MACHINE, metas, {}, tiling=t, functional=False).stats == run.stats


def _refusal(a: np.ndarray, b: np.ndarray, t: MatMulTiling) -> str | None:
    try:
        _k("MatMul").check_tiling([TensorMeta.of(a), TensorMeta.of(b)], {}, t, MACHINE)
    except TilingError as e:
        return str(e)
    return None


def test_tilings_that_do_not_fit_are_refused() -> None:
    a = np.ones((512, 512), np.float16)
    with pytest.raises(TilingError, match="L0C"):
        _k("MatMul").run(MACHINE, [a, a], {}, tiling=MatMulTiling(256, 256, 64, 64, 1, 1, 1, 24))
    with pytest.raises(TilingError, match="L1"):
        _k("MatMul").run(MACHINE, [a, a], {}, tiling=MatMulTiling(256, 128, 512, 32, 1, 1, 1, 24))
    with pytest.raises(TilingError, match="tile_k0"):
        _k("MatMul").run(MACHINE, [a, a], {}, tiling=MatMulTiling(64, 64, 64, 128, 1, 1, 1, 24))


def test_bad_inputs_say_why() -> None:
    with pytest.raises(KernelError, match="inner dimensions"):
        _k("MatMul").run(MACHINE, [np.ones((2, 3), np.float32), np.ones((4, 5), np.float32)], {})
    with pytest.raises(KernelError, match="float16 or float32"):
        _k("MatMul").run(MACHINE, [np.ones((2, 3), np.int32), np.ones((3, 5), np.int32)], {})
    a, b, c = np.ones((2, 3), np.float32), np.ones((3, 5), np.float32), np.ones(4, np.float32)
    with pytest.raises(KernelError, match="broadcast"):
        _k("Gemm").run(MACHINE, [a, b, c], {})


def test_cube_cycles_follow_the_block_count() -> None:
    # One core, one block: the Cube is busy ceil(m/16)*ceil(k/16)*ceil(n/16) cycles for fp16.
    a = np.ones((33, 40), np.float16)
    b = np.ones((40, 17), np.float16)
    run = _k("MatMul").run(MACHINE, [a, b], {}, tiling=MatMulTiling(48, 32, 48, 48, 0, 0, 0, 1))
    assert run.stats.pipe_busy["CUBE"] == 3 * 3 * 2
    run32 = _k("MatMul").run(
        MACHINE, [a.astype(np.float32), b.astype(np.float32)], {},
        tiling=MatMulTiling(48, 32, 48, 48, 0, 0, 0, 1),
    )  # fmt: skip
    assert run32.stats.pipe_busy["CUBE"] == 3 * 5 * 2  # fp32: k block of 8
    assert run.stats.gm_read == a.nbytes + b.nbytes
    assert run.stats.gm_write == 33 * 17 * 2


def test_default_tiling_evens_out_the_last_wave_of_blocks() -> None:
    """1024 x 1024 outputs in 128 x 256 blocks are 32 blocks on 24 cores (the second wave a
    third full): the default cuts N in 6 blocks of 176 (48 blocks, two full waves) and runs
    faster; 4096 x 4096 (512 blocks, the last wave a third full of 22) keeps 128 x 256."""
    mm = registry.get_kernel("", "MatMul")
    assert mm is not None
    f16 = np.dtype(np.float16)
    metas = [TensorMeta((1024, 4096), f16), TensorMeta((4096, 1024), f16)]
    t = mm.default_tiling(metas, {}, MACHINE)
    assert isinstance(t, MatMulTiling)
    assert (t.tile_m, t.tile_n) == (128, 176)
    wide = MatMulTiling(128, 256, t.tile_k, t.tile_k0, t.db_l1, t.db_l0, t.db_l0c, t.cores)
    fast = mm.run(MACHINE, metas, {}, tiling=t, functional=False).stats.cycles
    slow = mm.run(MACHINE, metas, {}, tiling=wide, functional=False).stats.cycles
    assert fast < slow
    big = [TensorMeta((4096, 4096), f16)] * 2
    tb = mm.default_tiling(big, {}, MACHINE)
    assert isinstance(tb, MatMulTiling)
    assert (tb.tile_m, tb.tile_n) == (128, 256)
    # The uneven split computes the same numbers (a 1024 / 176 tail of 144 columns).
    rng = np.random.default_rng(3)
    a = rng.standard_normal((200, 96)).astype(np.float32)
    b = rng.standard_normal((96, 1024)).astype(np.float32)
    got = mm.run(MACHINE, [a, b], {}, tiling=MatMulTiling(128, 176, 64, 32, 1, 1, 0, 24))
    np.testing.assert_allclose(got.outputs[0], a @ b, rtol=1e-4, atol=1e-3)
