"""AllGather MLPs: structure, checker and shape inference (onnxruntime has no AllGather)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.models import parallel
from model_checks import check, readers


def _allgather(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.op_type == "AllGather"]
    return node


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _dims(model: onnx.ModelProto, value: str) -> list[object]:
    vi = next(v for v in [*model.graph.value_info, *model.graph.output] if v.name == value)
    return [d.dim_value if d.HasField("dim_value") else d.dim_param
            for d in vi.type.tensor_type.shape.dim]  # fmt: skip


@pytest.mark.parametrize(
    ("builder", "axis", "gathered_shape"),
    [
        (parallel.tp_mlp, 2, ["batch", "seq", 32]),
        (lambda: parallel.tp_mlp(negative_axis=True), -1, ["batch", "seq", 32]),
        (parallel.sp_mlp, 0, [8, "batch", 32]),
        (lambda: parallel.sp_mlp(layout="bsh", seq="seq"), 1, ["batch", "seq", 32]),
    ],
)
def test_allgather_then_matmul(builder, axis: int, gathered_shape: list) -> None:  # type: ignore[no-untyped-def]
    model = builder()
    inferred = check(model)
    gather = _allgather(model)
    assert gather.domain == "com.microsoft"
    assert _attrs(gather) == {"axis": axis, "group_size": 2}
    assert any(o.domain == "com.microsoft" and o.version == 1 for o in model.opset_import)
    (matmul,) = readers(model, gather.output[0])
    assert matmul.op_type == "MatMul"
    assert matmul.input[0] == gather.output[0]  # the gathered tensor is the left operand
    weight = next(t for t in model.graph.initializer if t.name == matmul.input[1])
    assert list(weight.dims) == [32, 32]  # this rank's column shard of [32, 64]
    (add,) = readers(model, matmul.output[0])
    assert add.op_type == "Add"
    # shape inference continues past the AllGather through its value_info
    assert _dims(inferred, gather.output[0]) == gathered_shape
    assert _dims(inferred, "output") == gathered_shape


def test_shard_shapes_and_options() -> None:
    model = parallel.tp_mlp(batch=2, seq=3, hidden=16, group_size=4, bias=False)
    check(model)
    x = model.graph.input[0].type.tensor_type.shape
    assert [d.dim_value for d in x.dim] == [2, 3, 4]
    (matmul,) = readers(model, _allgather(model).output[0])
    assert readers(model, matmul.output[0])[0].op_type == "Relu"  # no bias Add
    with pytest.raises(ValueError, match="divisible"):
        parallel.sp_mlp(seq=7)


def test_sp_mlp_layernorm_is_before_the_gather() -> None:
    model = parallel.sp_mlp()
    gather = _allgather(model)
    ln = next(n for n in model.graph.node if n.output[0] == gather.input[0])
    assert ln.op_type == "LayerNormalization"
    assert parallel.sp_mlp(opset=13).graph.node[-1].op_type == "MatMul"


def test_float16() -> None:
    model = parallel.tp_mlp(dtype="float16")
    check(model)
    w = next(t for t in model.graph.initializer)
    assert onnx.numpy_helper.to_array(w).dtype == np.float16
