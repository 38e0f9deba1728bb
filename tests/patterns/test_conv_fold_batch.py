"""conv_bn_relu folds the raw-path Convs of a graph a batch at a time (one run of numpy calls
for many small layers). Each fold must give the bytes of the formula it replaced, computed here
independently in float64 for one chain: a = scale / sqrt(var + eps), W' = W * a,
B' = ((B or 0.0) - mean) * a + bias, cast once to W's dtype; whether the chain is folded in a
batch of others or alone, and whatever the graph did to a parameter after its fold was
computed ahead."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.patterns import conv_bn_relu
from onnx import TensorProto, helper, numpy_helper

from fuser.engine import opset_map
from fuser.graph import GraphIndex, TypeTable
from fuser.modelio import load_model
from fuser.pattern import Match
from fuser.testing import fuse_all

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

EPS = 1e-3


def _formula(values: dict[str, np.ndarray]) -> tuple[bytes, bytes] | None:
    """W', B' bytes as the fold computed them before batching, or None when not finite."""
    v = {k: a.astype(np.float64) for k, a in values.items()}
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        a = v["scale"] / np.sqrt(v["var"] + np.float64(np.float32(EPS)))
        w = v["W"] * a.reshape(-1, *([1] * (v["W"].ndim - 1)))
        b = (v.get("B", 0.0) - v["mean"]) * a + v["bias"]
        dtype = values["W"].dtype
        w_cast, b_cast = w.astype(dtype), b.astype(dtype)
    if not (np.isfinite(w_cast).all() and np.isfinite(b_cast).all()):
        return None
    return w_cast.tobytes(), b_cast.tobytes()


def _chain_values(
    rng: np.random.Generator,
    cout: int,
    cin_per_group: int,
    w_dtype: type,
    p_dtype: type,
    bias: bool,
    var_edge: str,
) -> dict[str, np.ndarray]:
    values = {
        "W": rng.standard_normal((cout, cin_per_group, 3, 3)).astype(w_dtype),
        "scale": rng.standard_normal(cout).astype(p_dtype),
        "bias": rng.standard_normal(cout).astype(p_dtype),
        "mean": rng.standard_normal(cout).astype(p_dtype),
        "var": rng.uniform(0.05, 3.0, cout).astype(p_dtype),
    }
    if bias:
        values["B"] = rng.standard_normal(cout).astype(p_dtype)
    eps = np.float32(EPS).astype(p_dtype)
    if var_edge == "zero":  # var = 0: a = scale / sqrt(eps), finite
        values["var"][0] = 0
    elif var_edge == "minus-eps":  # var + eps = 0 in float64 when var is -eps exactly
        values["var"][-1] = -eps
    elif var_edge == "negative":
        values["var"][cout // 2] = -2.0
    return values


# (cout, group, cin per group): plain, grouped, depthwise; 1 and 33 channels
SHAPES = [(1, 1, 3), (33, 1, 2), (6, 3, 2), (33, 33, 1), (4, 4, 1)]
DTYPES = [(np.float32, np.float32), (np.float16, np.float16), (np.float16, np.float32)]
EDGES = ["", "zero", "minus-eps", "negative"]


def _graph(chains: list[tuple[dict[str, np.ndarray], int]], x_dtype: int) -> onnx.ModelProto:
    """Each chain reads its own input: x_i -> Conv(group) -> BN -> Relu -> y_i."""
    nodes, inits, inputs, outputs = [], [], [], []
    for i, (values, group) in enumerate(chains):
        inits += [numpy_helper.from_array(v, f"c{i}.{k}") for k, v in values.items()]
        conv_in = [f"x{i}", f"c{i}.W", *([f"c{i}.B"] if "B" in values else [])]
        params = [f"c{i}.{p}" for p in ("scale", "bias", "mean", "var")]
        nodes += [
            helper.make_node(
                "Conv", conv_in, [f"c{i}.c"], name=f"c{i}.conv", pads=[1] * 4, group=group
            ),
            helper.make_node(
                "BatchNormalization", [f"c{i}.c", *params], [f"c{i}.n"], name=f"c{i}.bn",
                epsilon=EPS,
            ),
            helper.make_node("Relu", [f"c{i}.n"], [f"y{i}"], name=f"c{i}.relu"),
        ]  # fmt: skip
        cin = values["W"].shape[1] * group
        inputs.append(helper.make_tensor_value_info(f"x{i}", x_dtype, [1, cin, 5, 6]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", x_dtype, None))
    graph = helper.make_graph(nodes, "batch", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def _folds(model: onnx.ModelProto) -> tuple[dict[str, bytes], dict[str, list[str]]]:
    """The folded tensors' bytes by name, and per chain (its Conv's index) what the report
    says of it: the fusion's notes, or the reasons it was refused."""
    result = fuse_all(model)
    folded = {t.name: t.raw_data for t in result.model.graph.initializer if "_bn_folded" in t.name}
    said: dict[str, list[str]] = {}
    for f in result.report.fusions:
        said.setdefault(f.replaced[0].split(".")[0], []).extend(f.notes)
    for r in result.report.rejected:
        said.setdefault(r.nodes[0].split(".")[0], []).append(r.reason)
    return folded, said


