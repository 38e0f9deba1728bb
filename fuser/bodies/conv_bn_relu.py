"""ConvBnRelu's body: Conv, then BatchNormalization when its inputs are present, then Relu.

Variants (the function's overload): `folded` (BN already folded into W/B at fuse time) or `bn`
(the four BN inputs applied at run time), each with `_relu` when Relu is fused. Conv's
attributes and BN's epsilon are passed by reference; an absent Conv bias stays absent.
"""

from __future__ import annotations

from .builder import Body, BodyGraph, BodyRequest

CONV_ATTRIBUTES = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
INPUTS = ("X", "W", "B", "scale", "bias", "mean", "var")


def build(request: BodyRequest) -> Body:
    g = BodyGraph(request)
    with_bn = any(request.has_input(i) for i in range(3, 7))
    relu = bool(int(request.attributes["relu"]))
    last = "conv" if not (with_bn or relu) else "bn" if not relu else "relu"
    y = g.op(
        "Conv",
        "X",
        "W",
        "B",
        out="Y" if last == "conv" else None,
        refs={a: a for a in CONV_ATTRIBUTES},
    )
    if with_bn:
        bn_inputs = (y, "scale", "bias", "mean", "var")
        out = "Y" if last == "bn" else None
        y = g.op("BatchNormalization", *bn_inputs, out=out, refs={"epsilon": "epsilon"})
    if relu:
        g.op("Relu", y, out="Y")
    inputs = INPUTS if with_bn else INPUTS[:3]
    return g.build(inputs, ("Y",), "bn" if with_bn else "folded", "relu" if relu else "")
