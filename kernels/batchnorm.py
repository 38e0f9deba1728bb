"""BatchNormalization (inference) on the Vector unit.

    Y = (X - mean) * scale / sqrt(var + epsilon) + B,   per channel (axis 1)

Each core loads the four [C] parameters once and folds them (Adds, Sqrt, Div, Mul, Sub over C
elements) into a = scale / sqrt(var + eps) and b = B - mean * a; then it streams X in tiles
and computes Y = X * a + b, the per-channel a and b expanded to the tile (two Duplicates).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._stream import StreamKernel, StreamLayout
from .api import KernelError, TensorMeta


class BatchNormalization(StreamKernel):
    """ONNX BatchNormalization with training_mode=0: inputs X, scale, B, input_mean, input_var."""

    op_type = "BatchNormalization"
    domain = ""

    def layout(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> StreamLayout:
        if int(attrs.get("training_mode", 0)) != 0:
            raise KernelError("BatchNormalization: only inference (training_mode=0) is supported")
        if len(inputs_meta) < 5 or any(m is None for m in inputs_meta[:5]):
            raise KernelError("BatchNormalization: needs X, scale, B, input_mean, input_var")
        x, *params = (m for m in inputs_meta[:5] if m is not None)
        if x.dtype == np.float64:
            raise KernelError("BatchNormalization: the Vector unit has no float64 arithmetic")
        if len(x.shape) < 2:
            raise KernelError(f"BatchNormalization: X must have a channel axis, got {x.shape}")
        c = x.shape[1]
        for name, m in zip(("scale", "B", "input_mean", "input_var"), params, strict=True):
            if m.shape != (c,):
                raise KernelError(
                    f"BatchNormalization: {name} must have shape ({c},), got {m.shape}"
                )
        return StreamLayout(
            out=x,
            compute_dtype=x.dtype,
            streamed=(0,),
            resident=(1, 2, 3, 4),
            ops=("Duplicate", "Duplicate", "Mul", "Add"),
            prologue_ops=("Adds", "Sqrt", "Div", "Mul", "Sub"),
            prologue_n=c,
            prologue_bytes=2 * c * x.dtype.itemsize,
        )

    def prologue(self, attrs: Mapping[str, Any], resident: Sequence[np.ndarray]) -> np.ndarray:
        scale, b, mean, var = resident
        eps = float(attrs.get("epsilon", 1e-5))
        a = scale / np.sqrt(var + np.asarray(eps, var.dtype))
        return np.stack([a, b - mean * a])

    def expand_prologue(
        self, prepared: np.ndarray, out_shape: tuple[int, ...], s: int, e: int
    ) -> Sequence[np.ndarray]:
        # Output element i belongs to channel (i // inner) % C; expand the rows s..e cover.
        c = prepared.shape[1]
        inner = int(np.prod(out_shape[2:], dtype=np.int64))
        r0, r1 = s // inner, (e - 1) // inner + 1
        rows = np.arange(r0, r1) % c
        lo, hi = s - r0 * inner, e - r0 * inner
        return [np.repeat(prepared[j, rows], inner)[lo:hi] for j in (0, 1)]

    def tile_compute(self, attrs: Mapping[str, Any], operands: Sequence[np.ndarray]) -> np.ndarray:
        x, a, b = operands
        return (x * a + b).astype(x.dtype, copy=False)


KERNELS = (BatchNormalization(),)
