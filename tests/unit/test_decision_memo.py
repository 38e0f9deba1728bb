"""Decisions on repeated chains are memoized (the body check and the cost model each decide a
distinct chain once per fuse). A memo is only right if its key holds everything a decision
depends on: chains that differ in one attribute, dtype, shape, a weight-dependent refusal or
the outputs they carry get their own decision, equal to the one a fresh fuse of that chain
alone gives; identical chains share one."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuser.api import fuse
from fuser.bodies.builder import BodyError, BodyRequest
from fuser.body_check import BodyCheckedDecider
from fuser.decide import AlwaysFuse
from fuser.fusedop import FusedOp, Param
from fuser.pattern import Match, attributes_key


def test_attribute_keys_tell_apart_values_and_types() -> None:
    assert attributes_key({"a": 1, "b": [1, 2]}) == attributes_key({"b": [1, 2], "a": 1})
    distinct = [{"a": 1}, {"a": 1.0}, {"a": True}, {"a": 0.0}, {"a": -0.0}, {"a": [1]}, {"a": (1,)}]
    keys = [attributes_key(d) for d in distinct]
    assert len(set(keys)) == len(distinct)
    # an array's repr elides its middle: two arrays with the same repr still key apart
    big = np.zeros(5000)
    other = big.copy()
    other[2500] = 1.0
    assert repr(big) == repr(other)
    assert attributes_key({"t": big}) != attributes_key({"t": other})
    assert attributes_key({"t": big}) == attributes_key({"t": big.copy()})
    assert attributes_key({"d": {"unhashable": [1]}}) is None


SPECS: dict[str, dict[str, Any]] = {
    "a": {},
    "a_again": {},  # identical to "a": shares its decision
    "strided": {"strides": [2, 2]},  # one attribute: another output shape, another price
    "half": {"dtype": TensorProto.FLOAT16},  # one dtype
    "wide": {"width": 12},  # one input shape
    "unfoldable": {"var": -1.0},  # one weight: its fold is refused, BN stays as inputs
}


BN_PARAMS = ("scale", "bias", "mean", "var")


def _chains(names: list[str]) -> onnx.ModelProto:
    """One Conv -> BN -> Relu chain per name, each with its own input, as SPECS says."""
    rng = np.random.default_rng(7)
    nodes, inits, inputs, outputs = [], [], [], []
    for name in names:
        spec = SPECS[name]
        dtype = spec.get("dtype", TensorProto.FLOAT)
        np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
        var = rng.uniform(0.5, 1.5, 8)
        var[3] = spec.get("var", var[3])
        values = {
            "W": rng.standard_normal((8, 4, 3, 3)),
            "scale": rng.standard_normal(8),
            "bias": rng.standard_normal(8),
            "mean": rng.standard_normal(8),
            "var": var,
        }
        inits += [
            numpy_helper.from_array(v.astype(np_dtype), f"{name}.{k}") for k, v in values.items()
        ]
        nodes += [
            helper.make_node("Conv", [f"{name}.x", f"{name}.W"], [f"{name}.c"], name=f"{name}.conv",
                             pads=[1, 1, 1, 1], strides=spec.get("strides", [1, 1])),
            helper.make_node("BatchNormalization",
                             [f"{name}.c", *(f"{name}.{p}" for p in BN_PARAMS)],
                             [f"{name}.n"], name=f"{name}.bn"),
            helper.make_node("Relu", [f"{name}.n"], [f"{name}.y"], name=f"{name}.relu"),
        ]  # fmt: skip
        inputs.append(
            helper.make_tensor_value_info(f"{name}.x", dtype, [1, 4, 16, spec.get("width", 16)])
        )
        outputs.append(helper.make_tensor_value_info(f"{name}.y", dtype, None))  # fmt: skip
    graph = helper.make_graph(nodes, "chains", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _decisions(names: list[str]) -> dict[str, tuple[Any, ...]]:
    result = fuse(_chains(names), cache=False)
    return {
        f.replaced[0].split(".")[0]: (f.prediction, f.attributes, f.notes)
        for f in result.report.fusions
    }


def test_each_distinct_chain_gets_the_decision_a_fresh_fuse_gives() -> None:
    together = _decisions(list(SPECS))
    assert set(together) == set(SPECS)
    assert together["a"] == together["a_again"]
    for name in SPECS:
        alone = _decisions([name])
        assert together[name] == alone[name], name
    predictions = {name: together[name][0] for name in SPECS if name != "a_again"}
    fused_cycles = [p.fused_cycles for p in predictions.values()]
    assert len(set(fused_cycles)) == len(fused_cycles), predictions
    assert any("BN kept as inputs" in note for note in together["unfoldable"][2])


BUILT: list[tuple[bool, ...]] = []


def _body(request: BodyRequest) -> Any:
    BUILT.append(request.outputs)
    if request.outputs[1]:
        raise BodyError("no body carries the second output")
    return None


OP = FusedOp(
    name="TestOutputs",
    doc="test",
    attributes=(),
    inputs=(Param("A", "T", ""),),
    outputs=(Param("Y", "T", ""), Param("Z", "T", "", "optional")),
    type_constraints=(("T", ("tensor(float)",), ""),),
    infer=lambda inputs, attrs: [inputs[0], inputs[0]],
    reference=lambda inputs, attrs: (inputs[0], inputs[0]),
    body=_body,
)


def test_the_outputs_a_match_carries_are_part_of_the_body_check_key() -> None:
    BUILT.clear()
    decider = BodyCheckedDecider(AlwaysFuse(), 17, {}, lambda name: TensorProto.FLOAT)
    graph: Any = None  # AlwaysFuse never looks at the graph
    plain = Match("test", OP, (0,), ("a",), ("y", ""), {})
    carried = Match("test", OP, (0,), ("a",), ("y", "z"), {})
    verdicts = [decider.decide(graph, m) for m in (plain, carried, plain, carried)]
    assert [v.fuse for v in verdicts] == [True, False, True, False]
    assert "no body carries the second output" in verdicts[3].reason
    assert BUILT == [(True, False), (True, True)]
