"""What onnxruntime runs, fuser accepts (issue 14, items 9-10): each model here loads and runs in
onnxruntime but breaks a rule of onnx's checker. fuser fuses it, says what it normalized, writes
an output no less valid than the input that computes the same, and leaves the input alone."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser.errors import FuserError, ModelLoadError, UsageError

RNG_SEED = 7


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
    return session.run(None, feeds)


def layernorm_matmul(
    opset: int = 17, *, reverse: bool = False, out_shape: bool = True
) -> onnx.ModelProto:
    """LayerNormalization -> MatMul -> Relu over x[2,3,8] (odd sizes: 8 -> 5)."""
    rng = np.random.default_rng(RNG_SEED)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], name="ln", epsilon=1e-5),
        helper.make_node("MatMul", ["n", "w"], ["m"], name="mm"),
        helper.make_node("Relu", ["m"], ["y"], name="relu"),
    ]
    if reverse:
        nodes.reverse()
    inits = [
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), "g"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
        numpy_helper.from_array(rng.standard_normal((8, 5)).astype(np.float32), "w"),
    ]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 5] if out_shape else None)
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])], [out], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def conv_bn_relu(opset: int = 17, ir_version: int | None = None) -> onnx.ModelProto:
    rng = np.random.default_rng(RNG_SEED)
    c = 3
    inits = [
        numpy_helper.from_array(rng.standard_normal((c, 2, 3, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), "s"),
        numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "bb"),
        numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "mu"),
        numpy_helper.from_array(rng.uniform(0.1, 1, c).astype(np.float32), "var"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "bb", "mu", "var"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 5, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 5, 3])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    if ir_version is not None:
        model.ir_version = ir_version
    return model


def feeds_for(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(RNG_SEED + 1)
    inits = {t.name for t in model.graph.initializer}
    return {
        v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]).astype(
            np.float32
        )
        for v in model.graph.input
        if v.name not in inits
    }


def assert_fused_equal(original: onnx.ModelProto, result: fuser.FusionResult) -> None:
    """The fused model runs in onnxruntime (fuser's plugin) and equals the original there."""
    feeds = feeds_for(original)
    check = fuser.validate(original, result, inputs=feeds, runs=1, kernel="reference")
    assert check.ok, check.to_dict()


def checker_refuses(model: onnx.ModelProto) -> str | None:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        return str(exc)
    return None


# -- 9: not topologically sorted ---------------------------------------------------------------


def test_unsorted_nodes_are_sorted_and_fused() -> None:
    model = layernorm_matmul(reverse=True)
    assert "topologically sorted" in (checker_refuses(model) or "")
    before = model.SerializeToString()
    result = fuser.fuse(model, cache=False)
    assert result.report.summary["layernorm_matmul"] == 1
    assert any("sorted topologically" in n for n in result.report.normalized)
    onnx.checker.check_model(result.model, full_check=True)
    assert_fused_equal(layernorm_matmul(), result)
    assert model.SerializeToString() == before  # the caller's model is untouched


def test_unsorted_subgraph_is_sorted() -> None:
    then = helper.make_graph(
        [
            helper.make_node("Relu", ["t"], ["o"], name="late"),
            helper.make_node("Neg", ["x"], ["t"], name="early"),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, [3])],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"], name="id")],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [3])],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)],
        "g",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert checker_refuses(model) is not None
    result = fuser.fuse(model, cache=False)
    notes = result.report.normalized
    assert len(notes) == 1 and notes[0].startswith("subgraph if.then_branch: nodes sorted"), notes
    onnx.checker.check_model(result.model, full_check=True)
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    expected = np.maximum(-x, 0)
    got = run_ort(result.model, {"c": np.array(True), "x": x})[0]
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        (
            [
                helper.make_node("Neg", ["b"], ["a"], name="n1"),
                helper.make_node("Relu", ["a"], ["b"], name="n2"),
            ],
            "cycle through node 'n1'",
        ),
        ([helper.make_node("Neg", ["ghost"], ["a"], name="n1")], "reads 'ghost'"),
    ],
    ids=["cycle", "dangling"],
)
def test_cycles_and_dangling_inputs_are_still_refused(
    nodes: list[onnx.NodeProto], expected: str
) -> None:
    graph = helper.make_graph(
        nodes, "g", [], [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1])]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelLoadError, match=expected) as caught:
        fuser.fuse(model, cache=False)
    assert str(caught.value).startswith("<model>: ")


