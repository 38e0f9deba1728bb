"""The activation ops as their own kernels on the Vector unit: Sigmoid, Tanh, Clip, LeakyRelu,
HardSigmoid, HardSwish, Gelu.

Each streams its input tile by tile (`_stream`) and costs the same vector instructions the
fused ConvBnRelu epilogue runs for it (`conv_activation.VECTOR_OPS`), so an unfused chain
(Conv, BN, then the activation as its own launch with its own DMA heads) and the fused op are
priced from the same rows. Clip's bounds, when given as inputs, are one-element residents.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from fuser.patterns.conv_activation import (
    HARDSWISH_ALPHA,
    HARDSWISH_BETA,
    VECTOR_OPS,
    Activation,
    apply,
)

from ._stream import StreamKernel, StreamLayout
from .api import KernelError, TensorMeta


def _x(metas: Sequence[TensorMeta | None], op: str) -> TensorMeta:
    x = metas[0] if metas else None
    if x is None:
        raise KernelError(f"{op}: input X is required")
    if x.dtype not in (np.float16, np.float32):
        raise KernelError(f"{op}: the Vector unit takes float16 or float32, got {x.dtype}")
    return x


class _Activation(StreamKernel):
    """One activation op: `activation(attrs)` says which, and with which parameters."""

    domain = ""

    def activation(self, attrs: Mapping[str, Any]) -> Activation:
        return Activation(self.op_type)

    def _bounds(self, metas: Sequence[TensorMeta | None]) -> tuple[int, ...]:
        return ()

    def layout(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> StreamLayout:
        x = _x(inputs_meta, self.op_type)
        act = self.activation(attrs)
        return StreamLayout(
            out=TensorMeta(x.shape, x.dtype),
            compute_dtype=x.dtype,
            streamed=(0,),
            resident=self._bounds(inputs_meta),
            ops=self._ops(act, inputs_meta),
        )

    def _ops(self, act: Activation, metas: Sequence[TensorMeta | None]) -> tuple[str, ...]:
        return VECTOR_OPS[act.name]

    def tile_compute(self, attrs: Mapping[str, Any], operands: Sequence[np.ndarray]) -> np.ndarray:
        x = operands[0]
        return apply(self.activation(attrs), x.astype(np.float32)).astype(x.dtype)


class Sigmoid(_Activation):
    op_type = "Sigmoid"


class Tanh(_Activation):
    op_type = "Tanh"


class LeakyRelu(_Activation):
    op_type = "LeakyRelu"

    def activation(self, attrs: Mapping[str, Any]) -> Activation:
        return Activation("LeakyRelu", float(attrs.get("alpha", 0.01)))


class HardSigmoid(_Activation):
    op_type = "HardSigmoid"

    def activation(self, attrs: Mapping[str, Any]) -> Activation:
        return Activation(
            "HardSigmoid", float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5))
        )


class HardSwish(_Activation):
    op_type = "HardSwish"

    def activation(self, attrs: Mapping[str, Any]) -> Activation:
        return Activation("HardSwish", HARDSWISH_ALPHA, HARDSWISH_BETA)


class Gelu(_Activation):
    op_type = "Gelu"

    def activation(self, attrs: Mapping[str, Any]) -> Activation:
        approximate = attrs.get("approximate", "none")
        approximate = approximate.decode() if isinstance(approximate, bytes) else approximate
        if approximate not in ("none", "tanh"):
            raise KernelError(f"Gelu: unknown approximate '{approximate}'")
        return Activation("Gelu" if approximate == "none" else "GeluTanh")


class Clip(_Activation):
    """Clip: bounds as attributes (opset < 11) or as one-element inputs (opset >= 11)."""

    op_type = "Clip"

    def _bounds(self, metas: Sequence[TensorMeta | None]) -> tuple[int, ...]:
        present = tuple(i for i in (1, 2) if len(metas) > i and metas[i] is not None)
        if len(present) == 1:
            raise KernelError("Clip: one bound as an input and the other absent: not supported")
        for i in present:
            m = metas[i]
            if m is not None and m.size != 1:
                raise KernelError(f"Clip: bound {i} must have one element, got {m.shape}")
        return present

    def _ops(self, act: Activation, metas: Sequence[TensorMeta | None]) -> tuple[str, ...]:
        return ("Max", "Min")

    def tile_compute(self, attrs: Mapping[str, Any], operands: Sequence[np.ndarray]) -> np.ndarray:
        x = operands[0]
        if len(operands) == 1:
            lo = float(attrs.get("min", -math.inf))
            hi = float(attrs.get("max", math.inf))
            act = Activation("Clip", lo, hi)
            return apply(act, x.astype(np.float32)).astype(x.dtype)
        # Both bounds as inputs (expanded to the tile): as onnxruntime, max with min, then min.
        return np.minimum(np.maximum(x, operands[1]), operands[2]).astype(x.dtype)


KERNELS = (Sigmoid(), Tanh(), LeakyRelu(), HardSigmoid(), HardSwish(), Gelu(), Clip())
