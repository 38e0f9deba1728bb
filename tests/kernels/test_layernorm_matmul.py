"""LayerNormMatMul against the op's reference: shapes with tails, several weights, biases,
flatten, axis, stash_type, fp16/fp32, both core layouts (910B separate, 910 combined); the
workspace hop, GM traffic formula, capacity errors, timing-only mode, fused vs unfused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels.api import KernelError, TensorMeta, TilingError
from fuser.kernels.layernorm_matmul import LayerNormMatMulTiling as T
from fuser.kernels.npu.machine import load_target
from fuser.kernels.npu.stats import sequence
from fuser.kernels.search import search
from fuser.patterns.layernorm_matmul import reference

KERNEL = registry.get_kernel("fuser", "LayerNormMatMul")
B910 = load_target("ascend910b")
C910 = load_target("ascend910")


def make(shape, axis, ns, has_bias, flatten, dtype, seed=0, stash_type=1, affine=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    norm = shape[axis:]
    ins = [
        x,
        rng.standard_normal(norm).astype(dtype) if affine else None,
        rng.standard_normal(norm).astype(dtype) if affine else None,
    ]
    for n, hb in zip(ns, has_bias, strict=True):
        ins.append((rng.standard_normal((shape[-1], n)) / np.sqrt(shape[-1])).astype(dtype))
        if hb:
            ins.append(rng.standard_normal(n).astype(dtype))
    attrs = {"axis": axis, "epsilon": 1e-5, "stash_type": stash_type, "has_bias": list(has_bias),
             "flatten": list(flatten)}  # fmt: skip
    return ins, attrs


def check(outs, ins, attrs, dtype) -> None:
    want = reference(ins, attrs)
    assert len(outs) == len(want)
    tol = 2e-2 if dtype == np.float16 else 1e-5
    for got, ref in zip(outs, want, strict=True):
        assert got.shape == ref.shape
        assert got.dtype == ref.dtype
        np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), atol=tol,
                                   rtol=tol)  # fmt: skip


CASES = [
    ((1, 7, 96), -1, (40, 33), (1, 0), (0, 1), 1, True),
    ((2, 37, 80), -1, (50,), (1,), (0,), 0, True),
    ((3, 5, 6, 8), 2, (20, 16), (0, 1), (1, 0), 1, True),
    ((19, 48), -1, (129,), (1,), (1,), 1, False),
]


@pytest.mark.parametrize("machine", [B910, C910], ids=["910b", "910"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("shape", "axis", "ns", "hb", "fl", "stash", "affine"), CASES)
def test_matches_reference(machine, dtype, shape, axis, ns, hb, fl, stash, affine) -> None:
    ins, attrs = make(shape, axis, ns, hb, fl, dtype, seed=len(ns), stash_type=stash,
                      affine=affine)  # fmt: skip
    check(KERNEL.run(machine, ins, attrs).outputs, ins, attrs, dtype)


@pytest.mark.parametrize(
    "tiling",
    [
        T(16, 1, 1, 16, 32, 16, 1, 0, 2),
        T(32, 3, 3, 48, 64, 32, 0, 1, 24),
        T(48, 2, 5, 32, 96, 96, 1, 1, 5),
        T(64, 1, 7, 64, 32, 32, 0, 0, 3),
        T(48, 2, 3, 48, 64, 32, 0, 1, 7, l0c_single=1),
        T(32, 3, 4, 32, 96, 32, 1, 1, 24, l0c_single=1),
    ],
)
def test_explicit_tilings_with_tails(tiling: T) -> None:
    ins, attrs = make((3, 29, 96), -1, (70, 45), (1, 1), (0, 0), np.float16, seed=7)
    for machine in (B910, C910):
        check(KERNEL.run(machine, ins, attrs, tiling=tiling).outputs, ins, attrs, np.float16)


def test_vector_to_cube_hop_crosses_workspace_only_on_separate_cores() -> None:
    ins, attrs = make((1, 40, 64), -1, (64,), (0,), (0,), np.float16)
    tiling = T(16, 1, 8, 64, 64, 64, 1, 1, 24)
    sep = KERNEL.run(B910, ins, attrs, tiling=tiling).stats.timeline
    comb = KERNEL.run(C910, ins, attrs, tiling=tiling).stats.timeline
    assert sep is not None
    assert comb is not None
    hop_in = [i for i in sep.intervals if i.pipe == "MTE2" and "workspace ->" in i.label]
    hop_out = [i for i in sep.intervals if i.pipe == "MTE3" and "-> workspace" in i.label]
    # One per vector step: blocks of 16, 16 and 8 rows, in steps of 8 rows.
    assert len(hop_in) == len(hop_out) == 5
    # The cube core reads a piece only after the vector core has written it.
    assert min(i.start for i in hop_in) >= min(i.end for i in hop_out)
    assert not [i for i in comb.intervals if "workspace" in i.label]
    assert len([i for i in comb.intervals if i.pipe == "MTE3" and "-> a_block" in i.label]) == 5


def test_streamed_a_panels_come_from_the_workspace_and_w_is_read_once_per_block() -> None:
    ins, attrs = make((1, 96, 64), -1, (80,), (0,), (0,), np.float16)
    tiling = T(96, 1, 24, 32, 32, 16, 0, 1, 24)
    for machine in (B910, C910):
        st = KERNEL.run(machine, ins, attrs, tiling=tiling).stats
        tl = st.timeline
        assert tl is not None
        # One A panel per (N tile, K panel): 3 x 2, each read from the workspace.
        panels = [i for i in tl.intervals if i.pipe == "MTE2" and "-> a_panel" in i.label]
        assert len(panels) == 3 * 2
        # X and W once (one row block); A's re-reads stay in L2; scale and bias per vector core.
        vec_cores = 2 if machine is B910 else 1
        params = vec_cores * (ins[1].nbytes + ins[2].nbytes)
        assert st.gm_read == ins[0].nbytes + ins[3].nbytes + params


def test_gm_traffic_follows_the_fused_formula() -> None:
    # n_split=1: |X| + |W| * row-blocks + |Y| (+ the small parameters each core loads once).
    ins, attrs = make((2, 50, 64), -1, (96,), (1,), (0,), np.float16)
    x, scale, bias, w, b = ins
    tiling = T(32, 1, 8, 96, 64, 64, 1, 1, 24)
    st = KERNEL.run(B910, ins, attrs, tiling=tiling).stats
    blocks = -(-100 // 32)
    vec_cores = blocks * 2
    params = vec_cores * (scale.nbytes + bias.nbytes) + blocks * b.nbytes
    assert st.gm_read == x.nbytes + w.nbytes * blocks + params
    assert st.gm_write == 100 * 96 * 2
    emitted = KERNEL.run(B910, ins, attrs | {"emit_normalized": 1}, tiling=tiling).stats
    assert emitted.gm_write == st.gm_write + x.nbytes


def test_fused_is_never_slower_than_unfused_on_a_bert_layer() -> None:
    """The search picks among the fused schedules and the unfused chain's own (`staged`): the
    fused op never runs slower than LayerNorm, MatMul and the bias Add at their tilings."""
    dt = np.float16
    x, s, w = TensorMeta((1, 128, 768), dt), TensorMeta((768,), dt), TensorMeta((768, 2304), dt)
    b = TensorMeta((2304,), dt)
    attrs = {"axis": -1, "epsilon": 1e-5, "stash_type": 1, "has_bias": [1], "flatten": [0]}
    fused = KERNEL.run(B910, [x, s, s, w, b], attrs, functional=False).stats
    ln = registry.get_kernel("", "LayerNormalization").run(B910, [x, s, s], {}, functional=False)
    n2, y = TensorMeta((128, 768), dt), TensorMeta((128, 2304), dt)
    mm_k = registry.get_kernel("", "MatMul")
    mm_t = search("", "MatMul", [n2, w], {}, B910).best.tiling
    mm = mm_k.run(B910, [n2, w], {}, tiling=mm_t, functional=False)  # type: ignore[union-attr]
    add = registry.get_kernel("", "Add").run(B910, [y, b], {}, functional=False)  # type: ignore[union-attr]
    unfused = sequence([ln.stats, mm.stats, add.stats])
    # Within the model's pick error (the staged schedule itself costs exactly the chain): at
    # this shape the two are a near tie for the model (16.14k fused, 16.20k staged) while the
    # simulator has the fused pick 2.7% above its price and the chain 1.4% below its price.
    assert fused.cycles <= 1.05 * unfused.cycles
    assert fused.launches == 1
    assert unfused.launches == 3


def test_staged_schedule_computes_the_reference() -> None:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 5, 40)).astype(np.float16)
    sc, bi = (rng.standard_normal(40).astype(np.float16) for _ in range(2))
    w = (rng.standard_normal((40, 24)) * 0.2).astype(np.float16)
    b = rng.standard_normal(24).astype(np.float16)
    attrs = {"axis": -1, "epsilon": 1e-5, "stash_type": 1, "has_bias": [1], "flatten": [1]}
    metas = [TensorMeta.of(a) for a in (x, sc, bi, w, b)]
    base = KERNEL.default_tiling(metas, attrs, B910)
    staged = dataclasses.replace(base, staged=1)
    run = KERNEL.run(B910, [x, sc, bi, w, b], attrs, tiling=staged)
    fused = KERNEL.run(B910, [x, sc, bi, w, b], attrs, tiling=base)
    assert run.outputs[1].shape == (10, 24)
    np.testing.assert_array_equal(run.outputs[1], fused.outputs[1])
    np.testing.assert_array_equal(run.outputs[0], fused.outputs[0])
    assert run.stats.launches == 1
    # The attribute form of a tiling from before `staged` existed still loads (staged = 0).
    old = {k: v for k, v in KERNEL.tiling_to_attrs(base).items() if k != "tile_staged"}
    assert KERNEL.tiling_from_attrs(old) == base


def test_single_l0c_puts_each_fixpipe_before_the_next_blocks_first_multiply() -> None:
    """`l0c_single`: one L0C slot (MatMul's per-level choice), while L1 and L0A/B stay double."""
    ins, attrs = make((1, 64, 64), -1, (96,), (0,), (0,), np.float16)
    spans = {}
    for single in (0, 1):
        t = T(64, 1, 16, 32, 32, 16, 0, 1, 1, l0c_single=single)
        tl = KERNEL.run(B910, ins, attrs, tiling=t).stats.timeline
        assert tl is not None
        fix = sorted((i.start, i.end) for i in tl.intervals if i.pipe == "FIXP")
        cube = sorted(i.start for i in tl.intervals if i.pipe == "CUBE")
        assert len(fix) == 3  # three 32-column blocks
        # The first multiply of block j+1 (4 steps of 16 per block) against block j's FixPipe.
        spans[single] = [cube[4 * (j + 1)] >= fix[j][1] for j in range(2)]
        check(KERNEL.run(B910, ins, attrs, tiling=t).outputs, ins, attrs, np.float16)
    assert spans[1] == [True, True]
    assert spans[0] != [True, True]


def test_search_pick_is_within_a_percent_of_the_staged_schedule_at_the_articles_shape() -> None:
    """[8,512,1024] x [1024,4096] fp16: the search picks a fused schedule, and in the simulator
    it is within 1% of the staged one (the unfused chain's kernels in one launch), which is
    always in the space. (With statistics in two passes, issue 14, the two were a near tie
    here, 255.1k vs 254.5k cycles; with the first pass's mean replaced by a shift by the row's
    first element the fused schedule wins again: 239.9k vs 244.0k.)"""
    dt = np.float16
    metas = [TensorMeta((8, 512, 1024), dt), TensorMeta((1024,), dt), TensorMeta((1024,), dt),
             TensorMeta((1024, 4096), dt)]  # fmt: skip
    attrs = {"axis": -1, "epsilon": 1e-5, "has_bias": [0], "flatten": [0]}
    best = search("fuser", "LayerNormMatMul", metas, attrs, B910).best.tiling
    assert isinstance(best, T)
    assert not best.staged
    fused = KERNEL.run(B910, metas, attrs, tiling=best, functional=False).stats.cycles
    staged = KERNEL.run(B910, metas, attrs, tiling=dataclasses.replace(best, staged=1),
                        functional=False).stats.cycles  # fmt: skip
    assert fused <= 1.01 * staged, (fused, staged)


def test_timing_only_same_cycles() -> None:
    ins, attrs = make((2, 45, 80), -1, (64, 30), (1, 0), (0, 0), np.float32)
    metas = [None if a is None else TensorMeta.of(a) for a in ins]
    for machine in (B910, C910):
        f = KERNEL.run(machine, ins, attrs).stats
        t = KERNEL.run(machine, metas, attrs, functional=False).stats
        assert f.cycles == t.cycles
        assert f.bytes_by_level() == t.bytes_by_level()


def test_capacity_and_malformed_tilings_are_refused() -> None:
    ins, attrs = make((1, 512, 1024), -1, (256,), (0,), (0,), np.float16)
    metas = [None if a is None else TensorMeta.of(a) for a in ins]
    with pytest.raises(TilingError, match="L1"):
        KERNEL.check_tiling(metas, attrs, T(256, 1, 1, 256, 256, 64, 1, 1, 24), B910)
    with pytest.raises(TilingError, match="UB"):
        KERNEL.check_tiling(metas, attrs, T(64, 1, 64, 64, 64, 64, 1, 1, 24), B910)
    with pytest.raises(TilingError, match="L0A"):
        KERNEL.check_tiling(metas, attrs, T(128, 1, 1, 64, 512, 512, 1, 0, 24), B910)
    with pytest.raises(TilingError, match="tile_k0"):
        KERNEL.check_tiling(metas, attrs, T(16, 1, 1, 64, 64, 128, 1, 1, 24), B910)
    ins, attrs = make((3, 5, 6, 8), 2, (16,), (0,), (0,), np.float16)
    metas = [None if a is None else TensorMeta.of(a) for a in ins]
    with pytest.raises(TilingError, match="multiple of 6"):
        KERNEL.check_tiling(metas, attrs, T(16, 1, 1, 16, 16, 16, 1, 1, 24), B910)


def test_bad_inputs() -> None:
    ins, attrs = make((2, 8, 32), -1, (16,), (1,), (0,), np.float32)
    metas = [None if a is None else TensorMeta.of(a) for a in ins]
    with pytest.raises(KernelError, match="W_0 must be"):
        KERNEL.infer([*metas[:3], TensorMeta((31, 16), np.float32), metas[4]], attrs)
    with pytest.raises(KernelError, match="b_0"):
        KERNEL.infer([*metas[:4], TensorMeta((15,), np.float32)], attrs)
