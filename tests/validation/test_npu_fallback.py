"""`validate --kernel npu` on float64 fused norms: the NPU has no float64 unit, so such a node
runs on its numpy reference instead, is reported per node as "reference (npu: no float64
unit)", and is compared against the original like every other node (issue 8).

The fallback must not hide anything: every mutant of a float64 node (weight, bias, epsilon,
two weights swapped) is still caught and named, in a float64 model and in a mixed model whose
float32 node keeps running on the NPU kernel; a refusal that is not a machine limit still stops
validation. A target without chip-to-chip links is the other machine limit: it cannot host a
tensor-parallel group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from fuser.kernels.api import NO_FLOAT64_UNIT, KernelError, MachineLimitError, TensorMeta
from fuser.kernels.layernorm import layernorm_spec
from fuser.kernels.rmsnorm_matmul.plan import problem as rms_problem
from fuser.kernels.softmax import check_float
from fuser.models import get_example
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import fuser
from fuser.cli import app
from fuser.errors import ValidationRunError
from fuser.modelio import load_model
from fuser.mutants import mutants
from fuser.testing import fuse_all

D = 13  # odd: no lane-aligned shortcut
FALLBACK = f"reference (npu: {NO_FLOAT64_UNIT})"


class Graph:
    """A test graph of decomposed LayerNorms (opset 17), each feeding MatMuls."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[str] = []

    def input(self, name: str, dtype: Any) -> str:
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        self.inputs.append(helper.make_tensor_value_info(name, elem, ["B", 5, D]))
        return name

    def const(self, value: Any, dtype: Any) -> str:
        name = f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, **attrs: Any) -> str:
        name = f"{op_type}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=name, **attrs))
        return name

    def layer_norm(self, x: str, dtype: Any, widths: tuple[int, ...]) -> None:
        """LN(x) -> one MatMul per width (Q, K, V when there are three)."""
        d = self.op("Sub", x, self.op("ReduceMean", x, axes=[-1], keepdims=1))
        var = self.op("ReduceMean", self.op("Pow", d, self.const(2.0, dtype)), axes=[-1])
        std = self.op("Sqrt", self.op("Add", var, self.const(1e-5, dtype)))
        n = self.op("Div", d, std)
        n = self.op("Mul", n, self.const(self.rng.uniform(0.5, 1.5, D), dtype))
        n = self.op("Add", n, self.const(self.rng.standard_normal(D), dtype))
        for width in widths:
            w = self.const(self.rng.standard_normal((D, width)) * 0.3, dtype)
            self.outputs.append(self.op("MatMul", n, w))

    def model(self) -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in self.outputs]
        graph = helper.make_graph(self.nodes, "mixed", self.inputs, outs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        return onnx.shape_inference.infer_shapes(model)


def float64_model() -> onnx.ModelProto:
    g = Graph()
    g.layer_norm(g.input("x", np.float64), np.float64, (7, 7, 5))
    return g.model()


def mixed_model() -> onnx.ModelProto:
    """A float32 LN -> QKV (runs on the NPU kernel) beside a float64 LN -> gate/up."""
    g = Graph(1)
    g.layer_norm(g.input("x32", np.float32), np.float32, (6, 6, 4))
    g.layer_norm(g.input("x64", np.float64), np.float64, (7, 7))
    return g.model()


def fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "fuser"]


def dtype_of(model: onnx.ModelProto, node: onnx.NodeProto) -> int:
    (x,) = [v for v in model.graph.input if v.name == node.input[0]]
    return x.type.tensor_type.elem_type


def node_modes(result: Any) -> dict[tuple[str, str], tuple[str, str]]:
    """(node, mode) -> (kernel, fallback) over the node comparisons."""
    return {(c.node, c.mode): (c.kernel, c.fallback) for c in result.nodes}


@pytest.fixture(scope="module")
def mixed() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    original = mixed_model()
    return original, fuser.fuse(original, cache=False).model


