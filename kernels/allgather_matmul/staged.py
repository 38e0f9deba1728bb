"""AllGatherMatMul staged (`staged=1`, one chunk): the unfused chain's schedule inside the fused
kernel. The AllGather kernel gathers every shard, then the MatMul kernel multiplies the whole
gathered input at its own best tiling, and the bias is added as the unfused Add does (MatMul
rounds to T, then Add rounds again, as the op's reference). Nothing overlaps; see `_staged`
for why every fused kernel has such a schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._staged import Operand, one_launch, stage, stage_cycles
from ..api import KernelRun, TensorMeta
from ..npu.machine import Machine
from .kernel import _Problem

GATHER = ("com.microsoft", "AllGather")


def _gather_attrs(p: _Problem) -> dict[str, int]:
    return {"group_size": p.g.group_size, "axis": p.g.axis}


def run_staged(
    machine: Machine,
    p: _Problem,
    inputs: Sequence[np.ndarray | None],
    inputs_meta: Sequence[TensorMeta | None],
    functional: bool,
    timeline: bool,
) -> KernelRun:
    """Gather, multiply, add the bias; outputs (Y, gathered) as the fused kernel's."""
    src: list[Operand] = [*(inputs if functional else inputs_meta), None, None]
    ag = stage(machine, GATHER[1], src[:1], _gather_attrs(p), functional, timeline, GATHER[0])
    gathered: Operand = ag.outputs[0] if functional else TensorMeta(p.g.gathered, p.dtype)
    mm = stage(machine, "MatMul", [gathered, src[1]], {}, functional, timeline)
    runs = [ag.stats, mm.stats]
    y: Operand = mm.outputs[0] if functional else TensorMeta(p.out_shape, p.dtype)
    if p.has_bias:
        b = src[2]
        b = b.reshape(-1) if isinstance(b, np.ndarray) else TensorMeta((p.n,), p.dtype)
        add = stage(machine, "Add", [y, b], {}, functional, timeline)
        runs.append(add.stats)
        y = add.outputs[0] if functional else y
    stats = one_launch(runs)
    if not functional:
        return KernelRun((), stats)
    assert isinstance(y, np.ndarray)
    assert isinstance(gathered, np.ndarray)
    return KernelRun((y, gathered), stats)


def staged_cycles(machine: Machine, p: _Problem, inputs_meta: Sequence[TensorMeta | None]) -> float:
    """Predicted cycles of the staged schedule, each stage priced as `fuse` prices it."""
    x = inputs_meta[0]
    total = stage_cycles(machine, GATHER[1], [x], _gather_attrs(p), GATHER[0])
    gathered = TensorMeta(p.g.gathered, p.dtype)
    total += stage_cycles(machine, "MatMul", [gathered, inputs_meta[1]], {})
    if p.has_bias:
        y, b = TensorMeta(p.out_shape, p.dtype), TensorMeta((p.n,), p.dtype)
        total += stage_cycles(machine, "Add", [y, b], {})
    return total
