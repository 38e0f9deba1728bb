"""A DeepSeek-V3 router fused and then broken at its gating parameters is caught by
`fuser validate`: the selection bias moved for one expert, the renormalization's epsilon
changed (the `epsilon` mutant family), the routed scale changed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from typer.testing import CliRunner

from fuser.api import fuse, validate
from fuser.cli import app
from fuser.modelio import load_model
from fuser.mutants import mutants

FIXTURE = Path(__file__).parent.parent / "data" / "exported" / "deepseekv3-router-ts14.onnx"


def _fused() -> tuple[onnx.ModelProto, onnx.ModelProto, onnx.NodeProto]:
    original = onnx.load(str(FIXTURE))
    fused = fuse(original, cache=False).model
    (node,) = [n for n in fused.graph.node if n.op_type == "SoftmaxTopK"]
    return original, fused, node


def _set(node: onnx.NodeProto, name: str, value: float) -> None:
    (attr,) = [a for a in node.attribute if a.name == name]
    attr.f = value


def test_one_expert_bias_moved_is_caught_and_named() -> None:
    original, fused, node = _fused()
    bias = next(t for t in fused.graph.initializer if t.name == node.input[1])
    array = numpy_helper.to_array(bias).copy()
    array[int(np.argmin(array))] += 0.5  # the least-favoured expert now wins its group often
    bias.CopyFrom(numpy_helper.from_array(array, bias.name))
    checked = validate(original, fused, kernel="reference", runs=2)
    assert not checked.ok
    assert checked.failures[0].node == node.name
    # another expert chosen: the weights (paired with the indices) differ
    assert f"fused node '{node.name}'" in checked.failures[0].message()


@pytest.mark.parametrize(("name", "value"), [("scale", 2.6), ("epsilon", 1e-2)])
def test_scale_or_epsilon_changed_is_caught(name: str, value: float) -> None:
    original, fused, node = _fused()
    _set(node, name, value)
    checked = validate(original, fused, kernel="reference", runs=2)
    assert not checked.ok
    assert {f.node for f in checked.failures if f.where == "node"} == {node.name}


def test_the_epsilon_mutant_family_applies_and_is_caught() -> None:
    original, fused, node = _fused()
    (mutant,) = list(mutants(load_model(fused), ("epsilon",)))
    assert mutant.node == node.name
    assert not validate(original, mutant.model, kernel="reference", runs=2).ok


def test_cli_validate_fails_on_a_mutated_bias(tmp_path: Path) -> None:
    _, fused, node = _fused()
    bias = next(t for t in fused.graph.initializer if t.name == node.input[1])
    array = numpy_helper.to_array(bias)[::-1].copy()  # the biases of the experts reversed
    bias.CopyFrom(numpy_helper.from_array(array, bias.name))
    path = tmp_path / "broken.onnx"
    onnx.save(fused, str(path))
    result = CliRunner().invoke(app, ["validate", str(FIXTURE), str(path), "--runs", "2"])
    assert result.exit_code == 1, result.output
    assert node.name in result.output
