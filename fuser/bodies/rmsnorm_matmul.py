"""RmsNormMatMul's body: the RMSNorm written out in standard ops, then each MatMul (+ bias).

    xs = Cast(X, stats);  inv = Reciprocal(Sqrt(Add(ReduceMean(Mul(xs, xs), [-1]), eps)))
    N  = Cast(Mul(xs, inv), T) * scale               (round_before_scale=1)
    N  = Cast(Mul(Mul(xs, inv), Cast(scale, stats)), T)   (round_before_scale=0)

Statistics as `reference` computes them: stash_type=1 in float32 (the input's dtype if that is
wider), stash_type=0 in the input dtype. A flattened output (Reshape -> Gemm/MatMul, folded at
fuse time) is Flatten(N, -1) before its MatMul.

Variants: `<dtype>_stats<dtype>`, then `scale` or `scale_once` (round_before_scale=0) when gamma
is present, then `to<dtype>` when matmul_type casts N first, then one part per MatMul: `mm`, `b`
if it has a bias, `f` if flattened. epsilon is passed by reference (through a Constant from
opset 12), or with `exact_epsilon` is the node's last input (`epsinput`), as LayerNormMatMul's.
"""

from __future__ import annotations

from onnx import TensorProto

from .builder import Body, BodyError, BodyGraph, BodyRequest, dtype_name, linears
from .layernorm_matmul import EPSILON_INPUT, cast_for_linears, epsilon_operand


def build(request: BodyRequest) -> Body:
    g = BodyGraph(request)
    attrs = request.attributes
    has_bias = [int(v) for v in attrs.get("has_bias") or []]
    flatten = [int(v) for v in attrs.get("flatten") or []] or [0] * len(has_bias)
    if len(flatten) != len(has_bias):
        raise BodyError(f"has_bias {has_bias} and flatten {flatten} differ in length")
    if request.opset < 11:
        raise BodyError(f"ReduceMean and Flatten at opset {request.opset} take no axis -1")
    x_type = request.input_types[0] if request.input_types else 0
    if not x_type:
        raise BodyError("the element type of X is unknown")
    wide = int(attrs["stash_type"]) == 1 and x_type != TensorProto.DOUBLE
    stats = TensorProto.FLOAT if wide else x_type

    xs = g.op("Cast", "X", to=stats) if stats != x_type else "X"
    ms = g.reduce("ReduceMean", g.op("Mul", xs, xs), [-1], since=18)
    eps, eps_part = epsilon_operand(g, x_type, stats)
    n = g.op("Mul", xs, g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, eps))))
    scaled = request.has_input(1)
    once = scaled and not int(attrs["round_before_scale"])
    if once:
        scale = g.op("Cast", "scale", to=stats) if stats != x_type else "scale"
        n = g.op("Mul", n, scale)
    if stats != x_type:
        n = g.op("Cast", n, to=x_type, out=None if scaled and not once else "normalized")
    if scaled and not once:
        n = g.op("Mul", n, "scale", out="normalized")
    elif n != "normalized":
        n = g.op("Identity", n, out="normalized")

    inputs = ["X", "scale"]
    outputs = ["normalized"]
    n, parts = cast_for_linears(g, n, x_type)
    parts += linears(g, n, has_bias, flatten, inputs, outputs)
    if eps_part:
        inputs.append(EPSILON_INPUT)
    return g.build(
        inputs,
        outputs,
        f"{dtype_name(x_type)}_stats{dtype_name(stats)}",
        eps_part,
        ("scale_once" if once else "scale") if scaled else "",
        *parts,
    )
