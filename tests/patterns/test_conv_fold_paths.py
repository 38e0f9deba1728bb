"""conv_bn_relu folds BN two ways: parameters held as raw initializers take the raw path (one
array for the four BN parameters, W' and B' computed into one buffer, cast and checked once),
anything else (here: the same values as Constant nodes) the general one. Both must give the same
bytes, and the same refusal with the same reason, for every dtype and shape, whether the BN
reads the Conv directly or through an Identity, alone or beside other chains."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.testing import fuse_all

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def _model(
    values: dict[str, np.ndarray],
    dtype: int,
    spatial: int,
    as_constants: bool,
    identity: bool = False,
) -> onnx.ModelProto:
    """x -> Conv(W[, B]) [-> Identity] -> BN -> Relu, with `values` as initializers or as
    Constant nodes."""
    names = ["W", *(["B"] if "B" in values else [])]
    nodes = []
    inits = []
    for name, array in values.items():
        tensor = numpy_helper.from_array(array, name)
        if as_constants:
            nodes.append(helper.make_node("Constant", [], [name], value=tensor))
        else:
            inits.append(tensor)
    pads = [1] * (2 * spatial)
    nodes += [
        helper.make_node(
            "Conv", ["x", *names], ["c0" if identity else "c"], name="conv", pads=pads
        ),
        *([helper.make_node("Identity", ["c0"], ["c"])] if identity else []),
        helper.make_node(
            "BatchNormalization",
            ["c", "scale", "bias", "mean", "var"],
            ["n"],
            name="bn",
            epsilon=1e-3,
        ),
        helper.make_node("Relu", ["n"], ["y"], name="relu"),
    ]
    x_shape = [1, values["W"].shape[1], *([5, 7][:spatial])]
    graph = helper.make_graph(
        nodes,
        "fold_paths",
        [helper.make_tensor_value_info("x", dtype, x_shape)],
        [helper.make_tensor_value_info("y", dtype, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def _fused(model: onnx.ModelProto) -> tuple[list[tuple[str, int, list[int], bytes]], list[str]]:
    """The folded initializers (name, type, dims, bytes) and the fusion's notes."""
    result = fuse_all(model)
    (record,) = result.report.fusions
    folded = [
        (t.name, t.data_type, list(t.dims), t.raw_data)
        for t in result.model.graph.initializer
        if t.name.endswith("_bn_folded")
    ]
    return folded, list(record.notes)


def _values(
    rng: np.random.Generator, np_dtype: type, cout: int, cin: int, spatial: int, bias: bool
) -> dict[str, np.ndarray]:
    values = {
        "W": rng.standard_normal((cout, cin, *([3] * spatial))),
        "scale": rng.standard_normal(cout),
        "bias": rng.standard_normal(cout),
        "mean": rng.standard_normal(cout),
        "var": rng.uniform(0.1, 2.0, cout),
    }
    if bias:
        values["B"] = rng.standard_normal(cout)
    return {k: v.astype(np_dtype) for k, v in values.items()}


CASES = [
    (dtype, cout, cin, spatial, bias)
    for dtype in (TensorProto.FLOAT16, TensorProto.FLOAT)  # ConvBnRelu takes no float64
    for cout, cin, spatial in ((1, 3, 2), (3, 1, 1), (8, 5, 2), (64, 8, 2))
    for bias in (False, True)
]


@pytest.mark.parametrize(("dtype", "cout", "cin", "spatial", "bias"), CASES)
def test_every_path_folds_to_the_same_bytes(
    dtype: int, cout: int, cin: int, spatial: int, bias: bool
) -> None:
    rng = np.random.default_rng(cout * 100 + cin * 10 + spatial + 7 * bias + dtype)
    values = _values(rng, helper.tensor_dtype_to_np_dtype(dtype), cout, cin, spatial, bias)
    raw, raw_notes = _fused(_model(values, dtype, spatial, as_constants=False))
    single, single_notes = _fused(_model(values, dtype, spatial, False, identity=True))
    general, general_notes = _fused(_model(values, dtype, spatial, as_constants=True))
    assert [name for name, *_ in raw] == ["conv.W_bn_folded", "conv.B_bn_folded"]
    assert raw == single == general
    assert raw_notes == single_notes == general_notes
    # and it is the fold: W' = W * a, B' = (B - mean) * a + bias in float64, cast once
    v = {k: a.astype(np.float64) for k, a in values.items()}
    a = v["scale"] / np.sqrt(v["var"] + np.float64(np.float32(1e-3)))
    w_new = (v["W"] * a.reshape(-1, *([1] * (spatial + 1)))).astype(values["W"].dtype)
    b_new = ((v.get("B", np.zeros(cout)) - v["mean"]) * a + v["bias"]).astype(values["W"].dtype)
    assert raw[0][3] == w_new.tobytes()
    assert raw[1][3] == b_new.tobytes()


