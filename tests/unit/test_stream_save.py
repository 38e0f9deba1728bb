"""Saving with external data streams the model (no copy of it held): the files are byte for
byte those of copying the model and externalizing the copy, and the model is not changed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser import stream_save
from fuser.modelio import load_model, save_model


def _model() -> onnx.ModelProto:
    """Large and small initializers, a large Constant node, an If whose branch holds a large
    initializer, value_info, metadata and a doc string: every place a tensor can sit."""
    rng = np.random.default_rng(3)
    big = numpy_helper.from_array(rng.standard_normal((17, 23)).astype(np.float32), "big")
    small = numpy_helper.from_array(np.arange(3, dtype=np.int64), "small")
    const = helper.make_node(
        "Constant",
        [],
        ["c"],
        value=numpy_helper.from_array(rng.standard_normal((300,)).astype(np.float32)),
    )
    branch_w = numpy_helper.from_array(rng.standard_normal((301,)).astype(np.float32), "bw")
    then = helper.make_graph(
        [helper.make_node("Add", ["c", "bw"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [300])],
        initializer=[branch_w],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [300])],
    )
    nodes = [
        const,
        helper.make_node("MatMul", ["x", "big"], ["y"]),
        helper.make_node("If", ["cond"], ["z"], then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 17]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 23]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, None),
        ],
        initializer=[big, small],
        value_info=[helper.make_tensor_value_info("c", TensorProto.FLOAT, [300])],
        doc_string="doc",
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.metadata_props.add(key="k", value="v")
    return model


def _save(model: onnx.ModelProto, out: Path, source: object, stream: bool) -> list[bytes]:
    original = stream_save.streamable
    stream_save.streamable = (lambda m: original(m)) if stream else (lambda m: False)
    try:
        written = save_model(model, out, source=source, external=True)  # type: ignore[arg-type]
    finally:
        stream_save.streamable = original
    return [p.read_bytes() for p in written]


@pytest.mark.parametrize("from_external", [False, True])
def test_streamed_files_equal_the_copied_ones(tmp_path: Path, from_external: bool) -> None:
    model = _model()
    source = None
    if from_external:  # the input's tensors already live in a data file of its own
        first = tmp_path / "in" / "m.onnx"
        first.parent.mkdir()
        save_model(model, first, external=True)
        loaded = load_model(first)
        model, source = loaded.model, loaded
    before = model.SerializeToString()
    streamed = _save(model, tmp_path / "a.onnx", source, stream=True)
    assert model.SerializeToString() == before  # the model itself is untouched
    copied = _save(model, tmp_path / "b.onnx", source, stream=False)
    assert streamed[0].replace(b"a.onnx.data", b"b.onnx.data") == copied[0]
    assert streamed[1] == copied[1]
    assert len(streamed[1]) >= (17 * 23 + 300 + 301) * 4  # the three large tensors moved out
    back = onnx.load(str(tmp_path / "a.onnx"))
    np.testing.assert_array_equal(
        numpy_helper.to_array(back.graph.initializer[0]),
        numpy_helper.to_array(_model().graph.initializer[0]),
    )


def test_unknown_fields_take_the_copying_path() -> None:
    model = _model()
    model.ParseFromString(model.SerializeToString() + b"\xf8\x07\x01")  # field 127, unknown
    assert not stream_save.streamable(model)
    assert stream_save.streamable(_model())


def test_inline_save_is_the_models_own_serialization(tmp_path: Path) -> None:
    # every place a tensor can sit, functions and training-free extras: laid out a graph
    # element at a time, the bytes are `SerializeToString(deterministic=True)`'s
    model = _model()
    model.functions.add(name="f", domain="local", input=["a"], output=["a"])
    model.producer_name, model.doc_string = "fuser-test", "d" * 300
    before = model.SerializeToString(deterministic=True)
    written = save_model(model, tmp_path / "m.onnx", external=False)
    assert written == [tmp_path / "m.onnx"]
    assert written[0].read_bytes() == before
    assert model.SerializeToString(deterministic=True) == before  # the model is untouched


def test_the_size_limit_is_read_element_by_element(monkeypatch: pytest.MonkeyPatch) -> None:
    # the sum over the graph's elements bounds the serialization from above and by little
    from fuser import modelio

    model = _model()
    size = model.ByteSize()
    elements = sum(len(v) for fd, v in model.graph.ListFields() if fd.is_repeated)
    fields = len(model.ListFields()) + len(model.graph.ListFields())
    slack = 16 * (elements + fields) + len(str(model.metadata_props)) + 64
    monkeypatch.setattr(modelio, "PROTOBUF_LIMIT_BYTES", size - 1)
    assert modelio.too_large_for_one_protobuf(model)
    monkeypatch.setattr(modelio, "PROTOBUF_LIMIT_BYTES", size + slack)
    assert not modelio.too_large_for_one_protobuf(model)
    monkeypatch.setattr(modelio, "PROTOBUF_LIMIT_BYTES", 100)  # past it early: stops there
    assert modelio.too_large_for_one_protobuf(model)


@pytest.mark.parametrize("external", [False, True])
def test_without_a_scratch_file_the_bytes_are_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, external: bool
) -> None:
    # the graph is serialized once into a scratch file beside the output; where none can be
    # made, it is sized and serialized in two passes: the files are the same either way
    model = _model()
    with_scratch = save_model(model, tmp_path / "a" / "m.onnx", external=external)

    def refused(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stream_save.tempfile, "TemporaryFile", refused)
    without = save_model(model, tmp_path / "b" / "m.onnx", external=external)
    assert [p.read_bytes() for p in with_scratch] == [p.read_bytes() for p in without]
    assert with_scratch[0].read_bytes() == (
        without[0].read_bytes() if external else model.SerializeToString(deterministic=True)
    )


def test_the_scratch_file_is_in_the_outputs_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folders = []
    real = stream_save.tempfile.TemporaryFile

    def spy(*args: object, dir: Path | None = None, **kwargs: object) -> object:
        folders.append(dir)
        return real(*args, dir=dir, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(stream_save.tempfile, "TemporaryFile", spy)
    save_model(_model(), tmp_path / "out" / "m.onnx", external=False)
    assert folders == [tmp_path / "out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m.onnx"]


def _count(model: onnx.ModelProto) -> int:
    """too_large_for_one_protobuf's count of `model` (it passes the limit where this does)."""
    from fuser import modelio

    elements = [v for fd, value in model.graph.ListFields() if fd.is_repeated for v in value]
    counted = sum(modelio.KEY_BYTES + v.ByteSize() for v in elements if hasattr(v, "ByteSize"))
    return modelio.size_beside_elements(model) + counted


