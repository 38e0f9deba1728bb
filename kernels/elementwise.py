"""Elementwise ONNX ops on the Vector unit: Add, Sub, Mul, Div, Pow, Sqrt, Reciprocal, Relu, Cast.

Binary ops broadcast as numpy (ONNX multidirectional broadcasting). Each tile costs one
vector instruction of the op (`vector_ops` of the target), plus one `Duplicate` per broadcast
operand that is not a scalar (the Vector unit expands it to the tile first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from ._dtypes import numpy_dtype
from ._stream import RESIDENT_SHARE, StreamKernel, StreamLayout
from .api import KernelError, TensorMeta

_UB_RESIDENT_LIMIT = 196352 // RESIDENT_SHARE


def _required(metas: Sequence[TensorMeta | None], n: int, op: str) -> list[TensorMeta]:
    if len(metas) < n or any(m is None for m in metas[:n]):
        raise KernelError(f"{op}: needs {n} input(s)")
    out = [m for m in metas[:n] if m is not None]
    for m in out:
        if m.dtype == np.float64:
            raise KernelError(f"{op}: the Vector unit has no float64 arithmetic")
    return out


def _elementwise_layout(
    op: str, metas: Sequence[TensorMeta], out_dtype: np.dtype, vec_op: str
) -> StreamLayout:
    try:
        shape = tuple(np.broadcast_shapes(*(m.shape for m in metas)))
    except ValueError:
        raise KernelError(
            f"{op}: shapes {', '.join(str(m.shape) for m in metas)} do not broadcast"
        ) from None
    streamed: list[int] = []
    resident: list[int] = []
    dup = 0
    for i, m in enumerate(metas):
        padded = (1,) * (len(shape) - len(m.shape)) + m.shape
        if padded == shape:
            streamed.append(i)
        elif m.nbytes <= _UB_RESIDENT_LIMIT:
            resident.append(i)
            dup += m.size != 1
        else:
            # Too big to keep in UB: the DMA fetches it expanded, tile by tile.
            streamed.append(i)
    ops = (*(["Duplicate"] * dup), vec_op)
    return StreamLayout(
        out=TensorMeta(shape, out_dtype),
        compute_dtype=metas[0].dtype,
        streamed=tuple(streamed),
        resident=tuple(resident),
        ops=ops,
    )


class _Elementwise(StreamKernel):
    """An elementwise op of `arity` inputs; `apply` is its numpy arithmetic."""

    domain = ""
    arity: ClassVar[int]
    vector_op: ClassVar[str]

    def layout(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> StreamLayout:
        metas = _required(inputs_meta, self.arity, self.op_type)
        if self.arity == 2 and metas[0].dtype != metas[1].dtype and self.op_type != "Pow":
            raise KernelError(
                f"{self.op_type}: input dtypes differ ({metas[0].dtype} and {metas[1].dtype})"
            )
        out_dtype = self.out_dtype(metas[0].dtype, attrs)
        return _elementwise_layout(self.op_type, metas, out_dtype, self.vector_op)

    def out_dtype(self, dtype: np.dtype, attrs: Mapping[str, Any]) -> np.dtype:
        """Output dtype: the first input's, except for Cast."""
        return dtype

    def tile_compute(self, attrs: Mapping[str, Any], operands: Sequence[np.ndarray]) -> np.ndarray:
        out_dtype = self.out_dtype(operands[0].dtype, attrs)
        return np.asarray(self.apply(attrs, *operands)).astype(out_dtype, copy=False)

    def apply(self, attrs: Mapping[str, Any], *x: np.ndarray) -> np.ndarray:
        """The op on numpy tiles."""
        raise NotImplementedError


class Add(_Elementwise):
    op_type, arity, vector_op = "Add", 2, "Add"

    def apply(self, attrs: Mapping[str, Any], *x: np.ndarray) -> np.ndarray:
        return np.add(x[0], x[1])


class Sub(_Elementwise):
    op_type, arity, vector_op = "Sub", 2, "Sub"

    def apply(self, attrs: Mapping[str, Any], *x: np.ndarray) -> np.ndarray:
        return np.subtract(x[0], x[1])


class Mul(_Elementwise):
    op_type, arity, vector_op = "Mul", 2, "Mul"

    def apply(self, attrs: Mapping[str, Any], *x: np.ndarray) -> np.ndarray:
        return np.multiply(x[0], x[1])


class Div(_Elementwise):
    op_type, arity, vector_op = "Div", 2, "Div"

    def apply(self, attrs: Mapping[str, Any], *x: np.ndarray) -> np.ndarray:
        a, b = x
        if np.issubdtype(a.dtype, np.integer):
            # ONNX integer Div truncates toward zero (C semantics), numpy floors.
            q = np.floor_divide(a, b)
            fix = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
            return q + fix.astype(q.dtype)
        return np.divide(a, b)


class Pow(_Elementwise):
    op_type, arity, vector_op = "Pow", 2, "Pow"

    def apply(self, attrs: Mapping[str, Any], *x: np.ndarray) -> np.ndarray:
        return np.power(x[0], x[1].astype(x[0].dtype, copy=False))


class Sqrt(_Elementwise):
    op_type, arity, vector_op = "Sqrt", 1, "Sqrt"

    def apply(self, attrs: Mapping[str, Any], *x: np.ndarray) -> np.ndarray:
        return np.sqrt(x[0])


class Reciprocal(_Elementwise):
    op_type, arity, vector_op = "Reciprocal", 1, "Reciprocal"

    def apply(self, attrs: Mapping[str, Any], *x: np.ndarray) -> np.ndarray:
        return np.reciprocal(x[0])


class Relu(_Elementwise):
    op_type, arity, vector_op = "Relu", 1, "Relu"

    def apply(self, attrs: Mapping[str, Any], *x: np.ndarray) -> np.ndarray:
        return np.maximum(x[0], np.zeros((), x[0].dtype))


class Cast(_Elementwise):
    op_type, arity, vector_op = "Cast", 1, "Cast"

    def out_dtype(self, dtype: np.dtype, attrs: Mapping[str, Any]) -> np.dtype:
        if "to" not in attrs:
            raise KernelError("Cast: attribute 'to' is required")
        return numpy_dtype(int(attrs["to"]))

    def apply(self, attrs: Mapping[str, Any], *x: np.ndarray) -> np.ndarray:
        return x[0].astype(self.out_dtype(x[0].dtype, attrs))


KERNELS = (Add(), Sub(), Mul(), Div(), Pow(), Sqrt(), Reciprocal(), Relu(), Cast())
