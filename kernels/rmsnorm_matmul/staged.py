"""RmsNormMatMul staged (`staged=1`): the unfused chain's schedule inside the fused kernel.

The decomposed RMSNorm's kernels one after the other (Cast up, Mul x*x, ReduceMean, Add eps,
Sqrt, Reciprocal, Mul x, gamma and the Cast back in the order `round_before_scale` says),
writing N once, then per Linear the MatMul kernel reads N back at its own best tiling, and the
bias is added as the unfused Add does. See `_staged` for why a fused kernel has such a schedule
(the search can always fall back to the chain's cost). Its statistics are the ReduceMean
kernel's, equal to `reference` within a unit in the last place of the statistics dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from fuser.patterns.rmsnorm_matmul import WEIGHTS_AT
from onnx import helper

from .._staged import Operand, one_launch, stage, stage_cycles
from ..api import KernelRun, TensorMeta
from ..layernorm_matmul.plan import Problem
from ..npu.machine import Machine
from ..npu.stats import RunStats


def _norm_stages(p: Problem, rounded: bool) -> list[tuple[str, tuple[str, ...], dict[str, Any]]]:
    """(op, input names, attrs) of the RMSNorm chain; names: x, scale, eps, or earlier outputs
    `s<i>` (the output of stage i)."""
    s = p.ln
    up = s.stats != s.dtype
    wide, narrow = (helper.np_dtype_to_tensor_dtype(d) for d in (s.stats, s.dtype))
    stages: list[tuple[str, tuple[str, ...], dict[str, Any]]] = []

    def add(op: str, *ins: str, **attrs: Any) -> str:
        stages.append((op, ins, attrs))
        return f"s{len(stages) - 1}"

    xs = add("Cast", "x", to=wide) if up else "x"
    ms = add("ReduceMean", add("Mul", xs, xs), axes=[-1], keepdims=1)
    n = add("Mul", xs, add("Reciprocal", add("Sqrt", add("Add", ms, "eps"))))
    if s.has_scale and not rounded:
        n = add("Mul", n, "scale_stats")
    if up:
        n = add("Cast", n, to=narrow)
    if s.has_scale and rounded:
        add("Mul", n, "scale")
    return stages


def _run_norm(
    machine: Machine,
    p: Problem,
    rounded: bool,
    x: Operand,
    scale: Operand,
    functional: bool,
    timeline: bool,
) -> tuple[Operand, list[RunStats]]:
    s = p.ln
    values: dict[str, Operand] = {"x": x, "scale": scale}
    if functional:
        values["eps"] = np.asarray(s.epsilon, s.stats)
        if isinstance(scale, np.ndarray):
            values["scale_stats"] = scale.astype(s.stats)
    else:
        values["eps"] = TensorMeta((), s.stats)
        if scale is not None:
            values["scale_stats"] = TensorMeta(tuple(scale.shape), s.stats)
    runs = []
    last: Operand = x
    for i, (op, names, attrs) in enumerate(_norm_stages(p, rounded)):
        run = stage(machine, op, [values[n] for n in names], attrs, functional, timeline)
        runs.append(run.stats)
        last = run.outputs[0] if functional else _meta_after(op, [values[n] for n in names], attrs)
        values[f"s{i}"] = last
    return last, runs


def _meta_after(op: str, ins: Sequence[Operand], attrs: Mapping[str, Any]) -> TensorMeta:
    """The output meta of a chain stage in timing-only mode."""
    x = ins[0]
    assert x is not None
    shape = np.broadcast_shapes(*(tuple(i.shape) for i in ins if i is not None))
    if op == "ReduceMean":
        shape = (*shape[:-1], 1)
    dtype = helper.tensor_dtype_to_np_dtype(int(attrs["to"])) if op == "Cast" else x.dtype
    return TensorMeta(shape, dtype)


def run_staged(
    machine: Machine,
    p: Problem,
    rounded: bool,
    inputs: Sequence[np.ndarray | None],
    inputs_meta: Sequence[TensorMeta | None],
    out_metas: Sequence[TensorMeta],
    functional: bool,
    timeline: bool,
) -> KernelRun:
    """Run the stages (see the module docstring); outputs as the fused kernel's."""
    src: list[Operand] = [*(inputs if functional else inputs_meta), None, None]
    x = src[0]
    assert x is not None
    x2 = x.reshape(p.m, p.k) if isinstance(x, np.ndarray) else TensorMeta((p.m, p.k), p.ln.dtype)
    normalized, runs = _run_norm(machine, p, rounded, x2, src[1], functional, timeline)
    n = normalized
    if p.dtype != p.ln.dtype:  # autocast's Cast of N to the MatMuls' dtype, its own kernel
        to = helper.np_dtype_to_tensor_dtype(p.dtype)
        cast = stage(machine, "Cast", [n], {"to": to}, functional, timeline)
        runs.append(cast.stats)
        n = cast.outputs[0] if functional else TensorMeta((p.m, p.k), p.dtype)
    ys: list[np.ndarray] = []
    pos = WEIGHTS_AT
    for lin, meta in zip(p.linears, out_metas[1:], strict=True):
        mm = stage(machine, "MatMul", [n, src[pos]], {}, functional, timeline)
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
    assert isinstance(normalized, np.ndarray)
    return KernelRun((normalized.reshape(out_metas[0].shape), *ys), stats)


def staged_cycles(
    machine: Machine, p: Problem, rounded: bool, inputs_meta: Sequence[TensorMeta | None]
) -> float:
    """Predicted cycles of the staged schedule, each stage priced as `fuse` prices it."""
    s = p.ln
    values: dict[str, TensorMeta | None] = {
        "x": TensorMeta((p.m, p.k), p.ln.dtype),
        "scale": inputs_meta[1] if len(inputs_meta) > 1 else None,
        "eps": TensorMeta((), s.stats),
    }
    if values["scale"] is not None:
        values["scale_stats"] = TensorMeta(tuple(values["scale"].shape), s.stats)
    total = 0.0
    for i, (op, names, attrs) in enumerate(_norm_stages(p, rounded)):
        ins = [values[n] for n in names]
        total += stage_cycles(machine, op, ins, attrs)
        values[f"s{i}"] = _meta_after(op, ins, attrs)
    n2 = TensorMeta((p.m, p.k), p.dtype)
    if p.dtype != p.ln.dtype:
        wide = TensorMeta((p.m, p.k), p.ln.dtype)
        total += stage_cycles(
            machine, "Cast", [wide], {"to": helper.np_dtype_to_tensor_dtype(p.dtype)}
        )
    pos = WEIGHTS_AT
    for lin in p.linears:
        total += stage_cycles(machine, "MatMul", [n2, inputs_meta[pos]], {})
        if lin.has_bias:
            y, b = TensorMeta((p.m, lin.n), p.dtype), TensorMeta((lin.n,), p.dtype)
            total += stage_cycles(machine, "Add", [y, b], {})
        pos += 1 + lin.has_bias
    return total
