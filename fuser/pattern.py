"""What a pattern is: the subgraph it matches, its own checks, and the fused op it emits.

A pattern is anchored at one op type and walks outward from an anchor node. It answers with a
`Match` (which nodes, how the fused node is wired, which internal values it could also output),
a `Rejection` (a near-miss, with a reason a user can act on and the value at fault), or None
(the anchor is not the start of this pattern at all). Universal rules (no escaping internal
values, no cycles, no overlap, supported dtypes) are the matcher's job, not the pattern's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import onnx

from .fusedop import FusedOp
from .graph import GraphIndex


@dataclass(frozen=True)
class Rejection:
    """A near-miss: the pattern almost matched here, and this is why it did not."""

    pattern: str
    nodes: tuple[str, ...]
    reason: str
    value: str | None = None


@dataclass(frozen=True)
class Match:
    """A proposed fusion, with everything the rewrite needs (no state is kept elsewhere).

    `outputs[i]` is the original value the fused op's output i stands for ("" = not produced).
    `exportable` maps an internal value to the output position that can carry it if something
    outside the match reads it; the matcher fills that position in only when needed.
    `shape_sources` lets `Shape` readers of an internal value read a same-shaped input instead.
    """

    pattern: str
    op: FusedOp
    nodes: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: Mapping[str, Any]
    exportable: Mapping[str, int] = field(default_factory=dict)
    new_initializers: tuple[onnx.TensorProto, ...] = ()
    notes: tuple[str, ...] = ()
    # internal value -> an input of the match with the same shape: a `Shape` node outside the
    # match that reads the internal value is re-pointed there, so the value need not be output
    # just for its dims. The matcher fills `rewires` with the (Shape node, old, new) it applies.
    shape_sources: Mapping[str, str] = field(default_factory=dict)
    rewires: tuple[tuple[int, str, str], ...] = ()


class Pattern(Protocol):
    """A fusion family. One instance per family, registered by its module's `PATTERN`."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def anchors(self) -> tuple[tuple[str, str], ...]:
        """(domain, op_type) pairs a match may start at."""
        ...

    @property
    def ops(self) -> tuple[FusedOp, ...]:
        """The fused op types this pattern emits."""
        ...

    def match(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None: ...


def rejection(
    pattern: str,
    graph: GraphIndex,
    node_ids: tuple[int, ...] | list[int],
    reason: str,
    value: str | None = None,
) -> Rejection:
    """A Rejection naming the nodes by their (or their op type's) name."""
    return Rejection(pattern, tuple(graph.describe(i) for i in node_ids), reason, value)
