"""The near-tie judge of gating choices (fuzz_ties): it accepts another expert or group only
where exact arithmetic cannot tell the choices apart, and still catches a wrong gate.

The wrong gates are mutants of a DeepSeek-V3 grouped gate handed to the judge as if fuser had
written them (`check_case(..., fuse=...)`): a judge that accepts everything fails here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
from fuzz_check import INPUT_SETS, check_case, make_feeds, run_exact
from fuzz_graphs import Case, InputSpec, make_case
from fuzz_ties import alternatives, noise, replays, valid_choice
from onnx import TensorProto, helper, numpy_helper

U32 = 2.0**-24
E, GROUPS, TOKENS = 16, 4, 5


@dataclass(frozen=True)
class Gate:
    """A DeepSeek-V3 gate's variant (the default is the true gate; the rest, its mutants)."""

    bias: bool = True  # add the selection bias
    per_group: int = 2  # a group's score: the sum of its top `per_group` scores
    topk_group: int = 2
    k: int = 4
    reversed_ties: bool = False  # the same gate, exact ties broken toward the higher index


def gate_model(gate: Gate, bias: np.ndarray) -> onnx.ModelProto:
    """sigmoid(x) + bias -> group scores -> keep topk_group groups -> TopK k -> weights from
    the unbiased scores, renormalized (DeepSeek-V3's `noaux_tc`)."""
    i64 = lambda v, n: numpy_helper.from_array(np.array(v, np.int64), n)  # noqa: E731
    inits = [
        numpy_helper.from_array(bias.astype(np.float32), "bias"),
        i64([-1, GROUPS, E // GROUPS], "split"),
        i64([gate.per_group], "per_group"),
        i64([gate.topk_group], "topk_group"),
        i64([-1], "axes"),
        i64([1, GROUPS, E // GROUPS], "to_experts"),
        i64([-1, E], "flat"),
        i64([gate.k], "k"),
        numpy_helper.from_array(np.array(0.0, np.float32), "fill"),
    ]
    x, idx = "x", "idx_fwd" if gate.reversed_ties else "idx"
    nodes = []
    if gate.reversed_ties:  # experts in reverse order: ties go to the other end
        inits += [i64(np.arange(E)[::-1], "reverse"), i64(E - 1, "last")]
        nodes.append(helper.make_node("Gather", ["x", "reverse"], ["x_rev"], axis=1))
        x = "x_rev"
        inits[0] = numpy_helper.from_array(bias[::-1].astype(np.float32), "bias")
    nodes += [
        helper.make_node("Sigmoid", [x], ["s"]),
        helper.make_node("Add", ["s", "bias"] if gate.bias else ["s", "fill"], ["c"]),
        helper.make_node("Reshape", ["c", "split"], ["grouped"]),
        helper.make_node("TopK", ["grouped", "per_group"], ["top", "top_i"]),
        helper.make_node("ReduceSum", ["top", "axes"], ["group_score"], keepdims=0),
        helper.make_node("TopK", ["group_score", "topk_group"], ["_g", "kept"], sorted=0),
        helper.make_node("Shape", ["group_score"], ["gshape"]),
        helper.make_node("ConstantOfShape", ["gshape"], ["zeros"]),
        helper.make_node("Shape", ["kept"], ["kshape"]),
        helper.make_node(
            "ConstantOfShape",
            ["kshape"],
            ["ones"],
            value=numpy_helper.from_array(np.ones(1, np.float32)),
        ),
        helper.make_node("ScatterElements", ["zeros", "kept", "ones"], ["gmask"], axis=1),
        helper.make_node("Unsqueeze", ["gmask", "axes"], ["gmask3"]),
        helper.make_node("Expand", ["gmask3", "to_experts"], ["emask3"]),
        helper.make_node("Reshape", ["emask3", "flat"], ["emask"]),
        helper.make_node("Cast", ["emask"], ["keep"], to=TensorProto.BOOL),
        helper.make_node("Not", ["keep"], ["drop"]),
        helper.make_node("Where", ["drop", "fill", "c"], ["choice"]),
        helper.make_node("TopK", ["choice", "k"], ["_v", idx]),
        helper.make_node("GatherElements", ["s", idx], ["w"], axis=1),
        helper.make_node("ReduceSum", ["w", "axes"], ["total"], keepdims=1),
        helper.make_node("Div", ["w", "total"], ["weights"]),
    ]
    if gate.reversed_ties:
        nodes.append(helper.make_node("Sub", ["last", idx], ["idx"]))
    graph = helper.make_graph(
        nodes, "gate", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [TOKENS, E])],
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [TOKENS, gate.k]),
         helper.make_tensor_value_info("weights", TensorProto.FLOAT, [TOKENS, gate.k])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def gate_bias(seed: int) -> np.ndarray:
    """A selection bias in equal pairs: experts 2i and 2i+1 tie exactly on equal inputs."""
    return np.repeat(np.random.default_rng(seed).random(E // 2) * 0.5, 2)


def gate_case(seed: int = 5) -> Case:
    bias = gate_bias(seed)
    model = gate_model(Gate(), bias)
    return Case(seed, model, [InputSpec("x", (TOKENS, E), np.float32, "activation")], 1,
                ["sigmoid_gate"], [])  # fmt: skip


def pretend(original: onnx.ModelProto, rewrite: onnx.ModelProto) -> Any:
    """A `fuse` that rewrites `original` into `rewrite` (and fuses nothing more)."""
    source = original.SerializeToString()

    def fuse(model: onnx.ModelProto) -> Any:
        if model.SerializeToString() == source:
            return SimpleNamespace(model=rewrite, report=SimpleNamespace(summary={"gate": 1}))
        return SimpleNamespace(model=model, report=SimpleNamespace(summary={}))

    return fuse


def test_the_true_gate_fuses_and_is_judged_ok() -> None:
    case = gate_case()
    result = check_case(case)
    assert result.outcome == "ok", result.detail
    assert result.fused == {"softmax_topk": 1}


MUTANTS = {
    "no selection bias": Gate(bias=False),
    "top-1 per group": Gate(per_group=1),
    "one group too many": Gate(topk_group=3),
    "exact ties to the higher index": Gate(reversed_ties=True),
}


def exactly_different(case: Case, mutant: onnx.ModelProto, kind: str) -> bool:
    """Whether `mutant` computes other experts or weights than `case`'s gate on input set
    `kind`, both in float64 (the ground truth the judge is held to)."""
    rng = np.random.default_rng(case.seed)
    sets = [make_feeds(case, k, rng) for k in INPUT_SETS]
    want = run_exact(case, sets)[INPUT_SETS.index(kind)][0]
    got = run_exact(replace(case, model=mutant), sets)[INPUT_SETS.index(kind)][0]
    return not np.array_equal(want["idx"], got["idx"]) or not np.allclose(
        want["weights"], got["weights"], rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("name", MUTANTS)
def test_a_wrong_gate_is_judged_wrong(name: str) -> None:
    """On every input set where the mutant computes something else in float64 the judge says
    wrong, on the others ok; and the mutant differs on a set the near-tie rule is for."""
    case = gate_case()
    mutant = gate_model(MUTANTS[name], gate_bias(case.seed))
    fuse = pretend(case.model, mutant)
    differ = [k for k in INPUT_SETS if exactly_different(case, mutant, k)]
    assert {"large", "constant rows"} & set(differ), differ
    for kind in INPUT_SETS:
        result = check_case(case, fuse=fuse, kinds=[kind])
        assert result.outcome == ("wrong" if kind in differ else "ok"), (kind, result)


@pytest.mark.parametrize("seed", [1326, 1407, 1612])
def test_gates_fused_on_near_ties_are_ok(seed: int) -> None:
    """Seeds a sigmoid gate with a group limit was judged wrong on: its fused op kept
    another group (1326: group sums 2 and 2 - 1.3e-10) or expert (1407, 1612: saturated scores,
    onnxruntime's Sigmoid says 0 where the exact one says 1e-31, tie with masked experts' 0);
    each is what the original computes for that choice."""
    case = make_case(seed, later_traps=False)
    assert "sigmoid_gate" in case.planted and any("group limit" in t for t in case.traps)
    result = check_case(case)
    assert result.outcome == "ok", result.detail
    assert result.near_ties > 0


@pytest.mark.parametrize(("seed", "why"), [(953, "ConstantOfShape"), (1114, "Erf")])
def test_a_layernorm_of_constant_rows_is_judged_in_float64(seed: int, why: str) -> None:
    """A decomposed LayerNorm of constant rows divides the original's own rounding noise by
    sqrt(eps): the float64 twin judges it, and it did not run beside a gate's group limit (the
    float32 zeros of a ConstantOfShape without value, seed 953) or a GELU (onnxruntime has no
    double Erf, seed 1114). The twin's ConstantOfShape now makes double zeros, and an op
    without a double kernel runs in float32 between Casts."""
    case = make_case(seed, later_traps=False)
    assert "ln_decomposed" in case.planted
    assert any(n.op_type == why for n in _all_nodes(case.model.graph))
    assert check_case(case).outcome == "ok"


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    out = list(graph.node)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                out += _all_nodes(attr.g)
    return out


def test_the_noise_bound_scales_with_the_row() -> None:
    assert noise(np.array([1.0, 0.5]), U32) == pytest.approx(16 * U32)
    assert noise(np.array([-np.inf, 200.0, 3.0]), U32) == pytest.approx(200 * 16 * U32)


def test_a_choice_is_valid_only_within_the_noise() -> None:
    row = np.array([1.0, 0.0, 1e-31, 0.5, 0.0])
    assert valid_choice(row, np.array([0, 3, 2]), U32, sorted_=True)  # exact
    assert valid_choice(row, np.array([0, 3, 1]), U32, sorted_=True)  # 0 vs 1e-31: a near tie
    assert not valid_choice(row, np.array([0, 3, 4]), U32, sorted_=True)  # exact tie: index 1 first
    assert not valid_choice(row, np.array([3, 0, 2]), U32, sorted_=True)  # order beyond noise
    assert valid_choice(row, np.array([3, 0, 2]), U32, sorted_=False)  # unsorted: a set
    assert not valid_choice(row, np.array([0, 2, 1]), U32, sorted_=True)  # drops 0.5
    assert not valid_choice(row, np.array([0, 3, 3]), U32, sorted_=True)  # repeats


def test_group_alternatives_are_the_near_ties_at_the_boundary() -> None:
    groups = np.array([2.0, 2.0 - 1e-10, 2.0, 1.5])
    got = [sorted(a.tolist()) for a in alternatives(groups, 2, U32)]
    assert got == [[0, 2], [0, 1]]  # {1, 2} would pass over the exact tie of groups 0 and 2
    assert [a.tolist() for a in alternatives(np.array([2.0, 1.9, 1.0]), 2, U32)] == [[0, 1]]


def test_a_loop_body_is_replayed_as_onnx_runs_it() -> None:
    """The replay of a Loop with no condition input runs its trips and stacks its scan
    outputs (onnx's reference Loop ran none and concatenated), and takes the fused model's
    indices of every trip from the stacked output: here the original's own."""
    import onnxruntime

    k = numpy_helper.from_array(np.array([2], np.int64), "k")
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("TopK", ["x", "k"], ["v", "i"]),
            helper.make_node("GatherElements", ["x", "i"], ["g"], axis=-1),
        ],
        "body",
        [
            helper.make_tensor_value_info("it", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("i", TensorProto.INT64, [3, 2]),
            helper.make_tensor_value_info("g", TensorProto.FLOAT, [3, 2]),
        ],
    )
    trips = numpy_helper.from_array(np.array(2, np.int64), "trips")
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", ""], ["idx", "picked"], body=body)],
        "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [
            helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 3, 2]),
            helper.make_tensor_value_info("picked", TensorProto.FLOAT, [2, 3, 2]),
        ],
        [k, trips],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
    sess = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    idx, picked = sess.run(None, {"x": x})
    (replay,) = list(replays(model, model, {"x": x}, {"idx": idx, "picked": picked}))
    assert replay["idx"].shape == (2, 3, 2)
    np.testing.assert_array_equal(replay["idx"], idx)
    np.testing.assert_allclose(replay["picked"], picked, rtol=1e-6)
    wrong = idx[:, :, ::-1].copy()  # the two picked in the wrong order: no valid choice
    assert list(replays(model, model, {"x": x}, {"idx": wrong, "picked": picked})) == []
