"""Numpy mirrors of `_cost_base`'s stream and kernel formulas, over a whole tiling space at once.

The exact branch and bound of `search.best` prices a space's tilings in the order of their
lower bounds (`search.Bounded`). A model's bound is its own cost formula written over numpy
columns of the space's fields (one numpy pass instead of one Python call per tiling); these
are the pieces every such formula shares:

- `VecStream`: `Stream` over arrays (a stage added where its count is positive, the biggest
  stage kept as the first, `time` pipelined or summed per tiling). Where two pipes tie for the
  busiest (to rounding), the cheaper of their makespans is taken, so that a bound computed in
  another order of operations than the model's never lands above it;
- `kernel_floor`: `kernel_cycles` (launch, pipe heads, the HBM floor) per tiling, the heads
  asked of `Machine.copy_in_head` once per distinct (first copy, cores)
  (`_cost_base.copy_in_heads`).

A bound built from them is the model's price up to rounding, so `best` prices a handful of a
space's tilings: the cheapest few and those within `TIE` of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._cost_base import FLOW, ceil_div, copy_in_heads
from .npu.machine import Machine

#: Relative margin within which two pipes count as tied for the busiest (see the docstring).
NECK_TIE = 1e-9


def as_column(value: Any, n: int) -> np.ndarray:
    """`value` (a scalar or an array) as a float column of `n` entries."""
    return np.broadcast_to(np.asarray(value, dtype=float), (n,))


class VecStream:
    """`_cost_base.Stream` for `n` tilings at once (see the module docstring)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.busy: dict[str, np.ndarray] = {}
        self.first: dict[str, np.ndarray] = {}
        self.first_total = np.full(n, -np.inf)
        self.drain = np.zeros(n)

    def add(self, pipes: Mapping[str, Any], count: Any = 1.0) -> None:
        """`count` steps of the given per-pipe cycles, for the tilings whose count is > 0."""
        count = as_column(count, self.n)
        on = count > 0
        cols = {p: as_column(c, self.n) for p, c in pipes.items()}
        for p, c in cols.items():
            self.busy[p] = self.busy.get(p, np.zeros(self.n)) + np.where(on, c * count, 0.0)
        total = np.zeros(self.n)
        for c in cols.values():
            total = total + c
        take = on & (total > self.first_total)
        for p in {*self.first, *cols}:
            new = cols.get(p, np.zeros(self.n))
            self.first[p] = np.where(take, new, self.first.get(p, np.zeros(self.n)))
        self.first_total = np.where(take, total, self.first_total)

    def add_busy(self, pipe: str, cycles: Any) -> None:
        """Busy cycles on `pipe` outside any step (as the models add to `Stream.busy`)."""
        self.busy[pipe] = self.busy.get(pipe, np.zeros(self.n)) + as_column(cycles, self.n)

    def scaled(self, factor: Any) -> VecStream:
        """The same stream with every busy total times `factor` (a core's share of items)."""
        out = VecStream(self.n)
        out.busy = {p: c * as_column(factor, self.n) for p, c in self.busy.items()}
        out.first, out.first_total, out.drain = self.first, self.first_total, self.drain
        return out

    def first_slowest(self) -> np.ndarray:
        """The first stage's slowest pipe (`Stage.slowest`)."""
        return np.max(np.stack([*self.first.values(), np.zeros(self.n)]), axis=0)

    def single(self) -> np.ndarray:
        """`Stream.single`: the FLOW pipes but FixPipe in turn, plus the drain."""
        chain = np.zeros(self.n)
        for p, c in self.busy.items():
            if p in FLOW and p != "FIXP":
                chain = chain + c
        return chain + self.drain

    def pipelined(self) -> np.ndarray:
        """`Stream.time(True)`: the busiest pipe, the first stage's earlier pipes, the last
        stage's later ones, the drain (the cheapest reading where pipes tie, see above)."""
        if not self.busy:
            return np.zeros(self.n)
        top = np.max(np.stack(list(self.busy.values())), axis=0)
        best = np.full(self.n, np.inf)
        for p, b in self.busy.items():
            at = FLOW.index(p) if p in FLOW else 0
            fill = sum((self.first.get(q, 0.0) for q in FLOW[:at]), np.zeros(self.n))
            tail = sum((self.first.get(q, 0.0) for q in FLOW[at + 1 :]), np.zeros(self.n))
            value = b + fill + tail + (self.drain if p != "FIXP" else 0.0)
            best = np.where(b >= top * (1 - NECK_TIE), np.minimum(best, value), best)
        return best

    def time(self, double_buffer: np.ndarray) -> np.ndarray:
        """`Stream.time` per tiling: pipelined where `double_buffer`, else summed."""
        if not self.busy:
            return np.zeros(self.n)
        return np.where(double_buffer != 0, self.pipelined(), self.single())


def kernel_floor(
    machine: Machine,
    core_cycles: np.ndarray,
    gm_bytes: Any,
    first_in: np.ndarray,
    active: np.ndarray,
    out_head: Any = True,
) -> np.ndarray:
    """`_cost_base.kernel_cycles` per tiling (`out_head` may differ per tiling)."""
    first, cores, _ = np.broadcast_arrays(first_in, active, core_cycles)
    heads = copy_in_heads(machine, first, cores)
    heads = heads + np.where(np.asarray(out_head), machine.copy_out_head_cycles, 0.0)
    hbm = machine.hbm_cycles(as_column(gm_bytes, len(heads)))  # type: ignore[arg-type]
    return machine.kernel_launch_cycles + np.maximum(core_cycles + heads, hbm)


def k_chunk(
    machine: Machine,
    tm: np.ndarray,
    width: np.ndarray,
    kk: np.ndarray,
    tk0: np.ndarray,
    isz: int,
    k0: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(MTE1, Cube) cycles of one `kk`-deep K chunk of a `tm` x `width` output block in L0
    steps of `tk0` (a tail step last), as the models' `_chunks(kk, tk0)` sums price it: per
    step two L1 -> L0 loads with their start-ups, and the Cube's 16 x k0 x 16 blocks."""
    s_full, s_tail = np.divmod(kk, tk0)
    load_a = isz / machine.l1_to_l0a_bytes_per_cycle
    load_b = isz / machine.l1_to_l0b_bytes_per_cycle
    start = 2 * machine.l1_to_l0_startup_cycles
    mte1 = s_full * (start + tm * tk0 * load_a + tk0 * width * load_b) + (s_tail > 0) * (
        start + tm * s_tail * load_a + s_tail * width * load_b
    )
    mn = ceil_div(tm, 16) * ceil_div(width, 16)
    cube = (s_full * (mn * ceil_div(tk0, k0)) + mn * ceil_div(s_tail, k0)).astype(float)
    return mte1, cube
