"""The variadic Linear inputs of the "norm -> every Linear on it" fused ops, and their output
shapes: shared by `LayerNormMatMul` and `RmsNormMatMul`, which differ only in where W_0 sits.

Inputs from position `first` on are W_0 (b_0) W_1 (b_1) ...; attribute `has_bias[i]` says
whether b_i follows W_i, `flatten[i]` whether Linear i's output is 2-D (Reshape -> Gemm).
Output 0 is the normalized value (X's type), output 1 + i is Linear i's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fuser.fusedop import Dim, TensorInfo


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
