"""The engine does the work that repeats per match once per signature (the fused op and its
attributes): the fused node's attribute protos, and shape inference of the fused node (once
per signature and input types). What differs between matches of one signature is still
checked per match: a declared output type the inference contradicts, and attributes or input
types that differ make another signature."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import fuser


def _chains(specs: list[tuple[int, list[int], list[int] | None]]) -> onnx.ModelProto:
    """Per spec (dtype, pads, declared shape of the Relu output or None): X_i -> Conv(3->5,
    3x3) -> BN -> Relu -> Identity -> Y_i, on a [1,3,7,9] input."""
    rng = np.random.default_rng(17)
    nodes, inits, inputs, outputs, infos = [], [], [], [], []
    for i, (dtype, pads, declared) in enumerate(specs):
        np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
        p = f"k{i}."
        for name, shape in (("W", [5, 3, 3, 3]), ("s", [5]), ("b", [5]), ("m", [5])):
            inits.append(
                numpy_helper.from_array(rng.standard_normal(shape).astype(np_dtype), p + name)
            )
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 2, [5]).astype(np_dtype), p + "v"))
        nodes += [
            helper.make_node("Conv", [f"X{i}", p + "W"], [p + "c"], name=p + "conv", pads=pads),
            helper.make_node(
                "BatchNormalization", [p + "c", *(p + n for n in "sbmv")], [p + "n"], name=p + "bn"
            ),
            helper.make_node("Relu", [p + "n"], [p + "r"], name=p + "relu"),
            helper.make_node("Identity", [p + "r"], [f"Y{i}"], name=p + "id"),
        ]
        inputs.append(helper.make_tensor_value_info(f"X{i}", dtype, [1, 3, 7, 9]))
        outputs.append(helper.make_tensor_value_info(f"Y{i}", dtype, None))
        if declared is not None:
            infos.append(helper.make_tensor_value_info(p + "r", dtype, declared))
    graph = helper.make_graph(nodes, "memo", inputs, outputs, inits, value_info=infos)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def test_a_declaration_contradicted_is_refused_though_its_signature_was_fused_before() -> None:
    """Three chains of one signature; the second declares a shape its nodes do not compute.
    The inference is shared, the comparison with each match's declaration is not."""
    model = _chains([(F32, [0] * 4, None), (F32, [0] * 4, [1, 5, 4, 7]), (F32, [0] * 4, None)])
    result = fuser.fuse(model, patterns="conv_bn_relu", cache=False, force=True)
    assert [f.replaced[0] for f in result.report.fusions] == ["k0.conv", "k2.conv"]
    (miss,) = [r for r in result.report.rejected if r.value == "k1.r"]
    assert "declares float32[1,5,4,7] for 'k1.r'" in miss.reason
    assert "infers float32[1,5,5,7]" in miss.reason


def test_other_attributes_or_input_types_are_other_signatures() -> None:
    """Chains differing only in pads, or only in dtype, each get their own attributes and
    inferred output, not those of the first chain fused."""
    model = _chains([(F32, [0] * 4, None), (F32, [1] * 4, [1, 5, 7, 9]), (F16, [0] * 4, None)])
    result = fuser.fuse(model, patterns="conv_bn_relu", cache=False, force=True)
    assert [f.replaced[0] for f in result.report.fusions] == ["k0.conv", "k1.conv", "k2.conv"]
    fused = {n.name.split(".")[0]: n for n in result.model.graph.node if n.domain == "fuser"}
    pads = {
        k: list(next(a.ints for a in n.attribute if a.name == "pads")) for k, n in fused.items()
    }
    assert pads == {"k0": [0] * 4, "k1": [1] * 4, "k2": [0] * 4}
    inferred = onnx.shape_inference.infer_shapes(result.model)
    types = {v.name: v.type.tensor_type for v in inferred.graph.value_info}
    assert [d.dim_value for d in types["k0.r"].shape.dim] == [1, 5, 5, 7]
    assert [d.dim_value for d in types["k1.r"].shape.dim] == [1, 5, 7, 9]
    assert types["k2.r"].elem_type == F16
