"""RmsNormMatMul against the op's reference: shapes with tails and odd widths, several weights,
biases, flatten, stash_type and round_before_scale, fp16/fp32, both core layouts (910B
separate, 910 combined); explicit tilings (A resident or streamed), GM traffic, the cost model
against the simulator, timing-only mode, fused vs unfused."""

from __future__ import annotations

import numpy as np
import pytest
from fuser.kernels import registry, search
from fuser.kernels.api import KernelError, TensorMeta
from fuser.kernels.layernorm_matmul import LayerNormMatMulTiling as T
from fuser.kernels.npu.machine import load_target
from fuser.kernels.npu.stats import RunStats, sequence
from fuser.patterns.rmsnorm_matmul import reference

KERNEL = registry.get_kernel("fuser", "RmsNormMatMul")
B910 = load_target("ascend910b")
C910 = load_target("ascend910")


def make(shape, ns, has_bias, flatten, dtype, *, seed=0, stash=1, rounded=1, gamma=True):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2).astype(dtype)
    x.reshape(-1, shape[-1])[0] = 0  # a zero row: epsilon alone keeps it finite
    ins = [x, rng.uniform(0.5, 1.5, shape[-1]).astype(dtype) if gamma else None]
    for n, hb in zip(ns, has_bias, strict=True):
        ins.append((rng.standard_normal((shape[-1], n)) / np.sqrt(shape[-1])).astype(dtype))
        if hb:
            ins.append(rng.standard_normal(n).astype(dtype))
    attrs = {"epsilon": 1e-6, "stash_type": stash, "round_before_scale": rounded,
             "has_bias": list(has_bias), "flatten": list(flatten)}  # fmt: skip
    return ins, attrs


def check(outs, ins, attrs, dtype) -> None:
    want = reference(ins, attrs)
    assert len(outs) == len(want)
    # normalized is computed by the reference's own arithmetic: equal bit for bit
    np.testing.assert_array_equal(outs[0], want[0])
    tol = 2e-2 if dtype == np.float16 else 1e-5  # the Cube accumulates in float32
    for got, ref in zip(outs[1:], want[1:], strict=True):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), atol=tol,
                                   rtol=tol)  # fmt: skip


CASES = [
    ((1, 7, 96), (40, 33), (1, 0), (0, 1), 1, 1, True),
    ((2, 37, 80), (50,), (1,), (0,), 0, 1, True),
    ((3, 5, 13), (20, 16, 9), (0, 1, 0), (1, 0, 0), 1, 0, True),
    ((19, 48), (129,), (1,), (1,), 1, 1, False),
]


