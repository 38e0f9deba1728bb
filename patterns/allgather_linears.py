"""The Linears of one `AllGatherMatMul` (the op's input and attribute layout, read by the pattern,
the reference, the body and the kernel): every MatMul / Gemm that reads the gathered value.

Inputs from position 1 on are W_0 (b_0) W_1 (b_1) ...: attribute `has_bias[i]` says whether
b_i follows W_i. Without `has_bias` the node is the one-Linear form (inputs X, W, B optional,
B present iff given). Per Linear, optional attributes (all absent: a MatMul (+ Add)):

- `flatten[i]` 1: Y_i is 2-D, [prod(gathered leading dims), N_i] (Reshape -> MatMul/Gemm, or
  a Gemm on a 2-D gathered value);
- `trans_b[i]` 1: W_i is stored [N_i, K] (Gemm transB=1);
- `gemm[i]` 1: Y_i = alpha[i] * X @ W_i + beta[i] * b_i rounded once, as one Gemm rounds;
  0: Y_i = round(round(X @ W_i) + b_i), as MatMul then Add round.

Output 0 is Y_0, output 1 the optional `gathered`, outputs 2.. are Y_1, Y_2, ... (only the
last formal output may be variadic, and the one-Linear layout (Y, gathered) is kept).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Linear:
    """One Linear: its input positions and how its output is computed."""

    w: int  # input position of W_i
    b: int | None  # input position of b_i, None without bias
    flatten: bool = False
    trans_b: bool = False
    gemm: bool = False
    alpha: float = 1.0
    beta: float = 1.0


def linears(attrs: Mapping[str, Any], inputs: Sequence[object | None]) -> tuple[Linear, ...]:
    """The Linears of a node with these attributes and inputs (see the module docstring)."""
    has_bias = attrs.get("has_bias")
    if has_bias is None or len(has_bias) == 0:
        with_b = len(inputs) > 2 and inputs[2] is not None
        flags = [with_b]
    else:
        flags = [bool(int(v)) for v in has_bias]
    count = len(flags)

    def per(name: str, default: T) -> list[T]:
        values = list(attrs.get(name) or [])
        return values if values else [default] * count

    flatten, trans_b, gemm = per("flatten", 0), per("trans_b", 0), per("gemm", 0)
    alpha, beta = per("alpha", 1.0), per("beta", 1.0)
    for name, values in (("flatten", flatten), ("trans_b", trans_b), ("gemm", gemm),
                         ("alpha", alpha), ("beta", beta)):  # fmt: skip
        if len(values) != count:
            raise ValueError(f"{name} has {len(values)} values for {count} Linears")
    out, position = [], 1
    for i, with_b in enumerate(flags):
        out.append(
            Linear(
                w=position,
                b=position + 1 if with_b else None,
                flatten=bool(int(flatten[i])),
                trans_b=bool(int(trans_b[i])),
                gemm=bool(int(gemm[i])),
                alpha=float(alpha[i]),
                beta=float(beta[i]),
            )
        )
        position += 1 + int(with_b)
    return tuple(out)


def output_position(i: int) -> int:
    """The node output that holds Y_i (output 1 is `gathered`)."""
    return 0 if i == 0 else i + 1
