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


# -- several Linears, Gemm, flatten (issue 8 item 5) ----------------------------------------------


def linears_reference(x: np.ndarray, lins: list[dict], axis: int) -> list[np.ndarray]:
    """Each Linear as its original ops compute it: MatMul (+ Add), each rounded, or one Gemm
    alpha * A @ W' + beta * C rounded once; A flattened to 2-D where asked."""
    g = np.concatenate(list(x), axis=axis)
    out = []
    for lin in lins:
        a = g.reshape(-1, g.shape[-1]) if lin.get("flatten") else g
        w = lin["w"].T if lin.get("trans_b") else lin["w"]
        y64 = a.astype(np.float64) @ w.astype(np.float64)
        b = lin.get("b")
        if lin.get("gemm"):
            y64 = lin["alpha"] * y64 + (0 if b is None else lin["beta"] * b.astype(np.float64))
            out.append(y64.astype(x.dtype))
            continue
        y = y64.astype(x.dtype)
        out.append(y if b is None else (y + b).astype(x.dtype))
    return out


def linears_inputs(x: np.ndarray, lins: list[dict], p: int, axis: int, rank: int) -> tuple:
    ins: list[np.ndarray | None] = [x]
    for lin in lins:
        ins += [lin["w"], *([lin["b"]] if lin.get("b") is not None else [])]
    attrs = {
        "group_size": p, "axis": axis, "rank": rank,
        "has_bias": [int(lin.get("b") is not None) for lin in lins],
        "flatten": [int(lin.get("flatten", 0)) for lin in lins],
        "trans_b": [int(lin.get("trans_b", 0)) for lin in lins],
        "gemm": [int(lin.get("gemm", 0)) for lin in lins],
        "alpha": [float(lin.get("alpha", 1.0)) for lin in lins],
        "beta": [float(lin.get("beta", 1.0)) for lin in lins],
    }  # fmt: skip
    return ins, attrs


def _lins(rng: np.random.Generator, k: int, dtype: type) -> list[dict]:
    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(k)).astype(dtype)

    return [
        {"w": w(k, 40), "b": rng.standard_normal(40).astype(dtype)},  # q: tails (40 = 32 + 8)
        {"w": w(k, 17)},  # k: odd N, no bias
        {"w": w(23, k), "b": rng.standard_normal(23).astype(dtype), "trans_b": 1, "gemm": 1,
         "alpha": 0.5, "beta": 2.0, "flatten": 1},  # a Gemm, transB, on the flattened rows
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("p", "shard", "axis"), [(4, (2, 9, 24), 1), (2, (33, 40), 1),
                                                  (3, (1, 5, 16), 2)])  # fmt: skip
def test_several_linears_match_their_original_ops_on_every_rank(p, shard, axis, dtype) -> None:
    rng = np.random.default_rng(p + axis)
    x = rng.standard_normal((p, *shard)).astype(dtype)
    k = shard[-1] * (p if axis == len(shard) - 1 else 1)
    lins = _lins(rng, k, dtype)
    want = linears_reference(x, lins, axis)
    tol = 1e-2 if dtype == np.float16 else 1e-5
    for rank in (0, p - 1):
        ins, attrs = linears_inputs(x, lins, p, axis, rank)
        metas = [TensorMeta.of(a) for a in ins]
        assert [m.shape for m in KERNEL.infer(metas, attrs)] == [
            want[0].shape,
            np.concatenate(list(x), axis=axis).shape,
            want[1].shape,
            want[2].shape,
        ]
        for tiling in (None, T(16, 16, 16, 16, 3, 1, 5)):
            y0, gathered, y1, y2 = KERNEL.run(M, ins, attrs, tiling=tiling).outputs
            for got, exp in zip((y0, y1, y2), want, strict=True):
                np.testing.assert_allclose(got.astype(np.float32), exp.astype(np.float32),
                                           atol=tol, rtol=tol)  # fmt: skip
            np.testing.assert_array_equal(gathered, np.concatenate(list(x), axis=axis))


def test_several_linears_share_one_gather_and_beat_one_fused_op_each() -> None:
    """QKV on 4 ranks: the link carries each shard once, and one node is faster than three."""
    x = TensorMeta((4, 1, 256, 1024), F16)
    ws = [TensorMeta((1024, n), F16) for n in (1024, 512, 512)]
    attrs = {"group_size": 4, "axis": 1, "rank": 1, "has_bias": [0, 0, 0], "flatten": [0, 0, 0]}
    run = KERNEL.run(M, [x, *ws], attrs, functional=False)
    assert run.stats.timeline is not None
    assert len([i for i in run.stats.timeline.intervals if i.pipe == "LINK"]) == 3
    single = {"group_size": 4, "axis": 1, "rank": 1}
    apart = sum(KERNEL.run(M, [x, w], single, functional=False).stats.cycles for w in ws)
    assert run.stats.cycles < apart


