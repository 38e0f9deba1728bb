"""ONNX `ReduceMean`, `ReduceSum`, `ReduceMax` on the Vector unit (the decomposed LayerNorm's
reductions), rows tiled over vector cores.

The reduced axes are moved last and flattened, so each output element is the reduction of one
row (`_rows`). Axes come from input 1 (ReduceSum from opset 13, the others from opset 18) or
the `axes` attribute (earlier opsets); none means all axes, or nothing with
`noop_with_empty_axes=1`. `keepdims` (default 1) keeps the reduced axes as 1s.

float16 sums are accumulated in float32 (cast up, ReduceSum, cast back), as onnxruntime does;
max needs no widening. A reduced row must fit UB whole (no split of a row across tiles or
cores), so a full reduction of a tensor larger than UB has no tiling: `TilingError` says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from . import _rows
from ._rows import RowOut, RowPlan, RowTiling, VecStep
from .api import Input, Kernel, KernelError, KernelRun, TensorMeta, Tiling
from .npu.machine import Machine

F32 = np.dtype(np.float32)


def _axes(op: str, axes_in: Input, attrs: Mapping[str, Any], ndim: int) -> tuple[int, ...] | None:
    """Sorted non-negative axes, () for a no-op, None for all axes."""
    if isinstance(axes_in, TensorMeta):
        raise KernelError(f"{op}: the axes' values are needed: pass input 'axes' as an array")
    raw = axes_in if axes_in is not None else attrs.get("axes")
    values = [] if raw is None else [int(a) for a in np.asarray(raw).reshape(-1)]
    if not values:
        return () if int(attrs.get("noop_with_empty_axes", 0)) else None
    out = set()
    for a in values:
        if not -ndim <= a < ndim:
            raise KernelError(f"{op}: axis {a} out of range for rank {ndim}")
        out.add(a % ndim)
    return tuple(sorted(out))


class _ReduceKernel(Kernel):
    """One reduction over the given axes; subclasses name the op and its arithmetic."""

    domain = ""
    tiling_type = RowTiling
    vector_op: ClassVar[str]
    mean: ClassVar[bool] = False

    def run(
        self,
        machine: Machine,
        inputs: Sequence[Input],
        attrs: Mapping[str, Any],
        *,
        tiling: Tiling | None = None,
        functional: bool = True,
        timeline: bool = True,
    ) -> KernelRun:
        """As `Kernel.run`. Axes given as input 1 must be an array, also in timing-only mode:
        they shape the output. They are passed on as the `axes` attribute."""
        if len(inputs) > 1 and inputs[1] is not None:
            x = inputs[0]
            ndim = len(x.shape) if x is not None else 0
            axes = _axes(self.op_type, inputs[1], attrs, ndim)
            attrs = {**attrs, "axes": list(axes or ())}
            inputs = [inputs[0]]
        return super().run(
            machine, inputs, attrs, tiling=tiling, functional=functional, timeline=timeline
        )

    def _spec(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[RowPlan, tuple[int, ...], TensorMeta]:
        x = inputs_meta[0] if inputs_meta else None
        if x is None:
            raise KernelError(f"{self.op_type}: data is required")
        if x.dtype == np.float64 or (self.mean and x.dtype.kind != "f"):
            raise KernelError(f"{self.op_type}: the Vector unit does not take {x.dtype} here")
        ndim = len(x.shape)
        axes = _axes(self.op_type, None, attrs, ndim)
        axes = tuple(range(ndim)) if axes is None else axes
        keep = int(attrs.get("keepdims", 1))
        width = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
        out_shape = tuple((1 if keep else None) if d in axes else n for d, n in enumerate(x.shape))
        out = TensorMeta(tuple(n for n in out_shape if n is not None), x.dtype)
        plan = RowPlan(
            op=self.op_type,
            rows=x.size // width if width else 0,
            width=width,
            in_dtype=x.dtype,
            outs=(RowOut("y", 1, x.dtype),),
            steps=tuple(self._steps(x.dtype, width)),
            temp_bytes_per_row=width * 4 if x.dtype == np.float16 else 0,
        )
        return plan, axes, out

    def _steps(self, dtype: np.dtype, width: int) -> list[VecStep]:
        widen = dtype == np.float16 and self.vector_op == "ReduceSum"
        acc = F32 if widen else dtype
        steps = [VecStep(("Cast",), width, dtype)] if widen else []
        steps.append(VecStep((self.vector_op,), width, acc))
        if self.mean:
            steps.append(VecStep(("Muls",), 1, acc))
        if widen:
            steps.append(VecStep(("Cast",), 1, acc))
        return steps

    def _reduce(self, x: np.ndarray) -> np.ndarray:
        if self.vector_op == "ReduceMax":
            return x.max(axis=-1, keepdims=True)
        acc = x.astype(F32) if x.dtype == np.float16 else x
        total = acc.sum(axis=-1, keepdims=True, dtype=acc.dtype)
        if self.mean:
            total = total / x.shape[-1]
        return total.astype(x.dtype)

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        return (self._spec(inputs_meta, attrs)[2],)

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> RowTiling:
        return _rows.default(self._spec(inputs_meta, attrs)[0], machine)

    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, RowTiling)
        _rows.check(self._spec(inputs_meta, attrs)[0], tiling, machine)

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
        plan, axes, out = self._spec(inputs_meta, attrs)
        x = inputs[0]
        x_rows = None
        if functional and x is not None:
            x_rows = _rows.to_rows(x, axes) if axes else x.reshape(-1, 1)

        def tile(xt: np.ndarray) -> tuple[np.ndarray, ...]:
            return (self._reduce(xt),)

        outs, stats = _rows.run(machine, plan, tiling, x_rows, (), tile, functional, timeline)
        if not functional:
            return KernelRun((), stats)
        return KernelRun((outs[0].reshape(out.shape),), stats)


class ReduceMeanKernel(_ReduceKernel):
    """ONNX ReduceMean."""

    op_type = "ReduceMean"
    vector_op = "ReduceSum"
    mean = True


class ReduceSumKernel(_ReduceKernel):
    """ONNX ReduceSum."""

    op_type = "ReduceSum"
    vector_op = "ReduceSum"


class ReduceMaxKernel(_ReduceKernel):
    """ONNX ReduceMax."""

    op_type = "ReduceMax"
    vector_op = "ReduceMax"


KERNELS = (ReduceMeanKernel(), ReduceSumKernel(), ReduceMaxKernel())
