"""Shared pieces of the analytical cost models (each kernel package's `cost`, indexed by `search`).

A cost model prices one tiling of one kernel on a target without running the simulator, with
`shared/docs/npu-model.md`'s formulas:

- a stage on a pipe is `head + bytes / bandwidth` (DMA), `start-up + bytes / bandwidth` (MTE1),
  `ceil(m/16) * ceil(k/k0) * ceil(n/16)` (Cube) or `k * N + b` per vector instruction;
- a core walks its share of the work as a stream of steps (a K chunk, a row tile). With double
  buffering the pipes overlap: `fill + (n - 1) x slowest stage + drain`, written here as the
  busiest pipe's total plus one step's latency through the other pipes; single-buffered, the
  stages of a step run one after the other, so the step costs the sum of its stages;
- the kernel is `launch + max(slowest core + pipe heads, compulsory GM bytes / HBM bandwidth)`,
  the slowest core holding `ceil(items / cores)` items (the tail effect), each core's DMA at its
  L2 port rate (`Machine.read_bytes_per_cycle` / `write_bytes_per_cycle`), each copy paying its
  per-transfer cost and each DMA pipe its start-up head once (`npu.core`).

These modules only read the kernels' tiling types and buffer specs: they never change what a
kernel does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._budget import QueueSpec, fits
from ._columns import TilingColumns
from .api import TensorMeta, Tiling
from .npu.machine import Machine


class CostModel(Protocol):
    """The tiling space and analytical cost of one kernel (one op type)."""

    domain: str
    op_type: str

    def space(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Sequence[Tiling]:
        """Legal tilings on hardware-aligned steps, filtered by buffer capacities, deduplicated
        (two tilings the kernel would run identically appear once): a list, or numpy columns
        (`_columns.TilingColumns`) for the big spaces."""
        ...

    def cost(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> float:
        """Predicted kernel cycles of `tiling` (launch included)."""
        ...

    def rule_of_thumb(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Tiling | None:
        """The articles' rule-of-thumb tiling for this kernel (a baseline), or None."""
        ...


