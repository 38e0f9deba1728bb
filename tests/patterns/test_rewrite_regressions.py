"""Regressions of issue 14 ("wrong or invalid rewrites"), one test (or a few) per defect.

Each builds the smallest model that showed the defect, fuses it with every match accepted, and
checks the fused model against onnxruntime running the original (or against a float64
evaluation where onnxruntime's own kernel is the accurate one).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuser.ort import session
from fuser.testing import fuse_all, reasons

RNG_SEED = 14


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    inits: list[onnx.TensorProto],
    opset: int = 17,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _run_original(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[Any]:
    sess = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return list(sess.run(None, feeds))


def _run_fused(model: onnx.ModelProto, feeds: dict[str, np.ndarray], kernel: str) -> list[Any]:
    return list(session(model, kernel=kernel).run(None, feeds))


def _full_check(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)


# -- 2: new initializer names against enclosing graphs and subgraphs --------------------------


def _conv_bn(prefix: str, x: str, out: str, rng: np.random.Generator) -> tuple[list, list]:
    """Conv named `prefix` -> BN, its parameters as initializers named after it."""
    w = numpy_helper.from_array(rng.standard_normal((2, 2, 1, 1)).astype(np.float32), "w")
    params = [
        numpy_helper.from_array(v.astype(np.float32), f"{prefix}.{n}")
        for n, v in (
            ("s", rng.uniform(0.5, 2, 2)),
            ("b", rng.standard_normal(2)),
            ("m", rng.standard_normal(2)),
            ("v", rng.uniform(0.5, 2, 2)),
        )
    ]
    w.name = f"{prefix}.w"
    nodes = [
        helper.make_node("Conv", [x, w.name], [f"{prefix}.y"], name=prefix),
        helper.make_node("BatchNormalization", [f"{prefix}.y", *(p.name for p in params)], [out]),
    ]
    return nodes, [w, *params]


def test_folded_weight_in_a_branch_does_not_shadow_an_outer_value() -> None:
    """The branch reads outer 'conv.W_bn_folded'; the fold inside the branch must not take
    that name (it would silently replace what the branch reads)."""
    rng = np.random.default_rng(RNG_SEED)
    conv, inits = _conv_bn("conv", "x", "bn", rng)
    then_nodes = [*conv, helper.make_node("Add", ["bn", "conv.W_bn_folded"], ["t"])]
    then = helper.make_graph(
        then_nodes, "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 2, 3, 3])], inits
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["conv.W_bn_folded"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 2, 3, 3])],
    )
    outer = [
        helper.make_node("Relu", ["x"], ["conv.W_bn_folded"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
    ]
    model = _model(
        outer,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 3]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 3])],
        [],
    )
    result = fuse_all(model)
    assert result.report.summary["conv_bn_relu"] == 1, reasons(result)
    _full_check(result.model)
    feeds = {"x": rng.standard_normal((1, 2, 3, 3)).astype(np.float32), "c": np.array(True)}
    (expected,) = _run_original(model, feeds)
    (actual,) = _run_fused(result.model, feeds, "reference")
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_main_graph_fold_does_not_take_a_name_a_subgraph_defines() -> None:
    """A branch defines 'conv.W_bn_folded' itself: a main-graph initializer of that name
    would be defined twice (an SSA violation the checker and onnxruntime refuse)."""
    rng = np.random.default_rng(RNG_SEED)
    conv, inits = _conv_bn("conv", "x", "bn", rng)
    branch = helper.make_graph(
        [
            helper.make_node("Neg", ["x"], ["conv.W_bn_folded"]),
            helper.make_node("Identity", ["conv.W_bn_folded"], ["t"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 2, 3, 3])],
    )
    nodes = [
        *conv,
        helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 3]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 3]),
            helper.make_tensor_value_info("bn", TensorProto.FLOAT, [1, 2, 3, 3]),
        ],
        inits,
    )
    result = fuse_all(model)
    assert result.report.summary["conv_bn_relu"] == 1, reasons(result)
    names = [t.name for t in result.model.graph.initializer]
    assert "conv.W_bn_folded" not in names
    _full_check(result.model)
    feeds = {"x": rng.standard_normal((1, 2, 3, 3)).astype(np.float32), "c": np.array(True)}
    for expected, actual in zip(
        _run_original(model, feeds), _run_fused(result.model, feeds, "reference"), strict=True
    ):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


# -- 1: Shape re-pointing respects broadcasting ------------------------------------------------


def _decomposed_ln(x: str, gamma: str, beta: str, out: str) -> list[onnx.NodeProto]:
    """The exporters' decomposed LayerNorm over the last axis (opset 13: axes attribute)."""
    return [
        helper.make_node("ReduceMean", [x], ["mu"], axes=[-1]),
        helper.make_node("Sub", [x, "mu"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["d2"]),
        helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["std"]),
        helper.make_node("Div", ["d", "std"], ["nrm"]),
        helper.make_node("Mul", ["nrm", gamma], ["scaled"]),
        helper.make_node("Add", ["scaled", beta], [out]),
    ]