def test_gemm_linear_rounds_once_where_matmul_add_rounds_twice() -> None:
    """fp16 values where round(round(a @ w) + b) != round(a @ w + b): the Gemm form must
    give the single rounding, the MatMul form the double one, bit for bit."""
    x = np.full((2, 1, 1), 1.0, np.float16)  # gathered [2, 1] on axis 1: a = [1, 1]
    w = np.array([[1024.0], [0.25]], np.float16)  # a @ w = 1024.25 -> 1024 in fp16
    # double: 1024 + 0.5 -> 1024 (a tie, to even); single: 1024.25 + 0.5 = 1024.75 -> 1025
    b = np.array([0.5], np.float16)
    base = {"group_size": 2, "axis": 1, "rank": 0, "has_bias": [1], "flatten": [1]}
    gemm = {**base, "gemm": [1], "trans_b": [0], "alpha": [1.0], "beta": [1.0]}
    y_mm = KERNEL.run(M, [x, w, b], base).outputs[0]
    y_gemm = KERNEL.run(M, [x, w, b], gemm).outputs[0]
    assert float(y_mm[0, 0]) == 1024.0
    assert float(y_gemm[0, 0]) == 1025.0


def test_staged_schedule_of_several_linears_gives_the_fused_numbers() -> None:
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 6, 16)).astype(np.float16)
    lins = _lins(rng, 16, np.float16)
    ins, attrs = linears_inputs(x, lins, 2, 0, 1)
    metas = [TensorMeta.of(a) for a in ins]
    base = KERNEL.default_tiling(metas, attrs, M)  # type: ignore[union-attr]
    staged = KERNEL.run(M, ins, attrs, tiling=dataclasses.replace(base, staged=1))  # type: ignore[union-attr]
    fused = KERNEL.run(M, ins, attrs, tiling=base)  # type: ignore[union-attr]
    assert len(staged.outputs) == 4
    for got, want in zip(staged.outputs, fused.outputs, strict=True):
        np.testing.assert_array_equal(got, want)
    from fuser.kernels.search import search

    result = search("fuser", "AllGatherMatMul", metas, attrs, M)
    (priced,) = [c for c in result.candidates if c.tiling.staged]  # type: ignore[attr-defined]
    assert result.best.cycles <= priced.cycles


def test_model_ranks_several_linear_tilings_as_the_simulator_does() -> None:
    from fuser.kernels.search import search

    from fuser.tune import spearman

    x = TensorMeta((4, 256, 256), F16)
    ws = [TensorMeta((1024, n), F16) for n in (1024, 512, 512)]
    attrs = {"group_size": 4, "axis": 1, "rank": 1, "has_bias": [0, 0, 0], "flatten": [0, 0, 0]}
    result = search("fuser", "AllGatherMatMul", [x, *ws], attrs, M)
    sample = [c for c in result.candidates[:: max(1, len(result.candidates) // 16)]
              if not c.tiling.staged]  # type: ignore[attr-defined]  # fmt: skip
    sims = [KERNEL.run(M, [x, *ws], attrs, tiling=c.tiling, functional=False).stats.cycles
            for c in sample]  # fmt: skip
    rho = spearman([c.cycles for c in sample], sims)
    assert rho is not None and rho >= 0.9, rho
    ratios = [c.cycles / s for c, s in zip(sample, sims, strict=True)]
    assert 0.9 < float(np.median(ratios)) < 1.25, ratios


def test_bad_linear_layouts_say_why() -> None:
    x = TensorMeta((2, 4, 8), F16)
    with pytest.raises(KernelError, match="W must be"):
        KERNEL.infer([x, TensorMeta((8, 5), F16)], {"group_size": 2, "axis": 0, "has_bias": [0],
                                                    "trans_b": [1], "gemm": [1]})  # fmt: skip
    with pytest.raises(KernelError, match="B_1 must hold 5 values"):
        KERNEL.infer([x, TensorMeta((8, 3), F16), TensorMeta((8, 5), F16), TensorMeta((4,), F16)],
                     {"group_size": 2, "axis": 0, "has_bias": [0, 1]})  # fmt: skip
    with pytest.raises(KernelError, match="flatten has 1 values for 2 Linears"):
        KERNEL.infer([x, TensorMeta((8, 3), F16), TensorMeta((8, 5), F16)],
                     {"group_size": 2, "axis": 0, "has_bias": [0, 0], "flatten": [1]})  # fmt: skip
