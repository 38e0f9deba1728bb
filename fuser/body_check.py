"""Refuse, at decision time, a fusion whose fused op has no ONNX function body at the model's
opset, so `fuse` never fails late on it: the match becomes a near-miss saying why (and that
`--no-functions` would fuse it as a bare op), and the rest of the model still fuses.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
            failed = self._body_error(request)
            if failed is not None:
                return Decision(
                    False,
                    f"{op.name} has no ONNX function body at opset {self.opset} ({failed}); "
                    "--no-functions would fuse it as a bare op (fuser's plugin or an NPU "
                    "backend only)",
                )
        return self.inner.decide(graph, match)

    def _body_error(self, request: BodyRequest) -> str | None:
        """Why `request`'s body cannot be built, or None; once per distinct request."""
        key = _key(request)
        if key is not None and key in self.verdicts:
            return self.verdicts[key]
        assert request.op.body is not None
        try:
            request.op.body(request)
            verdict = None
        except BodyError as exc:
            verdict = str(exc)
        if key is not None:
            self.verdicts[key] = verdict
        return verdict


def _key(request: BodyRequest) -> Hashable | None:
    """What a body depends on, hashable; None if an attribute value is not (then no cache)."""
    try:
        attributes = tuple(sorted((k, _frozen(v)) for k, v in request.attributes.items()))
        key = (request.op.name, attributes, request.inputs, request.outputs, request.input_types)
        hash(key)
    except TypeError:
        return None
    return key


def _frozen(value: Any) -> Any:
    kind = type(value)
    if kind is int or kind is float or kind is str or kind is bool:  # most values: no walk
        return value
    if (kind is list or kind is tuple) and all(type(v) is int for v in value):
        return tuple(value)
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    return value
