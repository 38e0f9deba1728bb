"""Lower bounds of `row_cycles` over a whole tiling space (numpy; `search.Bounded`).

`row_lower_bounds` is `cost.row_cycles` written over numpy columns of the space's fields in
the same order (the resident copies, the per-tile copy-in, vector instructions and copy-outs
on the slowest core's share of tiles, the copy-out head hidden under later tiles when
double-buffered, launch, heads and HBM floor through `_bounds`): the model's price up to
rounding, so `search.best` prices only the cheapest few. A staged tiling (the unfused chain's
schedule) is bounded by 0: priced first, once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._bounds import VecStream, kernel_floor
from .._cost_base import ceil_div, dma, dma_out, field_columns
from .._rows import RowPlan
from ..api import Tiling
from ..npu.machine import Machine

#: The fields of `SoftmaxTopKTiling`, in the order `row_lower_bounds` reads them.
FIELDS = ("rows", "double_buffer", "cores", "staged")


def row_lower_bounds(machine: Machine, plan: RowPlan, tilings: Sequence[Tiling]) -> np.ndarray:
    """For each tiling, cycles `row_cycles(machine, plan, t)` never goes below (see the
    module docstring); `tilings` carry `FIELDS`."""
    rows_t, db, cores_t, staged = field_columns(tilings, FIELDS)
    count = len(tilings)
    if plan.rows == 0:
        return np.where(staged != 0, 0.0, float(machine.kernel_launch_cycles))
    n = np.minimum(rows_t, plan.rows)
    tiles = ceil_div(plan.rows, n)
    cores = np.maximum(1, np.minimum(cores_t, tiles))
    per_core = ceil_div(tiles, cores)
    s = VecStream(count)
    for i, nbytes in enumerate(plan.resident_bytes):
        s.add({f"MTE2.res{i}": dma(machine, nbytes, cores)}, 1)
    in_bytes = n * plan.width * plan.in_dtype.itemsize
    vec = np.zeros(count)
    for step in plan.steps:
        for op in step.ops:
            k, b = machine.vector_cost(op, step.dtype)
            vec = vec + (k * n * step.per_row + b)
    out = sum(
        (dma_out(machine, n * o.width * o.dtype.itemsize, cores) for o in plan.outs if o.emit),
        np.zeros(count),
    )
    s.add({"MTE2": dma(machine, in_bytes, cores), "VECTOR": vec, "MTE3": out}, per_core)
    # `_merge_resident`: the resident copies run on MTE2 before the first tile.
    for name in [p for p in s.busy if p.startswith("MTE2.")]:
        s.busy["MTE2"] = s.busy["MTE2"] + s.busy.pop(name)
    hidden = (db != 0) & (per_core > 1)
    s.add_busy("MTE3", np.where(hidden, machine.copy_out_head_cycles, 0.0))
    gm = plan.rows * (
        plan.width * plan.in_dtype.itemsize
        + sum(o.width * o.dtype.itemsize for o in plan.outs if o.emit)
    )
    first_in = np.full(count, plan.resident_bytes[0]) if plan.resident_bytes else in_bytes
    bound = kernel_floor(machine, s.time(db), gm, first_in, cores, out_head=~hidden)
    return np.where(staged != 0, 0.0, bound)
