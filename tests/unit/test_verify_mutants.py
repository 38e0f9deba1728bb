"""An output fuse made invalid is caught before anything is written: mutants of real fused
models (a fused node with a bad attribute, the `fuser` opset import missing, a duplicate output
name, a node reading a value no node makes, a broken function body) fail `verify` with the
checker's own words, and the unmutated models pass."""

from __future__ import annotations

from collections.abc import Callable

import onnx
import pytest
from fuser.models.synthetic import cnn_graph, transformer_graph
from onnx import helper

from fuser import api
from fuser.check_infer import verify
from fuser.errors import FusionError
from fuser.fusedop import DOMAIN


@pytest.fixture(scope="module", params=["cnn", "transformer"])
def fused(request: pytest.FixtureRequest) -> onnx.ModelProto:
    if request.param == "cnn":
        model = cnn_graph(200, batch=1, channels=5)
    else:
        model = transformer_graph(150, batch="b", seq=7)
    result = api.fuse(model, cache=False)
    assert result.report.fusions, "the mutants need fused nodes"
    return result.model


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _fuser_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == DOMAIN]


def test_the_fused_models_pass(fused):
    verify(fused, "m.onnx")


def _bad_attribute(model: onnx.ModelProto) -> str:
    node = _fuser_nodes(model)[-1]
    node.attribute.append(helper.make_attribute("no_such_attribute", 3))
    return "no_such_attribute"


def _no_fuser_import(model: onnx.ModelProto) -> str:
    kept = [o for o in model.opset_import if o.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return f"No opset import for domain '{DOMAIN}'"


def _duplicate_output(model: onnx.ModelProto) -> str:
    twin = model.graph.node.add()
    twin.CopyFrom(_fuser_nodes(model)[0])  # two fused nodes now make the same values
    twin.name += "_twin"
    return "single static assignment"


def _duplicate_of_unchanged_node(model: onnx.ModelProto) -> str:
    # a fused node's output named as an output of a node fuse did not touch
    plain = next(n for n in model.graph.node if n.domain != DOMAIN and n.output)
    _fuser_nodes(model)[-1].output[0] = plain.output[0]
    return "single static assignment"


def _undefined_input(model: onnx.ModelProto) -> str:
    # a node rewired to a value that no node makes (a rewire gone wrong)
    reader = next(n for n in reversed(model.graph.node) if n.domain != DOMAIN and n.input)
    reader.input[0] = "nowhere_made"
    return "topologically sorted"


def _bad_function(model: onnx.ModelProto) -> str:
    body = model.functions[0]
    body.node[0].op_type = "NoSuchStandardOp"
    return "NoSuchStandardOp"


MUTANTS: dict[str, Callable[[onnx.ModelProto], str]] = {
    "bad attribute": _bad_attribute,
    "no fuser opset import": _no_fuser_import,
    "duplicate fused output": _duplicate_output,
    "output of an unchanged node": _duplicate_of_unchanged_node,
    "undefined input": _undefined_input,
    "broken function body": _bad_function,
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_an_output_made_invalid_is_caught(fused, mutant):
    bad = _copy(fused)
    says = MUTANTS[mutant](bad)
    with pytest.raises(
        FusionError, match=r"m\.onnx: the fused model failed verification"
    ) as caught:
        verify(bad, "m.onnx")
    assert says in str(caught.value)
