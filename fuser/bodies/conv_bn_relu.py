"""ConvBnRelu's body: Conv (ConvTranspose with transposed=1, its own overload), then
BatchNormalization when its inputs are present, then the activation.

Variants (the function's overload): `folded` (BN already folded into W/B at fuse time, or no
BN at all) or `bn` (the four BN inputs applied at run time), each with the activation's name
when one is fused (`relu`, `clip`, `silu`, ...). Conv's attributes, BN's epsilon and the
activation's alpha/beta are passed by reference; an absent Conv bias stays absent. Each
activation is written in the ops of the model's opset: Clip's bounds as attributes below
opset 11 and as inputs from 11 (Cast to X's type), HardSwish as x * HardSigmoid(x) (what ONNX
defines it as, and it carries alpha/beta), SiLU as x * Sigmoid(x), GELU as the Gelu op from
opset 20 and below it as its erf / tanh formula.
"""

from __future__ import annotations

import math

from onnx import helper

from fuser.patterns.conv_activation import from_attributes

from .builder import Body, BodyError, BodyGraph, BodyRequest

CONV_ATTRIBUTES = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
#: ConvTranspose's (auto_pad is always NOTSET in a fused op, output_shape never set).
TRANSPOSE_ATTRIBUTES = (*CONV_ATTRIBUTES, "output_padding")
INPUTS = ("X", "W", "B", "scale", "bias", "mean", "var")


def build(request: BodyRequest) -> Body:
    g = BodyGraph(request)
    with_bn = any(request.has_input(i) for i in range(3, 7))
    try:
        act = from_attributes(request.attributes)
    except ValueError as e:
        raise BodyError(f"ConvBnRelu: {e}") from None
    last = "conv" if not (with_bn or act.name) else "bn" if not act.name else "act"
    transposed = bool(request.attributes.get("transposed", 0))
    y = g.op(
        "ConvTranspose" if transposed else "Conv",
        "X",
        "W",
        "B",
        out="Y" if last == "conv" else None,
        refs={a: a for a in (TRANSPOSE_ATTRIBUTES if transposed else CONV_ATTRIBUTES)},
    )
    if with_bn:
        bn_inputs = (y, "scale", "bias", "mean", "var")
        out = "Y" if last == "bn" else None
        y = g.op("BatchNormalization", *bn_inputs, out=out, refs={"epsilon": "epsilon"})
    if act.name:
        _activation(g, act.name, y, request.input_types[0] if request.input_types else 0)
    inputs = INPUTS if with_bn else INPUTS[:3]
    variant = ("transposed",) if transposed else ()
    return g.build(inputs, ("Y",), *variant, "bn" if with_bn else "folded", act.name.lower())


def _activation(g: BodyGraph, name: str, y: str, elem_type: int) -> None:
    """`name` applied to `y`, written to Y."""
    if name in ("Relu", "Sigmoid", "Tanh"):
        g.op(name, y, out="Y")
    elif name == "LeakyRelu":
        g.op("LeakyRelu", y, out="Y", refs={"alpha": "alpha"})
    elif name == "HardSigmoid":
        g.op("HardSigmoid", y, out="Y", refs={"alpha": "alpha", "beta": "beta"})
    elif name == "HardSwish":
        h = g.op("HardSigmoid", y, refs={"alpha": "alpha", "beta": "beta"})
        g.op("Mul", y, h, out="Y")
    elif name == "Silu":
        g.op("Mul", y, g.op("Sigmoid", y), out="Y")
    elif name == "Clip":
        if g.opset < 11:
            g.op("Clip", y, out="Y", refs={"min": "alpha", "max": "beta"})
        else:
            lo = _typed(g, g.scalar("alpha"), elem_type)
            hi = _typed(g, g.scalar("beta"), elem_type)
            g.op("Clip", y, lo, hi, out="Y")
    elif name in ("Gelu", "GeluTanh"):
        approximate = "none" if name == "Gelu" else "tanh"
        if g.opset >= 20:
            g.op("Gelu", y, out="Y", approximate=approximate)
        else:
            _gelu_formula(g, y, elem_type, approximate)
    else:
        raise BodyError(f"ConvBnRelu: no body for activation '{name}'")


def _typed(g: BodyGraph, scalar: str, elem_type: int) -> str:
    """A float32 scalar in X's element type (Clip's bounds must be)."""
    if not elem_type:
        raise BodyError("ConvBnRelu: Clip bounds need X's element type, which is unknown")
    if elem_type == 1:
        return scalar
    return g.op("Cast", scalar, to=elem_type)


def _const(g: BodyGraph, value: float, elem_type: int) -> str:
    if not elem_type:
        raise BodyError("ConvBnRelu: the GELU formula needs X's element type, which is unknown")
    return g.constant(value, helper.tensor_dtype_to_np_dtype(elem_type))


def _gelu_formula(g: BodyGraph, y: str, elem_type: int, approximate: str) -> None:
    """0.5 * y * (1 + erf(y / sqrt 2)), or the tanh form, in the ops of any opset."""
    if approximate == "none":
        inner = g.op("Erf", g.op("Div", y, _const(g, math.sqrt(2.0), elem_type)))
    else:
        cube = g.op("Mul", g.op("Mul", y, y), y)
        poly = g.op("Add", y, g.op("Mul", cube, _const(g, 0.044715, elem_type)))
        inner = g.op("Tanh", g.op("Mul", poly, _const(g, math.sqrt(2.0 / math.pi), elem_type)))
    one_plus = g.op("Add", inner, _const(g, 1.0, elem_type))
    half = g.op("Mul", y, _const(g, 0.5, elem_type))
    g.op("Mul", half, one_plus, out="Y")
