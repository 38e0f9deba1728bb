"""The real Llama-4 router fixtures, fused and then broken at the dense node, are caught by
`validate` and the node is named: another fill, another k, the float32 values of a 16-bit
router, the dense row dropped. (The mutation harness's families do not apply to the dense node:
it has no weight or bias, no epsilon in use, and its `attribute` family skips topk_softmax
order; these are the hand-made mutants.)"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from fuser.api import fuse, validate
from fuser.modelio import load_model
from fuser.mutants import mutants

DATA = Path(__file__).parent.parent / "data" / "exported"


def _fused(name: str) -> tuple[onnx.ModelProto, onnx.ModelProto, onnx.NodeProto]:
    original = onnx.load(str(DATA / f"{name}.onnx"))
    fused = fuse(original, cache=False).model
    (node,) = [n for n in fused.graph.node if n.op_type == "SoftmaxTopK"]
    return original, fused, node


def _set(node: onnx.NodeProto, name: str, value: object) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend([*kept, onnx.helper.make_attribute(name, value)])


@pytest.mark.parametrize(
    ("name", "attribute", "value"),
    [
        ("llama4-router-ts14", "fill", 0.0),  # sigmoid(0) = 0.5 where no expert was chosen
        ("llama4-router-ts14", "k", 2),
        ("llama4-router-dynamo18", "k", 1),
        ("llama4-router-fp16-dynamo18", "fill", -3.0),
    ],
)
def test_a_changed_dense_node_is_caught_and_named(name: str, attribute: str, value: object) -> None:
    original, fused, node = _fused(name)
    assert validate(original, fused, kernel="reference", runs=1).ok  # the fusion itself is fine
    _set(node, attribute, value)
    checked = validate(original, fused, kernel="reference", runs=2)
    assert not checked.ok
    assert {f.node for f in checked.failures if f.where == "node"} == {node.name}


def test_the_dense_row_dropped_is_caught() -> None:
    """dense 1 -> 0: k sigmoid values instead of the row of experts, a shape the Transpose
    and the original disagree on."""
    original, fused, node = _fused("llama4-router-dynamo18")
    _set(node, "dense", 0)
    assert not validate(original, fused, kernel="reference", runs=1).ok


def test_the_harness_makes_no_mutant_of_the_dense_node() -> None:
    """What the docstring says: no family applies (so these tests are the dense node's)."""
    _, fused, _ = _fused("llama4-router-ts14")
    assert list(mutants(load_model(fused))) == []
