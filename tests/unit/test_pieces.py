"""onnx's checker and shape inference a piece at a time (`fuser.pieces`) see what the whole-graph
tools see: the same types, in the same order, and the same first error, on models cut into
pieces of a few nodes (the module's sizes made small here)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.models.synthetic import cnn_graph, transformer_graph
from onnx import TensorProto, helper, numpy_helper

from fuser import check_infer, pieces
from fuser.checkview import checker_view
from fuser.errors import FusionError, ModelLoadError
from fuser.modelio import load_model


@pytest.fixture(autouse=True)
def _small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pieces, "PIECE_NODES", 3)
    monkeypatch.setattr(pieces, "MIN_NODES", 6)


def _run(
    model: onnx.ModelProto, whole: bool, monkeypatch: pytest.MonkeyPatch, as_read: bool = False
) -> object:
    """check_and_infer's types as an ordered list, or the error's message."""
    with monkeypatch.context() as patch:
        if whole:
            patch.setattr(check_infer, "plan", lambda *args: None)
        else:  # the pieces route must be the one taken
            real = pieces.plan
            taken = []
            patch.setattr(check_infer, "plan", lambda *a: taken.append(real(*a)) or taken[-1])
        try:
            checked = check_infer.check_and_infer(load_model(model), as_read=as_read)
        except ModelLoadError as exc:
            result: object = str(exc)
        else:
            assert checked is not None
            table = checked[0][""]
            result = [(name, table[name]) for name in table]
        if not whole:
            assert taken and taken[0] is not None
    return result


def _same(model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch) -> object:
    whole = _run(model, True, monkeypatch)
    assert _run(model, False, monkeypatch) == whole
    return whole


def _chain(n: int = 10, dims: list[int | str] | None = None) -> onnx.ModelProto:
    """x -> Relu -> Relu ... (n nodes) -> y."""
    dims = dims or [2, 3]
    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"], name=f"r{i}") for i in range(n)]
    nodes[0].input[0] = "x"
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    "model",
    [
        cnn_graph(30, batch=1, channels=3),
        transformer_graph(30, batch="b", seq=5),
        _chain(11, ["n", 7]),
    ],
    ids=["cnn", "transformer-symbolic", "chain"],
)
def test_the_types_are_the_whole_graphs(model, monkeypatch):
    types = _same(model, monkeypatch)
    assert isinstance(types, list) and len(types) > 10


def _nonzero_chain() -> onnx.ModelProto:
    """NonZero after NonZero: each makes an unknown dim, which inference names unk__N; the
    model's own value info already holds unk__1 (inference skips it)."""
    nodes = []
    value = "x"
    for i in range(8):
        nodes.append(helper.make_node("NonZero", [value], [f"nz{i}"]))
        nodes.append(helper.make_node("Cast", [f"nz{i}"], [f"c{i}"], to=TensorProto.FLOAT))
        value = f"c{i}"
    nodes.append(helper.make_node("Relu", [value], ["y"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, None])],
        value_info=[helper.make_tensor_value_info("c3", TensorProto.FLOAT, [2, "unk__1"])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_unknown_dims_get_the_whole_graphs_names(monkeypatch):
    types = dict(_same(_nonzero_chain(), monkeypatch))  # type: ignore[arg-type]
    names = [types[f"nz{i}"].shape[1] for i in range(8)]
    assert len(set(names)) == 8 and "unk__1" not in names[:3]
    assert types["c3"].shape == (2, "unk__1")


def _random_unknowns(seed: int) -> onnx.ModelProto:
    """A seeded random graph of ops that make unknown dims (NonZero, Concat of unequal dims,
    Add of two named dims) and ops that pass them on, whose own inputs, value infos and
    outputs already name some dims unk__N (with gaps, out of order, one with a leading zero)."""
    rng = np.random.default_rng(seed)
    taken = [f"unk__{n}" for n in rng.choice(12, size=4, replace=False)] + ["unk__03", "n"]
    inputs, values, nodes, infos = [], [], [], []
    for i in range(3):
        dims = [str(rng.choice(taken)), int(rng.integers(1, 4))]
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, dims))
        values.append(f"x{i}")
    for i in range(int(rng.integers(12, 30))):
        a, b = (str(rng.choice(values)) for _ in range(2))
        kind = int(rng.integers(4))
        if kind == 0:  # [2, unknown]: a new name
            nodes.append(helper.make_node("NonZero", [a], [f"z{i}"]))
            nodes.append(helper.make_node("Cast", [f"z{i}"], [f"v{i}"], to=TensorProto.FLOAT))
        elif kind == 1:  # rank 2 again, first dims added up
            nodes.append(helper.make_node("Flatten", [a], [f"fa{i}"]))
            nodes.append(helper.make_node("Flatten", [b], [f"fb{i}"]))
            nodes.append(helper.make_node("Concat", [f"fa{i}", f"fb{i}"], [f"v{i}"], axis=1))
        elif kind == 2:
            nodes.append(helper.make_node("Transpose", [a], [f"v{i}"]))
        else:
            nodes.append(helper.make_node("Relu", [a], [f"v{i}"]))
        values.append(f"v{i}")
        if rng.random() < 0.15:  # a value info of the model's own, partly named
            infos.append(helper.make_tensor_value_info(f"v{i}", TensorProto.FLOAT, None))
    outputs = [helper.make_tensor_value_info(values[-1], TensorProto.FLOAT, [None, None])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, value_info=infos)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("size", [1, 2, 5])
