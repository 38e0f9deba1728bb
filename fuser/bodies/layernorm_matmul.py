"""LayerNormMatMul's body: LayerNorm written out in standard ops (every opset has them; the
LayerNormalization op exists only from opset 17), then each MatMul (+ bias Add).

The normalized axes `axis..rank-1` are reached without knowing the rank: Flatten(X, axis) makes
them one axis of a 2-D tensor, the statistics are taken over it, and the result is reshaped
back to X's shape. Statistics are computed as accurately as onnxruntime's LayerNormalization
kernel computes them (which is also what runs an original decomposed chain: its optimizer
replaces the chain by the kernel), whatever stash_type says: in float32 at least (double stays
double), in two passes over the row shifted by its first element x0 (y = X - x0; the centred
d = y - mean(y); var = mean(d^2)), so a float16 row [300, -300, 0, 0] does not overflow in the
square and a constant row normalizes to exactly 0. The normalized value is rounded to the
input dtype before scale and bias, each rounded, as `reference` does. A flattened output
(Reshape -> Gemm, folded at fuse time into W_i/b_i) is Flatten(N, -1) before its MatMul.

Variants: `<dtype>_stats<dtype>` (the input's, the statistics'), then `scale`/`bias` when the
affine inputs are present, `to<dtype>` when matmul_type casts N first, then one part per
MatMul: `mm`, `b` if it has a bias, `f` if flattened (e.g. `mmb_mm_mmbf`). axis and epsilon
are passed by reference (epsilon through a Constant from opset 12); with `exact_epsilon` the
epsilon is the node's last input instead (`epsinput` after the dtype parts), added as it is.
"""

from __future__ import annotations

from onnx import TensorProto

from .builder import Body, BodyError, BodyGraph, BodyRequest, dtype_name, linears


def build(request: BodyRequest) -> Body:
    g = BodyGraph(request)
    attrs = request.attributes
    has_bias = [int(v) for v in attrs.get("has_bias") or []]
    flatten = [int(v) for v in attrs.get("flatten") or []] or [0] * len(has_bias)
    if len(flatten) != len(has_bias):
        raise BodyError(f"has_bias {has_bias} and flatten {flatten} differ in length")
    if request.opset < 11 and int(attrs["axis"]) < 0:
        raise BodyError(f"Flatten at opset {request.opset} takes no negative axis")
    if request.opset < 11 and any(flatten):
        raise BodyError(f"Flatten at opset {request.opset} takes no negative axis (flatten=1)")
    x_type = request.input_types[0] if request.input_types else 0
    if not x_type:
        raise BodyError("the element type of X is unknown")
    stats = x_type if x_type == TensorProto.DOUBLE else TensorProto.FLOAT

    xs = g.op("Cast", "X", to=stats) if stats != x_type else "X"
    flat = g.op("Flatten", xs, refs={"axis": "axis"})
    y = g.op("Sub", flat, g.op("Gather", flat, g.constant([0]), axis=1))
    d = g.op("Sub", y, g.reduce("ReduceMean", y, [1], since=18))
    var = g.reduce("ReduceMean", g.op("Mul", d, d), [1], since=18)
    eps, eps_part = epsilon_operand(g, x_type, stats)
    n = g.op("Div", d, g.op("Sqrt", g.op("Add", var, eps)))
    n = g.op("Reshape", n, g.op("Shape", "X"))
    if stats != x_type:
        n = g.op("Cast", n, to=x_type)
    affine = [(i, name) for i, name in ((1, "scale"), (2, "bias")) if request.has_input(i)]
    for position, (_, name) in enumerate(affine):
        out = "normalized" if position == len(affine) - 1 else None
        n = g.op("Mul" if name == "scale" else "Add", n, name, out=out)
    if not affine:
        n = g.op("Identity", n, out="normalized")

    inputs = ["X", "scale", "bias"]
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
        *(name for _, name in affine),
        *parts,
    )


EPSILON_INPUT = "epsilon"  # the formal input after the weights with exact_epsilon=1


def epsilon_operand(g: BodyGraph, x_type: int, stats: int) -> tuple[str, str]:
    """The epsilon in the statistics dtype, and the variant part naming where it came from:
    the node's trailing input (exact_epsilon=1, a double float32 cannot hold: `epsinput`), or
    the float32 attribute through a Constant ("")."""
    if int(g.request.attributes.get("exact_epsilon") or 0):
        eps = EPSILON_INPUT
        if stats != x_type:
            eps = g.op("Cast", eps, to=stats)
        return eps, "epsinput"
    eps = g.scalar("epsilon")
    if stats != TensorProto.FLOAT:  # the Constant holds a float32
        eps = g.op("Cast", eps, to=stats)
    return eps, ""


def cast_for_linears(g: BodyGraph, n: str, x_type: int) -> tuple[str, list[str]]:
    """N cast to `matmul_type` before the Linears (autocast, as the original's Cast), and the
    variant part `to<dtype>`; N and no part when the Linears run in X's dtype."""
    to = int(g.request.attributes.get("matmul_type") or 0)
    if not to or to == x_type:
        return n, []
    return g.op("Cast", n, to=to), [f"to{dtype_name(to)}"]
