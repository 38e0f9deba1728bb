"""SPMD launch: split the work over cores, run each core's program, gather `RunStats`.

Work is a sequence of items (tiles, rows, output blocks); core c of K gets a contiguous range,
the first N % K cores one item more than the rest (the balanced split of the articles). A
kernel's time is the launch head plus its slowest core's makespan.

In timing-only mode, cores whose items have the same signature (same tile sizes, not the same
data) run the same schedule, so one of them is simulated and its result reused.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol, TypeVar

from .core import Core
from .machine import Machine
from .pipes import COMPUTE_PIPES, GM_PIPES, Pipe
from .stats import RunStats
from .timeline import Interval, Timeline

W = TypeVar("W")


def split_balanced(n: int, parts: int) -> list[range]:
    """Split range(n) into `parts` contiguous ranges; the first n % parts get one more."""
    if parts <= 0:
        raise ValueError("parts must be positive")
    base, extra = divmod(n, parts)
    out: list[range] = []
    start = 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


class _CoreResult:
    __slots__ = ("busy", "gm_reads", "intervals", "makespan", "moved")

    def __init__(self, core: Core) -> None:
        self.makespan = core.makespan
        self.busy = core.busy
        self.moved = core.moved
        self.intervals = core.intervals
        self.gm_reads = core.gm_reads


def launch(
    machine: Machine,
    name: str,
    work: Sequence[W],
    body: Callable[[Core, Sequence[W]], None],
    *,
    max_cores: int,
    functional: bool,
    signature: Callable[[W], Hashable] | None = None,
    timeline: bool = True,
    gm_sizes: Mapping[str, int] | None = None,
) -> RunStats:
    """Run `body(core, items)` on each core for its share of `work`; return the run's stats.

    `max_cores` caps the cores used (fewer when there is less work than cores). `gm_sizes`
    gives the bytes of each GM tensor the program names in `copy_in(gm=...)`.
    """
    n_cores = max(1, min(max_cores, len(work)))
    shares = split_balanced(len(work), n_cores)
    results: list[_CoreResult] = []
    cache: dict[Hashable, _CoreResult] = {}
    for c, share in enumerate(shares):
        # One slice, one map: a row kernel's work is tens of thousands of tiles, and these
        # run for every core, simulated or not.
        items = work[share.start : share.stop]
        key: Hashable | None = None
        if not functional and signature is not None:
            key = tuple(map(signature, items))
            if key in cache:
                results.append(cache[key])
                continue
        core = Core(machine, c, n_cores, functional, record=timeline)
        if items:
            body(core, items)
        res = _CoreResult(core)
        if key is not None:
            cache[key] = res
        results.append(res)
    return gather(machine, name, results, timeline, gm_sizes)


class CoreRecord(Protocol):
    """What a finished core leaves behind: a `Core`, or the snapshot `launch` keeps of one."""

    @property
    def makespan(self) -> float: ...
    @property
    def busy(self) -> Mapping[Pipe, float]: ...
    @property
    def moved(self) -> Mapping[str, int]: ...
    @property
    def intervals(self) -> Sequence[tuple[Pipe, float, float, str]]: ...
    @property
    def gm_reads(self) -> Mapping[str, int]: ...


def hbm_bytes(
    machine: Machine, results: Sequence[CoreRecord], gm_sizes: Mapping[str, int] | None
) -> int:
    """HBM traffic of cores that ran as one kernel: every write, every unnamed read, and each
    named tensor once (its repeated reads hit the L2). When the named tensors together exceed
    the L2, the share of repeated reads that no longer fits misses too [D]."""
    sizes = gm_sizes or {}
    requested: dict[str, int] = {}
    for r in results:
        for t, b in r.gm_reads.items():
            requested[t] = requested.get(t, 0) + b
    named = sum(requested.values())
    unnamed = sum(r.moved["gm_read"] for r in results) - named
    first = {t: min(b, sizes.get(t, b)) for t, b in requested.items()}
    footprint = sum(first.values())
    again = named - footprint
    spill = again * max(0.0, 1.0 - machine.l2_bytes / footprint) if footprint else 0.0
    writes = sum(r.moved["gm_write"] for r in results)
    return int(unnamed + footprint + spill + writes)


def gather(
    machine: Machine,
    name: str,
    results: Sequence[CoreRecord],
    timeline: bool,
    gm_sizes: Mapping[str, int] | None = None,
) -> RunStats:
    """`RunStats` of cores that ran as one kernel: launch head + the slowest core's makespan,
    or the kernel's HBM traffic over the chip's HBM bandwidth when that is longer."""
    launch_cycles = machine.kernel_launch_cycles
    hbm = hbm_bytes(machine, results, gm_sizes)
    makespan = max(r.makespan for r in results)
    core_cycles = max(makespan, machine.hbm_cycles(hbm))
    cycles = launch_cycles + core_cycles
    n = len(results)
    busy = {p.value: sum(r.busy[p] for r in results) for p in Pipe}
    util = {p: (b / (core_cycles * n) if core_cycles > 0 else 0.0) for p, b in busy.items()}
    slowest = max(results, key=lambda r: r.makespan)
    mem = max(slowest.busy[p] for p in GM_PIPES)
    comp = max(slowest.busy[p] for p in COMPUTE_PIPES)
    moved = {k: sum(r.moved[k] for r in results) for k in results[0].moved}
    tl = None
    if timeline:
        intervals = tuple(
            Interval(c, p.value, s + launch_cycles, e + launch_cycles, label)
            for c, r in enumerate(results)
            for p, s, e, label in r.intervals
        )
        tl = Timeline(machine.clock_hz, intervals, ((0.0, cycles, name),))
    return RunStats(
        cycles=cycles,
        us=machine.cycles_to_us(cycles),
        core_cycles=core_cycles,
        pipe_busy=MappingProxyType(busy),
        pipe_utilization=MappingProxyType(util),
        launches=1,
        cores=n,
        bound="memory" if mem >= comp or core_cycles > makespan else "compute",
        estimated=False,
        timeline=tl,
        hbm_bytes=hbm,
        **moved,
    )