def test_unsorted_and_otherwise_invalid_is_refused_for_the_other_reason() -> None:
    """The order is checked once the checker refuses the model: sorted, the model is checked
    again and refused for what else is wrong, as when sorting came first."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    nodes = [
        helper.make_node("NoSuchOp", ["a"], ["y"], name="late"),
        helper.make_node("Relu", ["x"], ["a"], name="early"),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    assert "topologically sorted" in (checker_refuses(model) or "")
    with pytest.raises(ModelLoadError, match=r"invalid ONNX model: .*NoSuchOp") as caught:
        fuser.fuse(model, cache=False)
    assert "topologically" not in str(caught.value)


# -- 9: LayerNormalization below opset 17 ------------------------------------------------------


@pytest.mark.parametrize("opset", [11, 13, 16])
def test_layernorm_below_opset_17_fuses_as_onnxruntime_runs_it(opset: int) -> None:
    model = layernorm_matmul(opset)
    assert "No Op registered for LayerNormalization" in (checker_refuses(model) or "")
    run_ort(model, feeds_for(model))  # onnxruntime runs it
    result = fuser.fuse(model, cache=False)
    assert result.report.summary["layernorm_matmul"] == 1
    assert [n.op_type for n in result.model.graph.node] == ["LayerNormMatMul", "Relu"]
    assert any(f"at opset {opset}" in n for n in result.report.normalized)
    onnx.checker.check_model(result.model, full_check=True)  # more valid than the input
    assert_fused_equal(model, result)


def test_unfused_layernorm_below_opset_17_is_written_as_it_was() -> None:
    model = layernorm_matmul(13)
    del model.graph.node[1:]  # LayerNormalization alone: nothing to fuse
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("n", TensorProto.FLOAT, [2, 3, 8]))
    del model.graph.initializer[2:]
    result = fuser.fuse(model, cache=False)
    assert result.report.fusions == ()
    assert result.model.SerializeToString() == model.SerializeToString()


# -- 9: IR version below 4 with initializers that are not inputs --------------------------------


def test_ir3_initializers_not_listed_as_inputs() -> None:
    model = conv_bn_relu(opset=8, ir_version=3)
    assert "not in graph input" in (checker_refuses(model) or "")
    result = fuser.fuse(model, cache=False, functions=False)
    assert result.model.ir_version == 4  # function bodies (on by default) would need IR 10
    assert result.report.summary["conv_bn_relu"] == 1  # the weights are constants, as in ORT
    assert any("IR version 3 -> 4" in n for n in result.report.normalized)
    onnx.checker.check_model(result.model, full_check=True)
    assert_fused_equal(model, result)


# -- 9/10: graph inputs and outputs without shape or type --------------------------------------


def test_output_without_shape_gets_the_inferred_one() -> None:
    model = layernorm_matmul(out_shape=False)
    assert "Field 'shape'" in (checker_refuses(model) or "")
    result = fuser.fuse(model, cache=False)
    assert result.warnings == ()
    assert "graph output 'y' had no shape: inferred" in result.report.normalized
    dims = result.model.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [2, 3, 5]
    onnx.checker.check_model(result.model, full_check=True)


def test_output_without_type_and_input_without_type() -> None:
    model = conv_bn_relu()
    model.graph.output[0].ClearField("type")
    model.graph.input.append(onnx.ValueInfoProto(name="W"))  # typed by its initializer
    model.ir_version = 8
    assert checker_refuses(model) is not None
    result = fuser.fuse(model, cache=False)
    assert "graph output 'y' had no type: inferred" in result.report.normalized
    assert "graph input 'W' had no type: taken from its initializer" in result.report.normalized
    onnx.checker.check_model(result.model, full_check=True)


def test_uninferable_output_shape_is_a_warning_and_the_rest_still_fuses() -> None:
    """An output only onnxruntime can type (a com.microsoft op): the checker's complaint is a
    warning naming the value; the Conv chain is fused; the output keeps its unknown shape."""
    model = conv_bn_relu()
    model.graph.node.append(
        helper.make_node("Gelu", ["y"], ["z"], name="gelu", domain="com.microsoft")
    )
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    assert "Field 'shape' of 'type' is required" in (checker_refuses(model) or "")
    result = fuser.fuse(model, cache=False)
    assert result.report.summary["conv_bn_relu"] == 1
    (warning,) = result.warnings
    assert "graph output 'z'" in warning and "Field 'shape' of 'type'" in warning
    assert "\n" not in warning
    assert not result.model.graph.output[0].type.tensor_type.HasField("shape")
    # no less valid than the input: the same single complaint, nothing new
    assert checker_refuses(result.model) == checker_refuses(model)


# -- 10: refused as onnxruntime refuses ---------------------------------------------------------


def test_opset_newer_than_onnxruntime_knows_is_refused() -> None:
    model = conv_bn_relu(opset=99)
    with pytest.raises(ModelLoadError, match=r"<model>: imports opset 99 of ai\.onnx"):
        fuser.fuse(model, cache=False)


def test_normalized_output_fuses_again_to_the_same_bytes() -> None:
    once = fuser.fuse(layernorm_matmul(13, reverse=True, out_shape=False), cache=False)
    assert len(once.report.normalized) == 3  # sorted, output shape inferred, opset-13 LN
    twice = fuser.fuse(once.model, cache=False)
    assert twice.report.normalized == ()
    assert twice.model.SerializeToString() == once.model.SerializeToString()


# -- 10: the API's errors -----------------------------------------------------------------------


def test_patterns_as_a_string() -> None:
    model = conv_bn_relu()
    result = fuser.fuse(model, patterns="conv_bn_relu", cache=False)
    assert result.report.patterns == ("conv_bn_relu",)
    assert result.report.summary == {"conv_bn_relu": 1}
    assert fuser.fuse(model, disable="conv_bn_relu", cache=False).report.fusions == ()
    with pytest.raises(UsageError, match="unknown pattern 'nope'; known patterns: conv_bn_relu"):
        fuser.fuse(model, patterns="conv_bn_relu, nope", cache=False)


def test_unknown_example_is_a_usage_error_listing_the_known_ones() -> None:
    from fuser.models import EXAMPLES, get_example

    with pytest.raises(UsageError) as caught:
        get_example("nope")
    message = str(caught.value)
    assert message.startswith("unknown example model 'nope'; known: ")
    assert all(name in message for name in EXAMPLES)
    assert isinstance(caught.value, FuserError) and isinstance(caught.value, KeyError)


def test_reading_legacy_layernorm_leaves_onnx_reference_working() -> None:
    """The schema behind the legacy view must not shadow the ONNX op of the same name: onnx's
    reference runtime (fuser's constant folding uses it) indexes schemas by name alone, when
    first imported, so this runs in a fresh interpreter."""
    code = (
        "import onnx, fuser\n"
        "from onnx import TensorProto as T, helper as h\n"
        "n = h.make_node('LayerNormalization', ['x', 's'], ['y'])\n"
        "s = h.make_tensor('s', T.FLOAT, [4], [1, 2, 3, 4])\n"
        "x = h.make_tensor_value_info('x', T.FLOAT, [2, 4])\n"
        "y = h.make_tensor_value_info('y', T.FLOAT, [2, 4])\n"
        "g = h.make_graph([n], 'g', [x], [y], [s])\n"
        "fuser.fuse(h.make_model(g, opset_imports=[h.make_opsetid('', 13)]), cache=False)\n"
        "from onnx.reference import ReferenceEvaluator\n"
        "print('reference ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and "reference ok" in done.stdout, done.stderr[-2000:]


def test_heavy_initializers_are_typed_but_not_copied_into_the_views() -> None:
    """onnx's tools see a large weight as a typed input: its type and shape still reach the
    passes, the checker still checks the rest, and the model itself keeps its data."""
    from fuser import checkview, engine

    model = layernorm_matmul()
    big = np.arange(64 * 1024, dtype=np.float32).reshape(8, -1)  # 256 KB
    model.graph.initializer[2].CopyFrom(numpy_helper.from_array(big, "w"))
    model.graph.output[0].type.tensor_type.shape.dim[2].dim_value = big.shape[1]
    view = checkview.inference_view(model)
    assert [t.name for t in view.graph.initializer] == ["g", "b"]
    assert "w" in [v.name for v in view.graph.input]
    types = engine.infer_types(model)[""]
    assert types["w"].shape == big.shape and types["m"].shape == (2, 3, big.shape[1])
    assert len(model.graph.initializer[2].raw_data) == big.nbytes
    model.graph.node.append(helper.make_node("NoSuchOp", ["y"], ["z"], name="bad"))
    with pytest.raises(ModelLoadError, match="NoSuchOp"):
        fuser.fuse(model, cache=False)


@pytest.mark.parametrize("opset", [16, 17])
def test_one_walk_over_the_nodes_serves_normalize_and_the_input_check(
    opset: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fuse scans the input's nodes once, before normalize, and gives the scan to the check
    # (normalizing changes no node); the notes and the types are those of scanning twice
    from fuser import api, check_infer, checkview
    from fuser.modelio import load_model
    from fuser.normalize import normalize

    model = layernorm_matmul(opset)

    def load_stage(shared: bool) -> tuple[list[str], list[object], int]:
        scans = []
        real = checkview.scan_nodes

        def counted(m: onnx.ModelProto) -> checkview.NodeScan:
            scans.append(m)
            return real(m)

        with monkeypatch.context() as patch:
            patch.setattr(checkview, "scan_nodes", counted)
            loaded = load_model(model)
            scan = counted(loaded.model) if shared else None
            notes = normalize(loaded, sort=False, scan=scan)
            checked = check_infer.check_and_infer(loaded, as_read=not notes, scan=scan)
        assert checked is not None
        table = checked[0][""]
        return notes, [(name, table[name]) for name in table], len(scans)

    shared, alone = load_stage(True), load_stage(False)
    assert shared[:2] == alone[:2]
    assert shared[2] == alone[2] - 1  # one walk fewer (a legacy model's view walks again)
    assert bool(shared[0]) is (opset < 17)  # the legacy note, from the shared scan
    spied = []
    real_scan = api.scan_nodes
    monkeypatch.setattr(api, "scan_nodes", lambda m: spied.append(m) or real_scan(m))
    fuser.fuse(model)
    assert len(spied) == 1


def test_a_scan_is_not_taken_where_normalize_sorts() -> None:
    from fuser.checkview import scan_nodes
    from fuser.modelio import load_model
    from fuser.normalize import normalize

    loaded = load_model(conv_bn_relu())
    with pytest.raises(ValueError, match="sort=False"):
        normalize(loaded, scan=scan_nodes(loaded.model))