def test_float64_model_validates_on_the_npu_with_each_node_on_its_reference() -> None:
    original = float64_model()
    fused = fuser.fuse(original, cache=False).model
    (node,) = fused_nodes(fused)
    result = fuser.validate(original, fused, runs=2)  # default kernel: the simulated NPU
    assert result.ok and result.kernel == "npu"
    assert result.node_kernels == {node.name: FALLBACK}
    assert result.kernel_counts == {FALLBACK: 1}
    # compared in the model and run alone: every output of the node, on the reference
    modes = node_modes(result)
    assert modes[(node.name, "model")] == modes[(node.name, "isolated")]
    assert modes[(node.name, "model")] == ("reference", NO_FLOAT64_UNIT)
    assert len([c for c in result.nodes if c.mode == "isolated"]) == 3  # Q, K, V
    data = json.loads(json.dumps(result.to_dict()))
    assert data["kernel_counts"] == {FALLBACK: 1}
    assert data["node_kernels"] == {node.name: FALLBACK}
    assert all(c["kernel"] == FALLBACK for c in data["nodes"])


def test_mixed_model_runs_float32_on_the_npu_and_float64_on_the_reference(
    mixed: tuple[onnx.ModelProto, onnx.ModelProto],
) -> None:
    original, fused = mixed
    nodes = fused_nodes(fused)
    assert sorted(dtype_of(fused, n) for n in nodes) == [TensorProto.FLOAT, TensorProto.DOUBLE]
    result = fuser.validate(original, fused, runs=2)
    assert result.ok
    want = {n.name: "npu" if dtype_of(fused, n) == TensorProto.FLOAT else FALLBACK for n in nodes}
    assert result.node_kernels == want
    assert result.kernel_counts == {"npu": 1, FALLBACK: 1}
    for n in nodes:
        kernel = ("npu", "") if want[n.name] == "npu" else ("reference", NO_FLOAT64_UNIT)
        assert node_modes(result)[(n.name, "isolated")] == kernel
    # the stock comparison (function bodies) is no kernel's
    assert all(c.kernel == "" for c in result.stock_outputs)


def _swap_weights(fused: onnx.ModelProto, node_name: str) -> onnx.ModelProto:
    """The model with W_0 and W_1 of `node_name` exchanged (same shape: Q and K)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(fused)
    node = next(n for n in copy.graph.node if n.name == node_name)
    inits = {t.name: t for t in copy.graph.initializer}
    at = [i for i, name in enumerate(node.input) if name in inits and len(inits[name].dims) == 2]
    first, second = at[0], at[1]
    assert list(inits[node.input[first]].dims) == list(inits[node.input[second]].dims)
    node.input[first], node.input[second] = node.input[second], node.input[first]
    return copy


def _broken(fused: onnx.ModelProto) -> list[tuple[str, str, onnx.ModelProto]]:
    """(node, what changed, model) per fused node: every family of the mutation harness, then
    the first two weights swapped."""
    found = [
        (m.node, m.change, m.model)
        for m in mutants(load_model(fused), ("weight", "bias", "epsilon"))
    ]
    for node in fused_nodes(fused):
        found.append((node.name, "W_0 <-> W_1", _swap_weights(fused, node.name)))
    return found


@pytest.mark.parametrize("which", ["float64", pytest.param("mixed", marks=pytest.mark.slow)])
def test_every_mutant_of_a_fallback_node_is_caught_and_named(
    which: str, mixed: tuple[onnx.ModelProto, onnx.ModelProto]
) -> None:
    if which == "float64":
        original = float64_model()
        fused = fuser.fuse(original, cache=False).model
    else:
        original, fused = mixed
    kinds = {n.name: dtype_of(fused, n) for n in fused_nodes(fused)}
    broken = _broken(fused)
    # weight, bias, epsilon and the swap for every node
    assert len(broken) == 4 * len(kinds)
    assert any("epsilon 1e-05 ->" in change for _, change, _ in broken)
    for node, change, model in broken:
        checked = fuser.validate(original, model, runs=1)
        assert not checked.ok, f"{change} at {node} passed"
        first = checked.failures[0]
        assert first.where == "node" and first.node == node, first.message()
        assert {c.node for c in checked.failures if c.mode == "isolated"} == {node}
        if kinds[node] == TensorProto.DOUBLE:
            assert first.kernel_label == FALLBACK
            assert f", on {FALLBACK}) output" in first.message()
        else:
            assert first.kernel_label == "npu" and "(npu:" not in first.message()


def test_a_refusal_that_is_no_machine_limit_still_stops_validation(
    mixed: tuple[onnx.ModelProto, onnx.ModelProto],
) -> None:
    """exact_epsilon=1 on a float32 node (fuser writes it only for float64) has no NPU kernel:
    that is the kernel's own refusal, not a missing float64 unit, and is not papered over."""
    original, fused = mixed
    copy = onnx.ModelProto()
    copy.CopyFrom(fused)
    node = next(n for n in fused_nodes(copy) if dtype_of(copy, n) == TensorProto.FLOAT)
    copy.graph.initializer.append(numpy_helper.from_array(np.asarray([1e-5], np.float32), "eps"))
    node.input.append("eps")
    node.attribute.append(helper.make_attribute("exact_epsilon", 1))
    del copy.functions[:]  # the bodies were made for the node as fused
    assert fuser.validate(original, copy, kernel="reference", runs=1).ok  # the node is right
    with pytest.raises(ValidationRunError, match="exact_epsilon=1"):
        fuser.validate(original, copy, runs=1)