def test_random_unknown_dims_get_the_whole_graphs_names(seed, size, monkeypatch):
    """Each piece's inference names its unknown dims on its own; renumbered, they are the
    whole graph's names, whatever the names the model took already."""
    monkeypatch.setattr(pieces, "PIECE_NODES", size)
    monkeypatch.setattr(pieces, "MIN_NODES", 2)
    types = _same(_random_unknowns(seed), monkeypatch)
    assert isinstance(types, list)
    named = {d for _, t in types if t.shape for d in t.shape if isinstance(d, str)}
    assert any(d.startswith("unk__") for d in named)


def test_a_constant_of_an_earlier_piece_still_shapes_a_reshape(monkeypatch):
    shape = helper.make_tensor("s", TensorProto.INT64, [2], [3, 2])
    model = _chain(8)
    model.graph.node.insert(0, helper.make_node("Constant", [], ["shape"], value=shape))
    model.graph.node.append(helper.make_node("Reshape", ["y", "shape"], ["z"]))
    model.graph.node.append(helper.make_node("Reshape", ["v3", "k"], ["w"]))
    model.graph.initializer.append(numpy_helper.from_array(np.array([6], np.int64), "k"))
    types = dict(_same(model, monkeypatch))  # type: ignore[arg-type]
    assert types["z"].shape == (3, 2) and types["w"].shape == (6,)


def _broken(kind: str) -> onnx.ModelProto:
    model = _chain(12)
    nodes = model.graph.node
    if kind == "duplicate producer across pieces":
        nodes[9].output[0] = "v2"
    elif kind == "read before its definition across pieces":
        nodes[1].input[0] = "v10"
    elif kind == "undefined input":
        nodes[7].input[0] = "nowhere"
    elif kind == "bad attribute in the last piece":
        nodes[11].attribute.append(helper.make_attribute("alpha", 1.0))
    elif kind == "output redefines a graph input":
        nodes[8].output[0] = "x"
    elif kind == "two errors: a node spec, then a duplicate":
        nodes[4].attribute.append(helper.make_attribute("alpha", 1.0))
        nodes[10].output[0] = "v3"
    elif kind == "duplicate initializer, and a bad node":
        model.graph.initializer.extend(
            [numpy_helper.from_array(np.ones(2, np.float32), "w") for _ in range(2)]
        )
        nodes[1].attribute.append(helper.make_attribute("alpha", 1.0))
    return model


