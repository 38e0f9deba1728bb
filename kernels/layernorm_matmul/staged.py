"""LayerNormMatMul staged (`staged=1`): the unfused chain's schedule inside the fused kernel.

The LayerNormalization kernel normalizes every row and writes N once (to GM/L2), then, per
Linear, the MatMul kernel reads N back and multiplies it by W_i at its own best tiling, and
the bias is added as the unfused Add does. Each stage is the very kernel the unfused chain
runs, so this tiling costs what the unfused chain costs and computes the same numbers (MatMul
rounds to T, then the bias Add rounds again, as the op's reference): the tiling search can
always fall back to it, so a fused LayerNormMatMul is never predicted slower than its chain.
Stages are separated by a barrier across the cores, charged as one launch head each [G], so
the whole is one launch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..api import Kernel, KernelRun, TensorMeta
from ..npu.machine import Machine
from ..npu.stats import RunStats, sequence
from ..registry import get_kernel
from ..search import host_tiling, search
from .plan import Problem

LN_ATTRS = ("axis", "epsilon", "stash_type")


def _kernel(op: str) -> Kernel:
    k = get_kernel("", op)
    assert k is not None, op
    return k


def _stage(
    machine: Machine,
    op: str,
    inputs: Sequence[np.ndarray | TensorMeta | None],
    attrs: Mapping[str, Any],
    functional: bool,
    timeline: bool,
) -> KernelRun:
    kernel = _kernel(op)
    metas = [None if x is None else TensorMeta(x.shape, x.dtype) for x in inputs]
    tiling = host_tiling(kernel, metas, attrs, machine)
    return kernel.run(machine, inputs, attrs, tiling=tiling, functional=functional,
                      timeline=timeline)  # fmt: skip


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
    src: list[np.ndarray | TensorMeta | None] = list(inputs if functional else inputs_meta)
    src += [None] * 3
    ln_attrs = {k: attrs[k] for k in LN_ATTRS if k in attrs}
    ln = _stage(machine, "LayerNormalization", src[:3], ln_attrs, functional, timeline)
    runs = [ln.stats]
    normalized = ln.outputs[0] if functional else TensorMeta(p.ln.shape, p.dtype)
    n2 = (
        normalized.reshape(p.m, p.k)
        if isinstance(normalized, np.ndarray)
        else TensorMeta((p.m, p.k), p.dtype)
    )
    ys: list[np.ndarray] = []
    pos = 3
    for lin, meta in zip(p.linears, out_metas[1:], strict=True):
        mm = _stage(machine, "MatMul", [n2, src[pos]], {}, functional, timeline)
        runs.append(mm.stats)
        y: np.ndarray | TensorMeta = (
            mm.outputs[0] if functional else TensorMeta((p.m, lin.n), p.dtype)
        )
        if lin.has_bias:
            b = src[pos + 1]
            b = b.reshape(-1) if isinstance(b, np.ndarray) else TensorMeta((lin.n,), p.dtype)
            add = _stage(machine, "Add", [y, b], {}, functional, timeline)
            runs.append(add.stats)
            y = add.outputs[0] if functional else y
        if isinstance(y, np.ndarray):
            ys.append(y.reshape(meta.shape))
        pos += 1 + lin.has_bias
    stats = one_launch(machine, sequence(runs))
    if not functional:
        return KernelRun((), stats)
    assert isinstance(normalized, np.ndarray)
    return KernelRun((normalized.reshape(out_metas[0].shape), *ys), stats)


def one_launch(machine: Machine, stats: RunStats) -> RunStats:
    """Stages run back to back as one kernel: one launch, the others' heads as barriers."""
    return dataclasses.replace(stats, launches=1)


def staged_cycles(
    machine: Machine, p: Problem, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
) -> float:
    """Predicted cycles of the staged schedule, priced as `fuse` prices the unfused chain: each
    stage by its cost model's best tiling where it has one (MatMul), else by a timing-only run
    of its kernel (LayerNormalization, Add)."""
    src: list[TensorMeta | None] = [*inputs_meta, None, None, None]
    ln_attrs = {k: attrs[k] for k in LN_ATTRS if k in attrs}
    total = _stage(machine, "LayerNormalization", src[:3], ln_attrs, False, False).stats.cycles
    n2 = TensorMeta((p.m, p.k), p.dtype)
    pos = 3
    for lin in p.linears:
        w = src[pos]
        total += search("", "MatMul", [n2, w], {}, machine).best.cycles
        if lin.has_bias:
            y, b = TensorMeta((p.m, lin.n), p.dtype), TensorMeta((lin.n,), p.dtype)
            total += _stage(machine, "Add", [y, b], {}, False, False).stats.cycles
        pos += 1 + lin.has_bias
    return total
