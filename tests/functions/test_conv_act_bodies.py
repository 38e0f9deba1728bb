"""ConvBnRelu's bodies, one per activation variant: each passes onnx's function checker, the
fused model the full check, several activations in one model get one body each (by overload),
and unfusing gives plain ONNX that validates against the original."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import fuser
from fuser.fusedop import DOMAIN
from fuser.testing import fuse_all


def _cases(name: str, file: str) -> ModuleType:
    """The model builders of a pattern test module (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).parents[1] / "patterns" / file
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


cases = _cases("conv_act_cases", "test_conv_activations.py")
tcases = _cases("conv_transpose_cases", "test_conv_transpose.py")


@pytest.mark.parametrize(("form", "opset", "act", "alpha", "beta"), cases.CASES, ids=cases.IDS)
def test_each_variant_body_checks_and_unfuses_to_plain_onnx(
    form: cases.Form, opset: int, act: str | None, alpha: float | None, beta: float | None
) -> None:
    original = cases.model(form, opset=opset)
    fused = fuse_all(original)
    model = fused.model
    [node] = [n for n in model.graph.node if n.domain == DOMAIN]
    [body] = [f for f in model.functions if f.domain == DOMAIN]
    assert body.overload == node.overload
    assert (act or "relu").lower() in body.overload
    ctx = onnx.checker.C.CheckerContext()
    ctx.ir_version = model.ir_version
    ctx.opset_imports = {o.domain: o.version for o in model.opset_import}
    onnx.checker.check_function(body, ctx)
    onnx.checker.check_model(model, full_check=True)
    plain = fuser.unfuse(fused)
    assert all(n.domain != DOMAIN for n in plain.model.graph.node)
    result = fuser.validate(original, plain)
    assert result.ok, result.outputs


def test_two_activations_in_one_model_get_one_body_each() -> None:
    original = cases.model(cases.silu, opset=17, cout=3)
    graph = original.graph
    w2 = np.random.default_rng(3).standard_normal((4, 3, 1, 1)).astype(np.float32)
    graph.initializer.append(numpy_helper.from_array(w2, "W2"))
    graph.initializer.append(numpy_helper.from_array(np.float32(6), "six"))
    graph.initializer.append(numpy_helper.from_array(np.float32(0), "zero"))
    for n in graph.node:
        n.output[:] = ["y1" if o == "y" else o for o in n.output]
    graph.node.extend([
        helper.make_node("Conv", ["y1", "W2"], ["c2"], name="conv2"),
        helper.make_node("Clip", ["c2", "zero", "six"], ["y"], name="relu6"),
    ])  # fmt: skip
    del graph.value_info[:]
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None))
    original = onnx.shape_inference.infer_shapes(original)
    fused = fuse_all(original)
    nodes = [n for n in fused.model.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in fused.model.graph.node] == ["ConvBnRelu", "ConvBnRelu"]
    assert len({n.overload for n in nodes}) == 2
    assert {f.overload for f in fused.model.functions} == {n.overload for n in nodes}
    assert fuser.validate(original, fuse_all(original).model).ok


@pytest.mark.parametrize(
    ("attrs", "act", "bn", "opset"),
    [
        ({"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, "Relu", True, 17),
        ({"strides": [3, 2], "group": 3, "dilations": [1, 2]}, "Sigmoid", True, 13),
        ({"strides": [2, 2]}, "Tanh", False, 11),
        ({"strides": [2, 2], "output_padding": [0, 1]}, None, True, 21),
    ],
    ids=["relu-op17", "sigmoid-group-op13", "tanh-nobn-op11", "bn-only-op21"],
)
def test_transposed_body_checks_and_unfuses_to_conv_transpose(
    attrs: dict[str, object], act: str | None, bn: bool, opset: int
) -> None:
    original = tcases.deconv_model(attrs, cin=6, cout_g=2, act=act, bn=bn, opset=opset)
    if opset >= 21:
        original.ir_version = 10
    fused = fuse_all(original)
    model = fused.model
    [node] = [n for n in model.graph.node if n.domain == DOMAIN]
    [body] = [f for f in model.functions if f.domain == DOMAIN]
    assert body.overload == node.overload and "transposed" in body.overload
    assert [n.op_type for n in body.node if n.op_type == "ConvTranspose"] == ["ConvTranspose"]
    ctx = onnx.checker.C.CheckerContext()
    ctx.ir_version = model.ir_version
    ctx.opset_imports = {o.domain: o.version for o in model.opset_import}
    onnx.checker.check_function(body, ctx)
    onnx.checker.check_model(model, full_check=True)
    plain = fuser.unfuse(fused)
    assert "ConvTranspose" in [n.op_type for n in plain.model.graph.node]
    assert all(n.domain != DOMAIN for n in plain.model.graph.node)
    result = fuser.validate(original, plain)
    assert result.ok, result.outputs


def test_conv_and_conv_transpose_in_one_model_get_one_body_each() -> None:
    original = tcases.deconv_model({"strides": [2, 2]}, cin=3, cout_g=4)
    graph = original.graph
    w2 = np.random.default_rng(3).standard_normal((5, 4, 3, 3)).astype(np.float32)
    graph.initializer.append(numpy_helper.from_array(w2, "W2"))
    for n in graph.node:
        n.output[:] = ["y1" if o == "y" else o for o in n.output]
    graph.node.extend([
        helper.make_node("Conv", ["y1", "W2"], ["c2"], name="conv2"),
        helper.make_node("Relu", ["c2"], ["y"], name="relu2"),
    ])  # fmt: skip
    del graph.value_info[:]
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None))
    original = onnx.shape_inference.infer_shapes(original)
    fused = fuse_all(original)
    nodes = [n for n in fused.model.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in nodes] == ["ConvBnRelu", "ConvBnRelu"]
    assert len({n.overload for n in nodes}) == 2
    assert {f.overload for f in fused.model.functions} == {n.overload for n in nodes}
    assert fuser.validate(original, fused.model).ok
    assert fuser.validate(original, fuser.unfuse(fused).model).ok