def test_kernels_mark_float64_as_a_machine_limit_and_nothing_else() -> None:
    f64, f32 = np.dtype(np.float64), np.dtype(np.float32)
    x64, x32 = TensorMeta((2, D), f64), TensorMeta((2, D), f32)
    with pytest.raises(MachineLimitError) as limit:
        layernorm_spec("LayerNormMatMul", x64, None, None, {})
    assert limit.value.limit == NO_FLOAT64_UNIT
    with pytest.raises(KernelError) as other:
        layernorm_spec("LayerNormMatMul", TensorMeta((2, D), np.dtype(np.int32)), None, None, {})
    assert not isinstance(other.value, MachineLimitError)
    with pytest.raises(MachineLimitError):
        check_float("SoftmaxTopK", f64)
    # RmsNormMatMul renames LayerNormMatMul's refusal: the class (and limit) must survive
    w = TensorMeta((D, 3), f64)
    with pytest.raises(MachineLimitError, match="RmsNormMatMul") as rms:
        rms_problem([x64, None, w], {"has_bias": [0], "flatten": [0]})
    assert rms.value.limit == NO_FLOAT64_UNIT
    with pytest.raises(KernelError) as rms_other:
        rms_problem([x32, None, TensorMeta((D + 1, 3), f32)], {"has_bias": [0], "flatten": [0]})
    assert not isinstance(rms_other.value, MachineLimitError)
    assert "RmsNormMatMul" in str(rms_other.value)


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def test_cli_shows_how_many_nodes_ran_on_which_kernel(
    tmp_path: Path, mixed: tuple[onnx.ModelProto, onnx.ModelProto]
) -> None:
    original, fused = mixed
    onnx.save(original, tmp_path / "m.onnx")
    onnx.save(fused, tmp_path / "m.fused.onnx")
    ran = _cli("validate", str(tmp_path / "m.onnx"), str(tmp_path / "m.fused.onnx"), "--runs", "1")
    assert ran.exit_code == 0, ran.output
    assert f"fused nodes by kernel: 1 on npu, 1 on {FALLBACK}" in ran.output
    (f64,) = [n for n in fused_nodes(fused) if dtype_of(fused, n) == TensorProto.DOUBLE]
    row = next(line for line in ran.output.splitlines() if line.startswith(f64.name))
    assert row.split() == [f64.name, f64.op_type, *FALLBACK.split(), "yes"]

    broken = next(m for node, change, m in _broken(fused) if node == f64.name)
    onnx.save(broken, tmp_path / "broken.onnx")
    ran = _cli("validate", str(tmp_path / "m.onnx"), str(tmp_path / "broken.onnx"), "--json")
    assert ran.exit_code == 1, ran.output
    data = json.loads(ran.output)
    assert data["kernel_counts"] == {"npu": 1, FALLBACK: 1}
    assert data["node_kernels"][f64.name] == FALLBACK
    assert any(f"'{f64.name}'" in line and FALLBACK in line for line in data["failures"])


@pytest.mark.slow
def test_a_target_without_chip_links_runs_gathering_nodes_on_their_reference() -> None:
    """The other machine limit: ascend310p has no chip-to-chip links, so it cannot host the
    tensor-parallel group; every rank's AllGatherMatMul runs on its reference (the gather
    itself still runs), is compared, and is reported so."""
    original = get_example("tp-mlp")
    result = fuse_all(original)
    (node,) = fused_nodes(result.model)
    checked = fuser.validate(original, result, target="ascend310p", runs=1)
    assert checked.ok and checked.ranks == 2
    assert checked.node_kernels == {node.name: "reference (npu: no chip-to-chip links)"}
    assert {(c.kernel, c.fallback) for c in checked.nodes if c.node == node.name} == {
        ("reference", "no chip-to-chip links")
    }
    assert fuser.validate(original, result, runs=1).node_kernels == {node.name: "npu"}