@pytest.mark.parametrize("machine", [B910, C910], ids=["910b", "910"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("shape", "ns", "hb", "fl", "stash", "rounded", "gamma"), CASES)
def test_matches_reference(machine, dtype, shape, ns, hb, fl, stash, rounded, gamma) -> None:
    ins, attrs = make(shape, ns, hb, fl, dtype, seed=len(ns), stash=stash, rounded=rounded,
                      gamma=gamma)  # fmt: skip
    check(KERNEL.run(machine, ins, attrs).outputs, ins, attrs, dtype)


@pytest.mark.parametrize(
    "tiling",
    [
        T(16, 1, 1, 16, 32, 16, 1, 0, 2),
        T(32, 3, 3, 48, 64, 32, 0, 1, 24),
        T(48, 2, 5, 32, 96, 96, 1, 1, 5),
        T(64, 1, 7, 64, 32, 32, 0, 0, 3),
    ],
)
def test_explicit_tilings_with_tails(tiling: T) -> None:
    ins, attrs = make((3, 29, 96), (70, 45), (1, 1), (0, 0), np.float16, seed=7)
    for machine in (B910, C910):
        check(KERNEL.run(machine, ins, attrs, tiling=tiling).outputs, ins, attrs, np.float16)


def test_gm_traffic_follows_the_fused_formula() -> None:
    # n_split=1: |X| + |W| * row-blocks + |Y| (+ gamma per vector core, bias per block).
    ins, attrs = make((2, 50, 64), (96,), (1,), (0,), np.float16)
    x, gamma, w, b = ins
    tiling = T(32, 1, 8, 96, 64, 64, 1, 1, 24)
    st = KERNEL.run(B910, ins, attrs, tiling=tiling).stats
    blocks = -(-100 // 32)
    params = blocks * 2 * gamma.nbytes + blocks * b.nbytes
    assert st.gm_read == x.nbytes + w.nbytes * blocks + params
    assert st.gm_write == 100 * 96 * 2
    emitted = KERNEL.run(B910, ins, attrs | {"emit_normalized": 1}, tiling=tiling).stats
    assert emitted.gm_write == st.gm_write + x.nbytes


def test_timing_only_same_cycles() -> None:
    ins, attrs = make((2, 45, 80), (64, 30), (1, 0), (0, 0), np.float32)
    metas = [None if a is None else TensorMeta.of(a) for a in ins]
    for machine in (B910, C910):
        f = KERNEL.run(machine, ins, attrs).stats
        t = KERNEL.run(machine, metas, attrs, functional=False).stats
        assert f.cycles == t.cycles
        assert f.bytes_by_level() == t.bytes_by_level()


def test_cost_model_tracks_the_simulator() -> None:
    """The model's pick, simulated, is within 25% of the model, and no slower than the
    kernel's default tiling by more than 10%."""
    x, g = TensorMeta((1, 256, 1024), np.float16), TensorMeta((1024,), np.float16)
    w = TensorMeta((1024, 1024), np.float16)
    metas = [x, g, w, w, w]
    attrs = {"epsilon": 1e-6, "stash_type": 1, "round_before_scale": 1, "has_bias": [0, 0, 0],
             "flatten": [0, 0, 0]}  # fmt: skip
    best = search.search("fuser", "RmsNormMatMul", metas, attrs, B910).best
    sim = KERNEL.run(B910, metas, attrs, tiling=best.tiling, functional=False).stats.cycles
    assert abs(best.cycles - sim) / sim < 0.25
    default = KERNEL.run(B910, metas, attrs, functional=False, tiling=KERNEL.default_tiling(
        metas, attrs, B910)).stats.cycles  # fmt: skip
    assert sim <= default * 1.1


def unfused_llama_norm(x: TensorMeta, g: TensorMeta, ws: list[TensorMeta]) -> list[RunStats]:
    """The fp16 Llama RMSNorm as exported, op by op, then its MatMuls (default tilings)."""
    k = registry.get_kernel
    x32 = TensorMeta(x.shape, np.float32)
    row = TensorMeta((*x.shape[:-1], 1), np.float32)
    one = TensorMeta((), np.float32)
    axes = np.array([-1], np.int64)
    steps = [
        ("Cast", [x], {"to": 1}), ("Pow", [x32, one], {}), ("ReduceMean", [x32, axes], {}),
        ("Add", [row, one], {}), ("Sqrt", [row], {}), ("Div", [one, row], {}),
        ("Mul", [x32, row], {}), ("Cast", [x32], {"to": 10}), ("Mul", [g, x], {}),
    ]  # fmt: skip
    runs = [k("", op).run(B910, ins, a, functional=False).stats for op, ins, a in steps]
    return runs + [k("", "MatMul").run(B910, [x, w], {}, functional=False).stats for w in ws]


def test_fused_beats_the_unfused_llama_projection() -> None:
    dt = np.float16
    x, g = TensorMeta((1, 128, 1024), dt), TensorMeta((1024,), dt)
    ws = [TensorMeta((1024, 1024), dt)] * 3
    attrs = {"epsilon": 1e-6, "stash_type": 1, "round_before_scale": 1, "has_bias": [0] * 3,
             "flatten": [0] * 3}  # fmt: skip
    fused = KERNEL.run(B910, [x, g, *ws], attrs, functional=False).stats
    unfused = sequence(unfused_llama_norm(x, g, ws))
    assert fused.cycles < unfused.cycles
    assert fused.gm_read + fused.gm_write < unfused.gm_read + unfused.gm_write
    assert (fused.launches, unfused.launches) == (1, 12)


def test_bad_inputs_name_the_op() -> None:
    ins, attrs = make((2, 8, 32), (16,), (1,), (0,), np.float32)
    metas = [None if a is None else TensorMeta.of(a) for a in ins]
    with pytest.raises(KernelError, match="RmsNormMatMul: W_0 must be"):
        KERNEL.infer([*metas[:2], TensorMeta((31, 16), np.float32), metas[3]], attrs)
    with pytest.raises(KernelError, match="RmsNormMatMul: b_0"):
        KERNEL.infer([*metas[:3], TensorMeta((15,), np.float32)], attrs)


@pytest.mark.parametrize(("dtype", "rounded", "gamma"), [
    (np.float16, 1, True), (np.float16, 0, True), (np.float32, 1, False),
])  # fmt: skip
def test_staged_schedule_runs_the_chain(dtype, rounded, gamma) -> None:
    ins, attrs = make((2, 9, 40), (24, 8), (1, 0), (0, 1), dtype, rounded=rounded, gamma=gamma)
    tiling = T(16, 1, 8, 32, 64, 32, 1, 1, 24, staged=1)
    run = KERNEL.run(B910, ins, attrs, tiling=tiling)
    want = reference(ins, attrs)
    tol = 2e-2 if dtype == np.float16 else 1e-5
    for got, ref in zip(run.outputs, want, strict=True):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), atol=tol,
                                   rtol=tol)  # fmt: skip
    # the chain's kernels in one launch: 6-9 RMSNorm stages, 2 MatMuls and a bias Add
    assert run.stats.launches == 1
    metas = [None if a is None else TensorMeta.of(a) for a in ins]
    timing = KERNEL.run(B910, metas, attrs, tiling=tiling, functional=False).stats
    assert timing.cycles == run.stats.cycles


def test_the_search_never_prices_fused_above_the_staged_chain() -> None:
    dt = np.float16
    x, g = TensorMeta((1, 2048, 4096), dt), TensorMeta((4096,), dt)
    ws = [TensorMeta((4096, 4096), dt)] * 3
    attrs = {"epsilon": 1e-6, "stash_type": 1, "round_before_scale": 1, "has_bias": [0] * 3,
             "flatten": [0] * 3}  # fmt: skip
    result = search.search("fuser", "RmsNormMatMul", [x, g, *ws], attrs, B910)
    staged = [c for c in result.candidates if c.tiling.staged]
    assert len(staged) == 1
    assert result.best.cycles <= staged[0].cycles
