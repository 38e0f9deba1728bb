"""The function-body check builds each distinct body once per fuse (a model repeats a few
variants thousands of times), and a cached verdict is the verdict a fresh build gives."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fuser.bodies.builder import BodyError, BodyRequest
from fuser.body_check import BodyCheckedDecider
from fuser.decide import AlwaysFuse
from fuser.fusedop import FusedOp, Param
from fuser.pattern import Match

BUILDS: list[dict[str, Any]] = []


def body(request: BodyRequest) -> Any:
    BUILDS.append(dict(request.attributes))
    if request.attributes["k"] > 2:
        raise BodyError(f"k={request.attributes['k']} has no standard form")
    return None


OP = FusedOp(
    name="TestCached",
    doc="test",
    attributes=(),
    inputs=(Param("A", "T", ""),),
    outputs=(Param("Y", "T", ""),),
    type_constraints=(("T", ("tensor(float)",), ""),),
    infer=lambda inputs, attrs: [inputs[0]],
    reference=lambda inputs, attrs: (inputs[0],),
    body=body,
)


def match(k: int, pads: list[int]) -> Match:
    return Match("test", OP, (0,), ("a",), ("y",), {"k": k, "pads": pads})


def test_identical_requests_build_once_and_keep_their_verdict() -> None:
    BUILDS.clear()
    decider = BodyCheckedDecider(AlwaysFuse(), 17, {}, lambda name: 1)
    graph: Any = None  # AlwaysFuse never looks at the graph
    verdicts = [decider.decide(graph, m) for m in
                (match(1, [0, 1]), match(1, [0, 1]), match(3, [0, 1]), match(3, [0, 1]),
                 match(1, [1, 1]))]  # fmt: skip
    assert [v.fuse for v in verdicts] == [True, True, False, False, True]
    assert verdicts[2].reason == verdicts[3].reason
    assert "k=3 has no standard form" in verdicts[3].reason
    assert [(b["k"], b["pads"]) for b in BUILDS] == [(1, [0, 1]), (3, [0, 1]), (1, [1, 1])]


def test_the_element_type_of_an_input_is_part_of_the_request() -> None:
    BUILDS.clear()
    types = {"a": 1}
    decider = BodyCheckedDecider(AlwaysFuse(), 17, {}, lambda name: types[name])
    decider.decide(None, match(1, [0]))  # type: ignore[arg-type]
    types["a"] = 10  # float16 now: another body
    decider.decide(None, replace(match(1, [0])))  # type: ignore[arg-type]
    assert len(BUILDS) == 2
