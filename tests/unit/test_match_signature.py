"""One signature per match (`Match.input_facts`, `Match.signature`), read once and shared by
every decision on it: the type rule, the body check, the cost model and the fused node's
inference each memoize on it. A memo is only right if the key holds every fact the decision
reads: two matches equal in everything but one input's shape, element type, symbolic dim
name, one attribute, an absent optional input or a folded weight each get their own key and
their own verdict (with the reason naming their own values); symbolic dims the cost model
prices alike share one decision, and a dim `--dim` names is priced at its own size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser import engine
from fuser.costmodel import CostModelDecider
from fuser.decide import AlwaysFuse
from fuser.fusedop import FusedOp, Param, TensorInfo, register
from fuser.graph import GraphIndex
from fuser.modelio import load_model
from fuser.pattern import FOLDED, Match, Rejection


def _infer(
    inputs: Sequence[TensorInfo | None], attrs: Mapping[str, Any]
) -> list[TensorInfo | None]:
    return [inputs[0]]


def _reference(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any]
) -> tuple[np.ndarray, ...]:
    a, b, c = inputs
    assert a is not None and b is not None
    return (a * b + (0 if c is None else c),)


SIG_OP = register(
    FusedOp(
        name="TestSignatureMulAdd",
        doc="test op: a*b (+ c)",
        attributes=(),
        inputs=(Param("A", "T", ""), Param("B", "T", ""), Param("C", "T", "", "optional")),
        outputs=(Param("Y", "T", ""),),
        type_constraints=(("T", ("tensor(float)",), "float only"),),
        infer=_infer,
        reference=_reference,
    )
)


@dataclass(frozen=True)
class MulAdd:
    """Mul -> Add into TestSignatureMulAdd (a test-only pattern)."""

    name: str = "sig_mul_add"
    description: str = "test"
    anchors: tuple[tuple[str, str], ...] = (("", "Mul"),)
    ops: tuple[FusedOp, ...] = (SIG_OP,)

    def match(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None:
        mul = graph.node(node_id)
        adds = [r for r in graph.readers(mul.output[0]) if graph.node(r).op_type == "Add"]
        if not adds:
            return None
        add = graph.node(adds[0])
        return Match(
            self.name, SIG_OP, (node_id, adds[0]), (*mul.input, add.input[1]), (add.output[0],), {}
        )


def _run(text: str) -> engine.PassLog:
    loaded = load_model(onnx.parser.parse_model(text))
    types = engine.infer_types(loaded.model)
    return engine.run_passes(loaded, [MulAdd()], AlwaysFuse(), types)


HEADER = '<ir_version: 8, opset_import: ["" : 17]>\n'


def _index(text: str) -> GraphIndex:
    loaded = load_model(onnx.parser.parse_model(HEADER + text))
    types = engine.infer_types(loaded.model)
    return GraphIndex.build(loaded.model.graph, loaded, engine.opset_map(loaded.model), types[""])


GRAPH = """g (float[N,4] a, float[N,4] b, float[M,4] m, double[N,4] d, float[N,5] w,
       float[N,4] c) => (float[N,4] y) {
    y = Add(a, b)
}"""


def _match(inputs: tuple[str, ...], attributes: Mapping[str, Any] | None = None,
           folded: tuple[onnx.TensorProto, ...] = ()) -> Match:  # fmt: skip
    return Match("sig", SIG_OP, (0,), inputs, ("y",), dict(attributes or {"k": 1}),
                 new_initializers=folded)  # fmt: skip


def test_each_fact_of_an_input_or_attribute_is_its_own_signature() -> None:
    graph = _index(GRAPH)
    base = _match(("a", "b", ""))
    variants = {
        "shape": _match(("w", "b", "")),  # float[N,5] for float[N,4]
        "elem type": _match(("d", "b", "")),  # double for float
        "symbolic dim name": _match(("m", "b", "")),  # M for N
        "attribute": _match(("a", "b", ""), {"k": 2}),
        "attribute type": _match(("a", "b", ""), {"k": 1.0}),
        "optional input present": _match(("a", "b", "c")),
    }
    key = base.signature(graph)
    assert key == _match(("a", "b", "")).signature(graph)  # same facts: one signature
    keys = {name: m.signature(graph) for name, m in variants.items()}
    assert all(k != key for k in keys.values()), keys
    assert len(set(keys.values())) == len(keys)
    assert base.input_facts(graph) == ((1, ("N", 4)), (1, ("N", 4)), None)


def test_a_folded_weight_is_told_from_a_graph_value_of_its_type() -> None:
    graph = _index(GRAPH)
    weight = numpy_helper.from_array(np.ones([2, 4], np.float32), "b")  # shadows 'b'
    folded = _match(("a", "b", ""), folded=(weight,))
    assert folded.input_facts(graph)[1] == (1, (2, 4), FOLDED)
    assert folded.signature(graph) != _match(("a", "b", "")).signature(graph)


def test_facts_are_read_once_per_match_and_graph_and_kept_when_completed() -> None:
    graph, other = _index(GRAPH), _index(GRAPH.replace("float[N,4] a", "float[N,7] a"))
    match = _match(("a", "b", ""))
    first = match.input_facts(graph)
    assert match.input_facts(graph) is first  # kept
    assert match.input_facts(other)[0] == (1, ("N", 7))  # another graph is read anew
    done = match.completed(("y",), ("note",), ())
    assert done.notes == ("note",)
    assert done.__dict__.get("_input_facts") == match.__dict__["_input_facts"]
    assert done.attributes_key == match.attributes_key


def _chains(types: list[str]) -> str:
    """One Mul -> Add chain per tensor type of `types` ("float[N]"): inputs a_i, b_i, c_i of
    that type, output y_i."""
    inputs = ", ".join(f"{t} {v}{i}" for i, t in enumerate(types) for v in "abc")
    outputs = ", ".join(f"{t} y{i}" for i, t in enumerate(types))
    body = "".join(
        f"    p{i} = Mul(a{i}, b{i})\n    y{i} = Add(p{i}, c{i})\n" for i in range(len(types))
    )
    return f"g ({inputs}) => ({outputs}) {{\n{body}}}"


def test_the_type_rule_refuses_each_match_naming_its_own_value() -> None:
    """float, double, float16, double, float: the refusals of the two double chains share
    one verdict of the type rule, each reason naming its own input; float16 is another."""
    log = _run(HEADER + _chains(["float[N]", "double[N]", "float16[N]", "double[N]", "float[N]"]))
    assert [f.replaced[0] for f in log.fusions] == ["Mul#0", "Mul#8"]  # chains 0 and 4
    assert [r.reason for r in log.rejected] == [
        "'a1' is float64, which TestSignatureMulAdd does not support",
        "'a2' is float16, which TestSignatureMulAdd does not support",
        "'a3' is float64, which TestSignatureMulAdd does not support",
    ]
    assert [r.value for r in log.rejected] == ["a1", "a2", "a3"]


def test_the_inferred_type_check_reads_each_matchs_symbolic_dims() -> None:
    """Both chains declare a rank-1 sum where the op infers rank 2 (from A): the inference
    is keyed by the inputs' shapes with their dim names, so each reason shows its own."""
    model = onnx.parser.parse_model(HEADER + _chains(["float[N,4]", "float[M,4]"]))
    for i, dim in enumerate("NM"):
        model.graph.value_info.append(helper.make_tensor_value_info(f"y{i}", 1, [dim]))
        del model.graph.output[i].type.tensor_type.shape.dim[1]
    loaded = load_model(model)
    log = engine.run_passes(loaded, [MulAdd()], AlwaysFuse(), engine.infer_types(loaded.model))
    assert not log.fusions
    reasons = [r.reason for r in log.rejected]
    assert len(reasons) == 2
    assert "declares float32[N] for 'y0'" in reasons[0]
    assert "infers float32[N,4]" in reasons[0]
    assert "declares float32[M] for 'y1'" in reasons[1]
    assert "infers float32[M,4]" in reasons[1]


