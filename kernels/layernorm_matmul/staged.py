"""LayerNormMatMul staged (`staged=1`): the unfused chain's schedule inside the fused kernel.

The LayerNormalization kernel normalizes every row and writes N once (to GM/L2), then, per
Linear, the MatMul kernel reads N back and multiplies it by W_i at its own best tiling, and
the bias is added as the unfused Add does (MatMul rounds to T, then the bias Add rounds again,
as the op's reference). See `_staged` for why every fused kernel has such a schedule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._staged import Operand, one_launch, stage, stage_cycles
from ..api import KernelRun, TensorMeta
from ..npu.machine import Machine
from .plan import Problem

LN_ATTRS = ("axis", "epsilon", "stash_type")
_TO = {np.dtype(np.float16): 10, np.dtype(np.float32): 1}  # TensorProto types for Cast


def run_staged(
    machine: Machine,
    p: Problem,
    inputs: Sequence[np.ndarray | None],
    inputs_meta: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    out_metas: Sequence[TensorMeta],
    functional: bool,
    timeline: bool,
) -> KernelRun:
    """Run the stages (see the module docstring); outputs as the fused kernel's."""
    src: list[Operand] = [*(inputs if functional else inputs_meta), None, None, None]
    ln_attrs = {k: attrs[k] for k in LN_ATTRS if k in attrs}
    ln = stage(machine, "LayerNormalization", src[:3], ln_attrs, functional, timeline)
    runs = [ln.stats]
    n2: Operand = (
        ln.outputs[0].reshape(p.m, p.k) if functional else TensorMeta((p.m, p.k), p.ln.dtype)
    )
    if p.dtype != p.ln.dtype:  # autocast's Cast of N to the MatMuls' dtype, its own kernel
        cast = stage(machine, "Cast", [n2], {"to": _TO[p.dtype]}, functional, timeline)
        runs.append(cast.stats)
        n2 = cast.outputs[0] if functional else TensorMeta((p.m, p.k), p.dtype)
    ys: list[np.ndarray] = []
    pos = 3
    for lin, meta in zip(p.linears, out_metas[1:], strict=True):
        mm = stage(machine, "MatMul", [n2, src[pos]], {}, functional, timeline)
        runs.append(mm.stats)
        y: Operand = mm.outputs[0] if functional else TensorMeta((p.m, lin.n), p.dtype)
        if lin.has_bias:
            b = src[pos + 1]
            b = b.reshape(-1) if isinstance(b, np.ndarray) else TensorMeta((lin.n,), p.dtype)
            add = stage(machine, "Add", [y, b], {}, functional, timeline)
            runs.append(add.stats)
            y = add.outputs[0] if functional else y
        if isinstance(y, np.ndarray):
            ys.append(y.reshape(meta.shape))
        pos += 1 + lin.has_bias
    stats = one_launch(runs)
    if not functional:
        return KernelRun((), stats)
    return KernelRun((ln.outputs[0].reshape(out_metas[0].shape), *ys), stats)


def staged_cycles(
    machine: Machine, p: Problem, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
) -> float:
    """Predicted cycles of the staged schedule, each stage priced as `fuse` prices it."""
    src: list[TensorMeta | None] = [*inputs_meta, None, None, None]
    ln_attrs = {k: attrs[k] for k in LN_ATTRS if k in attrs}
    total = stage_cycles(machine, "LayerNormalization", src[:3], ln_attrs)
    n2 = TensorMeta((p.m, p.k), p.dtype)
    if p.dtype != p.ln.dtype:
        wide = TensorMeta((p.m, p.k), p.ln.dtype)
        total += stage_cycles(machine, "Cast", [wide], {"to": _TO[p.dtype]})
    pos = 3
    for lin in p.linears:
        total += stage_cycles(machine, "MatMul", [n2, src[pos]], {})
        if lin.has_bias:
            y, b = TensorMeta((p.m, lin.n), p.dtype), TensorMeta((lin.n,), p.dtype)
            total += stage_cycles(machine, "Add", [y, b], {})
        pos += 1 + lin.has_bias
    return total
