"""The variadic Linear inputs of the "norm -> every Linear on it" fused ops, and their output
shapes: shared by `LayerNormMatMul` and `RmsNormMatMul`, which differ only in where W_0 sits.

Inputs from position `first` on are W_0 (b_0) W_1 (b_1) ...; attribute `has_bias[i]` says
whether b_i follows W_i, `flatten[i]` whether Linear i's output is 2-D (Reshape -> Gemm).
Output 0 is the normalized value (X's type), output 1 + i is Linear i's. With attribute
`exact_epsilon` one more input follows the Linears' (the epsilon, see `EXACT_EPSILON`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from fuser.fusedop import FLOAT_TYPES, Attr, Dim, TensorInfo


def linear_weights(
    inputs: Sequence[Any], attrs: Mapping[str, Any], first: int
) -> list[tuple[Any, Any, bool]]:
    """(W_i, b_i or None, flatten_i) per Linear, unpacked from the variadic inputs."""
    has_bias = [int(v) for v in attrs.get("has_bias") or []]
    flatten = [int(v) for v in attrs.get("flatten") or []] or [0] * len(has_bias)
    found, position = [], first
    for with_bias, flat in zip(has_bias, flatten, strict=True):
        w = inputs[position] if position < len(inputs) else None
        b = inputs[position + 1] if with_bias and position + 1 < len(inputs) else None
        position += 1 + with_bias
        found.append((w, b, bool(flat)))
    return found


def linear_outputs(
    inputs: Sequence[TensorInfo | None], attrs: Mapping[str, Any], first: int
) -> list[TensorInfo | None]:
    """The fused op's output types: N like X, then [*X.shape[:-1], N_i] per Linear in W_i's
    type (the leading dims multiplied into one where `flatten`)."""
    x = inputs[0] if inputs else None
    if x is None:
        return [None] * (1 + len(attrs.get("has_bias") or []))
    results: list[TensorInfo | None] = [x]
    for w, _, flat in linear_weights(inputs, attrs, first):
        if x.shape is None or w is None or w.shape is None or len(w.shape) != 2:
            results.append(TensorInfo(x.elem_type if w is None else w.elem_type, None))
            continue
        lead: tuple[Dim, ...] = x.shape[:-1]
        if flat:
            known = all(isinstance(d, int) for d in lead)
            lead = (int(np.prod(lead, dtype=np.int64)) if known else None,)  # type: ignore[arg-type]
        results.append(TensorInfo(w.elem_type or x.elem_type, (*lead, w.shape[1])))
    return results


# -- what the two ops share beyond the Linears' layout -----------------------------------------

#: X's types: the NPU's float16 and float32, and double. A double norm has no NPU kernel (the
#: Vector unit and the Cube take no float64: its kernel refuses it, so the cost model leaves
#: the fusion unpriced), but its reference and function body compute it exactly as the original
#: does, so a float64 model still fuses and runs anywhere onnxruntime runs.
NORM_TYPES = (*FLOAT_TYPES, "tensor(double)")

MATMUL_TYPE = Attr(
    "matmul_type",
    "int",
    "0: the Linears run in T; else the TensorProto type U that N is cast to before them "
    "(autocast: the norm in float32, Cast to float16, MatMul)",
    0,
)

EXACT_EPSILON = Attr(
    "exact_epsilon",
    "int",
    "1: the last input (after the weights) is epsilon as a one-element tensor of T, exactly as "
    "the original holds it (a double that float32 cannot hold); `epsilon` is then that value "
    "rounded to float32, for reading only. 0: `epsilon` is exact",
    0,
)


def epsilon_value(inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any]) -> float:
    """The epsilon a node adds: its trailing input with `exact_epsilon`, else the attribute."""
    if int(attrs.get("exact_epsilon") or 0):
        value = inputs[-1] if inputs else None
        if value is None or value.size != 1:
            raise ValueError("exact_epsilon=1 needs the epsilon as a one-element last input")
        return float(value.reshape(-1)[0])
    return float(attrs["epsilon"])


def apply_linears(
    n: np.ndarray, inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any], first: int
) -> list[np.ndarray]:
    """Each N @ W_i (+ b_i): N cast to `matmul_type` first when it is set (as the original's
    Cast), the product in float64 rounded to the Linears' dtype once, then + b_i rounded
    again, as MatMul then Add round."""
    to = int(attrs.get("matmul_type") or 0)
    mm = onnx.helper.tensor_dtype_to_np_dtype(to) if to else n.dtype
    a_all = n.astype(mm)
    outputs = []
    for w, b, flat in linear_weights(inputs, attrs, first):
        assert w is not None
        a = a_all.reshape(-1, n.shape[-1]) if flat else a_all
        y = (a.astype(np.float64) @ w.astype(np.float64)).astype(mm)
        outputs.append(y if b is None else (y + b).astype(mm))
    return outputs