BROKEN = [
    "duplicate producer across pieces",
    "read before its definition across pieces",
    "undefined input",
    "bad attribute in the last piece",
    "output redefines a graph input",
    "two errors: a node spec, then a duplicate",
    "duplicate initializer, and a bad node",
]


@pytest.mark.parametrize("kind", BROKEN)
def test_a_broken_model_gets_the_whole_graphs_message(kind, monkeypatch):
    message = _same(_broken(kind), monkeypatch)
    assert isinstance(message, str) and "invalid ONNX model" in message


@pytest.mark.parametrize("kind", BROKEN)
def test_the_output_check_in_pieces_says_what_the_whole_check_says(kind, monkeypatch):
    def verified(whole: bool) -> str:
        with monkeypatch.context() as patch:
            if whole:
                patch.setattr(check_infer, "plan", lambda *args, **kwargs: None)
            with pytest.raises(FusionError) as caught:
                check_infer.verify(_broken(kind), "m.onnx")
        return str(caught.value)

    assert verified(False) == verified(True)


def test_an_external_initializer_is_seen_as_the_whole_graph_sees_it(tmp_path, monkeypatch):
    model = _chain(9)
    weight = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    model.graph.initializer.append(weight)
    model.graph.node.append(helper.make_node("Add", ["y", "w"], ["z"]))
    model.graph.output[0].name = "z"
    path = tmp_path / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, size_threshold=0, location="m.data")
    assert load_model(path).external
    whole = _run(path, True, monkeypatch)  # type: ignore[arg-type]
    assert _run(path, False, monkeypatch) == whole  # type: ignore[arg-type]
    assert dict(whole)["z"].shape == (2, 3)  # type: ignore[arg-type]


def test_a_legacy_layernorm_goes_whole_and_is_typed(monkeypatch):
    # the view moves onnxruntime's LayerNormalization out of the ONNX domain, where a node may
    # hold a subgraph (`NodeScan.nested`): such a model takes the whole-graph route
    model = _chain(9, [2, 4])
    model.opset_import[0].version = 13  # LayerNormalization is onnxruntime's below 17
    scale = numpy_helper.from_array(np.ones(4, np.float32), "scale")
    model.graph.initializer.append(scale)
    model.graph.node.append(
        helper.make_node("LayerNormalization", ["y", "scale"], ["z", "mean"], axis=-1)
    )
    model.graph.output[0].name = "z"
    view = checker_view(model)
    assert pieces.plan(view.model, view.nested) is None
    types = dict(_run(model, True, monkeypatch))  # type: ignore[arg-type]
    assert types["z"].shape == (2, 4) and types["mean"].shape == (2, 1)


def test_small_or_nested_graphs_go_whole():
    small = _chain(5)
    assert pieces.plan(small, nested=False) is None
    assert pieces.plan(_chain(9), nested=True) is None
    assert pieces.plan(_chain(9), nested=False) is not None
    passthrough = _chain(9)
    passthrough.graph.output.append(passthrough.graph.input[0])  # an output that is an input
    assert pieces.plan(passthrough, nested=False) is None


def test_a_value_of_unknown_rank_crossing_pieces_is_declared_for_the_checker_only(monkeypatch):
    # Squeeze (no axes) of NonZero's [2, unknown]: inference cannot tell the rank; the next
    # piece reads it (the checker wants a shape of a main graph's input, inference none)
    model = _chain(10)
    nodes = model.graph.node
    nodes[1].op_type, nodes[2].op_type = "NonZero", "Squeeze"
    nodes.insert(3, helper.make_node("Cast", ["v3"], ["v3f"], to=TensorProto.FLOAT))
    nodes[4].input[0] = "v3f"
    view = checker_view(model)
    steps = pieces.plan(view.model, view.nested)
    assert steps is not None and steps.steps[1].before == ["v3"]
    types = dict(_same(model, monkeypatch))  # type: ignore[arg-type]
    assert types["v3"].shape is None