@pytest.mark.parametrize(("w_dtype", "p_dtype"), DTYPES)
def test_every_fold_of_a_batch_is_the_formula(w_dtype: type, p_dtype: type) -> None:
    """Twenty chains, some sharing a shape (so folded in one batch), all shapes and variance
    edges: each fold equals the formula and the fold of its chain alone; a non-finite one
    is refused with the reason, in the batch as alone."""
    rng = np.random.default_rng(int(np.dtype(w_dtype).itemsize * 10 + np.dtype(p_dtype).itemsize))
    chains = []
    for i in range(20):
        cout, group, cin = SHAPES[i % len(SHAPES)]
        edge = EDGES[(i // len(SHAPES)) % len(EDGES)]
        values = _chain_values(rng, cout, cin, w_dtype, p_dtype, bias=i % 3 != 0, var_edge=edge)
        chains.append((values, group))
    x_dtype = helper.np_dtype_to_tensor_dtype(np.dtype(w_dtype))
    batch, batch_notes = _folds(_graph(chains, x_dtype))
    refused = 0
    for i, (values, group) in enumerate(chains):
        alone, alone_notes = _folds(_graph([(values, group)], x_dtype))
        alone_folds = [alone.get("c0.conv.W_bn_folded"), alone.get("c0.conv.B_bn_folded")]
        mine = [batch.get(f"c{i}.conv.W_bn_folded"), batch.get(f"c{i}.conv.B_bn_folded")]
        assert mine == alone_folds
        assert [n.replace(f"c{i}.", "c0.") for n in batch_notes[f"c{i}"]] == alone_notes["c0"]
        expected = _formula(values)
        if expected is None:
            refused += 1
            assert mine == [None, None]
            # BN kept as inputs saying why; or, with W and BN of different dtypes, refused
            said = " ".join(batch_notes[f"c{i}"])
            assert "non-finite" in said or "overflow" in said or "dtype differs" in said
        else:
            assert tuple(mine) == expected
    # the edges really are exercised: var = -eps and var < 0 are refused, var = 0 folds
    assert refused >= 4
    assert len(batch) == 2 * (len(chains) - refused)


def test_a_parameter_replaced_after_its_fold_was_computed_ahead_is_read_again() -> None:
    """The first Conv's match folds the next ones ahead; if the graph then holds another
    tensor under a BN parameter's name, that Conv's fold is of the tensor it holds now."""
    rng = np.random.default_rng(3)
    chains = [(_chain_values(rng, 4, 2, np.float32, np.float32, True, ""), 1) for _ in range(3)]
    loaded = load_model(_graph(chains, TensorProto.FLOAT))
    index = GraphIndex.build(loaded.model.graph, loaded, opset_map(loaded.model), TypeTable())
    convs = index.anchored([("", "Conv")])
    first = conv_bn_relu.PATTERN.match(index, convs[0])
    assert isinstance(first, Match)
    new_scale = rng.standard_normal(4).astype(np.float32)
    index.initializers["c2.scale"] = numpy_helper.from_array(new_scale, "c2.scale")
    found = [conv_bn_relu.PATTERN.match(index, c) for c in convs[1:]]
    assert all(isinstance(m, Match) for m in found)
    folds = [[t.raw_data for t in m.new_initializers] for m in found]  # type: ignore[union-attr]
    assert tuple(folds[0]) == _formula(chains[1][0])
    changed = dict(chains[2][0], scale=new_scale)
    assert tuple(folds[1]) == _formula(changed)
    assert tuple(folds[1]) != _formula(chains[2][0])


def test_no_fold_computed_ahead_outlives_the_fuse() -> None:
    """The folds computed ahead hold tensors of the fused model (a tensor held keeps its whole
    model's memory alive): a Conv whose match is refused after its fold was computed ahead
    (here: its Conv output is also a graph output, read elsewhere) leaves one behind during
    the pass, and none may be left once the fuse has returned."""
    import gc

    from fuser.patterns import _conv_fold

    rng = np.random.default_rng(7)
    chains = [(_chain_values(rng, 8, 3, np.float32, np.float32, True, "none"), 1) for _ in range(3)]
    model = _graph(chains, TensorProto.FLOAT)
    conv_out = next(n.output[0] for n in model.graph.node if n.op_type == "Conv")
    model.graph.output.append(helper.make_tensor_value_info(conv_out, TensorProto.FLOAT, None))
    result = fuse_all(model)
    assert len(result.report.fusions) == 2  # one chain refused, its fold unused
    gc.collect()
    assert _conv_fold.PREFETCH.held == 0


def test_the_pass_order_is_let_go_once_every_conv_is_covered() -> None:
    """The prefetch keeps the pass's Conv order (an entry per Conv) only until its last batch
    is folded: a large CNN's would otherwise be held through the rewrite's memory peak. The
    folds still go to their Convs, with the formula's bytes."""
    from fuser.patterns import _conv_fold

    rng = np.random.default_rng(11)
    chains = [(_chain_values(rng, 4, 2, np.float32, np.float32, True, ""), 1) for _ in range(3)]
    loaded = load_model(_graph(chains, TensorProto.FLOAT))
    index = GraphIndex.build(loaded.model.graph, loaded, opset_map(loaded.model), TypeTable())
    convs = index.anchored([("", "Conv")])
    found = [conv_bn_relu.PATTERN.match(index, c) for c in convs]
    assert _conv_fold.PREFETCH.ordered == 0  # three Convs: one batch, the last
    assert all(isinstance(m, Match) for m in found)
    for (values, _), m in zip(chains, found, strict=True):
        assert tuple(t.raw_data for t in m.new_initializers) == _formula(values)  # type: ignore[union-attr]


def test_a_bn_behind_identity_nodes_is_folded_ahead_as_a_bn_read_directly() -> None:
    """The prefetch finds each Conv's BN as the match does, through Identity nodes as well as
    the BN that is the Conv's one reader: after the first match every other Conv's fold is
    held, and each match gets the formula's bytes."""
    from fuser.patterns import _conv_fold

    rng = np.random.default_rng(13)
    chains = [
        (_chain_values(rng, 4, 2, np.float32, np.float32, i % 2 == 0, ""), 1) for i in range(4)
    ]
    model = _graph(chains, TensorProto.FLOAT)
    for i in (1, 3):  # c1 and c3: Conv -> Identity -> Identity -> BN
        bn = next(n for n in model.graph.node if n.name == f"c{i}.bn")
        bn.input[0] = f"c{i}.id2"
        at = [n.name for n in model.graph.node].index(f"c{i}.bn")
        model.graph.node.insert(at, helper.make_node("Identity", [f"c{i}.id1"], [f"c{i}.id2"]))
        model.graph.node.insert(at, helper.make_node("Identity", [f"c{i}.c"], [f"c{i}.id1"]))
    loaded = load_model(model)
    index = GraphIndex.build(loaded.model.graph, loaded, opset_map(loaded.model), TypeTable())
    convs = index.anchored([("", "Conv")])
    found = [conv_bn_relu.PATTERN.match(index, convs[0])]
    assert _conv_fold.PREFETCH.held == 3
    found += [conv_bn_relu.PATTERN.match(index, c) for c in convs[1:]]
    assert _conv_fold.PREFETCH.held == 0
    for (values, _), m in zip(chains, found, strict=True):
        assert isinstance(m, Match)
        assert tuple(t.raw_data for t in m.new_initializers) == _formula(values)
