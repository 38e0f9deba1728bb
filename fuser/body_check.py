"""Refuse, at decision time, a fusion whose fused op has no ONNX function body at the model's
opset, so `fuse` never fails late on it: the match becomes a near-miss saying why (and that
`--no-functions` would fuse it as a bare op), and the rest of the model still fuses.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

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

    # Verdicts by request (a model repeats the same few variants thousands of times, and
    # building a body costs more than the rest of a rewrite): None = the body builds.
    verdicts: dict[Hashable, str | None] = field(default_factory=dict, compare=False)

    def decide(self, graph: GraphIndex, match: Match) -> Decision:
        op = match.op
        if op.body is not None:
            failed = self._body_error(match)
            if failed is not None:
                return Decision(
                    False,
                    f"{op.name} has no ONNX function body at opset {self.opset} ({failed}); "
                    "--no-functions would fuse it as a bare op (fuser's plugin or an NPU "
                    "backend only)",
                )
        return self.inner.decide(graph, match)

    def _body_error(self, match: Match) -> str | None:
        """Why `match`'s body cannot be built, or None; built once per distinct request.

        The key is read off the match (no request is made for a known one): the op, its
        attributes (the request's are the op's defaults updated by them), which inputs and
        outputs are present and the inputs' element types; opset and domains are the model's,
        the same for every match."""
        op = match.op
        elem_types = self.elem_types
        input_types = tuple([elem_types(n) if n else 0 for n in match.inputs])
        attributes = match.attributes_key
        key: Hashable | None = None
        if attributes is not None:
            inputs = tuple(map(bool, match.inputs))
            outputs = tuple(map(bool, match.outputs))
            key = (op.name, attributes, inputs, outputs, input_types)
            if key in self.verdicts:
                return self.verdicts[key]
        assert op.body is not None
        defaults = {a.name: a.default for a in op.attributes}
        request = BodyRequest(
            op=op,
            attributes=defaults | dict(match.attributes),
            inputs=tuple(bool(n) for n in match.inputs),
            outputs=tuple(bool(n) for n in match.outputs),
            input_types=input_types,
            opset=self.opset,
            domains=dict(self.domains),
        )
        try:
            op.body(request)
            verdict = None
        except BodyError as exc:
            verdict = str(exc)
        if key is not None:
            self.verdicts[key] = verdict
        return verdict
