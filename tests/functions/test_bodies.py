"""The function bodies as ONNX: each passes the checker, the fused model passes the full check
and shape inference with them, `functions=False` writes today's bare ops, fusing stays
deterministic and idempotent, and fused nodes and models say where they come from."""

from __future__ import annotations

import json

import onnx
import pytest
from fuser.models import get_example

import fuser
from fuser import finish
from fuser.decide import AlwaysFuse
from fuser.fusedop import DOMAIN
from fuser.registry import all_patterns
from fuser.testing import fuse_all

# every fused op type and the main variants between them
EXAMPLES = ["cnn-edge", "bert", "gpt2", "gpt-noaffine", "moe-fp16", "topk-softmax-router", "tp-mlp",
            "llama-fp16", "tp-attention", "tp-gemm"]  # fmt: skip


def bodies(model: onnx.ModelProto) -> list[onnx.FunctionProto]:
    return [f for f in model.functions if f.domain == DOMAIN]


def test_every_registered_pattern_op_declares_a_body() -> None:
    """A new fused op (or pattern) without `FusedOp.body` would be written bare: refuse that."""
    missing = [op.name for p in all_patterns() for op in p.ops if op.body is None]
    assert not missing


def test_every_fused_op_type_has_a_body() -> None:
    seen = set()
    for name in EXAMPLES:
        fused = fuse_all(get_example(name)).model
        ops = {n.op_type for n in fused.graph.node if n.domain == DOMAIN}
        assert ops <= {f.name for f in bodies(fused)}, name
        seen |= ops
    assert seen == {op.name for pattern in all_patterns() for op in pattern.ops}


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_body_passes_the_checker_and_the_model_the_full_check(name: str) -> None:
    fused = fuse_all(get_example(name)).model
    assert bodies(fused)
    imports = {o.domain: o.version for o in fused.opset_import}
    for function in bodies(fused):
        ctx = onnx.checker.C.CheckerContext()
        ctx.ir_version = fused.ir_version
        ctx.opset_imports = imports
        onnx.checker.check_function(function, ctx)
        # the body's own imports agree with the model's (onnx's checker and inliner need it)
        assert all(imports[o.domain] == o.version for o in function.opset_import)
    onnx.checker.check_model(fused, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(fused, strict_mode=True)
    for out in inferred.graph.output:
        assert out.type.tensor_type.elem_type != 0


def test_a_broken_body_fails_the_checker() -> None:
    """The check above can fail: a body op the opset does not have is refused."""
    fused = fuse_all(get_example("bert")).model
    function = bodies(fused)[0]
    function.node[-1].op_type = "MatMulPlus"
    ctx = onnx.checker.C.CheckerContext()
    ctx.ir_version = fused.ir_version
    ctx.opset_imports = {o.domain: o.version for o in fused.opset_import}
    with pytest.raises(onnx.checker.ValidationError, match="MatMulPlus"):
        onnx.checker.check_function(function, ctx)


@pytest.mark.parametrize("name", EXAMPLES)
def test_no_functions_writes_the_bare_ops(name: str) -> None:
    model = get_example(name)
    with_bodies = fuser.fuse(model, decider=AlwaysFuse()).model
    bare = fuser.fuse(model, decider=AlwaysFuse(), functions=False).model
    assert not bodies(bare)
    assert all(not n.overload for n in bare.graph.node)
    assert bodies(with_bodies)
    for node in with_bodies.graph.node:  # same nodes; the overload names the body
        node.ClearField("overload")
    assert list(bare.graph.node) == list(with_bodies.graph.node)
    assert list(bare.graph.initializer) == list(with_bodies.graph.initializer)
    onnx.checker.check_model(bare, full_check=True)


@pytest.mark.parametrize("name", ["resnet", "bert", "moe"])
def test_fusing_is_deterministic_and_idempotent(name: str) -> None:
    once = fuse_all(get_example(name)).model.SerializeToString()
    assert fuse_all(get_example(name)).model.SerializeToString() == once
    again = fuse_all(onnx.load_from_string(once)).model.SerializeToString()
    assert again == once


def test_fused_nodes_and_the_model_say_where_they_come_from() -> None:
    model = get_example("cnn-edge")
    model.producer_name, model.producer_version = "pytorch", "2.13"
    result = fuser.fuse(model, target="ascend310p", decider=AlwaysFuse())
    fused = result.model
    for record in result.report.fusions:
        (node,) = [n for n in fused.graph.node if n.name == record.node]
        assert node.doc_string == f"fuser pattern '{record.pattern}' replaced: " + ", ".join(
            record.replaced
        )
        assert len(record.replaced) >= 2
    assert (fused.producer_name, fused.producer_version) == ("fuser", fuser.__version__)
    entry = json.loads({p.key: p.value for p in fused.metadata_props}["fuser"])
    assert entry["version"] == fuser.__version__
    assert entry["target"] == "ascend310p"
    assert entry["options"] == {
        "functions": True,
        "force": False,
        "patterns": [p.name for p in all_patterns()],  # every family, in the engine's order
    }
    assert entry["source_producer"] == "pytorch 2.13"
    # fusing the fused model again keeps the first producer (and is byte-identical)
    again = fuser.fuse(fused, target="ascend310p", decider=AlwaysFuse()).model
    assert finish.provenance(again) == entry


def test_a_variant_an_opset_cannot_express_is_refused_with_the_way_out(graph) -> None:  # type: ignore[no-untyped-def]
    """LayerNorm over axis -1 needs Flatten with a negative axis, which opset 10 lacks."""
    import numpy as np

    g = graph("float32", 10)
    x = g.input("x", ["B", 4, 8])
    mean = g.op("ReduceMean", x, axes=[-1], keepdims=1)
    d = g.op("Sub", x, mean)
    var = g.op("ReduceMean", g.op("Mul", d, d), axes=[-1], keepdims=1)
    n = g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const(1e-5, "eps"))))
    g.outputs.append(g.op("MatMul", n, g.const(np.ones((8, 3)), "w")))
    model = g.model()
    refused = fuse_all(model).report.rejected
    assert any(
        "no ONNX function body at opset 10" in r.reason and "--no-functions" in r.reason
        for r in refused
    )
    bare = fuser.fuse(model, decider=AlwaysFuse(), functions=False).model
    assert [n.op_type for n in bare.graph.node] == ["LayerNormMatMul"]


