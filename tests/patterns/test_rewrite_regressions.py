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
from fuser.kernels.softmax import (
    onnxruntime_softmax,
    onnxruntime_zeroes_subnormal_exp,
    softmax_rows,
)
from onnx import TensorProto, helper, numpy_helper

from fuser.ort import session
from fuser.testing import assert_equivalent, conv_bn_chain, fuse_all, reasons

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


def test_folded_weight_in_a_branch_does_not_shadow_an_outer_value() -> None:
    """The branch reads outer 'conv.W_bn_folded'; the fold inside the branch must not take
    that name (it would silently replace what the branch reads)."""
    rng = np.random.default_rng(RNG_SEED)
    conv, inits = conv_bn_chain("conv", "x", "bn", rng, 2)
    then_nodes = [*conv, helper.make_node("Add", ["bn", "conv.W_bn_folded"], ["t"])]
    then = helper.make_graph(
        then_nodes,
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 2, 3, 3])],
        inits,
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
    conv, inits = conv_bn_chain("conv", "x", "bn", rng, 2)
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


@pytest.mark.parametrize("bias_shape", [(), (1,)])
def test_allgather_matmul_scalar_bias_runs_on_the_npu_kernel(bias_shape: tuple[int, ...]) -> None:
    model, _ = _gather_model(bias_shape, (3, 5))
    result = fuse_all(model)
    assert result.report.summary["allgather_matmul"] == 1, reasons(result)
    (node,) = [n for n in result.model.graph.node if n.domain == "fuser"]
    bias = next(t for t in result.model.graph.initializer if t.name == node.input[2])
    assert list(bias.dims) == [5]
    validated = assert_equivalent(model, result.model, runs=2, kernel="npu")
    assert validated.ranks == 2


def test_allgather_matmul_batched_weight_is_refused() -> None:
    model, _ = _gather_model(None, (2, 3, 5))
    result = fuse_all(model)
    assert result.report.summary["allgather_matmul"] == 0
    assert reasons(result) == [
        "weight 'W' of MatMul 'MatMul#1' has shape [2, 3, 5]; AllGatherMatMul takes a 2-D "
        "[K, N] weight"
    ]


def test_float64_chains_are_refused_for_every_family_but_the_norms() -> None:
    """The NPU's units take float16 and float32: a float64 fused op would not run there. The
    norm families fuse anyway (issue 8): their kernels refuse double, so the cost model leaves
    them unpriced, and their reference and function body compute the original in double."""
    rng = np.random.default_rng(RNG_SEED)
    d = TensorProto.DOUBLE
    conv, _ = conv_bn_chain("conv", "x", "bn", rng, 2)
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
    assert {k: v for k, v in result.report.summary.items() if v} == {"layernorm_matmul": 1}
    assert sorted(reasons(result)) == [
        "'x' is float64, which ConvBnRelu does not support",
        "'y' is float64, which SoftmaxTopK does not support",
    ]


# -- 3: LayerNorm statistics at least as accurate as onnxruntime's kernel -----------------------


def _ln_model(form: str, dtype: Any, width: int, epsilon: float, stash_type: int) -> Any:
    """x [rows, width] -> LayerNorm (op with `stash_type`, or decomposed) -> n (an output too)
    -> MatMul W -> y."""
    rng = np.random.default_rng(RNG_SEED)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    gamma = rng.uniform(0.5, 2, width).astype(dtype)
    beta = rng.standard_normal(width).astype(dtype)
    w = (rng.standard_normal((width, 3)) / np.sqrt(width)).astype(dtype)
    inits = [
        numpy_helper.from_array(np.array(epsilon, dtype), "eps"),
        numpy_helper.from_array(gamma, "gamma"),
        numpy_helper.from_array(beta, "beta"),
        numpy_helper.from_array(w, "w"),
    ]
    if form == "op":
        ln = [
            helper.make_node(
                "LayerNormalization",
                ["x", "gamma", "beta"],
                ["n"],
                epsilon=epsilon,
                stash_type=stash_type,
            )
        ]
        inits = inits[1:]
    else:
        ln = _decomposed_ln("x", "gamma", "beta", "n")
    model = _model(
        [*ln, helper.make_node("MatMul", ["n", "w"], ["y"])],
        [helper.make_tensor_value_info("x", elem, ["rows", width])],
        [
            helper.make_tensor_value_info("y", elem, ["rows", 3]),
            helper.make_tensor_value_info("n", elem, ["rows", width]),
        ],
        inits,
        opset=17 if form == "op" else 13,
    )
    return model, (gamma, beta, w)


def _float64_layernorm(x: np.ndarray, gamma: Any, beta: Any, w: Any, eps: float) -> Any:
    x64 = x.astype(np.float64)
    d = x64 - x64.mean(axis=-1, keepdims=True)
    n = d / np.sqrt((d * d).mean(axis=-1, keepdims=True) + eps) * gamma + beta
    return n @ w.astype(np.float64), n