@dataclass(frozen=True)
class Stage:
    """Busy cycles per pipe of one step (e.g. one K chunk of one output block)."""

    pipes: Mapping[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """The step's stages one after the other (single buffering)."""
        return sum(self.pipes.values())

    @property
    def slowest(self) -> float:
        """The step's slowest stage (the pace when double-buffered)."""
        return max(self.pipes.values(), default=0.0)


#: Pipes in the order a step's data flows through them (copy in, move, compute, copy out).
FLOW: tuple[str, ...] = ("MTE2", "MTE1", "VECTOR", "CUBE", "MTE3", "FIXP")


class Stream:
    """One core's work as a stream of steps: per-pipe busy totals and the step latencies."""

    def __init__(self) -> None:
        self.busy: dict[str, float] = {}
        self.first: Stage | None = None
        self.steps = 0
        # Latency after the last step that no overlap hides (e.g. the last block's FixPipe).
        self.drain = 0.0
        # The last step as the drain sees it, when it differs from the first (None: the same).
        self.last: Stage | None = None

    def add(self, pipes: Mapping[str, float], count: float = 1.0) -> None:
        """`count` steps of the given per-pipe cycles."""
        if count <= 0:
            return
        for p, c in pipes.items():
            self.busy[p] = self.busy.get(p, 0.0) + c * count
        if self.first is None or sum(pipes.values()) > self.first.total:
            self.first = Stage(dict(pipes))
        self.steps += math.ceil(count)

    def single(self) -> float:
        """Single-buffered makespan: one slot per queue, so a step's copy, moves and compute
        follow one another, and the next step's copy waits for the slot. Only the FixPipe
        (its own L0C slot) and the scalar unit overlap: they count once, as the drain."""
        chain = sum(c for p, c in self.busy.items() if p in FLOW and p != "FIXP")
        return chain + self.drain

    def time(self, double_buffer: bool) -> float:
        """Makespan of the stream: pipelined (fill + busiest pipe + drain) or summed.

        Pipelined, the busiest pipe sets the pace; before its first instruction the step's
        earlier stages run once (fill), after its last the later ones (drain), in the order
        data flows through the pipes (`FLOW`).
        """
        if not self.busy:
            return 0.0
        if not double_buffer:
            return self.single()
        first = self.first or Stage()
        last = self.last or first
        neck = max(self.busy, key=lambda p: self.busy[p])
        at = FLOW.index(neck) if neck in FLOW else 0
        fill = sum(first.pipes.get(p, 0.0) for p in FLOW[:at])
        drain = sum(last.pipes.get(p, 0.0) for p in FLOW[at + 1 :])
        return self.busy[neck] + fill + drain + (self.drain if neck != "FIXP" else 0.0)


class LastProblem:
    """A one-entry memo of a model's parsed problem: the search prices many tilings of the
    same inputs, and parsing them (the kernel's own checks) costs more than the formula."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._value: Any = None

    def get(self, metas: Sequence[Any], attrs: Mapping[str, Any], make: Any) -> Any:
        """`make()` for these inputs, reused while they stay the same."""
        key = (tuple(metas), repr(sorted(attrs.items())))
        if key != self._key:
            self._value = make()
            self._key = key
        return self._value


def kernel_cycles(
    machine: Machine,
    core_cycles: float,
    gm_bytes: float,
    first_in: float,
    active: int,
    out_head: bool = True,
) -> float:
    """Launch + the slowest core with its DMA pipes' start-up heads (MTE2 sized by the first
    copy `first_in`, then the copy-out head unless `out_head` is False: the caller's stream
    already carries it on its copy-out pipe), never below the compulsory GM traffic over HBM."""
    heads = machine.copy_in_head(int(first_in), active)
    if out_head:
        heads += machine.copy_out_head_cycles
    return machine.kernel_launch_cycles + max(core_cycles + heads, machine.hbm_cycles(gm_bytes))


def l2_spill(machine: Machine, footprint: float, again: float) -> float:
    """HBM bytes of `again` repeated reads of tensors of `footprint` bytes: none while they fit
    the L2, else the share that no longer fits misses (as `npu.launch.hbm_bytes` charges)."""
    if footprint <= 0:
        return 0.0
    return again * max(0.0, 1.0 - machine.l2_bytes / footprint)


def dma(machine: Machine, nbytes: float, active: int = 1, to_l1: bool = False) -> float:
    """One GM -> core copy once the pipe has started: transfer cost + bytes at the L2 port
    (none for no bytes; `nbytes` may be a numpy column, for the bounds of `_bounds`)."""
    return (nbytes > 0) * (machine.copy_in_transfer(to_l1) + nbytes / machine.read_bytes_per_cycle)


def dma_out(machine: Machine, nbytes: float, active: int = 1, cap: float | None = None) -> float:
    """One core -> GM copy (MTE3, or FixPipe with its own bandwidth `cap`)."""
    bw = machine.write_bytes_per_cycle
    if cap is not None:
        bw = min(bw, cap)
    return machine.copy_out_transfer_cycles + nbytes / bw


def cube_blocks(m: int, k: int, n: int, k0: int) -> float:
    """Cube cycles of one m x k x n multiply (blocks of 16 x k0 x 16)."""
    return float(-(-m // 16) * -(-k // k0) * -(-n // 16))


def round_up(x: int, m: int) -> int:
    """x rounded up to a multiple of m."""
    return -(-x // m) * m


def aligned_sizes(limit: int, step: int, options: Iterable[int]) -> list[int]:
    """Tile sizes on `step` multiples from `options`, capped at `limit` rounded up to `step`
    (sizes past the problem collapse into that one)."""
    top = round_up(max(1, limit), step)
    return sorted({min(top, round_up(o, step)) for o in options if o > 0})


def core_counts(total: int) -> list[int]:
    """Cores a tiling may use: all, half, a quarter (fewer cores pay smaller DMA pipe heads,
    which can win on small shapes)."""
    return sorted({total, max(1, total // 2), max(1, total // 4)}, reverse=True)


def fitting(machine: Machine, specs: Sequence[QueueSpec]) -> bool:
    """True when the queues fit every buffer (counting both slots when double-buffered)."""
    return fits(machine, specs)


def field_columns(tilings: Sequence[Tiling], names: Sequence[str]) -> list[Any]:
    """The named fields of every tiling as int64 numpy columns, in the order of `names` (for
    the vectorized lower bounds that `search.best` prunes a space with)."""
    import numpy as np

    if isinstance(tilings, TilingColumns):
        return [tilings.columns[n] for n in names]
    table = np.array([[getattr(t, n) for n in names] for t in tilings], dtype=np.int64)
    return list(table.reshape(len(tilings), len(names)).T)


def copy_in_heads(machine: Machine, first_bytes: Any, cores: Any) -> Any:
    """`Machine.copy_in_head` of every (first copy bytes, active cores) pair of two int
    columns: computed once per distinct pair (a space has few)."""
    import numpy as np

    b = np.asarray(first_bytes).astype(np.int64)
    c = np.asarray(cores).astype(np.int64)
    if not len(b):
        return np.zeros(0)
    span = int(c.max()) + 1
    codes, inverse = np.unique(b * span + c, return_inverse=True)
    heads = [machine.copy_in_head(code // span, code % span) for code in codes.tolist()]
    return np.array(heads)[inverse.ravel()]


def ceil_div(a: Any, b: Any) -> Any:
    """ceil(a / b) of ints or int numpy arrays, elementwise."""
    return -(-a // b)
