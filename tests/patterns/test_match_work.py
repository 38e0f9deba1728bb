"""What a match reads, beyond what it decides on: a LayerNorm -> Linears match checks each
weight by its dims without reading its data (unless Gemm's transB/alpha are folded), and
asks no type of the normalized value unless a Cast or Reshape reads it; an attention
Softmax, which is no gate's, has its scores' type left unasked by the SoftmaxTopK pattern.
These are counts, not timings: a match pass over a 100k-node transformer asks this for every
anchor, and each read or first type lookup of a value is a protobuf walk."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.patterns import layernorm_matmul, softmax_topk
from onnx import TensorProto, helper, numpy_helper

from fuser import engine
from fuser import graph as graph_mod
from fuser.graph import GraphIndex
from fuser.modelio import load_model
from fuser.pattern import Match


def _index(model: onnx.ModelProto) -> GraphIndex:
    loaded = load_model(model)
    types = engine.infer_types(loaded.model)[""]
    return GraphIndex.build(loaded.model.graph, loaded, engine.opset_map(loaded.model), types)


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], out: list[str]):  # type: ignore[no-untyped-def]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 6])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in out],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _layernorm_linears(gemm_trans_b: int | None = None) -> onnx.ModelProto:
    """x [2, 5, 6] -> LayerNormalization -> three Linears [6, 7]: MatMul + Add bias twice, and a
    third that is a MatMul, or (with `gemm_trans_b`) Reshape -> Gemm."""
    rng = np.random.default_rng(3)

    def init(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    inits = [init("gamma", (6,)), init("beta", (6,)), init("w0", (6, 7)), init("w1", (6, 7))]
    inits += [init("b0", (7,)), init("b1", (7,))]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], axis=-1),
        helper.make_node("MatMul", ["n", "w0"], ["m0"]),
        helper.make_node("Add", ["m0", "b0"], ["y0"]),
        helper.make_node("MatMul", ["n", "w1"], ["m1"]),
        helper.make_node("Add", ["b1", "m1"], ["y1"]),
    ]
    if gemm_trans_b is None:
        inits.append(init("w2", (6, 7)))
        nodes.append(helper.make_node("MatMul", ["n", "w2"], ["y2"]))
    else:
        inits.append(init("w2", (7, 6) if gemm_trans_b else (6, 7)))
        inits.append(numpy_helper.from_array(np.array([-1, 6], np.int64), "flat"))
        nodes.append(helper.make_node("Reshape", ["n", "flat"], ["n2"]))
        nodes.append(helper.make_node("Gemm", ["n2", "w2"], ["y2"], transB=gemm_trans_b))
    return _model(nodes, inits, ["y0", "y1", "y2"])


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """(names of the tensors whose data is read, names whose type is asked), as the pattern
    asks for them."""
    tensors: list[str] = []
    asked: list[str] = []
    read_tensor = graph_mod.read_tensor
    value_type = GraphIndex.value_type

    def counting_read(loaded, tensor):  # type: ignore[no-untyped-def]
        tensors.append(tensor.name)
        return read_tensor(loaded, tensor)

    def counting_value_type(self, name):  # type: ignore[no-untyped-def]
        asked.append(name)
        return value_type(self, name)

    monkeypatch.setattr(graph_mod, "read_tensor", counting_read)
    monkeypatch.setattr(GraphIndex, "value_type", counting_value_type)
    return tensors, asked


def _anchor(index: GraphIndex, op_type: str) -> int:
    return next(i for i in index.live_nodes() if index.node(i).op_type == op_type)


def test_layernorm_linears_match_reads_no_weight_and_no_normalized_type(
    reads: tuple[list[str], list[str]],
) -> None:
    index = _index(_layernorm_linears())
    tensors, asked = reads
    tensors.clear()
    asked.clear()
    found = layernorm_matmul.PATTERN.match(index, _anchor(index, "LayerNormalization"))
    assert isinstance(found, Match)
    assert found.inputs == ("x", "gamma", "beta", "w0", "b0", "w1", "b1", "w2")
    assert found.attributes["has_bias"] == [1, 1, 0]
    assert not {"w0", "w1", "w2"} & set(tensors), tensors
    # The normalized value and the MatMuls' outputs before their bias are inside the match.
    assert not {"n", "m0", "m1"} & set(asked), asked


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_weight_is_read_only_to_fold_trans_b(
    reads: tuple[list[str], list[str]], trans_b: int
) -> None:
    index = _index(_layernorm_linears(gemm_trans_b=trans_b))
    tensors, _ = reads
    tensors.clear()
    found = layernorm_matmul.PATTERN.match(index, _anchor(index, "LayerNormalization"))
    assert isinstance(found, Match)
    assert found.attributes["flatten"] == [0, 0, 1]
    assert ("w2" in tensors) == bool(trans_b), tensors
    if trans_b:  # the folded weight is W^T, as a new [6, 7] initializer
        (folded,) = found.new_initializers
        w2 = numpy_helper.to_array(next(t for t in index.graph.initializer if t.name == "w2"))
        np.testing.assert_array_equal(numpy_helper.to_array(folded), w2.T)
        assert folded.name in found.inputs


def test_attention_softmax_scores_type_is_not_read(reads: tuple[list[str], list[str]]) -> None:
    nodes = [
        helper.make_node("Softmax", ["x"], ["p"], axis=-1),
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["p", "xt"], ["y"]),
    ]
    index = _index(_model(nodes, [], ["y"]))
    _, asked = reads
    asked.clear()
    assert softmax_topk.PATTERN.match(index, _anchor(index, "Softmax")) is None
    assert "p" not in asked, asked