def _layernorm_chains(rows: list[str | int]) -> onnx.ModelProto:
    """One LayerNormalization -> MatMul chain per entry of `rows` (its input's first dim)."""
    rng = np.random.default_rng(3)
    nodes, inits, inputs, outputs = [], [], [], []
    for i, rows_dim in enumerate(rows):
        p = f"c{i}."
        for name, shape in (("g", [64]), ("b", [64]), ("w", [64, 96])):
            inits.append(
                numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), p + name)
            )
        nodes += [
            helper.make_node(
                "LayerNormalization", [f"X{i}", p + "g", p + "b"], [p + "n"], name=p + "ln"
            ),
            helper.make_node("MatMul", [p + "n", p + "w"], [f"Y{i}"], name=p + "mm"),
        ]
        inputs.append(helper.make_tensor_value_info(f"X{i}", TensorProto.FLOAT, [rows_dim, 64]))
        outputs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "ln", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _decisions(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Counts the cost model's decisions actually made (not answered by its memo)."""
    made: list[Any] = []
    decide = CostModelDecider._decide

    def counted(self: CostModelDecider, graph: GraphIndex, match: Match) -> Any:
        made.append(match.inputs[0])
        return decide(self, graph, match)

    monkeypatch.setattr(CostModelDecider, "_decide", counted)
    return made


def test_unnamed_symbolic_dims_are_priced_alike_and_decided_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = _decisions(monkeypatch)
    result = fuser.fuse(_layernorm_chains(["batch", "seq", "seq2"]), patterns="layernorm_matmul",
                        cache=False)  # fmt: skip
    assert [f.replaced[0] for f in result.report.fusions] == ["c0.ln", "c1.ln", "c2.ln"]
    assert made == ["X0"]  # one decision for the three: their dims are priced alike
    first, *others = [f.prediction for f in result.report.fusions]
    assert first is not None and all(p == first for p in others)


def test_a_named_dim_is_priced_at_its_size_apart_from_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--dim batch=8` prices the chain on [batch, 64] at 8 rows; the chains on [seq, 64]
    and [seq2, 64] range over the default sizes, priced at 256: not the batch chain's price."""
    made = _decisions(monkeypatch)
    result = fuser.fuse(_layernorm_chains(["batch", "seq", "seq2", 8]),
                        patterns="layernorm_matmul", cache=False, dims={"batch": 8})  # fmt: skip
    fused = {f.replaced[0]: f.prediction for f in result.report.fusions}
    assert list(fused) == ["c0.ln", "c1.ln", "c2.ln", "c3.ln"]
    assert made == ["X0", "X1", "X3"]  # seq2 is priced as seq is
    assert fused["c1.ln"] == fused["c2.ln"]
    assert fused["c0.ln"] != fused["c1.ln"]
    assert fused["c0.ln"].fused_cycles < fused["c1.ln"].fused_cycles  # 8 rows against 256
    # priced at 8 like the static chain, but decided as symbolic: no tiling stored for it
    assert fused["c0.ln"].fused_cycles == fused["c3.ln"].fused_cycles
    nodes = {n.name.split("/")[0]: n for n in result.model.graph.node if n.domain == "fuser"}
    assert not any(a.name.startswith("tile_") for a in nodes["c0.ln"].attribute)
    assert any(a.name.startswith("tile_") for a in nodes["c3.ln"].attribute)
