"""Cost model of the fused row kernel on the Vector unit: `SoftmaxTopK` (the model is written
for any `_rows` plan; the unfused Softmax and TopK are priced by their simulated kernels).

Per row tile of `rows` rows (npu-model.md "Softmax+TopK": in `t * E * size`, the vector work of
max, sub, exp, sum, div and the selection, out `t * k * (value + index)`): one copy-in, the
plan's vector instructions (`k * N + b` each, so small tiles pay `b` over and over), one copy-out
per emitted output. Tiles are split over the vector cores; the slowest core holds
`ceil(tiles / cores)`. UB slots are rounded to 32 bytes by the buffer (`npu.memory.align`).

Space: rows per tile in powers of two up to the most that fit UB, plus the even splits of the
rows over 1, 2, 3, 4 rounds of the cores; single or double buffering; all / half / a quarter of
the vector cores. Deduplicated by (rows clipped, buffering, cores clipped).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._cost_base import LastProblem, Stream, core_counts, dma, dma_out, fitting, kernel_cycles
from .._rows import RowPlan, RowTiling, specs
from ..api import Kernel, TensorMeta, Tiling
from ..npu.machine import Machine
from ..registry import get_kernel
from .kernel import (
    SoftmaxTopKTiling,
    softmax_topk_tiling,
    staged_schedule_applies,
    staged_spec,
)
from .staged import staged_cycles


def row_cycles(machine: Machine, plan: RowPlan, t: RowTiling) -> float:
    """Predicted cycles of `t` on `plan` (see the module docstring)."""
    if plan.rows == 0:
        return float(machine.kernel_launch_cycles)
    n = min(t.rows, plan.rows)
    tiles = math.ceil(plan.rows / n)
    cores = max(1, min(t.cores, tiles))
    per_core = math.ceil(tiles / cores)
    s = Stream()
    for i, nbytes in enumerate(plan.resident_bytes):
        s.add({f"MTE2.res{i}": dma(machine, nbytes, cores)}, 1)
    # The tail tile is smaller; the slowest core is one holding full tiles.
    in_bytes = n * plan.width * plan.in_dtype.itemsize
    vec = 0.0
    for step in plan.steps:
        for op in step.ops:
            k, b = machine.vector_cost(op, step.dtype)
            vec += k * n * step.per_row + b
    out = sum(dma_out(machine, n * o.width * o.dtype.itemsize, cores) for o in plan.outs if o.emit)
    s.add({"MTE2": dma(machine, in_bytes, cores), "VECTOR": vec, "MTE3": out}, per_core)
    _merge_resident(s)
    # Double-buffered over several tiles, the copy-out pipe's start-up head (paid at the first
    # tile's copy-out) runs while the next tiles are copied in and computed: a stage of MTE3,
    # not a wait before the stream.
    hidden = bool(t.double_buffer) and per_core > 1
    if hidden:
        s.busy["MTE3"] = s.busy.get("MTE3", 0.0) + machine.copy_out_head_cycles
    gm = plan.rows * (
        plan.width * plan.in_dtype.itemsize
        + sum(o.width * o.dtype.itemsize for o in plan.outs if o.emit)
    )
    first_in = plan.resident_bytes[0] if plan.resident_bytes else in_bytes
    return kernel_cycles(
        machine, s.time(bool(t.double_buffer)), gm, first_in, cores, out_head=not hidden
    )


def _merge_resident(s: Stream) -> None:
    """Resident copies run on MTE2 before the first tile: fold them into the MTE2 total."""
    extra = {p: c for p, c in s.busy.items() if p.startswith("MTE2.")}
    for p, c in extra.items():
        del s.busy[p]
        s.busy["MTE2"] = s.busy.get("MTE2", 0.0) + c


def row_space(machine: Machine, plan: RowPlan) -> list[RowTiling]:
    """Fitting row tilings (see the module docstring)."""
    total = machine.vector_cores
    sizes: set[int] = set()
    r = 1
    while r < plan.rows * 2:
        sizes.add(min(r, max(1, plan.rows)))
        r *= 2
    for c in core_counts(total):
        for rounds in (1, 2, 3, 4):
            sizes.add(max(1, math.ceil(plan.rows / (c * rounds))))
    seen: set[tuple[int, int, int]] = set()
    out: list[RowTiling] = []
    for rows, db, cores in itertools.product(sorted(sizes), (1, 0), core_counts(total)):
        t = RowTiling(rows, db, cores)
        n = min(rows, max(1, plan.rows))
        key = (n, db, min(cores, math.ceil(max(1, plan.rows) / n)))
        if key in seen or not fitting(machine, specs(plan, t)):
            continue
        seen.add(key)
        out.append(t)
    return out


def moe_rule_of_thumb(machine: Machine, plan: RowPlan) -> RowTiling:
    """The MoE article's rule: tileS starts at the rows per core and halves until UB fits
    (double-buffered, every vector core)."""
    rows = max(1, math.ceil(plan.rows / machine.vector_cores))
    t = RowTiling(rows, 1, machine.vector_cores)
    while t.rows > 1 and not fitting(machine, specs(plan, t)):
        t = RowTiling(max(1, t.rows // 2), 1, t.cores)
    return t


class _RowModel:
    """A row kernel: the plan comes from the kernel (`_plan` of its spec)."""

    def __init__(self, domain: str, op_type: str) -> None:
        self.domain = domain
        self.op_type = op_type
        self._last = LastProblem()
        self._staged = LastProblem()

    def _plan(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> RowPlan:
        k = get_kernel(self.domain, self.op_type)
        assert k is not None
        return plan_of(k, metas, attrs, machine)

    def space(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> list[Tiling]:
        space: list[Tiling] = [
            softmax_topk_tiling(t) for t in row_space(machine, self._plan(metas, attrs, machine))
        ]
        # The unfused chain's schedule is a candidate wherever its stages exist (the softmax
        # chain): fused is never priced slower there.
        if staged_schedule_applies(metas, attrs):
            space.append(SoftmaxTopKTiling(1, 1, machine.vector_cores, staged=1))
        return space

    def cost(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> float:
        assert isinstance(tiling, RowTiling)
        if getattr(tiling, "staged", 0):  # memo keyed by the machine too: its price
            spec = staged_spec(metas, attrs)
            make = lambda: staged_cycles(machine, spec)  # noqa: E731
            return float(self._staged.get([*metas, machine], attrs, make))
        plan = self._last.get(metas, attrs, lambda: self._plan(metas, attrs, machine))
        return row_cycles(machine, plan, tiling)

    def rule_of_thumb(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Tiling | None:
        return softmax_topk_tiling(moe_rule_of_thumb(machine, self._plan(metas, attrs, machine)))


def plan_of(
    kernel: Kernel, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
) -> RowPlan:
    """The `RowPlan` the SoftmaxTopK kernel builds for these inputs."""
    from . import kernel as softmax_topk

    if isinstance(kernel, softmax_topk.SoftmaxTopKKernel):
        return kernel._plan(softmax_topk._spec(kernel.op_type, metas, attrs), machine)
    raise TypeError(f"{kernel.op_type}: no row cost model")


MODELS = (_RowModel("fuser", "SoftmaxTopK"),)


# The lower bound of the exact search (`search.Bounded`): `bounds.row_lower_bounds`.
import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

from .bounds import row_lower_bounds  # noqa: E402


class _BoundedRowModel(_RowModel):
    """`_RowModel` with a numpy lower bound over its space (`search.best` prunes with it)."""

    #: The tiling fields `lower_bounds` understands (`search.Bounded`).
    bound_fields = frozenset(f.name for f in dataclasses.fields(SoftmaxTopKTiling))

    def lower_bounds(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tilings: Sequence[Tiling],
        machine: Machine,
    ) -> np.ndarray:
        """Cycles each tiling's `cost` never goes below (`row_lower_bounds`)."""
        plan = self._last.get(metas, attrs, lambda: self._plan(metas, attrs, machine))
        return row_lower_bounds(machine, plan, tilings)


MODELS = (_BoundedRowModel("fuser", "SoftmaxTopK"),)
