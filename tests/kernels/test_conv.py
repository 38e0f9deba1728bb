"""Conv and the fused ConvBnRelu against onnxruntime (Conv -> BatchNormalization -> Relu)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels.api import Kernel, KernelError, TensorMeta, TilingError
from fuser.kernels.conv_bn_relu import ConvTiling
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_oracle import MACHINE, assert_close, run_chain, run_node

CONV = registry.get_kernel("", "Conv")
FUSED = registry.get_kernel("fuser", "ConvBnRelu")

# (X shape, W shape, attrs): tails, batch 1 and 2, groups, depthwise, strides, pads, dilations.
CASES: list[tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = [
    ((1, 3, 17, 19), (8, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 16, 9, 9), (16, 1, 3, 3), {"group": 16, "strides": [2, 2], "pads": [1, 0, 1, 2]}),
    ((1, 12, 10, 11), (18, 4, 3, 2), {"group": 3, "dilations": [2, 1], "pads": [2, 0, 1, 1]}),
    ((1, 12, 10, 11), (18, 4, 3, 2), {"group": 3, "auto_pad": "SAME_UPPER"}),
    ((1, 7, 8, 9), (5, 7, 2, 2), {"auto_pad": "SAME_LOWER", "strides": [2, 3]}),
    ((1, 5, 30), (7, 5, 5), {"strides": [3], "pads": [2, 1]}),
    ((2, 20, 8, 8), (40, 20, 1, 1), {"auto_pad": "VALID"}),
    ((1, 33, 14, 14), (33, 1, 5, 5), {"group": 33, "pads": [2, 2, 2, 2]}),
    ((1, 3, 23, 23), (17, 3, 7, 7), {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
]


def _kernel(k: Kernel | None) -> Kernel:
    assert k is not None
    return k


def _data(
    xs: tuple[int, ...], ws: tuple[int, ...], dtype: type, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(xs).astype(dtype)
    w = rng.standard_normal(ws).astype(dtype)
    b = rng.standard_normal(ws[0]).astype(dtype)
    c = ws[0]
    bn = [
        rng.uniform(0.5, 1.5, c).astype(dtype),
        rng.standard_normal(c).astype(dtype),
        rng.standard_normal(c).astype(dtype),
        rng.uniform(0.5, 2.0, c).astype(dtype),
    ]
    return x, w, b, bn


def _scale(ws: tuple[int, ...]) -> float:
    return math.sqrt(math.prod(ws[1:]))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("xs", "ws", "attrs"), CASES)
def test_conv_matches_onnxruntime(
    xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any], dtype: type
) -> None:
    x, w, b, _ = _data(xs, ws, dtype)
    got = _kernel(CONV).run(MACHINE, [x, w, b], attrs).outputs[0]
    assert got.dtype == dtype
    assert_close(got, run_node("Conv", [x, w, b], attrs), np.dtype(dtype), _scale(ws))


@pytest.mark.parametrize("relu", [0, 1])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("xs", "ws", "attrs"), CASES[::2])
def test_conv_bn_relu_matches_the_chain(
    xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any], dtype: type, relu: int
) -> None:
    x, w, b, bn = _data(xs, ws, dtype, seed=1)
    chain: list[tuple[str, list[str], dict[str, Any]]] = [
        ("Conv", ["x", "w", "b"], attrs),
        ("BatchNormalization", ["t0", "s", "beta", "mean", "var"], {"epsilon": 1e-3}),
    ]
    if relu:
        chain.append(("Relu", ["t1"], {}))
    feeds = dict(zip(["x", "w", "b", "s", "beta", "mean", "var"], [x, w, b, *bn], strict=True))
    want = run_chain(chain, feeds)
    got = _kernel(FUSED).run(MACHINE, [x, w, b, *bn], {**attrs, "epsilon": 1e-3, "relu": relu})
    assert_close(got.outputs[0], want, np.dtype(dtype), _scale(ws) * 2)
    if relu:
        assert (got.outputs[0] >= 0).all()


def test_folded_conv_bn_relu_without_bn_inputs_matches_the_chain() -> None:
    """BN folded at fuse time (fused-ops.md): W' = W * s / sqrt(v + eps), B' = (B - m) * ... + b."""
    x, w, b, (s, beta, mean, var) = _data((2, 6, 11, 10), (10, 6, 3, 3), np.float32, seed=2)
    k = s / np.sqrt(var + 1e-5)
    w_f = (w * k[:, None, None, None]).astype(np.float32)
    b_f = ((b - mean) * k + beta).astype(np.float32)
    attrs = {"pads": [1, 1, 1, 1], "relu": 1}
    got = _kernel(FUSED).run(MACHINE, [x, w_f, b_f], attrs).outputs[0]
    chain = [
        ("Conv", ["x", "w", "b"], {"pads": [1, 1, 1, 1]}),
        ("BatchNormalization", ["t0", "s", "beta", "mean", "var"], {}),
        ("Relu", ["t1"], {}),
    ]
    feeds = {"x": x, "w": w, "b": b, "s": s, "beta": beta, "mean": mean, "var": var}
    assert_close(got, run_chain(chain, feeds), np.dtype(np.float32), 10)


def test_conv_without_bias() -> None:
    x, w, _, _ = _data((1, 4, 6, 6), (4, 4, 3, 3), np.float32)
    got = _kernel(CONV).run(MACHINE, [x, w], {}).outputs[0]
    assert_close(got, run_node("Conv", [x, w], {}), np.dtype(np.float32), 6)
    got = _kernel(FUSED).run(MACHINE, [x, w, None], {"relu": 1}).outputs[0]
    assert_close(got, np.maximum(run_node("Conv", [x, w], {}), 0), np.dtype(np.float32), 6)


@settings(max_examples=12, deadline=None)
@given(
    st.integers(1, 9), st.integers(1, 20), st.sampled_from([16, 32, 48]),
    st.sampled_from([8, 16, 24]), st.integers(0, 1), st.integers(1, 24), st.integers(0, 3),
)  # fmt: skip
def test_any_fitting_tiling_gives_the_same_numbers(
    th: int, tw: int, tco: int, tci: int, db: int, cores: int, case: int
) -> None:
    xs, ws, attrs = [CASES[0], CASES[1], CASES[2], CASES[8]][case]
    x, w, b, bn = _data(xs, ws, np.float32, seed=3)
    inputs = [x, w, b, *bn]
    attrs = {**attrs, "relu": 1}
    want = _kernel(FUSED).run(MACHINE, inputs, attrs).outputs[0]
    t = ConvTiling(th, tw, tco, tci, db, cores)
    got = _kernel(FUSED).run(MACHINE, inputs, attrs, tiling=t)
    np.testing.assert_allclose(got.outputs[0], want, rtol=1e-5, atol=1e-4)
    assert got.stats.cores <= cores
    # The timing-only run of the same tiling has the same schedule.
    metas = [None if a is None else TensorMeta.of(a) for a in inputs]
    timing = _kernel(FUSED).run(MACHINE, metas, attrs, tiling=t, functional=False)
    assert timing.stats == got.stats


def test_too_big_tiling_is_refused_with_the_buffer_named() -> None:
    x, w, b, _ = _data((1, 64, 32, 32), (64, 64, 3, 3), np.float16)
    with pytest.raises(TilingError, match="L0C"):
        _kernel(CONV).run(MACHINE, [x, w, b], {}, tiling=ConvTiling(9, 32, 64, 16, 1, 24))
    with pytest.raises(TilingError, match="L0A"):
        _kernel(CONV).run(MACHINE, [x, w, b], {}, tiling=ConvTiling(9, 32, 16, 64, 1, 24))
    # Single buffering halves the footprint: the same tile then fits.
    _kernel(CONV).run(MACHINE, [x, w, b], {}, tiling=ConvTiling(9, 32, 16, 64, 0, 24))
    with pytest.raises(TilingError, match="double_buffer"):
        _kernel(CONV).run(MACHINE, [x, w, b], {}, tiling=ConvTiling(1, 30, 16, 16, 2, 24))


def test_default_tiling_fits_and_uses_the_cores() -> None:
    metas = [TensorMeta((1, 256, 56, 56), np.float16), TensorMeta((256, 256, 3, 3), np.float16)]
    k = _kernel(FUSED)
    t = k.default_tiling(metas, {"pads": [1, 1, 1, 1]}, MACHINE)
    k.check_tiling(metas, {"pads": [1, 1, 1, 1]}, t, MACHINE)
    run = k.run(MACHINE, metas, {"pads": [1, 1, 1, 1]}, functional=False)
    assert run.stats.cores == MACHINE.cube_cores
    assert run.stats.launches == 1
    # Implicit GEMM: the Cube did at least M*K*N / 4096 block-cycles over all cores.
    blocks = math.ceil(56 * 56 / 16) * (256 * 9 // 16) * (256 // 16)
    assert run.stats.pipe_busy["CUBE"] >= blocks


def test_bad_inputs_say_why() -> None:
    x, w, b, bn = _data((1, 4, 6, 6), (4, 4, 3, 3), np.float32)
    with pytest.raises(KernelError, match="all four or none"):
        _kernel(FUSED).run(MACHINE, [x, w, b, bn[0]], {})
    with pytest.raises(KernelError, match="group"):
        _kernel(CONV).run(MACHINE, [x, w], {"group": 3})
    with pytest.raises(KernelError, match="float16 or float32"):
        _kernel(CONV).run(MACHINE, [x.astype(np.float64), w.astype(np.float64)], {})
    with pytest.raises(KernelError, match="1-D and 2-D"):
        _kernel(CONV).run(MACHINE, [np.ones((1, 1, 2, 2, 2), np.float32)] * 2, {})


def test_timing_only_matches_functional_when_cores_straddle_channel_blocks() -> None:
    # Equal-sized blocks, but some cores cross from one channel block to the next and reload
    # weights and parameters there: their timing must not be shared with the others.
    x, w, b, bn = _data((1, 16, 9, 9), (48, 16, 1, 1), np.float16, seed=4)
    t = ConvTiling(1, 9, 16, 16, 1, 4)
    inputs = [x, w, b, *bn]
    f = _kernel(FUSED).run(MACHINE, inputs, {"relu": 1}, tiling=t)
    metas = [TensorMeta.of(a) for a in inputs]
    s = _kernel(FUSED).run(MACHINE, metas, {"relu": 1}, tiling=t, functional=False)
    assert s.stats == f.stats


@pytest.mark.parametrize(
    ("case", "tiling"),
    [
        (0, ConvTiling(5, 7, 16, 16, 1, 24, fold_taps=1)),  # Cin 3, 3x3: K 27 in steps of 16
        (8, ConvTiling(3, 12, 16, 64, 1, 5, fold_taps=1)),  # Cin 3, 7x7/2: K 147, tails
        (4, ConvTiling(2, 3, 16, 32, 0, 3, fold_taps=1)),  # Cin 7, 2x2, strides (2, 3)
        (5, ConvTiling(1, 4, 16, 48, 1, 2, fold_taps=1)),  # 1-D, Cin 5, 5 taps
    ],
)
def test_taps_folded_into_k_give_the_same_numbers(case: int, tiling: ConvTiling) -> None:
    xs, ws, attrs = CASES[case]
    x, w, b, bn = _data(xs, ws, np.float32, seed=5)
    inputs = [x, w, b, *bn]
    _agrees(inputs, {**attrs, "relu": 1}, ConvTiling(4, 8, 16, 16, 1, 24), tiling)


def _agrees(inputs: list[np.ndarray], attrs: dict[str, Any], base: ConvTiling,
            tiling: ConvTiling) -> None:  # fmt: skip
    """`tiling` computes what `base` does, and its timing-only run has the same schedule."""
    want = _kernel(FUSED).run(MACHINE, inputs, attrs, tiling=base)
    got = _kernel(FUSED).run(MACHINE, inputs, attrs, tiling=tiling)
    np.testing.assert_allclose(got.outputs[0], want.outputs[0], rtol=1e-5, atol=1e-4)
    metas = [TensorMeta.of(a) for a in inputs]
    timing = _kernel(FUSED).run(MACHINE, metas, attrs, tiling=tiling, functional=False)
    assert timing.stats == got.stats


def test_folded_taps_cut_the_cube_work_of_a_small_cin_stem() -> None:
    """7x7 stem, Cin 3: per tap the Cube pads 3 channels to 16 (49 K blocks per pixel block);
    folded, K = 147 takes 10; grouped convolutions cannot fold."""
    x, w, b, bn = _data((1, 3, 32, 32), (16, 3, 7, 7), np.float16, seed=6)
    inputs = [x, w, b, *bn]
    attrs = {"strides": [2, 2], "pads": [3, 3, 3, 3], "relu": 1}
    per_tap = _kernel(FUSED).run(MACHINE, inputs, attrs, tiling=ConvTiling(4, 16, 16, 16, 1, 4))
    folded = _kernel(FUSED).run(
        MACHINE, inputs, attrs, tiling=ConvTiling(4, 16, 16, 16, 1, 4, fold_taps=1)
    )
    assert per_tap.stats.pipe_busy["CUBE"] == 49 * folded.stats.pipe_busy["CUBE"] / 10
    np.testing.assert_allclose(
        folded.outputs[0].astype(np.float32), per_tap.outputs[0].astype(np.float32), atol=2e-2
    )
    xg, wg, bg, bng = _data(*CASES[1][:2], np.float32)
    with pytest.raises(TilingError, match="fold_taps needs group = 1"):
        _kernel(FUSED).run(MACHINE, [xg, wg, bg, *bng], CASES[1][2],
                           tiling=ConvTiling(1, 4, 16, 16, 1, 2, fold_taps=1))  # fmt: skip


@pytest.mark.parametrize(
    "tiling",
    [
        ConvTiling(7, 7, 16, 16, 1, 24, tile_n=2),  # batch 3: blocks of 2 images and a tail of 1
        ConvTiling(7, 7, 32, 32, 0, 2, tile_n=4),  # more images per block than the batch
        ConvTiling(7, 7, 16, 32, 1, 3, fold_taps=1, tile_n=2),
    ],
)
def test_blocks_of_several_images_give_the_same_numbers(tiling: ConvTiling) -> None:
    x, w, b, bn = _data((3, 12, 7, 7), (40, 12, 3, 3), np.float32, seed=8)
    inputs = [x, w, b, *bn]
    _agrees(inputs, {"pads": [1, 1, 1, 1], "relu": 1}, ConvTiling(7, 7, 16, 16, 1, 24), tiling)


def test_images_per_block_cut_the_weight_reads() -> None:
    """Weights are copied per block (several K chunks): 2 images per block read them half as
    often."""
    x, w, b, bn = _data((4, 64, 7, 7), (32, 64, 3, 3), np.float16, seed=9)
    inputs = [x, w, b, *bn]
    attrs = {"pads": [1, 1, 1, 1], "relu": 1}
    reads = {}
    for tn in (1, 2):
        t = ConvTiling(7, 7, 32, 32, 1, 4, tile_n=tn)
        reads[tn] = _kernel(FUSED).run(MACHINE, inputs, attrs, tiling=t).stats.gm_read
    # X is read the same either way (halo tiles of whole 7x7 maps); the weights and the five
    # parameter rows once per block: 4 blocks (one per core) against 2.
    per_block = w.nbytes + 5 * 32 * 2
    assert reads[1] - reads[2] == per_block * (4 - 2)


# -- activations in the epilogue (issue 8): on the Vector unit, priced there ------------------

# activation attributes -> the ONNX nodes after BN (reading t1), extra feeds
ACTIVATIONS: list[tuple[dict[str, Any], list[tuple[str, list[str], dict[str, Any]]], list[str]]]
ACTIVATIONS = [
    ({"activation": "Clip", "alpha": 0.0, "beta": 6.0}, [("Clip", ["t1", "lo", "hi"], {})],
     ["lo", "hi"]),
    ({"activation": "LeakyRelu", "alpha": 0.1}, [("LeakyRelu", ["t1"], {"alpha": 0.1})], []),
    ({"activation": "HardSigmoid", "alpha": 0.3, "beta": 0.4},
     [("HardSigmoid", ["t1"], {"alpha": 0.3, "beta": 0.4})], []),
    ({"activation": "HardSwish", "alpha": 1 / 6, "beta": 0.5}, [("HardSwish", ["t1"], {})], []),
    ({"activation": "Silu"}, [("Sigmoid", ["t1"], {}), ("Mul", ["t1", "t2"], {})], []),
    ({"activation": "Sigmoid"}, [("Sigmoid", ["t1"], {})], []),
    ({"activation": "Tanh"}, [("Tanh", ["t1"], {})], []),
    ({"activation": "Gelu"}, [("Gelu", ["t1"], {})], []),
    ({"activation": "GeluTanh"}, [("Gelu", ["t1"], {"approximate": "tanh"})], []),
]  # fmt: skip
ACT_IDS = [str(a[0]["activation"]) for a in ACTIVATIONS]


@pytest.mark.parametrize(("act", "tail", "extra"), ACTIVATIONS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("case", [0, 1, 7], ids=["tails-batch1", "depthwise-batch2", "odd-33ch"])
def test_each_activation_matches_the_chain(
    act: dict[str, Any], tail: list[Any], extra: list[str], dtype: type, case: int
) -> None:
    xs, ws, attrs = CASES[case]
    x, w, b, bn = _data(xs, ws, dtype, seed=6)
    w = (w / _scale(ws)).astype(dtype)  # pre-activations of order 1, where the curves bend
    chain: list[tuple[str, list[str], dict[str, Any]]] = [
        ("Conv", ["x", "w", "b"], attrs),
        ("BatchNormalization", ["t0", "s", "beta", "mean", "var"], {"epsilon": 1e-3}),
        *tail,
    ]
    feeds = dict(zip(["x", "w", "b", "s", "beta", "mean", "var"], [x, w, b, *bn], strict=True))
    feeds |= {"lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
    feeds = {k: v for k, v in feeds.items() if k in {"x", "w", "b", "s", "beta", "mean", "var",
                                                     *extra}}  # fmt: skip
    want = run_chain(chain, feeds, opset=20)
    full = {**attrs, "epsilon": 1e-3, "relu": 0, **act}
    got = _kernel(FUSED).run(MACHINE, [x, w, b, *bn], full)
    assert got.outputs[0].dtype == dtype
    assert_close(got.outputs[0], want, np.dtype(dtype), 2.0)
    # Timing-only runs the same schedule; the Vector unit did the activation.
    metas = [TensorMeta.of(a) for a in (x, w, b, *bn)]
    timing = _kernel(FUSED).run(MACHINE, metas, full, functional=False)
    assert timing.stats == got.stats
    assert got.stats.pipe_busy["VECTOR"] > 0


def test_vector_epilogue_charges_each_instruction_row() -> None:
    """VECTOR busy time is exactly the activation's rows (k * n + b per instruction, per UB
    chunk): the price comes from the target's table, nothing else."""
    from fuser.kernels.conv_bn_relu.epilogue import chunk_elements
    from fuser.patterns.conv_activation import VECTOR_OPS

    x, w, b, _ = _data((1, 16, 40, 40), (32, 16, 3, 3), np.float16, seed=7)
    metas = [TensorMeta.of(a) for a in (x, w, b)]
    attrs = {"pads": [1, 1, 1, 1], "activation": "Silu"}
    t = ConvTiling(4, 40, 32, 16, 1, 24)
    run = _kernel(FUSED).run(MACHINE, metas, attrs, tiling=t, functional=False)
    step = chunk_elements(np.dtype(np.float16))
    want = 0.0
    for _ in range(10):  # 10 blocks of 4 x 40 pixels x 32 channels
        n_left = 4 * 40 * 32
        while n_left:
            n = min(step, n_left)
            n_left -= n
            for op in VECTOR_OPS["Silu"]:
                k, c = MACHINE.vector_cost(op, np.dtype(np.float16))
                want += k * n + c
    assert run.stats.pipe_busy["VECTOR"] == pytest.approx(want)
    relu = _kernel(FUSED).run(MACHINE, metas, {**attrs, "activation": "", "relu": 1}, tiling=t,
                              functional=False)  # fmt: skip
    assert relu.stats.pipe_busy.get("VECTOR", 0.0) == 0.0  # Relu stays in FixPipe
    assert run.stats.cycles > relu.stats.cycles  # the extra pass is never free


