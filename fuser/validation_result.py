"""What validation found: one comparison per value (worst over runs and ranks), and the result.

`OutputComparison.message()` is the one line a user reads about a mismatch: the fused node, its
pattern, the nodes it replaced, how the fused side was computed, the run, the rank and the worst
element.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .compare import Comparison, compare_values


@dataclass(frozen=True)
class OutputComparison:
    """The worst case over all runs and ranks for one compared value.

    `where` is "output" (a graph output) or "node" (an output of fused node `node`); `mode` is
    how the fused side was computed: "model" (the fused model run whole), "isolated" (the node
    alone, fed the original's values) or "stock" (plain onnxruntime, function bodies).
    `kernel` is what computed a fused node there ("npu", "reference"; "" for stock and graph
    outputs); `fallback` the machine's limit when the NPU kernel refused the node and its
    reference ran instead ("no float64 unit"), else "".
    """

    name: str
    dtype: str
    max_abs: float
    max_rel: float
    tolerance: float
    ok: bool
    detail: str = ""
    where: str = "output"
    mode: str = "model"
    node: str = ""
    op: str = ""
    pattern: str = ""
    replaced: tuple[str, ...] = ()
    run: int = 0
    rank: int = 0
    worst_index: tuple[int, ...] = ()
    expected: float = 0.0
    actual: float = 0.0
    kernel: str = ""
    fallback: str = ""

    @property
    def kernel_label(self) -> str:
        """How the fused side was computed, as reports show it: "npu", "reference", or
        "reference (npu: no float64 unit)" where the NPU kernel refused the node."""
        return f"{self.kernel} (npu: {self.fallback})" if self.fallback else self.kernel

    def message(self) -> str:
        """One line naming what differs, where it came from, the run and the worst element."""
        if self.where == "node":
            what = f"fused node '{self.node}' ({self.op}"
            what += f", pattern {self.pattern}" if self.pattern else ""
            what += f", replaced {', '.join(self.replaced)}" if self.replaced else ""
            what += f", on {self.kernel_label}" if self.fallback else ""
            what += f") output '{self.name}'"
        else:
            what = f"output '{self.name}'"
        how = {"isolated": " run alone on the original's inputs", "stock": " in stock onnxruntime"}
        worst = (
            f" at {list(self.worst_index)}: original {self.expected:.6g}, fused {self.actual:.6g}"
            if self.max_abs != float("inf")
            else ""
        )
        detail = f" ({self.detail})" if self.detail else ""
        return (
            f"{what}{how.get(self.mode, '')} differs on run {self.run}, rank {self.rank}{worst}; "
            f"max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}, tolerance "
            f"{self.tolerance:.0e}{detail}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "tolerance": self.tolerance,
            "ok": self.ok,
            "detail": self.detail,
            "where": self.where,
            "mode": self.mode,
            "node": self.node,
            "op": self.op,
            "pattern": self.pattern,
            "replaced": list(self.replaced),
            "run": self.run,
            "rank": self.rank,
            "worst_index": list(self.worst_index),
            "expected": self.expected,
            "actual": self.actual,
            "kernel": self.kernel_label,
        }


@dataclass(frozen=True)
class ValidationResult:
    """Outcome of comparing two models: graph outputs, fused nodes, and the stock run."""

    ok: bool
    outputs: tuple[OutputComparison, ...]
    runs: int
    ranks: int
    seed: int
    kernel: str
    nodes: tuple[OutputComparison, ...] = ()
    stock: str = "not applicable: the fused model has no function bodies"
    stock_outputs: tuple[OutputComparison, ...] = ()
    seconds: Mapping[str, float] = field(default_factory=dict)  # where the time went
    # fused node -> what computed it ("npu"; "reference (npu: no float64 unit)" where the NPU
    # kernel refused it and its reference ran instead), in the fused model's node order
    node_kernels: Mapping[str, str] = field(default_factory=dict)

    @property
    def kernel_counts(self) -> dict[str, int]:
        """How many fused nodes ran on each kernel (`node_kernels` counted), most first."""
        counts: dict[str, int] = {}
        for label in self.node_kernels.values():
            counts[label] = counts.get(label, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    @property
    def failures(self) -> tuple[OutputComparison, ...]:
        """Every failed comparison, fused nodes first (the cause), then graph outputs."""
        every = (*self.nodes, *self.outputs, *self.stock_outputs)
        order = {"isolated": 0, "model": 1, "stock": 2}
        bad = [c for c in every if not c.ok]
        return tuple(sorted(bad, key=lambda c: (c.where != "node", order.get(c.mode, 3))))

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "runs": self.runs,
            "ranks": self.ranks,
            "seed": self.seed,
            "kernel": self.kernel,
            "outputs": [o.to_dict() for o in self.outputs],
            "nodes": [o.to_dict() for o in self.nodes],
            "stock": self.stock,
            "stock_outputs": [o.to_dict() for o in self.stock_outputs],
            "failures": [c.message() for c in self.failures],
            "seconds": dict(self.seconds),
            "node_kernels": dict(self.node_kernels),
            "kernel_counts": self.kernel_counts,
        }


def compare(
    name: str,
    expected: np.ndarray,
    actual: np.ndarray,
    rtol: float | None,
    atol: float | None,
    precision: str | None = None,
    noise: np.ndarray | None = None,
) -> OutputComparison:
    """Compare one value; `rtol`/`atol` (numpy allclose) override the dtype's default."""
    found = compare_values(expected, actual, rtol=rtol, atol=atol, precision=precision, noise=noise)
    return as_output(name, found)


def as_output(name: str, c: Comparison, **where: Any) -> OutputComparison:
    return OutputComparison(
        name,
        c.dtype,
        c.max_abs,
        c.max_rel,
        c.tolerance,
        c.ok,
        c.detail,
        worst_index=c.worst_index,
        expected=c.expected,
        actual=c.actual,
        **where,
    )


def keep_worst(worst: dict[tuple[str, str, str], OutputComparison], c: OutputComparison) -> None:
    """Keep `c` if it is the worst seen of its value: a failure over a pass, then max_rel."""
    key = (c.mode, c.node, c.name)
    previous = worst.get(key)
    if (
        previous is None
        or (previous.ok and not c.ok)
        or (previous.ok == c.ok and c.max_rel > previous.max_rel)
    ):
        worst[key] = c
