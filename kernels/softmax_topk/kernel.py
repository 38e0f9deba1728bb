"""`SoftmaxTopK` (domain fuser): MoE gating in one kernel, rows (points) tiled over cores.

    softmax_topk:  p = Softmax(X);  values, indices = TopK(p [cast to float32], k)
    topk_softmax:  l, indices = TopK(X, k);  values = Softmax(l)       (softmax over the k)
    renormalize:   values = values / sum(values)                         (per point)
    dense (Llama-4, topk_softmax + sigmoid): l, indices = TopK(X, k);
                   values = Sigmoid(ScatterElements(fill like X, indices, l))  (X's shape)

Each (B, S) point is a row of E experts (`axis` moved last). Per tile of `rows` points a core
copies in rows x E (npu-model.md "Softmax+TopK": t * E * size), runs max, sub, exp, sum, div
and the top-k selection on the Vector unit, and copies out rows x k values and int64 indices
(t * k * (value + index)). Nothing else touches GM: the unfused chain writes and reads the
probabilities, and the top-k values once more for the renormalization.

Numbers follow the op's `reference` (patterns/softmax_topk.py): the chain works in float32
for float16 input (as onnxruntime runs it), so the softmax, the ranking (and its ties) and the
renormalization are float32, and the values are rounded to T once at the end. The optional
`probs` output (the full softmax, softmax_topk order only; empty in topk_softmax order) costs
its copy-out only with attribute `emit_probs=1`: the op's contract returns every output, so the
array is filled either way in functional mode. Results always come sorted, also with
`sorted=0` (ONNX leaves that order unspecified). float64 is refused: the Vector unit has none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _rows
from .._rows import RowOut, RowPlan, RowTiling, VecStep
from ..api import Kernel, KernelError, KernelRun, TensorMeta, Tiling, TilingError
from ..npu.machine import Machine
from ..search import Searched
from ..softmax import (
    F32,
    LOG_SOFTMAX_OPS,
    SIGMOID_OPS,
    SOFTMAX_OPS,
    check_float,
    log_softmax_rows,
    sigmoid_rows,
    softmax_rows,
)
from ..topk import I64, group_limit_rows, select_steps, topk_rows
from .staged import Spec, run_staged

ORDERS = ("softmax_topk", "topk_softmax")
SCORES = ("softmax", "sigmoid", "log_softmax")


@dataclass(frozen=True)
class SoftmaxTopKTiling(RowTiling):
    """The row tiling (`rows` per tile, double buffering, vector cores), and `staged` 1: the
    unfused chain's schedule instead (`staged.py`: Softmax, TopK, ... one after the other,
    the probabilities through GM), the other fields then unused."""

    staged: int = 0


def softmax_topk_tiling(t: RowTiling, staged: int = 0) -> SoftmaxTopKTiling:
    """`t` as SoftmaxTopK's tiling."""
    return SoftmaxTopKTiling(t.rows, t.double_buffer, t.cores, staged)


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
    score: str = "softmax"
    bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    mask_value: float = float("-inf")
    epsilon: float = 0.0
    scale: float = 1.0
    dense: bool = False
    fill: float = float("-inf")

    @property
    def classic(self) -> bool:
        """The first version's chain (softmax, no bias, groups, epsilon or scale): the one
        the staged schedule runs."""
        return (self.score, self.bias, self.n_group, self.epsilon, self.scale) == (
            "softmax", False, 1, 0.0, 1.0
        )  # fmt: skip

    @property
    def width(self) -> int:
        return self.shape[self.axis]

    @property
    def values_dtype(self) -> np.dtype:
        return F32 if self.to_float32 else self.dtype

    @property
    def values_width(self) -> int:
        """k, or the whole row in the dense form."""
        return self.width if self.dense else self.k

    @property
    def probs_width(self) -> int:
        return self.width if self.order == "softmax_topk" else 0


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
    score = str(attrs.get("score", "softmax"))
    if score not in SCORES:
        raise KernelError(f"{op}: score must be one of {', '.join(SCORES)}, got '{score}'")
    bias = len(inputs_meta) > 1 and inputs_meta[1] is not None
    width = x.shape[axis]
    if bias and inputs_meta[1] is not None and inputs_meta[1].shape not in ((width,), (1, width)):
        raise KernelError(f"{op}: selection_bias must be [{width}], got {inputs_meta[1].shape}")
    n_group = int(attrs.get("n_group", 1))
    topk_group = int(attrs.get("topk_group", 1))
    if n_group > 1 and (width % n_group or width // n_group < 2):
        raise KernelError(
            f"{op}: n_group={n_group} does not split {width} experts into groups of 2+"
        )
    if n_group > 1 and not 1 <= topk_group <= n_group:
        raise KernelError(f"{op}: topk_group={topk_group} outside [1, {n_group}]")
    if order != "softmax_topk" and (bias or n_group > 1):
        raise KernelError(f"{op}: selection_bias and n_group need order softmax_topk")
    dense = bool(int(attrs.get("dense", 0)))
    renormalize = bool(int(attrs.get("renormalize", 0)))
    scale = float(attrs.get("scale", 1.0))
    if dense and (order, score, renormalize, scale) != ("topk_softmax", "sigmoid", False, 1.0):
        raise KernelError(
            f"{op}: dense=1 needs order topk_softmax and score sigmoid, without renormalize "
            "or scale"
        )
    return _Spec(
        axis=axis,
        k=k,
        order=order,
        renormalize=renormalize,
        to_float32=bool(int(attrs.get("to_float32", 0))),
        emit_probs=bool(int(attrs.get("emit_probs", 0))),
        dtype=x.dtype,
        shape=x.shape,
        score=score,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        mask_value=float(attrs.get("mask_value", float("-inf"))),
        epsilon=float(attrs.get("epsilon", 0.0)),
        scale=scale,
        dense=dense,
        fill=float(attrs.get("fill", float("-inf"))),
    )


def _score_steps(score: str, per_row: int) -> list[VecStep]:
    """The score of `per_row` elements in float32: softmax (npu-model.md's five), sigmoid as
    1 / (1 + exp(-x)) (Muls, Exp, Adds, Reciprocal: the target's rows, no Sigmoid row of its
    own), log-softmax as max, sub, exp, sum, ln, sub."""
    if score == "sigmoid":
        return [VecStep(SIGMOID_OPS, per_row, F32)]
    if score == "log_softmax":
        return [VecStep(LOG_SOFTMAX_OPS, per_row, F32)]
    return [VecStep(SOFTMAX_OPS, per_row, F32)]


def _choice_steps(s: _Spec, machine: Machine | None) -> list[VecStep]:
    """From the scores to the k chosen indices: the bias added (the resident row broadcast to
    the tile first), the group limit (top-2 of each group: two masked-max rounds over the row,
    segmented by group; their Add; the topk_group selection over the G group scores; the group
    mask broadcast back to the experts and selected), then the top-k, and the gather of the
    unbiased scores at the chosen positions (a Select and ReduceMax per chosen expert)."""
    e, k = s.width, s.k
    steps = [VecStep(("Duplicate", "Add"), e, F32)] if s.bias else []
    if s.n_group > 1:
        g = s.n_group
        steps += select_steps(None, F32, e, 2)
        steps += [VecStep(("Add",), g, F32), *select_steps(machine, F32, g, s.topk_group)]
        steps.append(VecStep(("Duplicate", "Select"), e, F32))
    steps += select_steps(machine, F32, e, k)
    if s.bias or s.n_group > 1:
        steps += [VecStep(("Select", "ReduceMax"), e, F32)] * k
    return steps


def _steps(s: _Spec, machine: Machine | None) -> list[VecStep]:
    e, k = s.width, s.k
    up = [VecStep(("Cast",), e, s.dtype)] if s.dtype != F32 else []
    if s.order == "softmax_topk":
        steps = [*up, *_score_steps(s.score, e), *_choice_steps(s, machine)]
        if s.emit_probs and s.dtype != F32:
            steps.append(VecStep(("Cast",), e, F32))
    else:
        steps = [*up, *select_steps(machine, F32, e, k), *_score_steps(s.score, k)]
    if s.dense:
        # The dense row: sigmoid(fill) duplicated over the row (one constant, computed once
        # per kernel), then each chosen expert's score selected in at its index (a Select per
        # chosen expert, as the gather), and the whole row copied out.
        steps += [VecStep(("Duplicate",), e, F32), *[VecStep(("Select",), e, F32)] * k]
    if s.renormalize:
        steps.append(VecStep(("ReduceSum", *(("Adds",) if s.epsilon else ()), "Div"), k, F32))
    if s.scale != 1.0:
        steps.append(VecStep(("Muls",), k, F32))
    if s.values_dtype != F32:
        steps.append(VecStep(("Cast",), s.values_width, F32))
    return steps


def _scores(score: str, x32: np.ndarray) -> np.ndarray:
    if score == "sigmoid":
        return sigmoid_rows(x32)
    if score == "log_softmax":
        return log_softmax_rows(x32)
    return softmax_rows(x32, F32)


def _tile(s: _Spec, x: np.ndarray, *resident: np.ndarray) -> tuple[np.ndarray, ...]:
    """values, indices (and probs in softmax_topk order) of a tile of points [t, E], all in
    float32 until the values are rounded at the end."""
    x32 = x.astype(F32, copy=False)
    if s.order == "softmax_topk":
        full = _scores(s.score, x32)
        choice = full + resident[0].reshape(1, -1).astype(F32) if s.bias else full
        if s.n_group > 1:
            choice = group_limit_rows(choice, s.n_group, s.topk_group, s.mask_value)
        values, indices = topk_rows(choice, s.k, largest=True)
        if choice is not full:
            values = np.take_along_axis(full, indices, axis=-1)
        extra: tuple[np.ndarray, ...] = (full.astype(s.dtype, copy=False),)
    else:
        top, indices = topk_rows(x32, s.k, largest=True)
        values = _scores(s.score, top)
        if s.dense:  # as `_steps` prices it: the row of sigmoid(fill), the k scores put in
            fill = np.full((1, 1), s.dtype.type(s.fill), dtype=s.dtype).astype(F32)
            row = np.broadcast_to(_scores(s.score, fill), x32.shape).copy()
            np.put_along_axis(row, indices, values, axis=-1)
            values = row
        extra = ()
    if s.renormalize:
        total = values.sum(axis=-1, keepdims=True, dtype=F32)
        values = values / (total + np.float32(s.epsilon)) if s.epsilon else values / total
    if s.scale != 1.0:
        values = values * np.float32(s.scale)
    return (values.astype(s.values_dtype, copy=False), indices, *extra)


class SoftmaxTopKKernel(Searched, Kernel):
    """Fused Softmax + TopK (+ renormalize), either order; see the module docstring."""

    op_type = "SoftmaxTopK"
    domain = "fuser"
    tiling_type = SoftmaxTopKTiling

    def _plan(self, s: _Spec, machine: Machine | None) -> RowPlan:
        width = s.width
        rows = int(np.prod(s.shape, dtype=np.int64)) // width if width else 0
        return RowPlan(
            op=self.op_type,
            rows=rows,
            width=width,
            in_dtype=s.dtype,
            outs=(
                RowOut("values", s.values_width, s.values_dtype),
                RowOut("indices", s.k, I64),
                # No softmax of the whole row exists in topk_softmax order: probs is empty.
                *([RowOut("probs", width, s.dtype, emit=s.emit_probs)] if s.probs_width else []),
            ),
            steps=tuple(_steps(s, machine)),
            # fp32 copy of the row (exp, then the masked copy the selection rounds walk); the
            # biased, group-masked choice is a second one.
            temp_bytes_per_row=width * 4 * (2 if s.bias or s.n_group > 1 else 1),
            # The bias row, loaded once per core and kept (float32 after its one Cast).
            resident_bytes=(width * 4,) if s.bias else (),
        )

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        s = _spec(self.op_type, inputs_meta, attrs)
        shape = list(s.shape)
        shape[s.axis] = s.k
        return (
            TensorMeta(s.shape if s.dense else tuple(shape), s.values_dtype),
            TensorMeta(tuple(shape), I64),
            TensorMeta(s.shape if s.probs_width else (0,), s.dtype),
        )

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> SoftmaxTopKTiling:
        plan = self._plan(_spec(self.op_type, inputs_meta, attrs), machine)
        return softmax_topk_tiling(_rows.default(plan, machine))

    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, RowTiling)
        plan = self._plan(_spec(self.op_type, inputs_meta, attrs), machine)
        staged = int(getattr(tiling, "staged", 0))
        if staged not in (0, 1):
            raise TilingError(f"{self.op_type}: staged must be 0 or 1, got {staged}")
        if staged and not _spec(self.op_type, inputs_meta, attrs).classic:
            raise TilingError(
                f"{self.op_type}: the staged schedule runs only the softmax chain without "
                "bias, groups, epsilon or scale (its stages have no Sigmoid, Where, Gather "
                "kernels)"
            )
        if not staged:  # the stages check their own tilings
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
        if getattr(tiling, "staged", 0):
            return self._staged(machine, s, inputs, inputs_meta, attrs, functional, timeline)
        plan = self._plan(s, machine)
        x = inputs[0]
        x_rows = _rows.to_rows(x, [s.axis]) if functional and x is not None else None
        bias = inputs[1] if len(inputs) > 1 else None
        residents = (
            (np.asarray(bias, F32).reshape(-1),) if s.bias and functional and bias is not None
            else ()
        )  # fmt: skip

        def tile(xt: np.ndarray, *res: np.ndarray) -> tuple[np.ndarray, ...]:
            return _tile(s, xt, *res)

        outs, stats = _rows.run(
            machine, plan, tiling, x_rows, residents, tile, functional, timeline
        )
        if not functional:
            return KernelRun((), stats)
        metas = self.infer(inputs_meta, attrs)
        ys = [
            np.ascontiguousarray(_rows.from_rows(o, m.shape, s.axis))
            for o, m in zip(outs, metas, strict=False)
        ]
        if len(ys) == 2:
            ys.append(np.empty(metas[2].shape, metas[2].dtype))
        return KernelRun(tuple(ys), stats)

    def _staged(
        self,
        machine: Machine,
        s: _Spec,
        inputs: Sequence[np.ndarray | None],
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        functional: bool,
        timeline: bool,
    ) -> KernelRun:
        x = inputs[0] if functional else inputs_meta[0]
        (values, indices, probs), stats = run_staged(
            machine, chain_spec(s), x, functional, timeline
        )
        if not functional:
            return KernelRun((), stats)
        metas = self.infer(inputs_meta, attrs)
        assert isinstance(values, np.ndarray)
        assert isinstance(indices, np.ndarray)
        p = probs if isinstance(probs, np.ndarray) else np.empty(metas[2].shape, metas[2].dtype)
        return KernelRun((values, indices, p), stats)


def staged_schedule_applies(
    inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
) -> bool:
    """Whether the staged schedule can run these attributes (the softmax chain only)."""
    return _spec(SoftmaxTopKKernel.op_type, inputs_meta, attrs).classic


def staged_spec(inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> Spec:
    """The unfused chain the `staged` schedule runs for these inputs and attributes."""
    return chain_spec(_spec(SoftmaxTopKKernel.op_type, inputs_meta, attrs))


def chain_spec(s: _Spec) -> Spec:
    """The unfused chain of these attributes (`staged`)."""
    return Spec(s.axis, s.k, s.order == "softmax_topk", s.renormalize, s.to_float32, s.dtype,
                s.shape)  # fmt: skip


KERNELS = (SoftmaxTopKKernel(),)
