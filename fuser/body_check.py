"""Refuse, at decision time, a fusion whose fused op has no ONNX function body at the model's
opset, so `fuse` never fails late on it: the match becomes a near-miss saying why (and that
`--no-functions` would fuse it as a bare op), and the rest of the model still fuses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .bodies.builder import BodyError, BodyRequest
from .decide import Decider, Decision
from .graph import GraphIndex
from .pattern import Match


@dataclass(frozen=True)
class BodyCheckedDecider:
    """`inner`'s verdict, for matches whose fused op can be written as a function body."""

    inner: Decider
    opset: int  # the model's default-domain opset, which a body must use
    domains: Mapping[str, int]  # the model's other opset imports
    elem_types: Callable[[str], int]  # element type of a value of the main graph (0: unknown)

    def decide(self, graph: GraphIndex, match: Match) -> Decision:
        op = match.op
        if op.body is not None:
            defaults = {a.name: a.default for a in op.attributes}
            request = BodyRequest(
                op=op,
                attributes=defaults | dict(match.attributes),
                inputs=tuple(bool(n) for n in match.inputs),
                outputs=tuple(bool(n) for n in match.outputs),
                input_types=tuple(self.elem_types(n) if n else 0 for n in match.inputs),
                opset=self.opset,
                domains=dict(self.domains),
            )
            try:
                op.body(request)
            except BodyError as exc:
                return Decision(
                    False,
                    f"{op.name} has no ONNX function body at opset {self.opset} ({exc}); "
                    "--no-functions would fuse it as a bare op (fuser's plugin or an NPU "
                    "backend only)",
                )
        return self.inner.decide(graph, match)
