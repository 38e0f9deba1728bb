"""Real exports of the grouped-gate spellings (gateforms lane): DeepSeek-V4's router in float16
with its bias kept in float32, and DeepSeek-V3's own MoEGate math (views by bsz * seq_len)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from fuser.api import fuse, validate

DATA = Path(__file__).resolve().parent.parent / "data" / "exported"


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("name", ["deepseekv4-router-fp16-ts14", "deepseekv4-router-fp16-dynamo18"])
def test_float32_bias_on_float16_scores_fuses_and_validates(name: str) -> None:
    """Sigmoid (fp16) -> Cast(float32) -> Add(float32 bias) -> TopK -> GatherElements of the
    float16 scores -> renormalize -> scale: one SoftmaxTopK, float32 bias, float16 weights."""
    model = onnx.load(str(DATA / f"{name}.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("TopK") == 1 and "Cast" in ops
    result = fuse(model, cache=False)
    assert result.report.summary["softmax_topk"] == 1
    left = {n.op_type for n in result.model.graph.node}
    assert not {"TopK", "Sigmoid", "GatherElements", "Div"} & left, left
    (node,) = [n for n in result.model.graph.node if n.domain == "fuser"]
    attrs = _attrs(node)
    assert (attrs["score"], attrs["to_float32"], attrs["renormalize"]) == (b"sigmoid", 0, 1)
    assert attrs["scale"] == pytest.approx(1.5)
    types = {t.name: t.data_type for t in result.model.graph.initializer}
    assert types[node.input[1]] == onnx.TensorProto.FLOAT
    assert "float16infloat" in node.overload  # the choice in float32
    checked = validate(model, result)
    assert checked.ok, [c.message() for c in checked.failures]


def test_hub_gate_dynamo_fuses_every_topk() -> None:
    """A view of the scores ([-1, 16]) before the bias and an Expand to a shape computed at
    run time, typed [batch*seq, 4, 4]: the three TopKs in one SoftmaxTopK, fill 0."""
    model = onnx.load(str(DATA / "deepseekv3-hub-gate-dynamo18.onnx"))
    assert sum(n.op_type == "TopK" for n in model.graph.node) == 3
    result = fuse(model, cache=False)
    assert result.report.summary["softmax_topk"] == 1
    left = {n.op_type for n in result.model.graph.node}
    assert not {"TopK", "Sigmoid", "Where", "Not"} & left, left
    assert "view_1" not in {o for n in result.model.graph.node for o in n.output}  # the view
    (node,) = [n for n in result.model.graph.node if n.domain == "fuser"]
    attrs = _attrs(node)
    assert (attrs["n_group"], attrs["topk_group"], attrs["mask_value"]) == (4, 2, 0.0)
    checked = validate(model, result)
    assert checked.ok, [c.message() for c in checked.failures]


def test_hub_gate_torchscript_is_a_near_miss_with_its_reason() -> None:
    """TorchScript writes the view of the scores to Concat(bsz * seq_len, -1) with no types:
    nothing shows it keeps the rows, so it is refused, and says so."""
    result = fuse(str(DATA / "deepseekv3-hub-gate-ts14.onnx"), cache=False)
    assert result.report.summary["softmax_topk"] == 0
    assert [r.reason for r in result.report.rejected] == [
        "Reshape '/Reshape_1' of the scores '/Sigmoid_output_0' to a shape computed at run time "
        "('/Concat_1_output_0'): its output's shape does not show it keeps [tokens, 16]"
    ]