@pytest.mark.parametrize("kernel", ["reference", "npu"])
@pytest.mark.parametrize(("form", "stash_type"), [("op", 0), ("op", 1), ("decomposed", 0)])
def test_float16_statistics_do_not_overflow(form: str, stash_type: int, kernel: str) -> None:
    """x = [300, -300, 0, 0] in float16: 300^2 overflows float16, so statistics in float16
    give 0s; onnxruntime's kernel (which also runs the decomposed chain) gives
    [1.414, -1.414, 0, 0]."""
    model, (gamma, beta, w) = _ln_model(form, np.float16, 4, 1e-5, stash_type)
    result = fuse_all(model)
    assert result.report.summary["layernorm_matmul"] == 1, reasons(result)
    x = np.array([[300, -300, 0, 0], [1, 2, 3, 4]], np.float16)
    y, n = _run_fused(result.model, {"x": x}, kernel)
    y64, n64 = _float64_layernorm(x, gamma, beta, w, 1e-5)
    np.testing.assert_allclose(n.astype(np.float64), n64, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(y.astype(np.float64), y64, rtol=1e-2, atol=1e-2)
    if form == "decomposed":  # onnxruntime runs the original chain accurately too
        _, expected_n = _run_original(model, {"x": x})
        np.testing.assert_allclose(n.astype(np.float32), expected_n, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kernel", ["reference", "npu"])
@pytest.mark.parametrize("form", ["op", "decomposed"])
@pytest.mark.parametrize("width", [7, 768])
def test_float32_constant_rows_with_tiny_epsilon_match_float64(
    form: str, width: int, kernel: str
) -> None:
    """epsilon 1e-12, constant rows: exactly, the normalized value is beta. float32 statistics
    whose mean misses the row's value by an ulp gave 0.21 off; onnxruntime's kernel 4e-7."""
    eps = float(np.float32(1e-12))
    model, (gamma, beta, w) = _ln_model(form, np.float32, width, eps, 1)
    result = fuse_all(model)
    assert result.report.summary["layernorm_matmul"] == 1, reasons(result)
    rng = np.random.default_rng(RNG_SEED + width)
    values = rng.uniform(-3, 3, 16).astype(np.float32)
    x = np.repeat(values[:, None], width, axis=1)
    y, n = _run_fused(result.model, {"x": x}, kernel)
    y64, n64 = _float64_layernorm(x, gamma, beta, w, eps)
    assert float(np.abs(n - n64).max()) <= 1e-6
    assert float(np.abs(y - y64).max()) <= 1e-5


# -- 4: SoftmaxTopK on rows with float32 denormal probabilities --------------------------------


@pytest.mark.parametrize("kernel", ["reference", "npu"])
@pytest.mark.parametrize("order", ["softmax_topk", "topk_softmax"])
def test_softmax_topk_matches_onnxruntime_on_denormal_probabilities(
    order: str, kernel: str
) -> None:
    """Logits 87+ below the row's max give float32 subnormal probabilities (exp(-103.6) is
    about 1e-45). onnxruntime's Softmax keeps them on an AVX-512 CPU (logits
    [0, -300, -103.6, -200], k=2 give indices [0, 2]) and makes them 0 on an AVX2 one
    (indices [0, 1]: the lowest index among equal zeros): the fused op must do as the
    host's does, or the index chosen among the "zeros" changes."""
    if order == "softmax_topk":
        nodes = [
            helper.make_node("Softmax", ["x"], ["p"], axis=-1),
            helper.make_node("TopK", ["p", "k"], ["v", "i"]),
        ]
    else:
        nodes = [
            helper.make_node("TopK", ["x", "k"], ["t", "i"]),
            helper.make_node("Softmax", ["t"], ["v"], axis=-1),
        ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 6])],
        [
            helper.make_tensor_value_info("v", TensorProto.FLOAT, ["rows", 3]),
            helper.make_tensor_value_info("i", TensorProto.INT64, ["rows", 3]),
        ],
        [numpy_helper.from_array(np.array([3], np.int64), "k")],
        opset=13,
    )
    result = fuse_all(model)
    assert result.report.summary["softmax_topk"] == 1, reasons(result)
    rng = np.random.default_rng(RNG_SEED)
    x = np.zeros((400, 6), np.float32)
    x[:, 1:] = rng.uniform(-106, -85, (400, 5)).astype(np.float32)
    x[0] = [0, -300, -103.6, -200, -300, -300]
    x[1] = [0, -103.95, -103.9, -104, -120, -87.3]  # around the smallest denormal
    expected_v, expected_i = _run_original(model, {"x": x})
    actual_v, actual_i = _run_fused(result.model, {"x": x}, kernel)
    if order == "softmax_topk":
        zeroed = onnxruntime_zeroes_subnormal_exp()
        assert list(expected_i[0][:2]) == ([0, 1] if zeroed else [0, 2])
    np.testing.assert_array_equal(actual_i, expected_i)
    # values: float32 rounding apart (a few ulps; among denormals ulps are 1.4e-45 each)
    np.testing.assert_allclose(actual_v, expected_v, rtol=1e-5, atol=1e-44)


def test_the_zeroed_softmax_terms_are_those_of_this_hosts_onnxruntime() -> None:
    """Logits swept across the subnormal range of exp (0 down to -110 below the row's max,
    rows with other maxima): fuser's float32 softmax is 0 exactly where onnxruntime's is,
    and equal to it elsewhere to a few ulps."""
    rng = np.random.default_rng(RNG_SEED)
    sweep = np.linspace(-110, 0, 4000, dtype=np.float32)
    x = np.stack([sweep, sweep + 0.5, sweep - 3.25, rng.uniform(-110, 0, 4000)]).astype(np.float32)
    x[:, 0] = [0.0, 0.5, -3.25, 0.0]  # each row's max, at a known place
    expected = onnxruntime_softmax(x)
    actual = softmax_rows(x, np.dtype(np.float32))
    assert ((expected == 0) == (actual == 0)).all()
    assert (expected > 0).sum() > 4 * 600  # the sweep reaches well into the normal range
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-44)
