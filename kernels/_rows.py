"""Row kernels: an op applied independently to rows of `width` elements on the Vector unit.

Softmax, TopK, SoftmaxTopK, LayerNormalization and the reductions all see their input as
`[rows, width]` (the op's axis moved last). Row tiles of `tiling.rows` rows are split over the
vector cores in balanced ranges; per tile a core copies the rows in (MTE2), runs the op's vector
instructions, and copies each output out (MTE3). With `double_buffer` the in and out queues have
two slots, so tile i+1's copy-in runs under tile i's compute.

A tile's arithmetic is one numpy function over the whole tile (vectorized, so a functional run
stays within a small factor of numpy); its cost is the list of `VecStep`s, each one vector
instruction per op on `rows x per_row` elements (k * N + b: the per-instruction b is what small
tiles pay over and over). A row must fit UB whole: there is no split along the row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ._budget import QueueSpec, check_flag, check_positive, fits, require_fits
from .api import KernelError, Tiling, TilingError
from .npu.core import Core
from .npu.launch import launch
from .npu.machine import Machine
from .npu.memory import Tile
from .npu.pipes import Level
from .npu.stats import RunStats


@dataclass(frozen=True)
class RowTiling(Tiling):
    """Rows per tile (a core's step), double buffering (0/1), vector cores used."""

    rows: int
    double_buffer: int
    cores: int


@dataclass(frozen=True)
class RowOut:
    """One output of a row kernel: `width` elements of `dtype` per row.

    `emit` False: the output is not requested, so nothing is copied out for it (the array is
    still returned in functional mode, as callers expect every output position filled).
    """

    name: str
    width: int
    dtype: np.dtype
    emit: bool = True


@dataclass(frozen=True)
class VecStep:
    """Vector instructions of one tile: each op in `ops` on rows x `per_row` elements."""

    ops: tuple[str, ...]
    per_row: int
    dtype: np.dtype


@dataclass(frozen=True)
class RowPlan:
    """What a row kernel moves and computes; see the module docstring."""

    op: str
    rows: int
    width: int
    in_dtype: np.dtype
    outs: tuple[RowOut, ...]
    steps: tuple[VecStep, ...]
    # float32 scratch per row (statistics, an upcast copy of the row): UB reserved, single slot.
    temp_bytes_per_row: int = 0
    # Inputs loaded once per core and kept in UB (LayerNorm's scale and bias): bytes each.
    resident_bytes: tuple[int, ...] = ()


#: Tile function: (x tile [t, width], *resident arrays) -> one array [t, out.width] per output.
TileFn = Callable[..., tuple[np.ndarray, ...]]


def specs(plan: RowPlan, t: RowTiling) -> list[QueueSpec]:
    """The UB queues a tiling reserves on each core."""
    depth = 2 if t.double_buffer else 1
    out = [QueueSpec(Level.UB, "x", t.rows * plan.width * plan.in_dtype.itemsize, depth)]
    for o in plan.outs:
        # An output that is not copied out is still a UB buffer, but no copy-out overlaps it.
        d = depth if o.emit else 1
        out.append(QueueSpec(Level.UB, o.name, t.rows * o.width * o.dtype.itemsize, d))
    if plan.temp_bytes_per_row:
        out.append(QueueSpec(Level.UB, "tmp", t.rows * plan.temp_bytes_per_row, 1))
    for i, nbytes in enumerate(plan.resident_bytes):
        out.append(QueueSpec(Level.UB, f"res{i}", max(1, nbytes), 1))
    return out


def check(plan: RowPlan, t: RowTiling, machine: Machine) -> None:
    """Raise `TilingError` if `t` is malformed or its queues do not fit UB."""
    check_positive(plan.op, rows=t.rows, cores=t.cores)
    check_flag(plan.op, double_buffer=t.double_buffer)
    if t.cores > machine.vector_cores:
        raise TilingError(
            f"{plan.op}: tiling uses {t.cores} cores, {machine.name} has "
            f"{machine.vector_cores} vector cores"
        )
    require_fits(plan.op, machine, specs(plan, t))


def default(plan: RowPlan, machine: Machine) -> RowTiling:
    """The cheapest by `estimate` of a few tile sizes that fit UB, double-buffered if possible.

    Candidates split the rows evenly over all vector cores or over fewer of them: fewer active
    cores each get a bigger share of HBM and pay smaller DMA heads, which can beat using them
    all (the MoE gating sweep's shape).
    """
    cores = machine.vector_cores
    fracs = (1, 2, 3, 4, 6, 8)
    sizes = sorted({max(1, math.ceil(plan.rows / max(1, cores * 2 // f))) for f in fracs})
    best: tuple[float, RowTiling] | None = None
    for rows in sizes:
        for db in (1, 0):
            t = RowTiling(rows, db, cores)
            while t.rows > 1 and not fits(machine, specs(plan, t)):
                t = RowTiling(max(1, t.rows // 2), db, cores)
            if not fits(machine, specs(plan, t)):
                continue
            cost = estimate(plan, t, machine)
            if best is None or cost < best[0]:
                best = (cost, t)
    if best is None:
        raise TilingError(
            f"{plan.op}: one row of {plan.width} elements does not fit UB "
            f"({machine.ub_bytes} bytes)"
        )
    return best[1]


def estimate(plan: RowPlan, t: RowTiling, machine: Machine) -> float:
    """Rough cycles: per core, its tiles' copy-in, vector work and copy-out, pipelined when
    double-buffered (fill + (n - 1) x slowest stage + drain), summed when not."""
    tiles = math.ceil(plan.rows / t.rows) if plan.rows else 0
    if tiles == 0:
        return float(machine.kernel_launch_cycles)
    active = min(t.cores, tiles)
    per_core = math.ceil(tiles / active)
    n = min(t.rows, plan.rows)
    in_bytes = n * plan.width * plan.in_dtype.itemsize
    t_in = machine.copy_in_transfer(False) + in_bytes / machine.read_bytes_per_cycle
    out_bytes = [n * o.width * o.dtype.itemsize for o in plan.outs if o.emit]
    t_out = sum(
        machine.copy_out_transfer_cycles + b / machine.write_bytes_per_cycle for b in out_bytes
    )
    t_vec = 0.0
    for step in plan.steps:
        for op in step.ops:
            k, b = machine.vector_cost(op, step.dtype)
            t_vec += k * n * step.per_row + b
    if t.double_buffer:
        core = t_in + t_vec + t_out + (per_core - 1) * max(t_in, t_vec, t_out)
    else:
        core = per_core * (t_in + t_vec + t_out)
    return machine.kernel_launch_cycles + core


def run(
    machine: Machine,
    plan: RowPlan,
    t: RowTiling,
    x_rows: np.ndarray | None,
    residents: Sequence[np.ndarray],
    fn: TileFn,
    functional: bool,
    timeline: bool,
) -> tuple[list[np.ndarray], RunStats]:
    """Run the row program; returns the outputs as [rows, width] arrays (empty list when timing
    only) and the stats."""
    if functional and x_rows is None:
        raise KernelError(f"{plan.op}: a functional run needs the input rows")
    # (start, stop) of each tile of t.rows rows, the last one cut at plan.rows: built as two
    # ranges zipped (a timing run of a big LayerNorm has tens of thousands of tiles).
    stops = [*range(t.rows, plan.rows, t.rows), plan.rows] if plan.rows else []
    tiles = list(zip(range(0, plan.rows, t.rows), stops, strict=True))
    outs = [np.empty((plan.rows, o.width), o.dtype) for o in plan.outs] if functional else []
    program = partial(_program, plan, t, x_rows, residents, fn, outs, functional)
    stats = launch(
        machine,
        plan.op,
        tiles,
        program,
        max_cores=t.cores,
        functional=functional,
        signature=lambda w: w[1] - w[0],
        timeline=timeline,
    )
    return outs, stats


def _program(
    plan: RowPlan,
    t: RowTiling,
    x_rows: np.ndarray | None,
    residents: Sequence[np.ndarray],
    fn: TileFn,
    outs: list[np.ndarray],
    functional: bool,
    core: Core,
    items: Sequence[tuple[int, int]],
) -> None:
    queues = {s.name: core.ub.queue(s.name, s.slot_bytes, s.depth) for s in specs(plan, t)}
    res_tiles: list[Tile] = []
    for i, nbytes in enumerate(plan.resident_bytes):
        slot = queues[f"res{i}"].alloc()
        core.copy_in(slot, nbytes, residents[i] if functional else None, label=f"in res{i}")
        res_tiles.append(slot)
    # What every tile repeats, made once: a row kernel's tiles number in the tens of thousands.
    in_row = plan.width * plan.in_dtype.itemsize
    x_queue = queues["x"]
    out_queues = [queues[o.name] for o in plan.outs]
    out_rows = [o.width * o.dtype.itemsize for o in plan.outs]  # bytes per row of each output
    first_row, narrowest = out_rows[0], min(out_rows)
    copies = [(k, o.emit, out_rows[k], f"out {o.name}") for k, o in enumerate(plan.outs)]
    compute = partial(_single, fn, len(plan.outs))
    head, *rest = plan.steps
    for r0, r1 in items:
        n = r1 - r0
        xin = x_queue.alloc()
        core.copy_in(xin, n * in_row, None if x_rows is None else x_rows[r0:r1])
        out_tiles = [q.alloc() for q in out_queues]
        first = out_tiles[0]
        # The first step computes the whole tile (one numpy call: fast); the later steps only
        # charge their instructions, in order on the same pipe, which is all the timing needs.
        core.vector(head.ops, head.dtype, n * head.per_row, (xin, *res_tiles), out_tiles, compute,
                    out_bytes=n * narrowest)  # fmt: skip
        for step in rest:
            core.vector(step.ops, step.dtype, n * step.per_row, (first,), (first,), None,
                        out_bytes=n * first_row)  # fmt: skip
        for k, emit, row_bytes, label in copies:
            tile = out_tiles[k]
            dst = outs[k][r0:r1] if functional else None
            if emit:
                core.copy_out(tile, n * row_bytes, dst, label=label)
            elif dst is not None and tile.data is not None:
                dst[...] = tile.data


def _single(fn: TileFn, n_out: int, *data: np.ndarray) -> Any:
    result = fn(*data)
    return result[0] if n_out == 1 else result


def to_rows(x: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    """`x` with `axes` moved last and flattened: [prod(other dims), prod(axes dims)]."""
    keep = [d for d in range(x.ndim) if d not in axes]
    moved = np.transpose(x, (*keep, *axes)) if list(axes) != list(range(len(keep), x.ndim)) else x
    width = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    return np.ascontiguousarray(moved).reshape(-1, width)


def from_rows(y_rows: np.ndarray, shape: Sequence[int], axis: int) -> np.ndarray:
    """Inverse of `to_rows` for one axis whose length may have changed: `shape` is the output
    shape, `axis` the op's axis in it."""
    ndim = len(shape)
    moved_shape = [shape[d] for d in range(ndim) if d != axis] + [shape[axis]]
    y = y_rows.reshape(moved_shape)
    if axis == ndim - 1:
        return y
    return np.moveaxis(y, -1, axis)


def normalize_axis(op: str, axis: int, ndim: int) -> int:
    """`axis` in [0, ndim), or `KernelError` naming the op."""
    if not -ndim <= axis < max(ndim, 1):
        raise KernelError(f"{op}: axis {axis} out of range for rank {ndim}")
    return axis % max(ndim, 1)
