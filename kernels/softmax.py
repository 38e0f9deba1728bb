"""ONNX `Softmax` (opset 13: one axis) on the Vector unit, rows tiled over vector cores.

    y = exp(x - max(x)) / sum(exp(x - max(x)))      along `axis`

The axis is moved last, so each row is one softmax (`_rows`). Per tile: max, sub, exp, sum,
div in float32 (a float16 row is cast up and the result cast back, as Ascend softmax kernels
do to keep the sum accurate).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from fuser.patterns.conv_activation import VECTOR_OPS

from . import _rows
from ._rows import RowOut, RowPlan, RowTiling, VecStep
from .api import Kernel, KernelError, KernelRun, MachineLimitError, TensorMeta, Tiling
from .npu.machine import Machine

F32 = np.dtype(np.float32)
#: The softmax of one row, as npu-model.md lists it (max, sub, exp, sum, div).
SOFTMAX_OPS: tuple[str, ...] = ("ReduceMax", "Sub", "Exp", "ReduceSum", "Div")
#: Sigmoid as 1 / (1 + exp(-x)): the target prices each of these (no Sigmoid row of its own);
#: the same sequence the Conv epilogue and the Sigmoid kernel run (one list, in conv_activation).
SIGMOID_OPS: tuple[str, ...] = VECTOR_OPS["Sigmoid"]
#: LogSoftmax as x - max - ln(sum(exp(x - max))).
LOG_SOFTMAX_OPS: tuple[str, ...] = ("ReduceMax", "Sub", "Exp", "ReduceSum", "Ln", "Sub")


def softmax_steps(dtype: np.dtype, per_row: int) -> list[VecStep]:
    """Vector steps of a softmax over rows of `per_row` elements of `dtype` (computed in fp32)."""
    steps = []
    if dtype != F32:
        steps.append(VecStep(("Cast",), per_row, dtype))
    steps.append(VecStep(SOFTMAX_OPS, per_row, F32))
    if dtype != F32:
        steps.append(VecStep(("Cast",), per_row, dtype))
    return steps


def softmax_rows(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Softmax along the last axis computed in float32, returned in `dtype`; the terms this
    host's onnxruntime computes as 0 are 0 (`zero_host_underflows`)."""
    x32 = x.astype(F32, copy=False)
    shifted = x32 - x32.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    zero_host_underflows(e, shifted)
    e /= e.sum(axis=-1, keepdims=True)
    return e.astype(dtype, copy=False)


#: log2(e) in float32, as MLAS's exp kernels hold it.
_LOG2E = np.float32(1.44269504088896341)


def zero_host_underflows(e: np.ndarray, shifted: np.ndarray) -> None:
    """Set to 0, in place, the terms e = exp(x - max) that onnxruntime's float32 Softmax on
    this host computes as exactly 0; `shifted` is x - max in float32 (e's shape). The zeros
    feed TopK, whose pick among them this decides.

    MLAS (onnxruntime's CPU kernels) has two Softmax exps. Its AVX2 (and SSE2 and NEON) kernel
    forms 2^m, m = rint((x - max) * log2 e), from the exponent bits alone: for m <= -127 the
    term is 0, while m = -126 still gives subnormals (exp(-87.65) = 8.6e-39 is kept,
    exp(-87.7) is 0). Its AVX-512 kernel scales with VSCALEFPS and keeps every subnormal
    (exp(-103.6) = 1.4e-45). Which one runs depends on the CPU, so the host is asked once
    (`onnxruntime_zeroes_subnormal_exp`); nothing changes where it keeps them, or for float64."""
    if shifted.dtype == F32 and onnxruntime_zeroes_subnormal_exp():
        e[np.rint(shifted * _LOG2E) <= -127] = 0


@functools.cache
def onnxruntime_zeroes_subnormal_exp() -> bool:
    """Whether this host's onnxruntime computes a float32 Softmax term of exp(-90) = 8.2e-40,
    a subnormal, as 0 (MLAS's AVX2 kernel) rather than keeping it (its AVX-512 kernel)."""
    p = onnxruntime_softmax(np.array([[0.0, -90.0]], F32))
    return bool(p[0, 1] == 0)


def onnxruntime_softmax(x: np.ndarray) -> np.ndarray:
    """onnxruntime's (CPU provider) float32 Softmax of `x` along its last axis."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["p"], axis=-1)],
        "softmax",
        [value("x", onnx.TensorProto.FLOAT, list(x.shape))],
        [value("p", onnx.TensorProto.FLOAT, list(x.shape))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    (p,) = session.run(None, {"x": x.astype(F32, copy=False)})
    return np.asarray(p)


def sigmoid_rows(x32: np.ndarray) -> np.ndarray:
    """Sigmoid of float32 rows, in float32."""
    one = np.float32(1.0)
    with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0: the sigmoid is then 0
        return (one / (one + np.exp(-x32))).astype(F32, copy=False)


def log_softmax_rows(x32: np.ndarray) -> np.ndarray:
    """LogSoftmax of float32 rows along the last axis, in float32."""
    shifted = x32 - x32.max(axis=-1, keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))).astype(F32)


def check_float(op: str, dtype: np.dtype) -> None:
    """Softmax-like kernels take float16 and float32 (the Vector unit has no float64)."""
    if dtype not in (np.float16, np.float32):
        error = MachineLimitError if dtype == np.float64 else KernelError
        raise error(f"{op}: takes float16 or float32 input, got {dtype}")


class SoftmaxKernel(Kernel):
    """ONNX Softmax (opset 13) over one axis."""

    op_type = "Softmax"
    domain = ""
    tiling_type = RowTiling

    def _plan(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[RowPlan, int]:
        x = inputs_meta[0] if inputs_meta else None
        if x is None:
            raise KernelError("Softmax: input is required")
        check_float(self.op_type, x.dtype)
        ndim = len(x.shape)
        axis = _rows.normalize_axis(self.op_type, int(attrs.get("axis", -1)), ndim)
        width = x.shape[axis] if ndim else 1
        rows = x.size // width if width else 0
        plan = RowPlan(
            op=self.op_type,
            rows=rows,
            width=width,
            in_dtype=x.dtype,
            outs=(RowOut("y", width, x.dtype),),
            steps=tuple(softmax_steps(x.dtype, width)),
            temp_bytes_per_row=width * 4,
        )
        return plan, axis

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        x = inputs_meta[0] if inputs_meta else None
        self._plan(inputs_meta, attrs)
        assert x is not None
        return (x,)

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> RowTiling:
        return _rows.default(self._plan(inputs_meta, attrs)[0], machine)

    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, RowTiling)
        _rows.check(self._plan(inputs_meta, attrs)[0], tiling, machine)

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
        plan, axis = self._plan(inputs_meta, attrs)
        x = inputs[0]
        shape = inputs_meta[0].shape if inputs_meta[0] is not None else ()
        x_rows = None
        if functional:
            assert x is not None
            x_rows = _rows.to_rows(x.reshape(shape or (1,)), [axis])

        def tile(xt: np.ndarray) -> tuple[np.ndarray, ...]:
            return (softmax_rows(xt, plan.in_dtype),)

        outs, stats = _rows.run(machine, plan, tiling, x_rows, (), tile, functional, timeline)
        if not functional:
            return KernelRun((), stats)
        y = _rows.from_rows(outs[0], shape or (1,), axis).reshape(shape)
        return KernelRun((np.ascontiguousarray(y),), stats)


KERNELS = (SoftmaxKernel(),)
