"""ONNX-domain SimplifiedLayerNormalization (onnxruntime's RMSNorm, as its transformer
optimizer writes it): onnx's checker refuses it, onnxruntime runs it; through `checkview` the
checker accepts it and shape inference types its outputs as onnxruntime does (Y: X's shape, the
scale's element type; inv_std_var: float, the normalized axis 1). The model is never changed."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser.checkview import checker_view, inference_view
from fuser.testing import reasons

D = 12
HALF, FLOAT = TensorProto.FLOAT16, TensorProto.FLOAT
ORT_TYPES: dict[int, str] = {
    HALF: "tensor(float16)",
    FLOAT: "tensor(float)",
    TensorProto.DOUBLE: "tensor(double)",
}


def sln_model(
    x_type: int, scale_type: int, opset: int, inv: bool = True, **attrs: Any
) -> onnx.ModelProto:
    """x [B, 5, D] -> SLN (ONNX domain) -> y (, inv); outputs declared without type or shape."""
    outputs = ["y", "inv"] if inv else ["y"]
    attrs = {"axis": -1, "epsilon": 1e-6, **attrs}
    node = helper.make_node(
        "SimplifiedLayerNormalization", ["x", "s"], outputs, name="sln", **attrs
    )
    scale = np.random.default_rng(3).uniform(0.5, 1.5, D)
    graph = helper.make_graph(
        [node],
        "sln",
        [helper.make_tensor_value_info("x", x_type, ["B", 5, D])],
        [onnx.ValueInfoProto(name=o) for o in outputs],
        [numpy_helper.from_array(scale.astype(helper.tensor_dtype_to_np_dtype(scale_type)), "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def inferred(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    out = onnx.shape_inference.infer_shapes(inference_view(model), strict_mode=True)
    return {v.name: v.type for v in (*out.graph.value_info, *out.graph.output)}


def dims(t: onnx.TypeProto) -> list[Any]:
    return [d.dim_param or d.dim_value for d in t.tensor_type.shape.dim]


def test_onnx_alone_refuses_the_model_onnxruntime_runs() -> None:
    """Why the view exists: the checker knows no such op, onnxruntime does."""
    model = sln_model(FLOAT, FLOAT, 17)
    ctx = onnx.checker.C.CheckerContext()
    ctx.ir_version, ctx.opset_imports = 8, {"": 17}
    with pytest.raises(onnx.checker.ValidationError, match="No Op registered for Simplified"):
        onnx.checker.check_node(model.graph.node[0], ctx)
    onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("opset", [14, 17, 18])
@pytest.mark.parametrize(
    ("x_type", "scale_type"), [(FLOAT, FLOAT), (HALF, HALF), (FLOAT, HALF), (HALF, FLOAT)]
)
def test_checker_accepts_and_inference_types_like_onnxruntime(
    opset: int, x_type: int, scale_type: int
) -> None:
    model = sln_model(x_type, scale_type, opset)
    before = model.SerializeToString()
    onnx.checker.check_model(checker_view(model).model, full_check=False)
    types = inferred(model)
    assert model.SerializeToString() == before  # the views are copies

    y, inv = types["y"], types["inv"]
    assert y.tensor_type.elem_type == scale_type and dims(y) == ["B", 5, D]
    assert inv.tensor_type.elem_type == FLOAT and dims(inv) == ["B", 5, 1]

    ort = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    declared = {o.name: o.type for o in ort.get_outputs()}
    assert declared == {"y": ORT_TYPES[scale_type], "inv": ORT_TYPES[FLOAT]}
    x = np.random.default_rng(opset).standard_normal((2, 5, D))
    got = ort.run(None, {"x": x.astype(helper.tensor_dtype_to_np_dtype(x_type))})
    assert [(a.dtype, a.shape) for a in got] == [
        (helper.tensor_dtype_to_np_dtype(scale_type), (2, 5, D)),
        (np.dtype(np.float32), (2, 5, 1)),
    ]


def test_inv_std_var_of_another_axis_has_its_type_but_no_shape() -> None:
    """axis=1 of rank 3: onnxruntime declares [2, 1, 8]-like shapes but computes [B, 1, 1];
    the view claims neither."""
    types = inferred(sln_model(FLOAT, FLOAT, 17, axis=1))
    assert dims(types["y"]) == ["B", 5, D]
    assert types["inv"].tensor_type.elem_type == FLOAT
    assert not types["inv"].tensor_type.HasField("shape")


def test_double_stash_types_inv_std_var_double() -> None:
    types = inferred(sln_model(FLOAT, FLOAT, 17, stash_type=TensorProto.DOUBLE))
    assert types["inv"].tensor_type.elem_type == TensorProto.DOUBLE


def test_a_scale_of_unknown_type_leaves_y_unknown() -> None:
    """Y's element type is the scale's: from an op without schema, nothing is claimed."""
    model = sln_model(FLOAT, FLOAT, 17, inv=False)
    model.graph.initializer.pop()
    model.graph.node.insert(
        0, helper.make_node("MakeScale", ["x"], ["s"], name="make", domain="com.example")
    )
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    onnx.checker.check_model(checker_view(model).model, full_check=False)
    out = onnx.shape_inference.infer_shapes(inference_view(model))
    (y,) = [v for v in (*out.graph.value_info, *out.graph.output) if v.name == "y"]
    assert y.type.tensor_type.elem_type == 0


def test_an_unfused_sln_passes_through_untouched() -> None:
    """SLN -> Relu (no Linear): fuser loads it, leaves it as it was, and the output loads and
    computes the same in stock onnxruntime."""
    model = sln_model(HALF, HALF, 18, inv=False)
    model.graph.node.append(helper.make_node("Relu", ["y"], ["r"], name="relu"))
    model.graph.output.append(onnx.ValueInfoProto(name="r"))
    result = fuser.fuse(model, cache=False)
    assert reasons(result) == []
    assert [n.SerializeToString() for n in result.model.graph.node] == [
        n.SerializeToString() for n in model.graph.node
    ]
    assert {o.domain for o in result.model.opset_import} == {""}  # nothing private leaked
    x = {"x": np.random.default_rng(7).standard_normal((3, 5, D)).astype(np.float16)}
    runs = [
        onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, x
        )
        for m in (model, result.model)
    ]
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a, b)