def _ln_params(rng: np.random.Generator, width: int, hidden: int) -> list[onnx.TensorProto]:
    return [
        numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
        numpy_helper.from_array(rng.uniform(0.5, 2, width).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), "beta"),
        numpy_helper.from_array(rng.standard_normal((width, hidden)).astype(np.float32), "w"),
    ]


@pytest.mark.parametrize("also_read", [False, True])
def test_gamma_broadcasting_the_normalized_value_up_is_refused(also_read: bool) -> None:
    """X [2, 1] with gamma [4]: N is [2, 4], so Shape(N) is not Shape(X); and the fused op's
    `normalized` would have X's shape. Refused with the reason, nothing rewritten."""
    rng = np.random.default_rng(RNG_SEED)
    nodes = [
        *_decomposed_ln("x", "gamma", "beta", "n"),
        helper.make_node("MatMul", ["n", "w"], ["y"]),
        helper.make_node("Shape", ["n"], ["shape"]),
    ]
    outputs = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
        helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
    ]
    if also_read:
        nodes.append(helper.make_node("Relu", ["n"], ["r"]))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 4]))
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1])],
        outputs,
        _ln_params(rng, 4, 3),
        opset=13,
    )
    result = fuse_all(model)
    assert result.report.summary["layernorm_matmul"] == 0
    (reason,) = reasons(result, "layernorm_matmul")
    assert reason == (
        "gamma 'gamma' of shape [4] broadcasts the normalized value up from the shape of 'x' "
        "[2, 1]; LayerNormMatMul keeps X's shape"
    )


def test_shape_of_normalized_is_served_by_the_fused_op_when_x_shape_is_not_proven() -> None:
    """X [batch, K] with K symbolic and gamma [4]: N has X's shape only if K is 4 (or 1), which
    nothing proves; the Shape then reads the fused op's `normalized` output, not X."""
    rng = np.random.default_rng(RNG_SEED)
    nodes = [
        *_decomposed_ln("x", "gamma", "beta", "n"),
        helper.make_node("MatMul", ["n", "w"], ["y"]),
        helper.make_node("Shape", ["n"], ["shape"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "k"])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        _ln_params(rng, 4, 3),
        opset=13,
    )
    result = fuse_all(model)
    assert result.report.summary["layernorm_matmul"] == 1, reasons(result)
    shape_node = next(n for n in result.model.graph.node if n.op_type == "Shape")
    assert list(shape_node.input) == ["n"]
    _full_check(result.model)
    feeds = {"x": rng.standard_normal((5, 4)).astype(np.float32)}
    for expected, actual in zip(
        _run_original(model, feeds), _run_fused(result.model, feeds, "reference"), strict=True
    ):
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


# -- 5: a Constant(value_float=...) bias keeps the op's dtype ----------------------------------


@pytest.mark.parametrize("linear", ["matmul_add", "gemm"])
def test_constant_value_float_bias_stays_float32(linear: str) -> None:
    """`Constant(value_float=0.25)` is a float32 scalar; the [N] bias fuser broadcasts it to
    must be float32 too (it was float64, feeding a float32 fused op)."""
    rng = np.random.default_rng(RNG_SEED)
    ln = helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], epsilon=1e-5)
    const = helper.make_node("Constant", [], ["b"], value_float=0.25)
    if linear == "gemm":
        linears = [helper.make_node("Gemm", ["n", "w", "b"], ["y"], transB=0)]
    else:
        linears = [
            helper.make_node("MatMul", ["n", "w"], ["p"]),
            helper.make_node("Add", ["p", "b"], ["y"]),
        ]
    inits = _ln_params(rng, 4, 3)[1:]
    model = _model(
        [ln, const, *linears],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 3])],
        inits,
    )
    result = fuse_all(model)
    assert result.report.summary["layernorm_matmul"] == 1, reasons(result)
    new = [t for t in result.model.graph.initializer if t.name not in {i.name for i in inits}]
    assert [t.data_type for t in new] == [TensorProto.FLOAT]
    _full_check(result.model)
    feeds = {"x": rng.standard_normal((5, 4)).astype(np.float32)}
    (expected,) = _run_original(model, feeds)
    (actual,) = _run_fused(result.model, feeds, "npu")
    assert actual.dtype == np.float32
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


# -- 6: what the pattern fuses, the NPU kernel runs (or the pattern refuses it) ----------------


