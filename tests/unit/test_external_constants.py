"""Constant nodes whose tensor is external data (onnx's `convert_model_to_external_data(...,
convert_attribute=True)` moves node attributes' tensors out as well as initializers;
onnxruntime runs such a model): fuser checks, fuses, validates and writes them, reading each
file from the input's folder."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import convert_model_to_external_data

from fuser import api, check_infer
from fuser.checkview import checker_view, scan_nodes
from fuser.errors import ModelLoadError
from fuser.modelio import load_model

RNG = np.random.default_rng(7)


def _constant(name: str, array: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))


def _cnn_of_constants(cout: int = 5) -> onnx.ModelProto:
    """x * one -> Conv -> BatchNormalization -> Relu -> If(flag: + shift, else: * gain), every
    parameter a Constant node (`shift` inside the then branch), `gain` the else branch's
    initializer."""
    f32 = np.float32
    params = {
        "W": RNG.standard_normal((cout, 3, 3, 3)).astype(f32),
        "B": RNG.standard_normal(cout).astype(f32),
        "scale": RNG.uniform(0.5, 2.0, cout).astype(f32),
        "bias": RNG.standard_normal(cout).astype(f32),
        "mean": RNG.standard_normal(cout).astype(f32),
        "var": RNG.uniform(0.5, 2.0, cout).astype(f32),
    }
    nodes = [_constant(name, value) for name, value in params.items()]
    # A scalar too (its lifted input must keep its empty shape: no shape at all is refused).
    nodes.append(_constant("one", np.array(1.0, dtype=f32)))
    nodes.append(helper.make_node("Mul", ["x", "one"], ["x1"]))
    nodes += [
        helper.make_node("Conv", ["x1", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["b"], name="bn"
        ),
        helper.make_node("Relu", ["b"], ["r"], name="relu"),
    ]
    shape = [1, cout, 7, 7]
    then_graph = helper.make_graph(
        [
            _constant("shift", RNG.standard_normal((1, cout, 1, 1)).astype(f32)),
            helper.make_node("Add", ["r", "shift"], ["then_y"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("then_y", TensorProto.FLOAT, shape)],
    )
    gain = RNG.uniform(0.5, 2.0, (1, cout, 1, 1)).astype(f32)
    else_graph = helper.make_graph(  # a subgraph's initializer, external too
        [helper.make_node("Mul", ["r", "gain"], ["else_y"])],
        "else",
        [],
        [helper.make_tensor_value_info("else_y", TensorProto.FLOAT, shape)],
        initializer=[numpy_helper.from_array(gain, "gain")],
    )
    nodes.append(
        helper.make_node(
            "If", ["flag"], ["y"], name="branch", then_branch=then_graph, else_branch=else_graph
        )
    )
    graph = helper.make_graph(
        nodes,
        "constants",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 7, 7]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _save_external(model: onnx.ModelProto, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    convert_model_to_external_data(
        model, location="m.bin", size_threshold=0, convert_attribute=True
    )
    onnx.save_model(model, path)
    return path


def _external_constants(model: onnx.ModelProto) -> int:
    return len(scan_nodes(model).external)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _run(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, feeds)[0])


def test_the_exported_model_has_external_constants_in_both_graphs(tmp_path):
    # The fixture is what the tests below rely on: onnx moved the Constants' tensors out,
    # the If branch's included, and onnxruntime runs the file.
    path = _save_external(_cnn_of_constants(), tmp_path / "in")
    loaded = load_model(path)
    assert loaded.external
    assert _external_constants(loaded.model) == 9  # 7 main-graph Constants, the If twice
    branches = {a.name: a.g for a in loaded.model.graph.node[-1].attribute}
    assert branches["else_branch"].initializer[0].data_location == TensorProto.EXTERNAL
    x = RNG.standard_normal((1, 3, 7, 7)).astype(np.float32)
    assert _run(path, {"x": x, "flag": np.array(True)}).shape == (1, 5, 7, 7)


@pytest.mark.parametrize("as_read", [True, False])
def test_external_constants_are_checked_and_typed(tmp_path, as_read):
    path = _save_external(_cnn_of_constants(cout=3), tmp_path / "in")
    loaded = load_model(path)
    checked = check_infer.check_and_infer(loaded, as_read=as_read)
    assert checked is not None
    types, warnings = checked
    assert warnings == ()
    assert types[""]["W"].shape == (3, 3, 3, 3)  # a lifted Constant keeps its type
    assert types[""]["y"].shape == (1, 3, 7, 7)
    # The model itself is untouched: its Constants are still there, still external.
    assert _external_constants(loaded.model) == 9
    assert [n.op_type for n in loaded.model.graph.node].count("Constant") == 7
    assert types[""]["one"].shape == ()


def test_the_checker_view_holds_no_external_tensor_but_the_main_initializers(tmp_path):
    path = _save_external(_cnn_of_constants(), tmp_path / "in")
    loaded = load_model(path)
    view = checker_view(loaded.model, loaded).model
    assert _external_constants(view) == 0
    # The main graph's Constants became typed graph inputs; the branch's was read inline.
    assert {"W", "B", "scale", "bias", "mean", "var"} <= {v.name for v in view.graph.input}
    view_branches = {a.name: a.g for a in view.graph.node[-1].attribute}
    shift = view_branches["then_branch"].node[0].attribute[0].t
    gain = view_branches["else_branch"].initializer[0]
    for tensor in (shift, gain):  # read inline: in the view, with the file's values
        assert tensor.data_location == TensorProto.DEFAULT and not tensor.external_data
    full = onnx.load(path)  # onnx's own reading of the external data
    full_branches = {a.name: a.g for a in full.graph.node[-1].attribute}
    expected_shift = full_branches["then_branch"].node[0].attribute[0].t
    expected_gain = full_branches["else_branch"].initializer[0]
    for got, expected in ((shift, expected_shift), (gain, expected_gain)):
        assert np.array_equal(numpy_helper.to_array(got), numpy_helper.to_array(expected))


def test_a_custom_ops_external_tensor_is_read_inline(tmp_path):
    model = _cnn_of_constants()
    value = numpy_helper.from_array(np.arange(6, dtype=np.float32), "table")
    model.graph.node.insert(0, helper.make_node("Lookup", [], ["t"], table=value, domain="x.y"))
    model.opset_import.append(helper.make_opsetid("x.y", 1))
    path = _save_external(model, tmp_path / "in")
    loaded = load_model(path)
    view = checker_view(loaded.model, loaded).model
    assert _external_constants(view) == 0
    table = view.graph.node[0].attribute[0].t
    assert np.array_equal(numpy_helper.to_array(table), np.arange(6, dtype=np.float32))
    assert check_infer.check_and_infer(loaded) is not None


def test_external_constants_fuse_and_the_output_runs_in_stock_onnxruntime(tmp_path):
    path = _save_external(_cnn_of_constants(), tmp_path / "in")
    before = _digest(path.parent)
    out = tmp_path / "out" / "fused.onnx"
    out.parent.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "fuser.cli", "fuse", str(path), "-o", str(out), "--validate"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "fused nodes: 1 of 1 match" in done.stdout
    assert _digest(path.parent) == before  # the input and its data file never modified
    fused = onnx.load(out, load_external_data=False)
    assert [n.op_type for n in fused.graph.node if n.domain == "fuser"] == ["ConvBnRelu"]
    x = RNG.standard_normal((1, 3, 7, 7)).astype(np.float32)
    for flag in (True, False):
        feeds = {"x": x, "flag": np.array(flag)}
        np.testing.assert_allclose(_run(out, feeds), _run(path, feeds), rtol=1e-5, atol=1e-5)


def test_a_truncated_external_constant_is_a_one_line_error(tmp_path):
    path = _save_external(_cnn_of_constants(), tmp_path / "in")
    data = path.with_name("m.bin")
    data.write_bytes(data.read_bytes()[:-8])  # the branch's constant, last, loses its end
    with pytest.raises(ModelLoadError, match=r"external data of tensor 'shift' is truncated"):
        api.fuse(path)
