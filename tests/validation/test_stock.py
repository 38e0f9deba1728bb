"""`validate` checks both ways of running a fused model with ONNX function bodies: the plugin
and plain onnxruntime (nothing of fuser registered)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from fuser.api import validate
from fuser.testing import fuse_all

CONV = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 3, 9, 9] x) => (float[N, 4, 9, 9] y) {
    c = Conv <pads = [1, 1, 1, 1]> (x, w, b)
    n = BatchNormalization (c, scale, bias, mean, var)
    y = Relu(n)
}
"""


def _original() -> onnx.ModelProto:
    model = onnx.parser.parse_model(CONV)
    rng = np.random.default_rng(0)
    for name, shape in (("w", (4, 3, 3, 3)), ("b", (4,)), ("scale", (4,)), ("bias", (4,)),
                        ("mean", (4,))):  # fmt: skip
        value = rng.standard_normal(shape).astype(np.float32)
        model.graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    var = rng.uniform(0.5, 2, 4).astype(np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(var, "var"))
    return model


def _with_body(fused: onnx.ModelProto, relu: bool) -> onnx.ModelProto:
    """The fused model plus a ConvBnRelu body (folded BN): Conv, then Relu if `relu`."""
    refs = []
    for name, kind in (("pads", onnx.AttributeProto.INTS), ("strides", onnx.AttributeProto.INTS)):
        ref = onnx.AttributeProto(name=name, ref_attr_name=name, type=kind)
        refs.append(ref)
    conv = helper.make_node("Conv", ["X", "W", "B"], ["C" if relu else "Y"])
    conv.attribute.extend(refs)
    nodes = [conv] + ([helper.make_node("Relu", ["C"], ["Y"])] if relu else [])
    function = helper.make_function(
        "fuser", "ConvBnRelu", ["X", "W", "B"], ["Y"], nodes,
        [helper.make_opsetid("", 17)], attributes=["pads", "strides"],
    )  # fmt: skip
    copy = onnx.ModelProto()
    copy.CopyFrom(fused)
    copy.functions.append(function)
    return copy


def test_stock_run_is_not_applicable_without_function_bodies() -> None:
    original = _original()
    bare = fuse_all(original, functions=False)
    checked = validate(original, bare, kernel="reference", runs=1)
    assert checked.ok and checked.stock.startswith("not applicable") and not checked.stock_outputs


def test_stock_onnxruntime_runs_the_function_bodies_and_is_compared() -> None:
    original = _original()
    fused = fuse_all(original, functions=False).model  # the bodies below are written by hand
    assert [n.op_type for n in fused.graph.node] == ["ConvBnRelu"] and not fused.functions
    good = validate(original, _with_body(fused, relu=True), kernel="reference", runs=2)
    assert good.ok and good.stock == "ok"
    assert {c.where for c in good.stock_outputs} == {"output", "node"}
    # a body that forgets the Relu: the plugin still agrees, stock onnxruntime does not
    bad = validate(original, _with_body(fused, relu=False), kernel="npu", runs=2)
    assert not bad.ok and bad.stock == "failed"
    assert all(c.ok for c in bad.nodes) and all(c.ok for c in bad.outputs)
    assert "in stock onnxruntime" in bad.failures[0].message()
