"""The fusion report: data first (JSON), text second (the CLI renders it).

This module owns fuser's JSON vocabulary (docs/json.md): every command's JSON starts with
`envelope` (schema and fuser version, command, input, target), a fusion is `fusion_dict` and a
near-miss `near_miss_dict` wherever they appear (`fuse`, `inspect`, the HTML report).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Bumped when a key of the JSON vocabulary is renamed or removed (adding one keeps it).
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Prediction:
    """The cost model's view of one fusion, in cycles of the target NPU."""

    fused_cycles: float
    unfused_cycles: float
    tiling: Mapping[str, int] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.unfused_cycles / self.fused_cycles if self.fused_cycles > 0 else float("inf")


@dataclass(frozen=True, slots=True)  # slots: no dict per record (a large fuse makes 10^4-10^5)
class FusionRecord:
    """One rewrite: which nodes became which fused node."""

    pattern: str
    node: str
    op: str
    replaced: tuple[str, ...]
    attributes: Mapping[str, Any]
    graph: str = ""
    notes: tuple[str, ...] = ()
    prediction: Prediction | None = None


@dataclass(frozen=True, slots=True)  # slots: no dict per record (a large fuse makes 10^4-10^5)
class RejectionRecord:
    """One near-miss or refused fusion, with the reason and the value at fault."""

    pattern: str
    nodes: tuple[str, ...]
    reason: str
    value: str | None = None
    graph: str = ""


@dataclass(frozen=True)
class FusionReport:
    """What `fuse` did to a model."""

    target: str
    patterns: tuple[str, ...]
    fusions: tuple[FusionRecord, ...]
    rejected: tuple[RejectionRecord, ...]
    nodes_before: int
    nodes_after: int
    seconds: Mapping[str, float] = field(default_factory=dict)
    # What fuser fixed in its copy of the input (or overlooked, as onnxruntime does) first.
    normalized: tuple[str, ...] = ()

    @property
    def summary(self) -> dict[str, int]:
        """Pattern name -> number of fusions (every enabled pattern listed, zeros included)."""
        counts = dict.fromkeys(self.patterns, 0)
        for fusion in self.fusions:
            counts[fusion.pattern] = counts.get(fusion.pattern, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        """The report in the JSON vocabulary (without the envelope, which the caller knows)."""
        return {
            "target": self.target,
            "summary": self.summary,
            "fusions": [fusion_dict(f) for f in self.fusions],
            "near_misses": [near_miss_dict(r) for r in self.rejected],
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "seconds": dict(self.seconds),
            "normalized": list(self.normalized),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)


def envelope(command: str, input: str, target: str | None) -> dict[str, Any]:
    """The keys every command's JSON starts with: what made it, from what, for which target."""
    from . import __version__

    return {
        "schema_version": SCHEMA_VERSION,
        "fuser_version": __version__,
        "command": command,
        "input": input,
        "target": target,
    }


# Written out rather than dataclasses.asdict, whose recursive deep copy took longer than the
# fusion itself on models with thousands of fusions.
def fusion_dict(f: FusionRecord) -> dict[str, Any]:
    """One fusion: `node` is the fused node's name, `nodes` the original nodes it replaced."""
    prediction = None
    if f.prediction is not None:
        prediction = {
            "fused_cycles": f.prediction.fused_cycles,
            "unfused_cycles": f.prediction.unfused_cycles,
            "tiling": dict(f.prediction.tiling),
            # JSON has no infinity: a fused op priced at 0 cycles has no ratio to print.
            "speedup": f.prediction.speedup if math.isfinite(f.prediction.speedup) else None,
        }
    return {
        "pattern": f.pattern,
        "node": f.node,
        "op": f.op,
        "nodes": list(f.replaced),
        "attributes": {k: _jsonable(v) for k, v in f.attributes.items()},
        "graph": f.graph,
        "notes": list(f.notes),
        "prediction": prediction,
    }


def near_miss_dict(r: RejectionRecord) -> dict[str, Any]:
    """One near-miss: the nodes a pattern matched, why it did not fuse them, the value at fault."""
    return {
        "pattern": r.pattern,
        "nodes": list(r.nodes),
        "reason": r.reason,
        "value": r.value,
        "graph": r.graph,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return value
