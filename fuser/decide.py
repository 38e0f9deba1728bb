"""Whether a match is worth fusing: the hook where the target's cost model decides.

The engine asks a `Decider` about every match that passed the universal rules. The default
fuses everything it is given; the cost-model decider prices fused against unfused on the target
NPU, refuses fusions predicted slower (unless forced) and supplies the tiling attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from .graph import GraphIndex
from .pattern import Match
from .report import Prediction


@dataclass(frozen=True)
class Decision:
    """The verdict on one match; `attributes` are added to the fused node (e.g. its tiling)."""

    fuse: bool
    reason: str = ""
    prediction: Prediction | None = None
    attributes: Mapping[str, int] = field(default_factory=dict)


class Decider(Protocol):
    def decide(self, graph: GraphIndex, match: Match) -> Decision: ...


@dataclass(frozen=True)
class AlwaysFuse:
    """Fuse every valid match, predicting nothing."""

    def decide(self, graph: GraphIndex, match: Match) -> Decision:
        return Decision(fuse=True)
