"""The activations `ConvBnRelu` applies on the way out: names, attributes, math, vector work.

One fact per activation, shared by the pattern (what it writes on the fused node), the numpy
reference, the kernel's epilogue, its cost model and the function body:

    activation   ONNX original                                   alpha, beta
    (none)       -
    Relu         Relu                                            -
    Clip         Clip(x, min, max) (ReLU6 is 0, 6)               min, max (+-inf: unbounded)
    LeakyRelu    LeakyRelu(alpha)                                alpha
    HardSigmoid  HardSigmoid(alpha, beta)                        alpha, beta
    HardSwish    HardSwish, or x * HardSigmoid(x, alpha, beta)   alpha, beta (1/6, 0.5 for the op)
    Silu         x * Sigmoid(x)                                  -
    Gelu         Gelu (approximate="none"), x*0.5*(1+Erf(x/sqrt2)) -
    GeluTanh     Gelu (approximate="tanh")                       -
    Sigmoid      Sigmoid                                         -
    Tanh         Tanh                                            -

The fused node keeps the old attribute `relu` (1 = Relu) so that models written before
activations existed read as they did: Relu is written as `relu=1` and no `activation`, every
other activation as `activation=NAME` with `alpha`/`beta` when it has parameters.

On the NPU, Relu runs in FixPipe on the way from L0C to GM (FixPipe has a ReLU stage); every
other activation runs on the Vector unit as the instruction sequence `VECTOR_OPS` names (rows
of the target's `vector_ops` table; the sequences are this module's guess at how a vector
kernel writes each function [G], each op priced by its own sourced row).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

NONE = ""
NAMES = (
    "Relu", "Clip", "LeakyRelu", "HardSigmoid", "HardSwish", "Silu", "Gelu", "GeluTanh",
    "Sigmoid", "Tanh",
)  # fmt: skip
#: Activations that have alpha/beta parameters (the others ignore them).
PARAMETERS = {
    "Clip": ("min", "max"),
    "LeakyRelu": ("alpha",),
    "HardSigmoid": ("alpha", "beta"),
    "HardSwish": ("alpha", "beta"),
}
#: HardSwish's fixed HardSigmoid inside (ONNX: alpha = 1/6, beta = 0.5), as float attributes.
HARDSWISH_ALPHA = float(np.float32(1.0 / 6.0))
HARDSWISH_BETA = 0.5

#: Vector instructions per element of each activation run on the Vector unit (see docstring).
VECTOR_OPS: Mapping[str, tuple[str, ...]] = {
    "Clip": ("Max", "Min"),
    "LeakyRelu": ("Muls", "Max"),
    "HardSigmoid": ("Muls", "Adds", "Max", "Min"),
    "HardSwish": ("Muls", "Adds", "Max", "Min", "Mul"),
    # sigmoid(x) = 1 / (1 + exp(-x))
    "Sigmoid": ("Muls", "Exp", "Adds", "Reciprocal"),
    "Silu": ("Muls", "Exp", "Adds", "Reciprocal", "Mul"),
    # tanh(x) = 2 / (1 + exp(-2x)) - 1
    "Tanh": ("Muls", "Exp", "Adds", "Reciprocal", "Muls", "Adds"),
    # erf by a rational approximation: x^2, two polynomial steps, a division, the products
    "Gelu": ("Mul", "Muls", "Adds", "Mul", "Adds", "Div", "Mul", "Adds", "Mul"),
    # x * sigmoid(2 * sqrt(2/pi) * (x + 0.044715 x^3))
    "GeluTanh": ("Mul", "Mul", "Muls", "Add", "Muls", "Exp", "Adds", "Reciprocal", "Mul"),
}


@dataclass(frozen=True)
class Activation:
    """One activation with its parameters (`name` "" = none)."""

    name: str = NONE
    alpha: float = 0.0
    beta: float = 0.0

    @property
    def on_vector(self) -> bool:
        """Whether the NPU kernel runs it on the Vector unit (Relu and none stay in FixPipe)."""
        return self.name not in (NONE, "Relu")

    def describe(self) -> str:
        """E.g. `Clip(min=0, max=6)`, `Silu`, `none`."""
        if not self.name:
            return "none"
        names = PARAMETERS.get(self.name, ())
        values = (self.alpha, self.beta)[: len(names)]
        inner = ", ".join(f"{n}={v:g}" for n, v in zip(names, values, strict=True))
        return f"{self.name}({inner})" if inner else self.name

    def attributes(self) -> dict[str, Any]:
        """The fused node's attributes for this activation (Relu as the old `relu=1`)."""
        if self.name in (NONE, "Relu"):
            return {"relu": int(self.name == "Relu")}
        attrs: dict[str, Any] = {"relu": 0, "activation": self.name}
        names = PARAMETERS.get(self.name, ())
        if names:
            attrs["alpha"] = self.alpha
        if len(names) > 1:
            attrs["beta"] = self.beta
        return attrs


