"""The input check and shape inference hand the model to onnx's C++ tools through a file that
has no name (so no serialization of it is held in memory while they run): the types, the
verdicts and the messages are the ones of handing over bytes, and no file is left anywhere."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx
import pytest
from fuser.models.synthetic import cnn_graph, transformer_graph
from onnx import TensorProto, helper

from fuser.check_infer import check_and_infer, serialized
from fuser.errors import ModelLoadError
from fuser.modelio import load_model

pytestmark = pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="Linux's O_TMPFILE")


def _types(model: onnx.ModelProto) -> dict[str, object]:
    checked = check_and_infer(load_model(model))
    assert checked is not None
    table = checked[0][""]
    return {name: table[name] for name in table}


@pytest.mark.parametrize(
    "model",
    [cnn_graph(150, batch=1, channels=3), transformer_graph(120, batch="b", seq=5)],
    ids=["cnn", "transformer-symbolic"],
)
def test_types_are_those_of_handing_over_bytes(model, monkeypatch):
    left = set(os.listdir(tempfile.gettempdir()))
    by_file = _types(model)
    assert set(os.listdir(tempfile.gettempdir())) <= left  # nothing named was made
    monkeypatch.delattr(os, "O_TMPFILE")  # the bytes route
    by_bytes = _types(model)
    assert by_file == by_bytes
    assert len(by_file) > 100  # every value typed, not an empty table on both sides


def test_the_serialized_file_holds_the_model_and_goes_away():
    model = transformer_graph(60)
    with serialized(model) as where:
        assert isinstance(where, str) and where.startswith("/proc/self/fd/")
        assert Path(where).read_bytes() == model.SerializeToString()
    assert not Path(where).exists()


def _bad() -> onnx.ModelProto:
    node = helper.make_node("NoSuchOp", ["x"], ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_invalid_input_gets_the_same_message(monkeypatch):
    with pytest.raises(ModelLoadError) as by_file:
        check_and_infer(load_model(_bad(), label="bad.onnx"))
    monkeypatch.delattr(os, "O_TMPFILE")
    with pytest.raises(ModelLoadError) as by_bytes:
        check_and_infer(load_model(_bad(), label="bad.onnx"))
    assert str(by_file.value) == str(by_bytes.value)
    assert str(by_file.value).startswith("bad.onnx: invalid ONNX model: ")
    assert "NoSuchOp" in str(by_file.value)


def test_the_inferred_model_is_not_read_back_whole(monkeypatch):
    # Only the inferred graph's value types are kept: reading the whole inferred file back
    # (its nodes and tensors as Python messages) was a second model's worth of memory.
    model = cnn_graph(150, batch=1, channels=3)
    expected = _types(model)

    loads: list[object] = []
    for name in ("load_model", "load"):
        monkeypatch.setattr(onnx, name, lambda *args, **kwargs: loads.append(args))
    assert _types(model) == expected
    assert loads == []  # (a failing load would be caught: the bytes route would type it all)
    assert len(expected) > 100