@pytest.mark.parametrize("act", ["Silu", "Clip", "Gelu"])
@pytest.mark.parametrize(
    ("xs", "ws", "attrs"),
    [
        ((1, 32, 56, 56), (32, 1, 3, 3), {"group": 32, "pads": [1, 1, 1, 1]}),
        ((4, 96, 28, 28), (24, 96, 1, 1), {}),
        ((1, 3, 64, 64), (16, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ],
    ids=["depthwise", "pointwise-batch4", "stem"],
)
def test_cost_model_agrees_with_the_simulated_vector_epilogue(
    act: str, xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any]
) -> None:
    from fuser.kernels.search import search

    f16 = np.dtype(np.float16)
    metas = [TensorMeta(xs, f16), TensorMeta(ws, f16), TensorMeta((ws[0],), f16)]
    full = {**attrs, "activation": act, "alpha": 0.0, "beta": 6.0}
    result = search("fuser", "ConvBnRelu", metas, full, MACHINE)
    for priced in result.candidates[:4]:
        sim = _kernel(FUSED).run(MACHINE, metas, full, tiling=priced.tiling, functional=False)
        assert priced.cycles == pytest.approx(sim.stats.cycles, rel=0.12)


def test_conflicting_activation_attributes_are_refused() -> None:
    x, w, b, _ = _data((1, 4, 6, 6), (4, 4, 3, 3), np.float32)
    with pytest.raises(KernelError, match="relu=1 conflicts with activation 'Tanh'"):
        _kernel(FUSED).run(MACHINE, [x, w, b], {"relu": 1, "activation": "Tanh"})
    with pytest.raises(KernelError, match="unknown activation 'Mish'"):
        _kernel(FUSED).run(MACHINE, [x, w, b], {"activation": "Mish"})


# ConvTranspose (transposed=1): (X shape, W shape [Cin, Cout/group, *k], attrs). Strides 2
# and 3, output_padding, groups (depthwise), dilation, pads past the kernel span (a crop),
# 1-D, batch 1 and 2, odd channel counts.
TRANSPOSED: list[tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = [
    ((1, 7, 6, 5), (7, 5, 4, 4), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((2, 6, 5, 4), (6, 3, 3, 3), {"strides": [3, 2], "group": 2, "output_padding": [2, 1]}),
    ((1, 9, 7, 7), (9, 1, 4, 4), {"strides": [2, 2], "group": 9, "pads": [1, 2, 1, 0]}),
    (
        (1, 5, 4, 6),
        (5, 3, 3, 2),
        {"strides": [2, 3], "dilations": [2, 1], "pads": [0, 1, 1, 0], "output_padding": [1, 2]},
    ),
    (
        (1, 7, 9),
        (7, 5, 5),
        {"strides": [3], "dilations": [2], "pads": [3, 1], "output_padding": [1]},
    ),
    ((1, 3, 5, 5), (3, 2, 3, 3), {"pads": [3, 3, 2, 2]}),  # stride 1, pads past the span
]


def _transposed_data(
    xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any], dtype: type
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    cout = ws[1] * int(attrs.get("group", 1))
    x, w, _, _ = _data(xs, ws, dtype)
    _, _, b, bn = _data(xs, (cout, *ws[1:]), dtype, seed=1)
    return x, w, b, bn


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("xs", "ws", "attrs"), TRANSPOSED)
def test_transposed_conv_bn_relu_matches_the_conv_transpose_chain(
    xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any], dtype: type
) -> None:
    x, w, b, bn = _transposed_data(xs, ws, attrs, dtype)
    full = {**attrs, "transposed": 1, "relu": 1, "epsilon": 1e-5}
    got = _kernel(FUSED).run(MACHINE, [x, w, b, *bn], full).outputs[0]
    want = run_chain(
        [
            ("ConvTranspose", ["x", "w", "b"], attrs),
            ("BatchNormalization", ["t0", "s", "bb", "m", "v"], {"epsilon": 1e-5}),
            ("Relu", ["t1"], {}),
        ],
        {"x": x, "w": w, "b": b, "s": bn[0], "bb": bn[1], "m": bn[2], "v": bn[3]},
    )
    assert got.dtype == dtype
    taps = math.prod(ws[2:]) * xs[1] // int(attrs.get("group", 1))
    assert_close(got, want, np.dtype(dtype), math.sqrt(taps) * 2)


@pytest.mark.parametrize(
    "tiling",
    [ConvTiling(3, 4, 16, 16, 0, 3), ConvTiling(1, 16, 32, 32, 1, 7, 0, 2)],
    ids=["small-blocks", "images"],
)
def test_transposed_tilings_give_the_same_numbers(tiling: ConvTiling) -> None:
    xs, ws, attrs = TRANSPOSED[1]
    x, w, b, _ = _transposed_data(xs, ws, attrs, np.float32)
    full = {**attrs, "transposed": 1, "activation": "Silu"}
    got = _kernel(FUSED).run(MACHINE, [x, w, b], full, tiling=tiling).outputs[0]
    default = _kernel(FUSED).run(MACHINE, [x, w, b], full).outputs[0]
    np.testing.assert_allclose(got, default, rtol=1e-6, atol=1e-6)
    y = run_node("ConvTranspose", [x, w, b], attrs)
    assert_close(got, y / (1 + np.exp(-y)), np.dtype(np.float32), _scale(ws))


def test_transposed_prices_the_zeros_as_the_equivalent_convolution() -> None:
    """A ConvTranspose (64 -> 32, 4x4, stride 2, pads 1) costs the Cube exactly what the
    convolution over its zero-inserted input does: the zeros are multiplied, never skipped;
    its input DMA writes the zeros too, while GM holds (and HBM reads) only the real pixels."""
    f16 = np.dtype(np.float16)
    xs, ws = (1, 64, 28, 28), (64, 32, 4, 4)
    attrs = {"strides": [2, 2], "pads": [1, 1, 1, 1], "transposed": 1, "relu": 1}
    metas = [TensorMeta(xs, f16), TensorMeta(ws, f16), TensorMeta((32,), f16)]
    # The equivalent Conv: input 55 x 55 (27 zero rows/cols inserted), pads 4 - 1 - 1 = 2.
    eq_metas = [TensorMeta((1, 64, 55, 55), f16), TensorMeta((32, 64, 4, 4), f16), metas[2]]
    eq_attrs = {"pads": [2, 2, 2, 2], "relu": 1}
    t = ConvTiling(4, 14, 32, 64, 1, 8)
    run = _kernel(FUSED).run(MACHINE, metas, attrs, tiling=t, functional=False)
    eq = _kernel(FUSED).run(MACHINE, eq_metas, eq_attrs, tiling=t, functional=False)
    assert run.outputs == ()
    assert run.stats.pipe_busy["CUBE"] == pytest.approx(eq.stats.pipe_busy["CUBE"])
    assert run.stats.pipe_busy["MTE2"] == pytest.approx(eq.stats.pipe_busy["MTE2"])
    assert run.stats.hbm_bytes < eq.stats.hbm_bytes  # X is read at its real size
    assert run.stats.cycles >= eq.stats.cycles * 0.99


@pytest.mark.parametrize("act", ["", "Silu"])
@pytest.mark.parametrize(
    ("xs", "ws", "attrs"),
    [
        ((1, 64, 56, 56), (64, 32, 4, 4), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
        (
            (2, 24, 15, 15),
            (24, 1, 3, 3),
            {"strides": [2, 2], "group": 24, "output_padding": [1, 1]},
        ),
    ],
    ids=["decoder-64to32", "depthwise-batch2"],
)
def test_cost_model_agrees_with_the_simulated_transposed_kernel(
    act: str, xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any]
) -> None:
    from fuser.kernels.search import search

    f16 = np.dtype(np.float16)
    cout = ws[1] * int(attrs.get("group", 1))
    metas = [TensorMeta(xs, f16), TensorMeta(ws, f16), TensorMeta((cout,), f16)]
    full = {**attrs, "transposed": 1, "activation": act, "relu": 0 if act else 1}
    result = search("fuser", "ConvBnRelu", metas, full, MACHINE)
    for priced in result.candidates[:4]:
        sim = _kernel(FUSED).run(MACHINE, metas, full, tiling=priced.tiling, functional=False)
        # 15%, not the 12% above: at the decoder shape the analytical conv model is 13%
        # pessimistic for the plain Conv over the same (zero-inserted) geometry too.
        assert priced.cycles == pytest.approx(sim.stats.cycles, rel=0.15)
        assert priced.cycles >= sim.stats.cycles * 0.88


def test_transposed_refuses_what_it_does_not_resolve() -> None:
    x, w, b, _ = _transposed_data((1, 3, 4, 4), (3, 2, 3, 3), {}, np.float32)
    for extra, why in (
        ({"auto_pad": "SAME_UPPER"}, "transposed with auto_pad='SAME_UPPER'"),
        ({"output_shape": [9, 9]}, "transposed with output_shape"),
    ):
        with pytest.raises(KernelError, match=why):
            _kernel(FUSED).run(MACHINE, [x, w, b], {"transposed": 1, "relu": 1, **extra})


@pytest.mark.parametrize(("xs", "ws", "attrs"), TRANSPOSED)
def test_onnx_conv_transpose_kernel_matches_onnxruntime(
    xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any]
) -> None:
    """The unfused ConvTranspose gets the same program (so the fused row compares against a
    priced kernel, not a guess)."""
    kernel = _kernel(registry.get_kernel("", "ConvTranspose"))
    x, w, b, _ = _transposed_data(xs, ws, attrs, np.float32)
    got = kernel.run(MACHINE, [x, w, b], attrs).outputs[0]
    want = run_node("ConvTranspose", [x, w, b], attrs)
    assert_close(got, want, np.dtype(np.float32), _scale(ws) * 2)
    no_bias = kernel.run(MACHINE, [x, w], attrs).outputs[0]
    assert_close(no_bias, run_node("ConvTranspose", [x, w], attrs), np.dtype(np.float32), 4)
