"""MatMul and Gemm kernels against onnxruntime."""

from __future__ import annotations

import dataclasses
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


# -- split-K (issue 9 item 2) ---------------------------------------------------------------------

SPLIT_CASES = [
    # (op, A, B, C, attrs, tiling): each leaves a partly filled last wave, so blocks are cut
    ("MatMul", (70, 300), (300, 90), None, {}, MatMulTiling(32, 32, 64, 32, 1, 1, 0, 5, 3)),
    ("MatMul", (2, 37, 257), (257, 50), None, {}, MatMulTiling(16, 32, 64, 16, 1, 0, 1, 5, 4)),
    ("Gemm", (33, 200), (90, 200), (90,), {"transB": 1, "alpha": 0.5, "beta": 2.0},
     MatMulTiling(16, 32, 32, 16, 0, 1, 1, 7, 2)),
    ("Gemm", (40, 129), (129, 48), (40, 48), {}, MatMulTiling(16, 16, 64, 32, 1, 1, 0, 11, 8)),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("op", "sa", "sb", "sc", "attrs", "tiling"), SPLIT_CASES)
def test_split_k_matches_onnxruntime_and_does_what_it_prices(
    op: str, sa: tuple, sb: tuple, sc: tuple | None, attrs: dict, tiling: MatMulTiling, dtype: type
) -> None:
    rng = np.random.default_rng(9)
    ins = [rng.standard_normal(s).astype(dtype) for s in (sa, sb, *([sc] if sc else []))]
    run = _k(op).run(MACHINE, ins, attrs, tiling=tiling)
    k = sa[-1]
    assert_close(run.outputs[0], run_node(op, ins, attrs), np.dtype(dtype), 3 * math.sqrt(k))
    # fp32 accumulation either way: split-K agrees with the unsplit kernel to fp32 rounding.
    whole = _k(op).run(MACHINE, ins, attrs, tiling=dataclasses.replace(tiling, split_k=1))
    np.testing.assert_allclose(
        run.outputs[0].astype(np.float64), whole.outputs[0].astype(np.float64),
        rtol=2e-3 if dtype == np.float16 else 1e-5, atol=2e-3 if dtype == np.float16 else 1e-5,
    )  # fmt: skip
    # The program is the one priced: cube slices, then the reduce on the vector cores.
    tl = run.stats.timeline
    assert tl is not None and run.stats.launches == 1
    vector = [i for i in tl.intervals if i.pipe == "VECTOR"]
    cube_end = max(i.end for i in tl.intervals if i.pipe == "CUBE")
    assert vector and min(i.start for i in vector) >= cube_end
    metas = [TensorMeta.of(x) for x in ins]
    timing = _k(op).run(MACHINE, metas, attrs, tiling=tiling, functional=False).stats
    assert timing.cycles == run.stats.cycles
    from fuser.kernels.search import model_for

    model = model_for("", op)
    assert model is not None
    predicted = model.cost(metas, attrs, tiling, MACHINE)
    assert 0.85 < predicted / run.stats.cycles < 1.25


def test_split_k_writes_and_reads_its_fp32_workspace_through_hbm() -> None:
    """Nothing is free: the cut blocks' partials cost 4 bytes an element each way."""
    metas = [
        TensorMeta((70, 300), np.dtype(np.float16)),
        TensorMeta((300, 90), np.dtype(np.float16)),
    ]
    t = MatMulTiling(32, 32, 64, 32, 1, 1, 0, 5, 3)
    split = _k("MatMul").run(MACHINE, metas, {}, tiling=t, functional=False).stats
    whole = _k("MatMul").run(MACHINE, metas, {}, tiling=dataclasses.replace(t, split_k=1),
                             functional=False).stats  # fmt: skip
    # 9 blocks (rows 32, 32, 6 x columns 32, 32, 26) on 5 cores: the last 4 are cut, 3 slices
    cut = 32 * 26 + 6 * 32 + 6 * 32 + 6 * 26
    assert split.hbm_bytes - whole.hbm_bytes == 2 * 3 * 4 * cut  # written, then read back


@pytest.mark.parametrize(
    ("shape", "splits"),
    [((1024, 4096, 1024), True), ((512, 8192, 512), True), ((16, 4096, 4096), False)],
    ids=["1024x4096x1024", "512x8192x512", "decode-16x4096x4096"],
)
def test_search_picks_split_k_only_where_it_wins(shape: tuple[int, int, int], splits: bool) -> None:
    from fuser.kernels.search import search

    m, k, n = shape
    f16 = np.dtype(np.float16)
    metas = [TensorMeta((m, k), f16), TensorMeta((k, n), f16)]
    result = search("", "MatMul", metas, {}, MACHINE)
    best = result.best.tiling
    assert isinstance(best, MatMulTiling)
    assert (best.split_k > 1) == splits, best
    plain = min((c for c in result.candidates if c.tiling.split_k == 1),  # type: ignore[attr-defined]
                key=lambda c: c.cycles)  # fmt: skip
    sim = _k("MatMul").run(MACHINE, metas, {}, tiling=best, functional=False).stats.cycles
    sim_plain = _k("MatMul").run(MACHINE, metas, {}, tiling=plain.tiling, functional=False)
    if splits:  # the simulator agrees that it wins
        assert sim < sim_plain.stats.cycles
