"""`SoftmaxTopK` (domain fuser): MoE gating in one kernel, rows (points) tiled over cores.

    softmax_topk:  p = Softmax(X);  values, indices = TopK(p [cast to float32], k)
    topk_softmax:  l, indices = TopK(X, k);  values = Softmax(l)       (softmax over the k)
    renormalize:   values = values / sum(values)                         (per point)

Each (B, S) point is a row of E experts (`axis` moved last). Per tile of `rows` points a core
copies in rows x E (npu-model.md "Softmax+TopK": t * E * size), runs max, sub, exp, sum, div
and the top-k selection on the Vector unit, and copies out rows x k values and int64 indices
(t * k * (value + index)). Nothing else touches GM: the unfused chain writes and reads the
probabilities, and the top-k values once more for the renormalization.

The optional `probs` output (the full softmax output, emitted when something outside the
match reads it) costs its copy-out only with attribute `emit_probs=1`: the op's contract
returns every output, so the array is filled either way in functional mode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _rows
from ._rows import RowOut, RowPlan, RowTiling, VecStep
from .api import Kernel, KernelError, KernelRun, TensorMeta, Tiling
from .npu.machine import Machine
from .softmax import F32, check_float, softmax_rows, softmax_steps
from .topk import I64, select_steps, topk_rows

ORDERS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class _Spec:
    axis: int
    k: int
    order: str
    renormalize: bool
    to_float32: bool
    emit_probs: bool
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def width(self) -> int:
        return self.shape[self.axis]

    @property
    def values_dtype(self) -> np.dtype:
        return F32 if self.to_float32 else self.dtype

    @property
    def probs_width(self) -> int:
        return self.width if self.order == "softmax_topk" else self.k

    @property
    def probs_dtype(self) -> np.dtype:
        return self.dtype


def _spec(op: str, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> _Spec:
    x = inputs_meta[0] if inputs_meta else None
    if x is None or len(x.shape) == 0:
        raise KernelError(f"{op}: X must be a tensor of rank >= 1")
    check_float(op, x.dtype)
    axis = _rows.normalize_axis(op, int(attrs.get("axis", -1)), len(x.shape))
    if "k" not in attrs:
        raise KernelError(f"{op}: attribute k is required")
    k = int(attrs["k"])
    if not 1 <= k <= x.shape[axis]:
        raise KernelError(f"{op}: k={k} outside [1, {x.shape[axis]}] along axis {axis}")
    order = str(attrs.get("order", "softmax_topk"))
    if order not in ORDERS:
        raise KernelError(f"{op}: order must be one of {', '.join(ORDERS)}, got '{order}'")
    return _Spec(
        axis=axis,
        k=k,
        order=order,
        renormalize=bool(int(attrs.get("renormalize", 0))),
        to_float32=bool(int(attrs.get("to_float32", 0))),
        emit_probs=bool(int(attrs.get("emit_probs", 0))),
        dtype=x.dtype,
        shape=x.shape,
    )


def _steps(s: _Spec, machine: Machine | None) -> list[VecStep]:
    e, k = s.width, s.k
    if s.order == "softmax_topk":
        steps = softmax_steps(s.dtype, e)
        if s.to_float32:
            steps.append(VecStep(("Cast",), e, s.dtype))
        steps += select_steps(machine, s.values_dtype, e, k)
    else:
        steps = select_steps(machine, s.dtype, e, k)
        steps += softmax_steps(s.dtype, k)
        if s.to_float32:
            steps.append(VecStep(("Cast",), k, s.dtype))
    if s.renormalize:
        steps.append(VecStep(("ReduceSum", "Div"), k, s.values_dtype))
    return steps


def _tile(s: _Spec, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """values, indices, probs of a tile of points [t, E]."""
    if s.order == "softmax_topk":
        probs = softmax_rows(x, s.dtype)
        scored = probs.astype(F32) if s.to_float32 else probs
        values, indices = topk_rows(scored, s.k, largest=True)
    else:
        logits, indices = topk_rows(x, s.k, largest=True)
        probs = softmax_rows(logits, s.dtype)
        values = probs.astype(F32) if s.to_float32 else probs
    if s.renormalize:
        v32 = values.astype(F32, copy=False)
        values = (v32 / v32.sum(axis=-1, keepdims=True)).astype(s.values_dtype, copy=False)
    return values, indices, probs


class SoftmaxTopKKernel(Kernel):
    """Fused Softmax + TopK (+ renormalize), either order; see the module docstring."""

    op_type = "SoftmaxTopK"
    domain = "fuser"
    tiling_type = RowTiling

    def _plan(self, s: _Spec, machine: Machine | None) -> RowPlan:
        width = s.width
        rows = int(np.prod(s.shape, dtype=np.int64)) // width if width else 0
        return RowPlan(
            op=self.op_type,
            rows=rows,
            width=width,
            in_dtype=s.dtype,
            outs=(
                RowOut("values", s.k, s.values_dtype),
                RowOut("indices", s.k, I64),
                RowOut("probs", s.probs_width, s.probs_dtype, emit=s.emit_probs),
            ),
            steps=tuple(_steps(s, machine)),
            # fp32 copy of the row (exp, then the masked copy the selection rounds walk).
            temp_bytes_per_row=width * 4,
        )

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        s = _spec(self.op_type, inputs_meta, attrs)
        shape = list(s.shape)
        shape[s.axis] = s.k
        probs = list(s.shape)
        probs[s.axis] = s.probs_width
        return (
            TensorMeta(tuple(shape), s.values_dtype),
            TensorMeta(tuple(shape), I64),
            TensorMeta(tuple(probs), s.probs_dtype),
        )

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> RowTiling:
        return _rows.default(self._plan(_spec(self.op_type, inputs_meta, attrs), machine), machine)

    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, RowTiling)
        plan = self._plan(_spec(self.op_type, inputs_meta, attrs), machine)
        _rows.check(plan, tiling, machine)

    def simulate(
        self,
        machine: Machine,
        inputs: Sequence[np.ndarray | None],
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        functional: bool,
        timeline: bool,
    ) -> KernelRun:
        assert isinstance(tiling, RowTiling)
        s = _spec(self.op_type, inputs_meta, attrs)
        plan = self._plan(s, machine)
        x = inputs[0]
        x_rows = _rows.to_rows(x, [s.axis]) if functional and x is not None else None

        def tile(xt: np.ndarray) -> tuple[np.ndarray, ...]:
            return _tile(s, xt)

        outs, stats = _rows.run(machine, plan, tiling, x_rows, (), tile, functional, timeline)
        if not functional:
            return KernelRun((), stats)
        metas = self.infer(inputs_meta, attrs)
        ys = tuple(
            np.ascontiguousarray(_rows.from_rows(o, m.shape, s.axis))
            for o, m in zip(outs, metas, strict=True)
        )
        return KernelRun(ys, stats)


KERNELS = (SoftmaxTopKKernel(),)
