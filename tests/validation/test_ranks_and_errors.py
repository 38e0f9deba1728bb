"""Multi-rank models with or without a declared gathered value; only fuser's errors escape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from fuser.models import get_example
from onnx import numpy_helper

from fuser.api import validate
from fuser.errors import FuserError, ValidationInputError
from fuser.testing import fuse_all


def _without_value_info(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.value_info[:]
    return copy


@pytest.mark.parametrize("declared", [True, False])
def test_allgather_models_run_whether_or_not_value_info_declares_the_gathered_value(
    declared: bool,
) -> None:
    original = get_example("tp-mlp")
    if not declared:
        original = _without_value_info(original)
        assert not original.graph.value_info
    result = fuse_all(original)
    assert any(n.op_type == "AllGatherMatMul" for n in result.model.graph.node)
    checked = validate(original, result, kernel="reference", runs=2)
    assert checked.ok and checked.ranks == 2
    assert {c.mode for c in checked.nodes} == {"model", "isolated"}
    # and a broken gathering node is caught on every rank it runs on
    node = next(n for n in result.model.graph.node if n.op_type == "AllGatherMatMul")
    w = next(t for t in result.model.graph.initializer if t.name == node.input[1])
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * np.float32(1.02), w.name))
    broken = validate(original, result.model, kernel="reference", runs=1)
    assert not broken.ok and broken.failures[0].node == node.name


def test_wrong_input_shape_is_a_fuser_error_never_onnxruntimes() -> None:
    original = get_example("cnn-edge")
    result = fuse_all(original)
    name = original.graph.input[0].name
    with pytest.raises(ValidationInputError, match=f"--input {name}: shape"):
        validate(original, result, inputs={name: np.ones((1, 2, 3, 4), np.float32)})
    bert = get_example("bert")
    ids = next(
        v for v in bert.graph.input if v.type.tensor_type.elem_type == onnx.TensorProto.INT64
    )
    shape = [d.dim_value or 3 for d in ids.type.tensor_type.shape.dim]
    with pytest.raises(ValidationInputError, match=f"--input {ids.name}: dtype float32 given"):
        validate(bert, bert, inputs={ids.name: np.ones(shape, np.float32)})


def test_models_that_do_not_belong_together_are_refused_in_one_line() -> None:
    with pytest.raises(FuserError, match=r"lacks input|takes input|lacks output") as info:
        validate(get_example("cnn-edge"), fuse_all(get_example("bert")), kernel="reference")
    assert "\n" not in str(info.value)


def _fuser(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fuser.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_prints_one_line_and_exits_2_on_a_wrong_input(tmp_path: Path) -> None:
    original = get_example("cnn-edge")
    onnx.save(original, tmp_path / "m.onnx")
    fuse_all(original).save(tmp_path / "f.onnx")
    np.save(tmp_path / "x.npy", np.ones((2, 2), np.float32))
    name = original.graph.input[0].name
    done = _fuser(
        "validate", str(tmp_path / "m.onnx"), str(tmp_path / "f.onnx"),
        "--input", f"{name}={tmp_path / 'x.npy'}", "--kernel", "reference",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "rank 2 given" in done.stderr
    assert "Traceback" not in done.stderr


def test_cli_names_the_broken_node_and_exits_1(tmp_path: Path) -> None:
    original = get_example("resnet")
    onnx.save(original, tmp_path / "m.onnx")
    result = fuse_all(original)
    node = next(n for n in result.model.graph.node if n.domain == "fuser")
    w = next(t for t in result.model.graph.initializer if t.name == node.input[1])
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * np.float32(-3), w.name))
    result.save(tmp_path / "f.onnx")
    done = _fuser(
        "validate", str(tmp_path / "m.onnx"), str(tmp_path / "f.onnx"), "--runs", "1",
        "--kernel", "reference", "--dim-size", "1",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert f"mismatch: fused node '{node.name}' (ConvBnRelu, pattern conv_bn_relu" in done.stdout


def test_fuse_validate_takes_the_validation_flags(tmp_path: Path) -> None:
    import json

    original = get_example("cnn-edge")
    onnx.save(original, tmp_path / "m.onnx")
    value = original.graph.input[0]
    shape = [d.dim_value or 2 for d in value.type.tensor_type.shape.dim]
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    done = _fuser(
        "fuse", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "f.onnx"), "--validate",
        "--input", f"{value.name}={tmp_path / 'x.npy'}", "--kernel", "reference", "--runs", "1",
        "--dim-size", "2", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    validation = json.loads(done.stdout)["validation"]
    assert validation["ok"] and validation["runs"] == 1 and validation["kernel"] == "reference"
    assert {c["mode"] for c in validation["nodes"]} == {"model", "isolated"}
