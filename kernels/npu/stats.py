"""`RunStats`: what one kernel run (or a sequence of runs) cost on the simulated NPU."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .timeline import Timeline, concat

BYTE_LEVELS: tuple[str, ...] = ("gm_read", "gm_write", "ub", "l1", "l0a", "l0b", "l0c")


@dataclass(frozen=True)
class RunStats:
    """Cycles, pipe usage, bytes per memory level and the timeline of a run.

    `pipe_busy` sums busy cycles over the cores used; `pipe_utilization` is that sum over
    (`core_cycles` x `cores`). Bytes count data moved into each level (`gm_read` out of GM).
    `estimated` is True for roofline estimates, which have no timeline. `hbm_bytes` is the
    traffic the chip's HBM served: first touches of what was read, and every write (reads that
    hit the L2 are in `gm_read` but not here).
    """

    cycles: float
    us: float
    core_cycles: float
    pipe_busy: Mapping[str, float]
    pipe_utilization: Mapping[str, float]
    gm_read: int
    gm_write: int
    ub: int
    l1: int
    l0a: int
    l0b: int
    l0c: int
    launches: int
    cores: int
    bound: str
    estimated: bool
    timeline: Timeline | None = field(default=None, compare=False, repr=False)
    hbm_bytes: int = 0

    @property
    def gm_bytes(self) -> int:
        """GM bytes read plus written."""
        return self.gm_read + self.gm_write

    def bytes_by_level(self) -> dict[str, int]:
        """Bytes moved per memory level, keyed as in `BYTE_LEVELS`."""
        return {k: int(getattr(self, k)) for k in BYTE_LEVELS}

    def to_chrome_trace(self) -> dict[str, Any]:
        """The timeline as Chrome trace JSON (raises if the run has no timeline)."""
        if self.timeline is None:
            raise ValueError("this run has no timeline (estimated runs have none)")
        return self.timeline.to_chrome_trace()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary without the timeline."""
        return {
            "cycles": self.cycles,
            "us": self.us,
            "core_cycles": self.core_cycles,
            "pipe_busy": dict(self.pipe_busy),
            "pipe_utilization": dict(self.pipe_utilization),
            **self.bytes_by_level(),
            "hbm_bytes": self.hbm_bytes,
            "launches": self.launches,
            "cores": self.cores,
            "bound": self.bound,
            "estimated": self.estimated,
        }


def sequence(runs: Sequence[RunStats]) -> RunStats:
    """Runs executed one after another (e.g. an unfused chain): cycles and bytes add up."""
    if not runs:
        raise ValueError("sequence needs at least one run")
    cycles = sum(r.cycles for r in runs)
    us = sum(r.us for r in runs)
    busy: dict[str, float] = {}
    for r in runs:
        for p, b in r.pipe_busy.items():
            busy[p] = busy.get(p, 0.0) + b
    cores = max(r.cores for r in runs)
    util = {p: b / (cycles * cores) if cycles and cores else 0.0 for p, b in busy.items()}
    levels = {k: sum(int(getattr(r, k)) for r in runs) for k in BYTE_LEVELS}
    timelines = [r.timeline for r in runs]
    timeline = None
    if all(t is not None for t in timelines):
        offsets = [sum(r.cycles for r in runs[:i]) for i in range(len(runs))]
        timeline = concat([t for t in timelines if t is not None], offsets)
    slowest = max(runs, key=lambda r: r.cycles)
    return RunStats(
        cycles=cycles,
        us=us,
        core_cycles=sum(r.core_cycles for r in runs),
        pipe_busy=MappingProxyType(busy),
        pipe_utilization=MappingProxyType(util),
        launches=sum(r.launches for r in runs),
        cores=cores,
        bound=slowest.bound,
        estimated=any(r.estimated for r in runs),
        timeline=timeline,
        hbm_bytes=sum(r.hbm_bytes for r in runs),
        **levels,
    )