def from_attributes(attrs: Mapping[str, Any]) -> Activation:
    """The activation a fused node's attributes say; `ValueError` naming what is wrong."""
    name = attrs.get("activation") or NONE
    if isinstance(name, bytes):
        name = name.decode()
    relu = int(attrs.get("relu") or 0)
    if name and name not in NAMES:
        raise ValueError(f"unknown activation '{name}' (known: {', '.join(NAMES)})")
    if relu and name not in (NONE, "Relu"):
        raise ValueError(f"relu=1 conflicts with activation '{name}'")
    if relu:
        name = "Relu"
    defaults = {"LeakyRelu": (0.01, 0.0), "HardSigmoid": (0.2, 0.5)}
    a0, b0 = defaults.get(name, (0.0, 0.0))
    if name == "HardSwish":
        a0, b0 = HARDSWISH_ALPHA, HARDSWISH_BETA
    if name == "Clip":
        a0, b0 = -math.inf, math.inf
    alpha = attrs.get("alpha")
    beta = attrs.get("beta")
    return Activation(
        name, float(a0 if alpha is None else alpha), float(b0 if beta is None else beta)
    )


def apply(act: Activation, y: np.ndarray) -> np.ndarray:
    """The activation on `y`, computed in y's dtype (float64 for the reference)."""
    name, a, b = act.name, act.alpha, act.beta
    t = y.dtype.type
    if name == NONE:
        return y
    if name == "Relu":
        return np.maximum(y, t(0))
    if name == "Clip":
        return np.minimum(np.maximum(y, t(a)), t(b))
    if name == "LeakyRelu":
        return np.where(y < 0, y * t(a), y)
    if name in ("HardSigmoid", "HardSwish"):
        h = np.clip(y * t(a) + t(b), t(0), t(1))
        return h if name == "HardSigmoid" else y * h
    if name in ("Sigmoid", "Silu"):
        s = _sigmoid(y)
        return s if name == "Sigmoid" else y * s
    if name == "Tanh":
        return np.tanh(y)
    if name == "Gelu":
        return t(0.5) * y * (t(1) + _erf(y / t(math.sqrt(2.0))))
    if name == "GeluTanh":
        inner = t(math.sqrt(2.0 / math.pi)) * (y + t(0.044715) * y * y * y)
        return t(0.5) * y * (t(1) + np.tanh(inner))
    raise ValueError(f"unknown activation '{name}'")


def _sigmoid(y: np.ndarray) -> np.ndarray:
    # Split by sign so exp never overflows.
    t = y.dtype.type
    e = np.exp(-np.abs(y))
    return np.where(y >= 0, t(1) / (t(1) + e), e / (t(1) + e))


_ERF = np.frompyfunc(math.erf, 1, 1)


def _erf(y: np.ndarray) -> np.ndarray:
    """erf elementwise (math.erf: correctly rounded in float64)."""
    return np.asarray(_ERF(y.astype(np.float64)), dtype=np.float64).astype(y.dtype)