def test_a_node_omitting_trailing_inputs_gets_its_own_body_that_equals_the_reference() -> None:
    """ConvBnRelu with neither bias nor BN inputs ([X, W]): the body's B is dropped (variant
    `_noB`) and stock onnxruntime computes what the op's numpy reference computes."""
    import numpy as np
    import onnxruntime
    from fuser.patterns.conv_bn_relu import CONV_BN_RELU
    from onnx import TensorProto, helper, numpy_helper

    from fuser import engine, functions

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    node = helper.make_node(
        "ConvBnRelu", ["x", "w"], ["y"], domain=DOMAIN, name="c", relu=1, pads=[1, 0, 1, 2]
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 5, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 5, 6])],
        [w],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(DOMAIN, 1)]
    )
    assert functions.attach(model, functions.elem_types_from(engine.infer_types(model))) == 1
    assert model.graph.node[0].overload == "folded_relu_noB"
    assert list(model.functions[0].input) == ["X", "W"]
    x = rng.standard_normal((2, 3, 5, 6)).astype(np.float32)
    (y,) = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    attrs = CONV_BN_RELU.attribute_values(model.graph.node[0])
    (expected,) = CONV_BN_RELU.reference([x, numpy_helper.to_array(w)], attrs)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def _conv_bn_relu_model(nodes: list[onnx.NodeProto]) -> onnx.ModelProto:
    """ConvBnRelu nodes side by side, each reading x (float) or h (float16) and its own w."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    weights = []
    for node in nodes:
        dtype = np.float16 if node.input[0] == "h" else np.float32
        weights.append(
            numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(dtype), node.input[1])
        )
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 5, 7]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT16, [1, 3, 5, 7]),
        ],
        [
            helper.make_tensor_value_info(
                n.output[0], TensorProto.FLOAT16 if n.input[0] == "h" else TensorProto.FLOAT, None
            )
            for n in nodes
        ],
        weights,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(DOMAIN, 1)]
    )


def test_nodes_share_a_body_exactly_when_their_values_agree_and_each_gets_its_own_variant() -> None:
    """attach looks nodes up by their raw attributes first: tiling attributes, attribute order
    and an attribute written at its default must not split a body, while a different value,
    input type or set of inputs must; every node gets the variant it gets alone."""
    from onnx import helper

    from fuser import engine, functions

    def conv(name: str, x: str, **attrs: object) -> onnx.NodeProto:
        return helper.make_node(
            "ConvBnRelu", [x, f"w_{name}"], [f"y_{name}"], domain=DOMAIN, name=name, **attrs
        )

    nodes = [
        conv("a", "x", relu=1, pads=[1, 0, 1, 2], tile_m=16),
        conv("b", "x", pads=[1, 0, 1, 2], relu=1, tile_m=32, tile_n=8),  # order, tiling differ
        conv("c", "x", relu=1, pads=[1, 0, 1, 2], group=1),  # group at its default
        conv("d", "x", relu=0, pads=[1, 0, 1, 2]),  # another value
        conv("e", "h", relu=1, pads=[1, 0, 1, 2]),  # float16 input
        conv("f", "x", relu=1, pads=[0, 0, 0, 0], tile_m=16),
    ]
    model = _conv_bn_relu_model(nodes)
    written = functions.attach(model, functions.elem_types_from(engine.infer_types(model)))
    overloads = {n.name: n.overload for n in model.graph.node}
    alone = {}
    for node in nodes:
        single = _conv_bn_relu_model([node])
        functions.attach(single, functions.elem_types_from(engine.infer_types(single)))
        alone[node.name] = single.graph.node[0].overload
    assert overloads == alone
    assert overloads["a"] == overloads["b"] == overloads["c"]
    assert overloads["d"] != overloads["a"]
    assert written == len(set(overloads.values()))
    assert sorted((f.name, f.overload) for f in model.functions) == sorted(
        {("ConvBnRelu", v) for v in overloads.values()}
    )