@pytest.mark.parametrize("scratch", [True, False])
@pytest.mark.parametrize("past", [True, False])
def test_an_inline_save_past_the_limit_goes_external_as_the_size_check_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scratch: bool, past: bool
) -> None:
    # save_model(external=None) counts the sizes as it writes inline (no pass of its own):
    # past protobuf's limit exactly where too_large_for_one_protobuf says so, it writes with
    # external data instead, the files those of deciding first
    from fuser import modelio

    model = _model()
    monkeypatch.setattr(modelio, "PROTOBUF_LIMIT_BYTES", _count(model) - past)
    assert modelio.too_large_for_one_protobuf(model) is past
    expected = save_model(model, tmp_path / "a" / "m.onnx", external=past)
    if not scratch:
        monkeypatch.setattr(stream_save.tempfile, "TemporaryFile", _no_scratch)
    checks = []
    real = modelio.too_large_for_one_protobuf
    monkeypatch.setattr(
        modelio, "too_large_for_one_protobuf", lambda m: [checks.append(m), real(m)][1]
    )
    written = save_model(model, tmp_path / "b" / "m.onnx", holds_external=False)
    assert checks == []  # no size pass of its own
    assert [p.name for p in written] == [p.name for p in expected]
    assert [p.read_bytes() for p in written] == [p.read_bytes() for p in expected]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(p.name for p in written)


def _no_scratch(*args: object, **kwargs: object) -> None:
    raise OSError(28, "No space left on device")


def _many(seed: int) -> onnx.ModelProto:
    """A few thousand nodes and initializers of seeded random sizes, small ones (most), some
    past 16 KB (a length prefix of three bytes) and some moved out by an external save, in a
    random order: runs of elements of every mix of sizes."""
    rng = np.random.default_rng(seed)
    tensors, nodes = [], []
    for i in range(int(rng.integers(2500, 3500))):
        size = int(rng.choice([1, 3, 40, 5000], p=[0.6, 0.2, 0.15, 0.05]))
        tensors.append(
            numpy_helper.from_array(rng.standard_normal(size).astype(np.float32), f"w{i}")
        )
        nodes.append(helper.make_node("Identity", [f"w{i}"], [f"y{i}"], name="n" * (i % 7)))
    graph = helper.make_graph(
        nodes,
        "many",
        [],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in (0, 1)],
        initializer=tensors,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("largest", [512, 5])
def test_runs_of_any_length_and_size_lay_out_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, largest: int
) -> None:
    # elements are serialized a run at a time (runs growing while the elements are small):
    # inline, the bytes are the model's own serialization; external, those of copying the
    # model and externalizing the copy, wherever the runs begin and end
    monkeypatch.setattr(stream_save, "RUN_ELEMENTS", largest)
    model = _many(seed)
    inline = save_model(model, tmp_path / "i" / "m.onnx", external=False)
    assert inline[0].read_bytes() == model.SerializeToString(deterministic=True)
    streamed = _save(model, tmp_path / "a.onnx", None, stream=True)
    copied = _save(model, tmp_path / "b.onnx", None, stream=False)
    assert streamed[0].replace(b"a.onnx.data", b"b.onnx.data") == copied[0]
    assert streamed[1] == copied[1]


def test_a_run_grows_from_one_element_up_to_its_bounds() -> None:
    rng = np.random.default_rng(5)
    count = 1
    for _ in range(200):
        elements = int(rng.integers(1, count + 1))
        size = elements * int(rng.choice([1, 100, 10_000, 10**7]))
        after = stream_save.next_run(count, elements, size)
        assert 1 <= after <= min(stream_save.RUN_ELEMENTS, 8 * count)
        each = size // elements
        assert after == 1 or after * each <= stream_save.RUN_BYTES  # about that many bytes
        count = after
    assert stream_save.next_run(1, 1, 10) == 8  # small elements: 8 times as many
    assert stream_save.next_run(512, 512, 512 * 10**7) == 1  # large ones: one at a time
