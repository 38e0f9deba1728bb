"""AllGatherMatMul: numbers against numpy for gathers along M and along K (partial sums), every
rank, tails, fp16/fp32; the overlap of link transfers and the Cube in the timeline; the bound
max(T_allgather, T_matmul) <= fused < T_allgather + T_matmul on a balanced shape."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels.allgather_matmul import AllGatherMatMulTiling as T
from fuser.kernels.api import KernelError, TensorMeta, TilingError
from fuser.kernels.npu.machine import load_target

M = load_target("ascend910b")
KERNEL = registry.get_kernel("fuser", "AllGatherMatMul")
ALLGATHER = registry.get_kernel("com.microsoft", "AllGather")
MATMUL = registry.get_kernel("", "MatMul")
F16 = np.dtype(np.float16)


def numpy_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, axis: int) -> np.ndarray:
    g = np.concatenate(list(x), axis=axis)
    y = (g.astype(np.float64) @ w.astype(np.float64)).astype(x.dtype)
    return y if b is None else (y + b).astype(x.dtype)


CASES = [
    (4, (2, 17, 40), 1, 50, True),  # sequence (M) gather, tails
    (2, (33, 64), 1, 30, False),  # hidden (K) gather: partial sums
    (3, (5, 7, 24), 0, 20, True),  # batch gather
    (8, (1, 3, 16), 2, 24, True),  # K gather, 8 ranks, batch 1
    (1, (19, 40), 0, 33, False),  # a group of one is a plain MatMul
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("p", "shard", "axis", "n", "bias"), CASES)
def test_matches_numpy_on_every_rank(p, shard, axis, n, bias, dtype) -> None:
    rng = np.random.default_rng(p * 10 + axis)
    x = rng.standard_normal((p, *shard)).astype(dtype)
    k = shard[-1] * (p if axis == len(shard) - 1 else 1)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype) if bias else None
    want = numpy_reference(x, w, b, axis)
    tol = 1e-2 if dtype == np.float16 else 1e-5
    for rank in sorted({0, p - 1}):
        y, gathered = KERNEL.run(
            M, [x, w, b], {"group_size": p, "axis": axis, "rank": rank}
        ).outputs
        np.testing.assert_allclose(
            y.astype(np.float32), want.astype(np.float32), atol=tol, rtol=tol
        )
        np.testing.assert_array_equal(gathered, np.concatenate(list(x), axis=axis))


@pytest.mark.parametrize(
    "tiling", [T(16, 16, 16, 16, 1, 0, 3), T(48, 32, 64, 32, 3, 1, 24), T(32, 64, 32, 16, 2, 1, 5)]
)
@pytest.mark.parametrize("axis", [0, 1])
def test_explicit_tilings_with_tails(tiling: T, axis: int) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 37, 45)).astype(np.float16)
    k = 45 * (3 if axis == 1 else 1)
    w = (rng.standard_normal((k, 70)) / 8).astype(np.float16)
    b = rng.standard_normal(70).astype(np.float16)
    y, _ = KERNEL.run(
        M, [x, w, b], {"group_size": 3, "axis": axis, "rank": 1}, tiling=tiling
    ).outputs
    want = numpy_reference(x, w, b, axis)
    np.testing.assert_allclose(y.astype(np.float32), want.astype(np.float32), atol=1e-2, rtol=1e-2)


def _balanced(axis: int = 1, n: int = 1024) -> tuple[list[TensorMeta], dict[str, int], TensorMeta]:
    # 4 ranks, each shard 256 x 1024 fp16 (512 KiB per ring step), N = 1024: gather and matmul
    # take about as long on ascend910b (N = 2048: a shard's matmul outlasts its ring step).
    x = TensorMeta((4, 1, 256, 1024), F16)
    w = TensorMeta((1024, n), F16)
    return [x, w], {"group_size": 4, "axis": axis, "rank": 1}, TensorMeta((1, 1024, 1024), F16)


def test_fused_between_max_and_sum_of_allgather_and_matmul() -> None:
    metas, attrs, gathered = _balanced(n=1536)
    fused = KERNEL.run(M, metas, attrs, functional=False).stats.cycles
    t_ag = ALLGATHER.run(M, metas[:1], attrs, functional=False).stats.cycles
    t_mm = MATMUL.run(M, [gathered, metas[1]], {}, functional=False).stats.cycles
    assert 0.5 < t_ag / t_mm < 2, "the shape is meant to be balanced"
    assert fused >= max(t_ag, t_mm)
    assert fused < t_ag + t_mm


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def test_link_time_is_hidden_under_the_cube_in_the_timeline() -> None:
    metas, attrs, _ = _balanced(n=2048)
    # The overlap mechanism under the kernel's own default tiling: the searched pick is faster
    # and leaves less compute to hide the gather under, which is not what this test is about.
    tiling = KERNEL.default_tiling(metas, attrs, M)
    stats = KERNEL.run(M, metas, attrs, tiling=tiling, functional=False).stats
    tl = stats.timeline
    assert tl is not None
    link = [(i.start, i.end) for i in tl.intervals if i.pipe == "LINK"]
    busy = _union([(i.start, i.end) for i in tl.intervals if i.pipe in ("CUBE", "MTE2", "FIXP")
                   and i.end > i.start])  # fmt: skip
    assert len(link) == 3
    assert stats.pipe_busy["LINK"] == pytest.approx(sum(e - s for s, e in link))
    hidden = sum(max(0.0, min(e, be) - max(s, bs)) for s, e in link for bs, be in busy)
    share = hidden / sum(e - s for s, e in link)
    assert share > 0.8, f"only {share:.0%} of the link time overlaps compute"
    # Every ring step overlaps Cube instructions themselves, not only the copies feeding them.
    cube = [(i.start, i.end) for i in tl.intervals if i.pipe == "CUBE"]
    for s, e in link:
        assert any(cs < e and ce > s for cs, ce in cube)
    # The local shard is multiplied while the first remote shard is still on the link.
    first_mmad = min(i.start for i in tl.intervals if i.pipe == "CUBE")
    assert first_mmad < link[0][1]
    # A remote shard is not read before it has landed.
    waits = [i for i in tl.intervals if i.label.startswith("wait shard")]
    landed = {i.label: i.end for i in tl.intervals if i.pipe == "LINK"}
    for wt in waits:
        assert wt.start >= landed[wt.label.removeprefix("wait ")] - 1e-6


def test_k_gather_accumulates_across_shards_and_needs_more_passes_when_l0c_is_short() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 64, 32)).astype(np.float32)
    w = (rng.standard_normal((128, 96)) / 8).astype(np.float32)
    attrs = {"group_size": 4, "axis": 1, "rank": 3}
    want = numpy_reference(x, w, None, 1)
    one = KERNEL.run(M, [x, w, None], attrs, tiling=T(16, 16, 32, 8, 1, 1, 2))
    many = KERNEL.run(M, [x, w, None], attrs, tiling=T(16, 16, 32, 8, 24, 1, 2))
    for run in (one, many):
        np.testing.assert_allclose(run.outputs[0], want, atol=1e-5, rtol=1e-5)
        tl = run.stats.timeline
        assert tl is not None
        fix = [i for i in tl.intervals if i.pipe == "FIXP"]
        assert len(fix) == (64 // 16) * (96 // 16)  # each output tile written once...
        last_landed = max(i.end for i in tl.intervals if i.pipe == "LINK")
        assert min(i.start for i in fix) >= last_landed  # ...after every shard added to it


def test_timing_only_same_cycles() -> None:
    rng = np.random.default_rng(6)
    for axis in (0, 1):
        x = rng.standard_normal((4, 40, 48)).astype(np.float16)
        w = rng.standard_normal((48 * (4 if axis == 1 else 1), 64)).astype(np.float16)
        attrs = {"group_size": 4, "axis": axis, "rank": 2}
        f = KERNEL.run(M, [x, w], attrs).stats
        t = KERNEL.run(M, [TensorMeta.of(x), TensorMeta.of(w)], attrs, functional=False).stats
        assert f.cycles == t.cycles
        assert f.bytes_by_level() == t.bytes_by_level()


def test_capacity_and_input_errors() -> None:
    metas, attrs, _ = _balanced()
    with pytest.raises(TilingError, match="L0C"):
        KERNEL.check_tiling(metas, attrs, T(128, 256, 64, 64, 2, 1, 24), M)
    with pytest.raises(TilingError, match="L1"):
        KERNEL.check_tiling(metas, attrs, T(256, 256, 1024, 64, 1, 1, 24), M)
    with pytest.raises(TilingError, match="tile_k0"):
        KERNEL.check_tiling(metas, attrs, T(16, 16, 16, 32, 1, 1, 24), M)
    with pytest.raises(KernelError, match="W must be"):
        KERNEL.infer([metas[0], TensorMeta((1000, 8), F16)], attrs)
    with pytest.raises(KernelError, match="shards stacked"):
        KERNEL.infer([TensorMeta((3, 1, 4, 8), F16), TensorMeta((8, 8), F16)], attrs)


@pytest.mark.parametrize("axis", [1, 2])
def test_staged_one_chunk_schedule_is_gather_then_multiply(axis: int) -> None:
    rng = np.random.default_rng(21)
    x = rng.standard_normal((2, 3, 8, 16)).astype(np.float16)
    k = 16 * (2 if axis == 2 else 1)
    w = (rng.standard_normal((k, 24)) * 0.2).astype(np.float16)
    b = rng.standard_normal(24).astype(np.float16)
    attrs = {"group_size": 2, "axis": axis, "rank": 0}
    metas = [TensorMeta.of(a) for a in (x, w, b)]
    base = KERNEL.default_tiling(metas, attrs, M)  # type: ignore[union-attr]
    staged = dataclasses.replace(base, staged=1)
    run = KERNEL.run(M, [x, w, b], attrs, tiling=staged)  # type: ignore[union-attr]
    fused = KERNEL.run(M, [x, w, b], attrs, tiling=base)  # type: ignore[union-attr]
    np.testing.assert_array_equal(run.outputs[0], fused.outputs[0])
    np.testing.assert_array_equal(run.outputs[1], fused.outputs[1])
    assert run.stats.launches == 1
    # Nothing overlaps: the gather's link time and the multiply add up.
    t_ag = ALLGATHER.run(M, [x], attrs, functional=False).stats.cycles  # type: ignore[union-attr]
    timing = KERNEL.run(M, metas, attrs, tiling=staged, functional=False)  # type: ignore[union-attr]
    assert timing.stats.cycles > t_ag


def test_search_never_prices_the_fused_op_above_the_staged_chain() -> None:
    from fuser.kernels.search import search

    metas, attrs, _ = _balanced()
    result = search("fuser", "AllGatherMatMul", metas, attrs, M)
    staged = [p for p in result.candidates if p.tiling.staged]  # type: ignore[attr-defined]
    assert len(staged) == 1
    assert result.best.cycles <= staged[0].cycles
