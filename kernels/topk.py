"""ONNX `TopK` (opset 11+: k as input, `largest`, `sorted`) on the Vector unit.

The axis is moved last and each row selects its k largest (or smallest) elements. Ties follow
ONNX: among equal values the lower index comes first; a stable sort on the key gives exactly
that order. The output is always in sorted order, which is also a valid order for
`sorted=0` (ONNX leaves it unspecified then).

Cost of the selection on the Vector unit: k rounds of (ReduceMax, Compare, Select: find the
best, mask it out) over the row, or one Sort of the row when that is cheaper (large k).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import _rows
from ._rows import RowOut, RowPlan, RowTiling, VecStep
from .api import Input, Kernel, KernelError, KernelRun, TensorMeta, Tiling
from .npu.machine import Machine

I64 = np.dtype(np.int64)
_ROUND_OPS = ("ReduceMax", "Compare", "Select")


def select_steps(machine: Machine | None, dtype: np.dtype, width: int, k: int) -> list[VecStep]:
    """Vector steps selecting k of `width` per row: k masked max rounds or one Sort, whichever
    the machine prices lower (rounds when no machine is given)."""
    rounds = [VecStep(_ROUND_OPS, width, dtype)] * k
    if machine is None or k == 0:
        return rounds
    round_cost = (
        sum(
            machine.vector_cost(op, dtype)[0] * width + machine.vector_cost(op, dtype)[1]
            for op in _ROUND_OPS
        )
        * k
    )
    k_s, b_s = machine.vector_cost("Sort", dtype)
    if k_s * width + b_s < round_cost:
        return [VecStep(("Sort",), width, dtype)]
    return rounds


def topk_rows(x: np.ndarray, k: int, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    """(values, int64 indices) of the k largest (smallest) along the last axis, ties to the
    lower index, in sorted order."""
    # Negated for largest (ints widened first so that negation cannot overflow).
    key = (-x if x.dtype.kind == "f" else -x.astype(np.int64)) if largest else x
    # A stable sort keeps equal keys in index order: ONNX's tie rule.
    idx = np.argsort(key, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, idx, axis=-1), idx.astype(I64, copy=False)


def group_limit_rows(choice: np.ndarray, n_group: int, topk_group: int, fill: float) -> np.ndarray:
    """DeepSeek-V3's group limit on rows [t, E]: each of the n_group groups scores the sum of
    its top-2, the topk_group best groups (ties to the lower group) keep their experts, the
    others' become `fill`."""
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    top2, _ = topk_rows(grouped, 2, largest=True)
    _, kept = topk_rows(top2[..., 0] + top2[..., 1], topk_group, largest=True)
    keep = np.zeros((t, n_group), dtype=bool)
    np.put_along_axis(keep, kept, True, axis=-1)
    return np.where(np.repeat(keep, e // n_group, axis=-1), choice, choice.dtype.type(fill))


def k_value(op: str, k_input: np.ndarray | TensorMeta | None, attrs: Mapping[str, Any]) -> int:
    """k from TopK's second input (an array, also in timing-only runs) or the `k` attribute."""
    if isinstance(k_input, np.ndarray):
        if k_input.size != 1:
            raise KernelError(f"{op}: K must hold one value, got shape {k_input.shape}")
        return int(k_input.reshape(-1)[0])
    if "k" in attrs:
        return int(attrs["k"])
    raise KernelError(f"{op}: k's value is needed for the tiling: pass input K as an array")


class TopKKernel(Kernel):
    """ONNX TopK: values and int64 indices of the k largest (smallest) along `axis`."""

    op_type = "TopK"
    domain = ""
    tiling_type = RowTiling

    def _plan(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        machine: Machine | None = None,
    ) -> tuple[RowPlan, int, int]:
        x = inputs_meta[0] if inputs_meta else None
        if x is None or len(x.shape) == 0:
            raise KernelError("TopK: X must be a tensor of rank >= 1")
        if x.dtype == np.float64:
            raise KernelError("TopK: the Vector unit has no float64")
        k = k_value(self.op_type, None, attrs)
        axis = _rows.normalize_axis(self.op_type, int(attrs.get("axis", -1)), len(x.shape))
        width = x.shape[axis]
        if not 0 <= k <= width:
            raise KernelError(f"TopK: k={k} outside [0, {width}] along axis {axis}")
        rows = x.size // width if width else 0
        plan = RowPlan(
            op=self.op_type,
            rows=rows,
            width=width,
            in_dtype=x.dtype,
            outs=(RowOut("values", k, x.dtype), RowOut("indices", k, I64)),
            # A working copy of the row (masked as rounds go) and its index vector.
            steps=tuple(select_steps(machine, x.dtype, width, k)),
            temp_bytes_per_row=width * (x.dtype.itemsize + 4),
        )
        return plan, axis, k

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
        """As `Kernel.run`. K (input 1) must be an array, also in timing-only mode: its value
        shapes the outputs. It is passed on as the `k` attribute (TopK-1's form)."""
        k_in = inputs[1] if len(inputs) > 1 else None
        k = k_value(self.op_type, k_in, attrs)
        return super().run(
            machine, inputs, {**attrs, "k": k}, tiling=tiling, functional=functional,
            timeline=timeline,
        )  # fmt: skip

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        _, axis, k = self._plan(inputs_meta, attrs)
        x = inputs_meta[0]
        assert x is not None
        shape = list(x.shape)
        shape[axis] = k
        return TensorMeta(tuple(shape), x.dtype), TensorMeta(tuple(shape), I64)

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> RowTiling:
        return _rows.default(self._plan(inputs_meta, attrs, machine)[0], machine)

    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, RowTiling)
        _rows.check(self._plan(inputs_meta, attrs, machine)[0], tiling, machine)

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
        plan, axis, k = self._plan(inputs_meta, attrs, machine)
        largest = bool(int(attrs.get("largest", 1)))
        x = inputs[0]
        x_rows = _rows.to_rows(x, [axis]) if functional and x is not None else None

        def tile(xt: np.ndarray) -> tuple[np.ndarray, ...]:
            return topk_rows(xt, k, largest)

        outs, stats = _rows.run(machine, plan, tiling, x_rows, (), tile, functional, timeline)
        if not functional:
            return KernelRun((), stats)
        metas = self.infer(inputs_meta, attrs)
        ys = tuple(
            np.ascontiguousarray(_rows.from_rows(o, m.shape, axis))
            for o, m in zip(outs, metas, strict=True)
        )
        return KernelRun(ys, stats)


KERNELS = (TopKKernel(),)
