"""SoftmaxTopK staged (`staged=1`): the unfused chain's schedule inside the fused kernel.

The chain's own kernels one after the other, each at its run-time tiling, in one launch
(`_staged`): softmax_topk order Softmax -> [Cast to float32] -> TopK -> [ReduceSum, Div];
topk_softmax order TopK -> [Cast] -> Softmax -> [ReduceSum, Div]. The probabilities (and the
top-k values for the renormalization) make their round trip through GM as in the chain, and
each stage rounds its output to its dtype as the simulator's unfused kernels do (the fused
schedule keeps float32 between steps, as onnxruntime runs the chain for 16-bit inputs: the
two agree within the 16-bit tolerance).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from onnx import TensorProto

from .._staged import Operand, one_launch, stage, stage_cycles
from ..api import TensorMeta
from ..npu.machine import Machine
from ..npu.stats import RunStats


class Spec(NamedTuple):
    """What the chain computes (the fused op's attributes, resolved)."""

    axis: int
    k: int
    softmax_first: bool
    renormalize: bool
    to_float32: bool
    dtype: np.dtype
    shape: tuple[int, ...]


def _meta(shape: Sequence[int], dtype: Any) -> TensorMeta:
    return TensorMeta(tuple(shape), np.dtype(dtype))


class _Chain:
    """Runs (or prices) the stages in order; operands are arrays or metas."""

    def __init__(self, machine: Machine, functional: bool, timeline: bool, price: bool) -> None:
        self.machine, self.functional, self.timeline = machine, functional, timeline
        self.price = price
        self.runs: list[RunStats] = []
        self.cycles = 0.0

    def __call__(
        self, op: str, inputs: list[Operand], attrs: dict[str, Any], outs: list[TensorMeta]
    ) -> list[Operand]:
        if self.price:
            metas = [None if x is None else _meta(x.shape, x.dtype) for x in inputs]
            self.cycles += stage_cycles(self.machine, op, metas, attrs)
            return list(outs)
        run = stage(self.machine, op, inputs, attrs, self.functional, self.timeline)
        self.runs.append(run.stats)
        return list(run.outputs) if self.functional else list(outs)


def _walk(s: Spec, x: Operand, chain: _Chain) -> tuple[Operand, Operand, Operand | None]:
    """(values, indices, probs or None) through the chain's stages."""
    top_shape = list(s.shape)
    top_shape[s.axis] = s.k
    sum_shape = list(s.shape)
    sum_shape[s.axis] = 1
    mid = np.dtype(np.float32) if s.to_float32 else s.dtype
    topk_attrs = {"axis": s.axis, "k": s.k}
    probs = None
    if s.softmax_first:
        (probs,) = chain("Softmax", [x], {"axis": s.axis}, [_meta(s.shape, s.dtype)])
        src = probs
        if s.to_float32:
            (src,) = chain("Cast", [probs], {"to": TensorProto.FLOAT}, [_meta(s.shape, mid)])
        values, indices = chain(
            "TopK", [src], topk_attrs, [_meta(top_shape, mid), _meta(top_shape, np.int64)]
        )
    else:
        top, indices = chain(
            "TopK", [x], topk_attrs, [_meta(top_shape, s.dtype), _meta(top_shape, np.int64)]
        )
        if s.to_float32:
            (top,) = chain("Cast", [top], {"to": TensorProto.FLOAT}, [_meta(top_shape, mid)])
        (values,) = chain("Softmax", [top], {"axis": s.axis}, [_meta(top_shape, mid)])
    if s.renormalize:
        (total,) = chain(
            "ReduceSum", [values], {"axes": [s.axis], "keepdims": 1}, [_meta(sum_shape, mid)]
        )
        (values,) = chain("Div", [values, total], {}, [_meta(top_shape, mid)])
    return values, indices, probs


def run_staged(
    machine: Machine, s: Spec, x: Operand, functional: bool, timeline: bool
) -> tuple[tuple[Operand, Operand, Operand | None], RunStats]:
    """Run the stages (see the module docstring): the outputs and the one-launch stats."""
    chain = _Chain(machine, functional, timeline, price=False)
    outs = _walk(s, x, chain)
    return outs, one_launch(chain.runs)


def staged_cycles(machine: Machine, s: Spec) -> float:
    """Predicted cycles of the staged schedule, each stage priced as `fuse` prices it."""
    chain = _Chain(machine, False, False, price=True)
    _walk(s, _meta(s.shape, s.dtype), chain)
    return chain.cycles