def _gather_model(bias_shape: tuple[int, ...] | None, w_shape: tuple[int, ...]) -> Any:
    rng = np.random.default_rng(RNG_SEED)
    w = numpy_helper.from_array(rng.standard_normal(w_shape).astype(np.float32), "W")
    nodes = [
        helper.make_node(
            "AllGather", ["x"], ["g"], domain="com.microsoft", group_size=2, axis=0, name="ag"
        ),
        helper.make_node("MatMul", ["g", "W"], ["mm" if bias_shape is not None else "y"]),
    ]
    inits = [w]
    if bias_shape is not None:
        inits.append(
            numpy_helper.from_array(rng.standard_normal(bias_shape).astype(np.float32), "B")
        )
        nodes.append(helper.make_node("Add", ["mm", "B"], ["y"], name="bias"))
    out = [4, 5] if len(w_shape) == 2 else [w_shape[0], 4, w_shape[-1]]
    graph = helper.make_graph(
        nodes,
        "rank",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)],
        inits,
        value_info=[helper.make_tensor_value_info("g", TensorProto.FLOAT, [4, 3])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets), inits


def _run_two_ranks(model: onnx.ModelProto, shards: list[np.ndarray]) -> list[np.ndarray]:
    import threading

    from fuser.collective import Communicator

    session(model, kernel="npu")  # registers the plugin op before the ranks' sessions exist
    communicator = Communicator(2)
    sessions = [session(model, kernel="npu", rank=r, communicator=communicator) for r in (0, 1)]
    results: list[np.ndarray] = [np.empty(0), np.empty(0)]
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            results[rank] = sessions[rank].run(None, {"x": shards[rank]})[0]
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("bias_shape", [(), (1,)])
def test_allgather_matmul_scalar_bias_runs_on_the_npu_kernel(bias_shape: tuple[int, ...]) -> None:
    model, (w, b) = _gather_model(bias_shape, (3, 5))
    result = fuse_all(model)
    assert result.report.summary["allgather_matmul"] == 1, reasons(result)
    (node,) = [n for n in result.model.graph.node if n.domain == "fuser"]
    bias = next(t for t in result.model.graph.initializer if t.name == node.input[2])
    assert list(bias.dims) == [5]
    rng = np.random.default_rng(RNG_SEED + 1)
    shards = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2)]
    truth = np.concatenate(shards) @ numpy_helper.to_array(w) + numpy_helper.to_array(b)
    for y in _run_two_ranks(result.model, shards):
        np.testing.assert_allclose(y, truth, rtol=1e-5, atol=1e-5)


def test_allgather_matmul_batched_weight_is_refused() -> None:
    model, _ = _gather_model(None, (2, 3, 5))
    result = fuse_all(model)
    assert result.report.summary["allgather_matmul"] == 0
    assert reasons(result) == [
        "weight 'W' of MatMul 'MatMul#1' has shape [2, 3, 5]; AllGatherMatMul takes a 2-D "
        "[K, N] weight"
    ]


def test_float64_chains_are_refused_for_every_family() -> None:
    """The NPU's units take float16 and float32: a float64 fused op would not run there."""
    rng = np.random.default_rng(RNG_SEED)
    d = TensorProto.DOUBLE
    conv, _ = _conv_bn("conv", "x", "bn", rng)
    inits64 = [
        numpy_helper.from_array(rng.uniform(0.5, 2, s).astype(np.float64), n)
        for n, s in (
            ("conv.w", (2, 2, 1, 1)),
            ("conv.s", 2),
            ("conv.b", 2),
            ("conv.m", 2),
            ("conv.v", 2),
            ("gamma", 9),
            ("beta", 9),
            ("w", (9, 3)),
        )
    ]
    nodes = [
        *conv,
        helper.make_node("Flatten", ["bn"], ["f"]),  # [1, 18] -> reshape [2, 9]
        helper.make_node("Reshape", ["f", "shape"], ["r"]),
        helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["n"]),
        helper.make_node("MatMul", ["n", "w"], ["y"]),
        helper.make_node("Softmax", ["y"], ["p"]),
        helper.make_node("TopK", ["p", "k"], ["v", "i"]),
    ]
    inits64 += [
        numpy_helper.from_array(np.array([2, 9], np.int64), "shape"),
        numpy_helper.from_array(np.array([2], np.int64), "k"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", d, [1, 2, 3, 3])],
        [
            helper.make_tensor_value_info("v", d, [2, 2]),
            helper.make_tensor_value_info("i", TensorProto.INT64, [2, 2]),
        ],
        inits64,
    )
    result = fuse_all(model)
    assert sum(result.report.summary.values()) == 0
    assert sorted(reasons(result)) == [
        "'r' is float64, which LayerNormMatMul does not support",
        "'x' is float64, which ConvBnRelu does not support",
        "'y' is float64, which SoftmaxTopK does not support",
    ]
