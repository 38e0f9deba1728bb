"""The timeline of a run: busy intervals per core and pipe, exportable as a Chrome trace.

A Chrome trace (JSON object with `traceEvents`) opens in Perfetto or chrome://tracing; each
core is a process and each of its pipes a thread, so there is one track per core and pipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple


class Interval(NamedTuple):
    """One instruction: `pipe` of `core` busy from `start` to `end` cycles (kernel time)."""

    core: int
    pipe: str
    start: float
    end: float
    label: str


@dataclass(frozen=True)
class Timeline:
    """All intervals of one or several kernel runs, in cycles from the first launch."""

    clock_hz: float
    intervals: tuple[Interval, ...]
    #: (start cycle, end cycle, kernel name) of each launch, launch overhead included.
    kernels: tuple[tuple[float, float, str], ...] = ()

    def shifted(self, offset: float) -> Timeline:
        """The same timeline starting `offset` cycles later."""
        return Timeline(
            self.clock_hz,
            tuple(
                Interval(i.core, i.pipe, i.start + offset, i.end + offset, i.label)
                for i in self.intervals
            ),
            tuple((s + offset, e + offset, n) for s, e, n in self.kernels),
        )

    def on(self, core: int, pipe: str) -> list[tuple[float, float]]:
        """(start, end) of every interval of `pipe` on `core`, in time order."""
        return sorted((i.start, i.end) for i in self.intervals if i.core == core and i.pipe == pipe)

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace JSON: one process per core, one thread per pipe, times in µs."""
        return to_chrome_trace(self)


def concat(timelines: Sequence[Timeline], offsets: Sequence[float]) -> Timeline:
    """Timelines of kernels run one after another, each starting at its offset."""
    if not timelines:
        raise ValueError("concat needs at least one timeline")
    intervals: list[Interval] = []
    kernels: list[tuple[float, float, str]] = []
    for t, off in zip(timelines, offsets, strict=True):
        s = t.shifted(off)
        intervals.extend(s.intervals)
        kernels.extend(s.kernels)
    return Timeline(timelines[0].clock_hz, tuple(intervals), tuple(kernels))


_PIPE_ORDER = ("SCALAR", "MTE2", "MTE1", "CUBE", "VECTOR", "FIXP", "MTE3")


def to_chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """Export `timeline` as a Chrome trace event object (complete events, µs)."""
    us_per_cycle = 1e6 / timeline.clock_hz
    events: list[dict[str, Any]] = []
    cores = sorted({i.core for i in timeline.intervals})
    pipes = sorted({i.pipe for i in timeline.intervals}, key=_pipe_rank)
    tid = {p: n for n, p in enumerate(pipes, start=1)}
    for c in cores:
        events.append(
            {"ph": "M", "name": "process_name", "pid": c + 1, "args": {"name": f"core {c}"}}
        )
        for p in pipes:
            events.append(
                {"ph": "M", "name": "thread_name", "pid": c + 1, "tid": tid[p], "args": {"name": p}}
            )
    for s, e, name in timeline.kernels:
        events.append(
            {
                "ph": "X",
                "name": name,
                "pid": 0,
                "tid": 0,
                "ts": s * us_per_cycle,
                "dur": (e - s) * us_per_cycle,
            }
        )
    if timeline.kernels:
        events.append({"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "kernels"}})
    for i in timeline.intervals:
        events.append(
            {
                "ph": "X",
                "name": i.label,
                "pid": i.core + 1,
                "tid": tid[i.pipe],
                "ts": i.start * us_per_cycle,
                "dur": (i.end - i.start) * us_per_cycle,
                "args": {"cycles": i.end - i.start},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def _pipe_rank(pipe: str) -> tuple[int, str]:
    return (_PIPE_ORDER.index(pipe) if pipe in _PIPE_ORDER else len(_PIPE_ORDER), pipe)