def test_a_piece_refused_wrongly_is_overruled_by_the_whole_check(monkeypatch):
    model = _chain(10)
    whole = _run(model, True, monkeypatch)
    refused = []

    def refuse(*args, **kwargs):  # a piece that fails where the whole graph passes
        refused.append(1)
        raise pieces.PieceRefusedError("refused")

    monkeypatch.setattr(check_infer, "infer_pieces", refuse)
    monkeypatch.setattr(check_infer, "check_pieces", refuse)
    checked = check_infer.check_and_infer(load_model(model))
    assert checked is not None
    table = checked[0][""]
    assert [(n, table[n]) for n in table] == whole
    check_infer.verify(model, "m.onnx")  # passes: the whole check says so
    assert refused == [1, 1]


def test_value_infos_whose_fields_do_not_line_up_are_read_one_by_one():
    # merged, the names and types of value infos line up only where each has one of each
    typed = helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, "n"])
    untyped = onnx.ValueInfoProto(name="b")
    nameless = helper.make_tensor_value_info("", TensorProto.INT64, [3])
    raw = [v.SerializeToString() for v in (typed, untyped, nameless, typed)]
    merged = pieces.raw_types().values.FromString(b"".join(raw))
    names, types = pieces._values(merged, raw)
    assert names == ["a", "b", "", "a"]
    assert types == [
        typed.type.SerializeToString(),
        None,
        nameless.type.SerializeToString(),
        typed.type.SerializeToString(),
    ]
    both = raw[:1] + raw[3:]
    merged = pieces.raw_types().values.FromString(b"".join(both))
    assert pieces._values(merged, both) == (["a", "a"], [types[0], types[0]])


def test_constants_are_found_where_a_node_has_no_op_type(monkeypatch):
    # the op types of a piece's nodes line up with its nodes only where each has one
    shape = helper.make_tensor("s", TensorProto.INT64, [2], [3, 2])
    model = _chain(8)
    model.graph.node.insert(1, helper.make_node("Constant", [], ["shape"], value=shape))
    model.graph.node.append(helper.make_node("Reshape", ["y", "shape"], ["z"]))
    steps = pieces.plan(model, nested=False)
    assert steps is not None and steps.steps[0].constants == [1]
    model.graph.node[0].ClearField("op_type")
    steps = pieces.plan(model, nested=False)
    assert steps is not None and steps.steps[0].constants == [1]


def test_the_checker_alone_takes_pieces_half_as_large(monkeypatch):
    # PIECE_NODES 3, MIN_NODES 6 here: pieces of 1 node, from 3 nodes up, for the checker
    # alone (the output check); of 3 from 6 up for check and inference
    model = _chain(11)
    both, alone = pieces.plan(model, nested=False), pieces.plan(model, False, check_only=True)
    assert both is not None and alone is not None
    assert [(s.start, s.stop) for s in both.steps] == [(0, 3), (3, 6), (6, 9), (9, 11)]
    assert [(s.start, s.stop) for s in alone.steps] == [(k, k + 1) for k in range(11)]
    assert pieces.plan(_chain(4), nested=False) is None
    assert pieces.plan(_chain(4), nested=False, check_only=True) is not None
    assert pieces.plan(_chain(2), nested=False, check_only=True) is None


def test_the_output_check_takes_the_checkers_pieces(monkeypatch):
    asked = []
    real = pieces.plan

    def spy(model, nested, check_only=False):
        asked.append(check_only)
        return real(model, nested, check_only)

    monkeypatch.setattr(check_infer, "plan", spy)
    check_infer.verify(_chain(4), "m.onnx")
    assert asked == [True]
    check_infer.check_and_infer(load_model(_chain(11)))
    assert asked == [True, False]