@pytest.mark.parametrize(
    ("w_dtype", "p_dtype"),
    [(TensorProto.FLOAT, TensorProto.FLOAT16), (TensorProto.FLOAT16, TensorProto.FLOAT)],
)
def test_bn_parameters_of_another_dtype_fold_alike(w_dtype: int, p_dtype: int) -> None:
    """BN parameters of one dtype, W of another (BN's T1/T2 may differ from its input's T):
    the raw path converts the two runs into its one buffer, to the general path's bytes."""
    rng = np.random.default_rng(w_dtype * 10 + p_dtype)
    values = _values(rng, helper.tensor_dtype_to_np_dtype(p_dtype), 6, 3, 2, bias=False)
    values["W"] = values["W"].astype(helper.tensor_dtype_to_np_dtype(w_dtype))
    raw, raw_notes = _fused(_model(values, w_dtype, 2, as_constants=False))
    general, general_notes = _fused(_model(values, w_dtype, 2, as_constants=True))
    assert [name for name, *_ in raw] == ["conv.W_bn_folded", "conv.B_bn_folded"]
    assert raw == general
    assert raw_notes == general_notes
    assert raw[0][1] == raw[1][1] == w_dtype


def test_signed_zeros_fold_alike() -> None:
    """No Conv bias, a zero mean and a -0.0 BN bias: B' = (0 - 0) * a + -0.0 = +0.0 (the
    general path's zeros minus the mean), not -0.0 as negating the mean would give."""
    values = _values(np.random.default_rng(5), np.float32, 4, 2, 2, bias=False)
    values["mean"] = np.zeros(4, np.float32)
    values["bias"] = np.array([-0.0, 0.0, -0.0, 1.0], np.float32)
    raw, _ = _fused(_model(values, TensorProto.FLOAT, 2, as_constants=False))
    general, _ = _fused(_model(values, TensorProto.FLOAT, 2, as_constants=True))
    assert raw == general
    b = np.frombuffer(raw[1][3], np.float32)
    assert not np.signbit(b[:3]).any()


@pytest.mark.parametrize(
    ("dtype", "change", "reason"),
    [
        (TensorProto.FLOAT, {"var": -4.0}, "non-finite weights"),
        (TensorProto.FLOAT16, {"scale": 6e4, "var": 1e-4}, "overflow float16"),
    ],
)
def test_both_paths_refuse_alike(dtype: int, change: dict[str, float], reason: str) -> None:
    """One channel's fold fails: BN stays as inputs, with the same note on both paths."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    values = _values(np.random.default_rng(11), np_dtype, 3, 2, 2, bias=True)
    for name, value in change.items():
        values[name] = values[name].copy()
        values[name][1] = value
    raw, raw_notes = _fused(_model(values, dtype, 2, as_constants=False))
    single, single_notes = _fused(_model(values, dtype, 2, False, identity=True))
    general, general_notes = _fused(_model(values, dtype, 2, as_constants=True))
    assert raw == single == general == []
    assert raw_notes == single_notes == general_notes
    assert any(reason in note for note in raw_notes)


def test_chains_side_by_side_fold_each_as_alone() -> None:
    """Five same-shaped chains in one graph, one of them refused (negative variance): each
    gives what its chain alone gives on the general path."""
    rng = np.random.default_rng(23)
    chains = [_values(rng, np.float32, 4, 3, 2, bias=i % 2 == 0) for i in range(5)]
    chains[2]["var"] = chains[2]["var"].copy()
    chains[2]["var"][0] = -1.0
    nodes, inits, outputs = [], [], []
    for i, values in enumerate(chains):
        inits += [numpy_helper.from_array(v, f"c{i}.{k}") for k, v in values.items()]
        conv_inputs = ["x", f"c{i}.W", *([f"c{i}.B"] if "B" in values else [])]
        nodes += [
            helper.make_node("Conv", conv_inputs, [f"c{i}.c"], name=f"c{i}.conv", pads=[1] * 4),
            helper.make_node("BatchNormalization",
                             [f"c{i}.c", *(f"c{i}.{p}" for p in ("scale", "bias", "mean", "var"))],
                             [f"c{i}.y"], name=f"c{i}.bn", epsilon=1e-3),
        ]  # fmt: skip
        outputs.append(helper.make_tensor_value_info(f"c{i}.y", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5, 7])
    graph = helper.make_graph(nodes, "batch", [x], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = fuse_all(onnx.shape_inference.infer_shapes(model))
    folded = {t.name: t.raw_data for t in result.model.graph.initializer if "_bn_folded" in t.name}
    assert len(folded) == 8  # four folded chains, the refused one keeps BN as inputs
    for i, values in enumerate(chains):
        alone, notes = _fused(_model(values, TensorProto.FLOAT, 2, as_constants=True))
        mine = next(f for f in result.report.fusions if f.replaced[0] == f"c{i}.conv")
        assert [n for n in mine.notes if "BN" in n] == [n for n in notes if "BN" in n]
        if i == 2:
            assert alone == [] and any("non-finite" in n for n in mine.notes)
            assert not any(n.startswith("c2.") for n in folded)
            continue
        assert [folded[f"c{i}.conv.W_bn_folded"], folded[f"c{i}.conv.B_bn_folded"]] == [
            data for *_, data in alone
        ]
