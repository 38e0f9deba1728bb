"""rmsnorm_matmul: RMSNorm (ops or decomposed, fp16 Cast form) -> Linears => RmsNormMatMul.

Positive cases count the fusions and the nodes left, and compare the fused model run through the
plugin with the original in onnxruntime, on seeded inputs with a zero row (where a lost epsilon
shows as NaN) and symbolic dims. Negative cases assert that nothing is fused and the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from fuser.models import get_example
from fuser.models.inventory import count_chains
from fuser.patterns.rmsnorm_matmul import RMSNORM_MATMUL, reference, rms_norm
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser.ort import session
from fuser.testing import assert_equivalent, assert_runs_stock, count_ops, fuse_all, reasons

PATTERN = "rmsnorm_matmul"
D = 12


@dataclass
class G:
    """A tiny graph: nodes, initializers, one input x [batch, seq, d]."""

    dtype: Any = np.float32
    opset: int = 18
    d: int = D
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    declared: dict[str, list[int | str]] = field(default_factory=dict)  # where inference has none

    def __post_init__(self) -> None:
        self.inputs.append(helper.make_tensor_value_info("x", self.elem, ["batch", "seq", self.d]))

    @property
    def elem(self) -> int:
        return helper.np_dtype_to_tensor_dtype(np.dtype(self.dtype))

    def const(self, value: Any, name: str, dtype: Any = None) -> str:
        array = np.asarray(value, dtype=dtype or self.dtype)
        self.inits.append(numpy_helper.from_array(array, f"{name}_{len(self.inits)}"))
        return self.inits[-1].name

    def op(
        self, op_type: str, *inputs: str, name: str | None = None, domain: str = "", **attrs: Any
    ) -> str:
        name = name or f"{op_type}_{len(self.nodes)}"
        self.nodes.append(
            helper.make_node(
                op_type, list(inputs), [f"{name}_out"], name=name, domain=domain, **attrs
            )
        )
        return f"{name}_out"

    def matmul(self, x: str, n: int, name: str = "") -> str:
        w = self.const(self.rng.standard_normal((self.d, n)) / np.sqrt(self.d), "W")
        return self.op("MatMul", x, w, name=name or None)

    def model(self) -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in self.outputs]
        graph = helper.make_graph(self.nodes, "t", self.inputs, outs, self.inits)
        opsets = [helper.make_opsetid("", self.opset)]
        if any(n.domain == "com.microsoft" for n in self.nodes):
            opsets.append(helper.make_opsetid("com.microsoft", 1))
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 10
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        del model.graph.output[:]
        for out in inferred.graph.output:
            if out.name in self.declared:
                elem = out.type.tensor_type.elem_type or self.elem
                out = helper.make_tensor_value_info(out.name, elem, self.declared[out.name])
            model.graph.output.append(out)
        return model


def rms(
    g: G,
    x: str = "x",
    *,
    square: str = "pow",
    inverse: str = "div_one",
    exponent: float = 2.0,
    axes: Sequence[int] = (-1,),
    keepdims: int = 1,
    eps: float | str = 1e-6,
    gamma_shape: Sequence[int] | None = (D,),
    gamma_first: bool = True,
    numerator: float = 1.0,
    cast: bool | None = None,
) -> str:
    """The decomposed RMSNorm as exporters write it (with the fp16 Casts when the dtype is
    float16, unless `cast` says otherwise); returns N."""
    half = np.dtype(g.dtype) == np.float16 if cast is None else cast
    stats = np.float32 if half else g.dtype
    xs = g.op("Cast", x, to=TensorProto.FLOAT, name="cast_up") if half else x
    sq = (
        g.op("Pow", xs, g.const(exponent, "two", stats), name="pow")
        if square == "pow"
        else g.op("Mul", xs, xs, name="square")
    )
    if g.opset >= 18:
        ms = g.op(
            "ReduceMean", sq, g.const(list(axes), "axes", np.int64), keepdims=keepdims, name="mean"
        )
    else:
        ms = g.op("ReduceMean", sq, axes=list(axes), keepdims=keepdims, name="mean")
    e = eps if isinstance(eps, str) else g.const(eps, "eps", stats)
    r = g.op("Sqrt", g.op("Add", ms, e, name="add_eps"), name="sqrt")
    if inverse == "div":
        n = g.op("Div", xs, r, name="normalize")
    elif inverse == "reciprocal":
        n = g.op("Mul", xs, g.op("Reciprocal", r, name="rsqrt"), name="normalize")
    else:
        inv = g.op("Div", g.const(numerator, "one", stats), r, name="rsqrt")
        n = g.op("Mul", xs, inv, name="normalize")
    if half:
        n = g.op("Cast", n, to=g.elem, name="cast_down")
    if gamma_shape is None:
        return n
    gamma = g.const(g.rng.uniform(0.5, 1.5, gamma_shape), "gamma")
    return (
        g.op("Mul", gamma, n, name="scale") if gamma_first else g.op("Mul", n, gamma, name="scale")
    )


def feeds(g: G, batch: int = 2, seq: int = 5) -> dict[str, np.ndarray]:
    x = g.rng.standard_normal((batch, seq, g.d)) * 2
    x[0, 1] = 0.0  # a zero row: ms = 0, only epsilon keeps N finite
    return {"x": x.astype(g.dtype)}


def fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "RmsNormMatMul"]


def attrs_of(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def check_fused(g: G, fusions: int = 1, nodes_after: int | None = None) -> onnx.ModelProto:
    model = g.model()
    result = fuse_all(model, [PATTERN])
    assert result.report.summary[PATTERN] == fusions, reasons(result)
    if nodes_after is not None:
        assert len(result.model.graph.node) == nodes_after
    onnx.checker.check_model(result.model, full_check=True)
    assert_equivalent(model, result.model, inputs=feeds(g), runs=1)
    assert fuser.validate(model, result).ok  # fused op on its simulated NPU kernel
    return result.model


def rejected(g: G) -> list[str]:
    result = fuse_all(g.model(), [PATTERN])
    assert result.report.summary[PATTERN] == 0
    found = reasons(result, PATTERN)
    near = [m.reason for m in fuser.inspect(g.model(), [PATTERN]).near_misses]
    assert near == found  # inspect shows the same near misses
    return found


# -- positive ----------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("square", ["pow", "mul"])
@pytest.mark.parametrize("inverse", ["div_one", "reciprocal", "div"])
def test_decomposed_qkv_fuses_into_one_node(opset: int, square: str, inverse: str) -> None:
    g = G(opset=opset)
    n = rms(g, square=square, inverse=inverse, gamma_first=inverse != "div")
    g.outputs += [g.matmul(n, 8, "q"), g.matmul(n, 4, "k"), g.matmul(n, 4, "v")]
    fused = check_fused(g, nodes_after=1)
    (node,) = fused_nodes(fused)
    a = attrs_of(node)
    assert a["stash_type"] == 0 and a["round_before_scale"] == 1
    assert a["has_bias"] == [0, 0, 0] and np.float32(a["epsilon"]) == np.float32(1e-6)
    assert node.output[0] == ""  # normalized is read by nothing else


def test_fp16_cast_form_keeps_statistics_in_float32() -> None:
    g = G(dtype=np.float16)
    n = rms(g)
    g.outputs += [g.matmul(n, 16, "gate"), g.matmul(n, 16, "up")]
    fused = check_fused(g, nodes_after=1)
    (node,) = fused_nodes(fused)
    assert attrs_of(node)["stash_type"] == 1
    assert attrs_of(node)["round_before_scale"] == 1
    report = fuse_all(g.model(), [PATTERN]).report
    assert any("statistics in float32" in note for f in report.fusions for note in f.notes)


def test_fp16_statistics_really_are_float32() -> None:
    """Values whose squares overflow float16: only float32 statistics stay finite."""
    x = np.full((1, 4), 300.0, np.float16)
    n32 = rms_norm(x, None, 1e-6, 1, 1)
    np.testing.assert_allclose(n32.astype(np.float32), 1.0, rtol=1e-3)
    assert not np.allclose(rms_norm(x, None, 1e-6, 0, 1).astype(np.float32), 1.0, rtol=0.1)


def test_fp32_without_gamma_and_with_bias_and_odd_width() -> None:
    g = G(d=13)
    n = rms(g, gamma_shape=None)
    y = g.matmul(n, 7, "q")
    g.outputs.append(g.op("Add", g.const(g.rng.standard_normal(7), "b"), y, name="bias"))
    fused = check_fused(g, nodes_after=1)
    (node,) = fused_nodes(fused)
    assert attrs_of(node)["has_bias"] == [1]
    assert node.input[1] == ""  # no gamma


def test_normalized_read_by_residual_and_shape_is_output() -> None:
    g = G()
    n = rms(g)
    g.outputs += [g.matmul(n, 8, "q"), g.op("Add", n, "x", name="residual")]
    g.outputs.append(g.op("Shape", n, name="shape"))
    fused = check_fused(g, nodes_after=3)
    (node,) = fused_nodes(fused)
    assert node.output[0]  # normalized, for the residual Add
    shape = next(n for n in fused.graph.node if n.op_type == "Shape")
    assert list(shape.input) == ["x"]  # re-pointed to the same-shaped input


def test_reshape_to_gemm_and_matmul_flatten() -> None:
    g = G()
    n = rms(g)
    flat = g.const([-1, D], "shape", np.int64)
    w = g.const(g.rng.standard_normal((6, D)), "Wt")
    g.outputs.append(g.op("Gemm", g.op("Reshape", n, flat), w, transB=1, alpha=0.5, name="gemm"))
    g.outputs.append(g.matmul(g.op("Reshape", n, flat, name="flat2"), 5, "mm2"))
    fused = check_fused(g, nodes_after=1)
    assert attrs_of(fused_nodes(fused)[0])["flatten"] == [1, 1]


def test_gamma_with_leading_ones_and_noop_casts() -> None:
    g = G()
    x = g.op("Cast", "x", to=TensorProto.FLOAT, name="noop_in")
    n = rms(g, x, gamma_shape=(1, 1, D), gamma_first=False)
    n = g.op("Cast", n, to=TensorProto.FLOAT, name="noop_out")
    g.outputs.append(g.matmul(n, 8))
    check_fused(g, nodes_after=1)


def norm_op_graph(op: str, domain: str, dtype: Any) -> G:
    g = G(dtype=dtype, opset=23, d=20)
    gamma = g.const(g.rng.uniform(0.5, 1.5, 20), "gamma")
    n = g.op(op, "x", gamma, axis=-1, epsilon=1e-5, name="norm", domain=domain)
    g.outputs += [g.matmul(n, 9, "q"), g.matmul(n, 9, "k")]
    g.declared = {o: ["batch", "seq", 9] for o in g.outputs}  # onnx cannot infer through
    return g


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rmsnormalization_op(dtype: Any) -> None:
    fused = check_fused(norm_op_graph("RMSNormalization", "", dtype), nodes_after=1)
    a = attrs_of(fused_nodes(fused)[0])
    assert a["stash_type"] == 1 and a["round_before_scale"] == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_simplified_layernormalization_op(dtype: Any) -> None:
    """onnxruntime runs its contrib op in the ONNX domain, which onnx's checker (and so fuser's
    loader) does not know; fuser fuses the com.microsoft spelling, compared here with
    onnxruntime running the ONNX-domain one."""
    g = norm_op_graph("SimplifiedLayerNormalization", "com.microsoft", dtype)
    model = g.model()
    result = fuse_all(model, [PATTERN])
    assert result.report.summary[PATTERN] == 1 and len(result.model.graph.node) == 1
    assert attrs_of(fused_nodes(result.model)[0])["round_before_scale"] == 0
    ort_model = onnx.ModelProto()
    ort_model.CopyFrom(model)
    ort_model.graph.node[0].domain = ""
    x = feeds(g)
    expected = onnxruntime.InferenceSession(
        ort_model.SerializeToString(), providers=["CPUExecutionProvider"]
    ).run(None, x)
    got = session(result.model, kernel="reference").run(None, x)
    tol = 1e-3 if dtype == np.float16 else 1e-5
    for e, a in zip(expected, got, strict=True):
        np.testing.assert_allclose(a.astype(np.float32), e.astype(np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["llama", "llama-fp16", "llama-op"])
def test_llama_examples_fuse_every_rmsnorm(name: str) -> None:
    model = get_example(name)
    result = fuse_all(model)
    # 2 layers: input/post-attention norms each, plus the final norm; 11 MatMuls on them.
    assert result.report.summary[PATTERN] == 5
    fused = fused_nodes(result.model)
    assert sum(len(attrs_of(n)["has_bias"]) for n in fused) == 11
    assert count_ops(result.model, "ReduceMean") == 0
    assert count_ops(result.model, "RMSNormalization") == 0
    assert_equivalent(model, result.model, runs=2)


def test_reference_rounds_gamma_as_the_forms_do() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 32)).astype(np.float16)
    gamma = rng.uniform(0.5, 1.5, 32).astype(np.float16)
    xs = x.astype(np.float32)
    inv = 1 / np.sqrt((xs * xs).mean(-1, keepdims=True) + np.float32(1e-6))
    once = (xs * inv * gamma.astype(np.float32)).astype(np.float16)
    twice = ((xs * inv).astype(np.float16) * gamma).astype(np.float16)
    assert (once != twice).any()  # the attribute matters
    np.testing.assert_array_equal(rms_norm(x, gamma, 1e-6, 1, 0), once)
    np.testing.assert_array_equal(rms_norm(x, gamma, 1e-6, 1, 1), twice)
    attrs = {"epsilon": 1e-6, "stash_type": 1, "round_before_scale": 0, "has_bias": [0]}
    w = rng.standard_normal((32, 3)).astype(np.float16)
    n, y = reference([x, gamma, w], attrs | {"flatten": [0]})
    np.testing.assert_array_equal(n, once)
    np.testing.assert_array_equal(y, (once.astype(np.float64) @ w).astype(np.float16))
    assert RMSNORM_MATMUL.name == "RmsNormMatMul"


# -- negative: each blocking trap, with its reason -----------------------------------------------


def test_mean_square_read_elsewhere_blocks() -> None:
    g = G()
    n = rms(g)
    g.outputs += [g.matmul(n, 8), "mean_out"]
    (reason,) = rejected(g)
    assert "internal value 'mean_out' is a graph output" in reason


def test_wrong_exponent() -> None:
    g = G()
    g.outputs.append(g.matmul(rms(g, exponent=3.0), 8))
    (reason,) = rejected(g)
    assert "Pow 'pow' raises to 3" in reason


@pytest.mark.parametrize(("axes", "keepdims", "why"), [
    ((1,), 1, "averages over axes [-2]"),
    ((-2, -1), 1, "averages over axes [-2, -1]"),
    ((-1,), 0, "keepdims=0"),
])  # fmt: skip
def test_reduction_not_over_the_last_axis(axes: Sequence[int], keepdims: int, why: str) -> None:
    g = G(opset=13)
    n = rms(g, axes=axes, keepdims=keepdims)
    g.outputs.append(g.op("MatMul", n, g.const(np.ones((D, 3)), "W")))
    (reason,) = rejected(g)
    assert why in reason and "'mean'" in reason


def test_gamma_broadcasting_on_another_axis() -> None:
    g = G(opset=18)
    g.inputs[0] = helper.make_tensor_value_info("x", g.elem, [2, 5, D])
    g.outputs.append(g.matmul(rms(g, gamma_shape=(5, D)), 8))
    (reason,) = rejected(g)
    assert "gamma" in reason and "varies along axis 1" in reason and "'scale'" in reason


def test_non_constant_epsilon() -> None:
    g = G()
    g.inputs.append(helper.make_tensor_value_info("eps", g.elem, []))
    g.outputs.append(g.matmul(rms(g, eps="eps"), 8))
    (reason,) = rejected(g)
    assert "epsilon 'eps' of 'add_eps' is a graph input, not a constant" in reason


def test_numerator_not_one() -> None:
    g = G()
    g.outputs.append(g.matmul(rms(g, numerator=2.0), 8))
    (reason,) = rejected(g)
    assert "Div 'rsqrt' divides 2 by the RMS" in reason


def test_non_constant_weight() -> None:
    g = G()
    g.inputs.append(helper.make_tensor_value_info("w", g.elem, [D, 4]))
    g.outputs.append(g.op("MatMul", rms(g), "w", name="proj"))
    (reason,) = rejected(g)
    assert "weight 'w' of MatMul 'proj' is a graph input" in reason


def test_op_axis_not_last() -> None:
    g = G(opset=23)
    gamma = g.const(np.ones((5, D)), "gamma")
    g.inputs[0] = helper.make_tensor_value_info("x", g.elem, [2, 5, D])
    n = g.op("RMSNormalization", "x", gamma, axis=1, name="norm")
    g.outputs.append(g.matmul(n, 4))
    (reason,) = rejected(g)
    assert "RMSNormalization 'norm' normalizes from axis 1" in reason


def test_fp16_op_with_stash_type_0_is_refused() -> None:
    g = G(opset=23, dtype=np.float16)
    n = g.op("RMSNormalization", "x", g.const(np.ones(D), "gamma"), stash_type=0, name="norm")
    g.outputs.append(g.matmul(n, 4))
    (reason,) = rejected(g)
    assert "stash_type=0 on a float16 input" in reason


def test_rmsnorm_without_linear_is_not_this_pattern() -> None:
    g = G()
    g.outputs.append(g.op("Add", rms(g, exponent=3.0), "x"))
    assert rejected(g) == []  # nothing to fuse and no near miss: silently not a match


def test_layernorm_variance_is_not_an_rmsnorm() -> None:
    g = G()
    mean = g.op("ReduceMean", "x", g.const([-1], "axes", np.int64), name="mu")
    d = g.op("Sub", "x", mean, name="centre")
    g.outputs.append(g.matmul(rms(g, d, inverse="div"), 8))
    assert rejected(g) == []
    assert fuse_all(g.model()).report.summary["layernorm_matmul"] == 1


def test_one_reshape_feeding_several_gemms() -> None:
    g = G()
    flat = g.op("Reshape", rms(g), g.const([-1, D], "shape", np.int64), name="view")
    for name in ("gate", "up"):
        w = g.const(g.rng.standard_normal((8, D)), "Wt")
        g.outputs.append(g.op("Gemm", flat, w, transB=1, name=name))
    fused = check_fused(g, nodes_after=1)
    assert attrs_of(fused_nodes(fused)[0])["flatten"] == [1, 1]


def test_reshape_read_by_more_than_linears_is_a_near_miss() -> None:
    g = G()
    flat = g.op("Reshape", rms(g), g.const([-1, D], "shape", np.int64), name="view")
    g.outputs += [g.op("Gemm", flat, g.const(np.ones((D, 4)), "W"), name="gate")]
    g.outputs += [g.op("Unsqueeze", flat, g.const([0], "ax", np.int64), name="other")]
    (reason,) = rejected(g)
    assert "Reshape 'view' before Gemm 'gate'" in reason
    assert "also read by 'other' (Unsqueeze)" in reason


# -- real exports (tests/data/exported) ----------------------------------------------------------

EXPORTED = Path(__file__).resolve().parent.parent / "data" / "exported"
# fixture -> (fusions, Linears fused, near misses): every RMSNorm -> Linear chain the inventory
# counts is fused, except Qwen2-MoE's shared-expert Reshape that other nodes read too.
FIXTURES = {
    "llama-ts14": (5, 11, 0),
    "llama-fp16-dynamo18": (5, 11, 0),
    "qwen3-fp16-ts14": (3, 6, 0),
    "mixtral-dynamo18": (2, 4, 0),
    "mixtral-fp16-dynamo18": (2, 4, 0),
    "qwen2moe-dynamo18": (2, 4, 1),
}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_exported_fixture_fuses_every_rmsnorm_matmul_chain(name: str) -> None:
    model = onnx.load(str(EXPORTED / f"{name}.onnx"))
    counts = count_chains(model)
    fusions, linears, misses = FIXTURES[name]
    result = fuse_all(model, [PATTERN])
    assert result.report.summary[PATTERN] == fusions == counts["rmsnorm_matmul"] - misses
    fused = fused_nodes(result.model)
    assert sum(len(attrs_of(n)["has_bias"]) for n in fused) == linears
    half = "fp16" in name
    assert all(attrs_of(n)["stash_type"] == int(half) for n in fused)
    assert len(reasons(result, PATTERN)) == misses
    data = np.load(EXPORTED / f"{name}.npz")
    feeds = {k.removeprefix("in_"): data[k] for k in data.files if k.startswith("in_")}
    assert fuser.validate(model, result, inputs=feeds, runs=1).ok
    assert fuser.validate(model, result, runs=1).ok


def test_fp16_gamma_before_the_cast_back_is_a_near_miss() -> None:
    """Gemma writes `(norm(x.float()) * (1 + w.float())).type_as(x)`: gamma in float32."""
    g = G(dtype=np.float16)
    n = rms(g, gamma_shape=None, cast=True)  # ends with the Cast back: rebuild without it
    g.nodes.pop()
    n32 = g.nodes[-1].output[0]
    w32 = g.const(g.rng.uniform(0.5, 1.5, D), "gamma32", np.float32)
    y = g.op("Cast", g.op("Mul", n32, w32, name="gemma_scale"), to=TensorProto.FLOAT16, name="back")
    g.outputs.append(g.matmul(y, 8))
    assert n  # the dropped Cast's output is unused
    (reason,) = rejected(g)
    assert "gamma 'gamma32_" in reason and "Mul 'gemma_scale' is applied in float32" in reason


# -- the function body (fuser.bodies.rmsnorm_matmul): stock onnxruntime runs the fused model -----


def body_case(case: str) -> tuple[G, str]:
    """A graph per variant of the body, and the variant's name."""
    if case == "fp16-cast":
        g = G(dtype=np.float16)
        n = rms(g)
        g.outputs += [g.matmul(n, 8), g.matmul(n, 4)]
        return g, "float16_statsfloat32_scale_mm_mm"
    if case == "fp32-noscale-bias-flat":
        g = G()
        n = rms(g, gamma_shape=None, inverse="reciprocal")
        y = g.matmul(n, 7)
        g.outputs.append(g.op("Add", y, g.const(g.rng.standard_normal(7), "b")))
        flat = g.op("Reshape", n, g.const([-1, D], "shape", np.int64))
        g.outputs.append(g.op("Gemm", flat, g.const(g.rng.standard_normal((D, 3)), "W")))
        return g, "float32_statsfloat32_mmb_mmf"
    if case == "fp16-nocast-opset13":
        g = G(dtype=np.float16, opset=13)
        g.outputs.append(g.matmul(rms(g, cast=False), 8))
        return g, "float16_statsfloat16_scale_mm"
    dtype = np.float16 if case == "op-fp16" else np.float32
    return norm_op_graph(
        "RMSNormalization", "", dtype
    ), f"{np.dtype(dtype).name}_statsfloat32_scale_once_mm_mm"


