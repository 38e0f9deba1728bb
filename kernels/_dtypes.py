"""ONNX element types as numpy dtypes (kernels take `Cast.to` as the TensorProto enum)."""

from __future__ import annotations

import numpy as np

from .api import KernelError

# TensorProto.DataType values (onnx.proto); bfloat16 and the fp8 types have no numpy dtype.
_ONNX_TO_NUMPY: dict[int, np.dtype] = {
    1: np.dtype(np.float32),
    2: np.dtype(np.uint8),
    3: np.dtype(np.int8),
    4: np.dtype(np.uint16),
    5: np.dtype(np.int16),
    6: np.dtype(np.int32),
    7: np.dtype(np.int64),
    9: np.dtype(np.bool_),
    10: np.dtype(np.float16),
    11: np.dtype(np.float64),
    12: np.dtype(np.uint32),
    13: np.dtype(np.uint64),
}


def numpy_dtype(onnx_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type; raises `KernelError` if numpy has none."""
    try:
        return _ONNX_TO_NUMPY[int(onnx_type)]
    except KeyError:
        raise KernelError(f"ONNX element type {onnx_type} has no numpy dtype here") from None


def vector_dtype_ok(dtype: np.dtype) -> bool:
    """The Vector unit works on 8/16/32-bit ints and fp16/fp32, and int64 (ints only)."""
    return np.dtype(dtype) != np.float64
