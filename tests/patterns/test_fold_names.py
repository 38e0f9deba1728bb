"""Names of folded Conv weights: never one the model used, even a value an earlier fusion of
the same pass already took out of the graph (the name set is read off the index's tables
rather than walked out of the GraphProto, and must say the same)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from fuser.graph import GraphIndex, TypeTable
from fuser.modelio import load_model
from fuser.ort import session
from fuser.testing import conv_bn_chain, fuse_all, reasons

RNG_SEED = 10


def _two_layers() -> onnx.ModelProto:
    """c1 -> BN writing 'c2.W_bn_folded' -> Relu -> c2 -> BN: the first fusion removes the
    value 'c2.W_bn_folded' before the second fold names its weight."""
    rng = np.random.default_rng(RNG_SEED)
    first, inits1 = conv_bn_chain("c1", "x", "c2.W_bn_folded", rng, 3)
    second, inits2 = conv_bn_chain("c2", "r", "y", rng, 3)
    nodes = [*first, helper.make_node("Relu", ["c2.W_bn_folded"], ["r"]), *second]
    shape = [1, 3, 4, 5]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [*inits1, *inits2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_fold_does_not_reuse_a_name_an_earlier_fusion_removed() -> None:
    model = _two_layers()
    result = fuse_all(model)
    assert result.report.summary["conv_bn_relu"] == 2, reasons(result)
    names = sorted(t.name for t in result.model.graph.initializer)
    # the name the first fusion removed stays reserved for the whole pass, as when the
    # model's names were walked before the rewrites
    assert names == ["c1.B_bn_folded", "c1.W_bn_folded", "c2.B_bn_folded", "c2.W_bn_folded_2"]
    onnx.checker.check_model(result.model, full_check=True)
    x = np.random.default_rng(RNG_SEED).standard_normal((1, 3, 4, 5)).astype(np.float32)
    (expected,) = session(model, kernel="reference").run(None, {"x": x})
    (actual,) = session(result.model, kernel="reference").run(None, {"x": x})
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_main_graph_names_read_off_the_index_are_every_name_of_the_graph() -> None:
    """Every name the GraphProto holds is taken for the main graph's index (a new value of any
    of these names would be defined twice or shadow a subgraph's)."""
    model = _two_layers()
    branch = helper.make_graph(
        [helper.make_node("Neg", ["y"], ["inner"]), helper.make_node("Abs", ["inner"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)],
    )
    model.graph.node.append(
        helper.make_node("If", ["c"], ["z"], then_branch=branch, else_branch=branch)
    )
    model.graph.input.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    model.graph.value_info.append(helper.make_tensor_value_info("c1.y", TensorProto.FLOAT, None))
    loaded = load_model(model)
    index = GraphIndex.build(loaded.model.graph, loaded, {"": 17}, TypeTable())
    every = {
        "x", "y", "c", "z", "r", "c1.y", "c2.y", "c2.W_bn_folded", "inner", "t",
        *(t.name for t in model.graph.initializer),
    }  # fmt: skip
    for name in sorted(every):
        assert index.unique_value_name(name) == f"{name}_2", name
    assert index.unique_value_name("fresh") == "fresh"