@pytest.mark.parametrize(
    "case", ["fp16-cast", "fp32-noscale-bias-flat", "fp16-nocast-opset13", "op-fp16", "op-fp32"]
)
def test_function_body_runs_in_stock_onnxruntime(case: str) -> None:
    g, variant = body_case(case)
    model = g.model()
    fused = fuse_all(model, [PATTERN]).model
    (node,) = fused_nodes(fused)
    assert node.overload == variant
    (body,) = [f for f in fused.functions if f.name == "RmsNormMatMul"]
    ctx = onnx.checker.C.CheckerContext()
    ctx.ir_version = fused.ir_version
    ctx.opset_imports = {o.domain: o.version for o in fused.opset_import}
    onnx.checker.check_function(body, ctx)
    assert assert_runs_stock(model, fused, runs=2) == ["RmsNormMatMul"]


def test_cost_model_says_the_llama_fusions_pay() -> None:
    result = fuser.fuse(get_example("llama-fp16"), target="ascend910b", cache=False)
    assert result.report.summary[PATTERN] == 5
    verdicts = [n for f in result.report.fusions for n in f.notes if n.startswith("cost model")]
    assert len(verdicts) == 5 and all("faster" in v for v in verdicts)


def test_fp16_upcast_read_elsewhere_blocks() -> None:
    g = G(dtype=np.float16)
    n = rms(g)
    g.outputs += [g.matmul(n, 8), g.op("Relu", "cast_up_out", name="spy")]
    (reason,) = rejected(g)
    assert "internal value 'cast_up_out' is also read by 'spy' (Relu) outside the match" in reason


@pytest.mark.parametrize(("axes", "fused"), [((-1,), 1), ((2,), 0)])
def test_unknown_rank(axes: Sequence[int], fused: int) -> None:
    """A positive axis cannot be checked to be the last without the rank; -1 can."""
    g = G(opset=13)
    g.inputs.append(helper.make_tensor_value_info("shape", TensorProto.INT64, ["k"]))
    x = g.op("Reshape", "x", "shape", name="view")  # a rank shape inference cannot know
    g.outputs.append(g.matmul(rms(g, x, axes=axes), 8))
    g.declared = {g.outputs[0]: ["batch", "seq", 8]}
    result = fuse_all(g.model(), [PATTERN])
    assert result.report.summary[PATTERN] == fused
    if fused:
        inputs = feeds(g) | {"shape": np.array([5, 2, D], np.int64)}
        assert_equivalent(g.model(), result.model, inputs=inputs, runs=1)
    else:
        (reason,) = reasons(result, PATTERN)
        assert "has axes [2] but the rank of 'view_out' is unknown" in reason
