"""ONNX `LayerNormalization` (opset 17) on the Vector unit, rows tiled over vector cores.

    mu = mean(x),  d = x - mu,  var = mean(d * d),  y = d / sqrt(var + eps) * scale + bias

over the normalized axes (`axis` .. last), each normalized slice one row (`_rows`). The
statistics are computed in float32 whatever `stash_type` (a float16 row is cast up, the result
cast back), in two passes over the row shifted by its first element (y = x - x0, mean(y);
then d = y - mean(y), mean(d^2)): at least as accurate as onnxruntime's LayerNormalization
kernel (a constant row shifts to exact zeros; the variance is centred). The shift stands in
for a first mean pass, so it costs one reduction fewer than mean-then-correct. The arithmetic is
the fused ops' `layer_norm` (patterns/layernorm_matmul.py), op for op, so fused and unfused
agree.
Scale and bias are copied into UB once per core.

Outputs: Y, Mean and InvStdDev (shape X.shape[:axis] + 1s, float32 with stash_type=1). Mean
and InvStdDev are copied out only with attribute `emit_stats=1`; the arrays are returned in
functional mode either way, as callers expect every output position filled.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from . import _rows
from ._rows import RowOut, RowPlan, RowTiling, VecStep
from .api import Kernel, KernelError, KernelRun, MachineLimitError, TensorMeta, Tiling
from .npu.machine import Machine


@dataclass(frozen=True)
class LayerNormSpec:
    """A LayerNorm viewed as rows: `rows` slices of `width` normalized elements."""

    shape: tuple[int, ...]
    axis: int
    rows: int
    width: int
    dtype: np.dtype
    stats: np.dtype
    epsilon: float
    has_scale: bool
    has_bias: bool

    @property
    def work(self) -> np.dtype:
        """The dtype the statistics are computed in: float32 at least, whatever `stats` (the
        Mean/InvStdDev outputs' dtype) says, as onnxruntime's kernel does: a float16 row of
        [300, -300, 0, 0] squared overflows float16."""
        return np.dtype(np.promote_types(self.stats, np.float32))


def layernorm_spec(
    op: str,
    x: TensorMeta | None,
    scale: TensorMeta | None,
    bias: TensorMeta | None,
    attrs: Mapping[str, Any],
) -> LayerNormSpec:
    """Check a LayerNorm's inputs and attributes; `KernelError` names what is wrong."""
    if x is None or len(x.shape) == 0:
        raise KernelError(f"{op}: X must be a tensor of rank >= 1")
    if x.dtype not in (np.float16, np.float32):
        error = MachineLimitError if x.dtype == np.float64 else KernelError
        raise error(
            f"{op}: the Vector unit takes float16 or float32, got {x.dtype} (the NPU has no "
            "float64 unit; run a float64 fused op with --kernel reference or its function body)"
        )
    if int(attrs.get("exact_epsilon") or 0):
        # fuser writes it only for float64 norms (float32 holds every narrower epsilon).
        raise KernelError(f"{op}: exact_epsilon=1 (epsilon as an input) has no NPU kernel")
    axis = _rows.normalize_axis(op, int(attrs.get("axis", -1)), len(x.shape))
    norm_shape = x.shape[axis:]
    for name, m in (("scale", scale), ("bias", bias)):
        if m is None:
            continue
        shape = _drop_leading_ones(m.shape)
        if len(shape) > len(norm_shape) or any(
            d not in (1, n) for d, n in zip(shape[::-1], norm_shape[::-1], strict=False)
        ):
            raise KernelError(
                f"{op}: {name} of shape {m.shape} does not broadcast to the normalized shape "
                f"{norm_shape}"
            )
    width = int(np.prod(norm_shape, dtype=np.int64))
    stash = int(attrs.get("stash_type", 1))
    if stash not in (0, 1):
        raise KernelError(f"{op}: stash_type must be 0 or 1, got {stash}")
    return LayerNormSpec(
        shape=x.shape,
        axis=axis,
        rows=x.size // width if width else 0,
        width=width,
        dtype=x.dtype,
        stats=np.dtype(np.promote_types(x.dtype, np.float32)) if stash == 1 else x.dtype,
        epsilon=float(attrs.get("epsilon", 1e-5)),
        has_scale=scale is not None,
        has_bias=bias is not None,
    )


def layernorm_steps(s: LayerNormSpec) -> list[VecStep]:
    """Vector instructions per row: statistics in `s.stats`, the affine part in the dtype."""
    d, up = s.width, s.work != s.dtype
    steps = []
    if up:
        steps.append(VecStep(("Cast",), d, s.dtype))
    # The row shifted by its first element, its mean; the centred row, its mean square; N.
    passes = ("Sub", "ReduceSum", "Sub", "Mul", "ReduceSum", "Div")
    steps.append(VecStep(passes, d, s.work))
    # Per row: both sums scaled by 1/D, + eps, sqrt; the mean x0 + mean(y) (the Mean output).
    steps.append(VecStep(("Muls", "Muls", "Adds", "Sqrt", "Add"), 1, s.work))
    if up:
        steps.append(VecStep(("Cast",), d, s.work))
    affine = ("Mul",) * s.has_scale + ("Add",) * s.has_bias
    if affine:
        steps.append(VecStep(affine, d, s.dtype))
    return steps


def layernorm_rows(
    s: LayerNormSpec, x: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(normalized [t, D] in the dtype, mean [t, 1], inv std [t, 1] in the stats dtype) of a
    tile of rows; `scale`/`bias` are flat [D] or None. Rounds as `layer_norm` does."""
    work = s.work
    xs = x.astype(work, copy=False)
    eps = np.asarray(s.epsilon, dtype=work)
    x0 = xs[:, :1]
    # Shifted by the row's first element: a constant row gives exact zeros (so it normalizes
    # to 0 even with a tiny epsilon, where a float32 mean can miss the value by an ulp).
    y = xs - x0
    shift = y.mean(axis=-1, keepdims=True, dtype=work)
    d = y - shift  # centred: the variance below is a second pass, not E[y^2] - E[y]^2
    var = (d * d).mean(axis=-1, keepdims=True, dtype=work)
    std = np.sqrt(var + eps)
    with np.errstate(divide="ignore", invalid="ignore"):  # epsilon 0, constant row: NaN as ONNX
        n = (d / std).astype(s.dtype, copy=False)
        inv_std = (1 / std).astype(s.stats, copy=False)
    mean = x0 + shift
    if scale is not None:
        n = (n * scale).astype(s.dtype, copy=False)
    if bias is not None:
        n = (n + bias).astype(s.dtype, copy=False)
    return n, mean.astype(s.stats, copy=False), inv_std


def flat_param(p: np.ndarray | None, s: LayerNormSpec) -> np.ndarray | None:
    """A scale or bias broadcast to the normalized shape and flattened to [D]."""
    if p is None:
        return None
    p = p.reshape(_drop_leading_ones(p.shape))
    return np.ascontiguousarray(np.broadcast_to(p, s.shape[s.axis :])).reshape(-1)


def _drop_leading_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    # [1, 1, D] broadcasts like [D]: leading 1s carry no layout.
    i = 0
    while i < len(shape) and shape[i] == 1:
        i += 1
    return shape[i:]


class LayerNormalizationKernel(Kernel):
    """ONNX LayerNormalization: Y, Mean, InvStdDev (see the module docstring)."""

    op_type = "LayerNormalization"
    domain = ""
    tiling_type = RowTiling
    # The plan reads shapes; scale and bias data go to the cores only in functional mode.
    value_inputs: ClassVar[frozenset[int] | None] = frozenset()

    def _spec(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> LayerNormSpec:
        metas = [*inputs_meta, None, None, None]
        return layernorm_spec(self.op_type, metas[0], metas[1], metas[2], attrs)

    def _plan(self, s: LayerNormSpec, attrs: Mapping[str, Any]) -> RowPlan:
        emit = bool(int(attrs.get("emit_stats", 0)))
        isz = s.dtype.itemsize
        return RowPlan(
            op=self.op_type,
            rows=s.rows,
            width=s.width,
            in_dtype=s.dtype,
            outs=(
                RowOut("y", s.width, s.dtype),
                RowOut("mean", 1, s.stats, emit=emit),
                RowOut("inv_std", 1, s.stats, emit=emit),
            ),
            steps=tuple(layernorm_steps(s)),
            # The centred row in the statistics dtype.
            temp_bytes_per_row=s.width * s.work.itemsize,
            resident_bytes=(s.width * isz,) * (s.has_scale + s.has_bias),
        )

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        s = self._spec(inputs_meta, attrs)
        stat_shape = s.shape[: s.axis] + (1,) * (len(s.shape) - s.axis)
        return (
            TensorMeta(s.shape, s.dtype),
            TensorMeta(stat_shape, s.stats),
            TensorMeta(stat_shape, s.stats),
        )

    def timing_key(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> Hashable:
        """The row plan: the run-time tiling (`default_tiling`) and a timing-only run read
        nothing else, so LayerNorms differing only in `epsilon`, or in `stash_type` where it
        leaves the statistics' dtype alone (float32 input), are timed once."""
        return self._plan(self._spec(inputs_meta, attrs), attrs)

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> RowTiling:
        return _rows.default(self._plan(self._spec(inputs_meta, attrs), attrs), machine)

    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, RowTiling)
        _rows.check(self._plan(self._spec(inputs_meta, attrs), attrs), tiling, machine)

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
        s = self._spec(inputs_meta, attrs)
        plan = self._plan(s, attrs)
        ins = [*inputs, None, None, None]
        scale, bias = flat_param(ins[1], s), flat_param(ins[2], s)
        residents = [p for p in (scale, bias) if p is not None]
        x = ins[0]
        x_rows = x.reshape(s.rows, s.width) if functional and x is not None else None

        def tile(xt: np.ndarray, *res: np.ndarray) -> tuple[np.ndarray, ...]:
            it = iter(res)
            sc = next(it) if s.has_scale else None
            bi = next(it) if s.has_bias else None
            return layernorm_rows(s, xt, sc, bi)

        outs, stats = _rows.run(
            machine, plan, tiling, x_rows, residents, tile, functional, timeline
        )
        if not functional:
            return KernelRun((), stats)
        metas = self.infer(inputs_meta, attrs)
        return KernelRun(tuple(o.reshape(m.shape) for o, m in zip(outs, metas, strict=True)), stats)


KERNELS = (LayerNormalizationKernel(),)
