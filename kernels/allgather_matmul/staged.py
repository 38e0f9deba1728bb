"""AllGatherMatMul staged (`staged=1`, one chunk): the unfused chain's schedule inside the fused
kernel. The AllGather kernel gathers every shard, then per Linear the MatMul kernel multiplies
the whole gathered input at its own best tiling and the bias is added as the unfused Add does
(MatMul rounds to T, then Add rounds again, as the op's reference), or the Gemm kernel runs
the Linear as one Gemm. Nothing overlaps; see `_staged` for why every fused kernel has such a
schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._staged import Operand, one_launch, stage, stage_cycles
from ..api import KernelRun, TensorMeta
from ..npu.machine import Machine
from .kernel import _Problem

GATHER = ("com.microsoft", "AllGather")


def _gather_attrs(p: _Problem) -> dict[str, int]:
    return {"group_size": p.g.group_size, "axis": p.g.axis}


def _linear_stages(
    p: _Problem, i: int, gathered: Operand, w: Operand, b: Operand
) -> list[tuple[str, list[Operand], dict[str, Any]]]:
    """The unfused ops of Linear i: (op, inputs, attributes) in order; an input None stands
    for the previous stage's output. A flatten Reshape moves no data (the kernels read the
    same rows)."""
    spec = p.lins[i].spec
    if isinstance(gathered, np.ndarray):
        a: Operand = gathered.reshape(-1, gathered.shape[-1]) if spec.flatten else gathered
    else:
        shape = (math.prod(p.g.gathered[:-1]), p.g.gathered[-1])
        a = TensorMeta(shape if spec.flatten else p.g.gathered, p.dtype)
    if isinstance(b, np.ndarray):
        b = b.reshape(-1)
    elif spec.b is not None:
        b = TensorMeta((p.lins[i].n,), p.dtype)
    if spec.gemm:
        attrs = {"transB": int(spec.trans_b), "alpha": spec.alpha, "beta": spec.beta}
        return [("Gemm", [a, w, *([b] if spec.b is not None else [])], attrs)]
    stages: list[tuple[str, list[Operand], dict[str, Any]]] = [("MatMul", [a, w], {})]
    if spec.b is not None:
        stages.append(("Add", [None, b], {}))
    return stages


def run_staged(
    machine: Machine,
    p: _Problem,
    inputs: Sequence[np.ndarray | None],
    inputs_meta: Sequence[TensorMeta | None],
    functional: bool,
    timeline: bool,
) -> KernelRun:
    """Gather, then each Linear's MatMul (+ Add) or Gemm; outputs (Y_0, gathered, Y_1, ...)
    as the fused kernel's."""
    src: list[Operand] = [*(inputs if functional else inputs_meta), None, None]
    ag = stage(machine, GATHER[1], src[:1], _gather_attrs(p), functional, timeline, GATHER[0])
    gathered: Operand = ag.outputs[0] if functional else TensorMeta(p.g.gathered, p.dtype)
    runs = [ag.stats]
    ys: list[Operand] = []
    for i, lin in enumerate(p.lins):
        b = None if lin.spec.b is None else src[lin.spec.b]
        y: Operand = None
        for op, ins, attrs in _linear_stages(p, i, gathered, src[lin.spec.w], b):
            ins = [y if x is None else x for x in ins]
            run = stage(machine, op, ins, attrs, functional, timeline)
            runs.append(run.stats)
            y = run.outputs[0] if functional else TensorMeta(p.out_shape(i), p.dtype)
        ys.append(y)
    stats = one_launch(runs)
    if not functional:
        return KernelRun((), stats)
    assert isinstance(gathered, np.ndarray)
    outs = [np.asarray(y).reshape(p.out_shape(i)) for i, y in enumerate(ys)]
    return KernelRun((outs[0], gathered, *outs[1:]), stats)


def staged_cycles(machine: Machine, p: _Problem, inputs_meta: Sequence[TensorMeta | None]) -> float:
    """Predicted cycles of the staged schedule, each stage priced as `fuse` prices it."""
    x = inputs_meta[0]
    metas = [*inputs_meta, None, None]
    total = stage_cycles(machine, GATHER[1], [x], _gather_attrs(p), GATHER[0])
    gathered = TensorMeta(p.g.gathered, p.dtype)
    for i, lin in enumerate(p.lins):
        b = None if lin.spec.b is None else metas[lin.spec.b]
        y: TensorMeta | None = None
        for op, ins, attrs in _linear_stages(p, i, gathered, metas[lin.spec.w], b):
            metas_i = [y if x is None else x for x in ins]
            total += stage_cycles(machine, op, metas_i, attrs)  # type: ignore[arg-type]
            y = TensorMeta(p.out_shape(i), p.dtype)
    return total
