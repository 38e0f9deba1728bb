"""SoftmaxTopK's body: Softmax and TopK in the op's order, the optional Cast to float32 between
them, and the optional renormalization (Div by ReduceSum, keepdims).

Variants: the order (`softmax_topk` or `topk_softmax`), then `_f32` (the Cast) and `_renorm`.
axis, sorted and k are passed by reference (k through a Constant from opset 12; written in
below). TopK always selects the largest (the pattern refuses largest=0). Outputs: values,
indices, and probs in `softmax_topk` order only (the other order has no full softmax).
"""

from __future__ import annotations

from onnx import TensorProto

from .builder import Body, BodyError, BodyGraph, BodyRequest

SOFTMAX_FIRST = "softmax_topk"
TOPK_FIRST = "topk_softmax"


def build(request: BodyRequest) -> Body:
    g = BodyGraph(request)
    attrs = request.attributes
    order = str(attrs["order"])
    if order not in (SOFTMAX_FIRST, TOPK_FIRST):
        raise BodyError(f"SoftmaxTopK order '{order}' is neither {SOFTMAX_FIRST} nor {TOPK_FIRST}")
    to_float32 = bool(int(attrs["to_float32"]))
    renormalize = bool(int(attrs["renormalize"]))
    last = "values" if not renormalize else None

    def cast(x: str, out: str | None = None) -> str:
        return g.op("Cast", x, to=TensorProto.FLOAT, out=out) if to_float32 else x

    if order == SOFTMAX_FIRST:
        probs = g.op("Softmax", "X", out="probs", refs={"axis": "axis"})
        values, _ = _topk(g, cast(probs), last)
        outputs: tuple[str, ...] = ("values", "indices", "probs")
    else:
        top, _ = _topk(g, "X", None)
        values = g.op("Softmax", cast(top), out=last, refs={"axis": "axis"})
        outputs = ("values", "indices")
    if renormalize:
        if request.opset >= 13:
            total = g.op("ReduceSum", values, g.one_d(g.scalar("axis")), keepdims=1)
        else:
            total = g.reduce("ReduceSum", values, [int(attrs["axis"])], since=13)
            g.variant.append(f"axis{int(attrs['axis'])}")
        g.op("Div", values, total, out="values")
    return g.build(
        ("X",), outputs, order, "f32" if to_float32 else "", "renorm" if renormalize else ""
    )


def _topk(g: BodyGraph, x: str, values: str | None) -> tuple[str, str]:
    """TopK(x, k) along axis, largest, sorted as the op says, in this opset's form."""
    out = [values or f"{x}_top", "indices"]
    refs = {"axis": "axis"}
    if g.opset >= 11:
        refs["sorted"] = "sorted"
    elif int(g.request.attributes["sorted"]) != 1:
        raise BodyError(f"TopK at opset {g.opset} has no sorted attribute; sorted=0 needs 11+")
    if g.opset >= 10:
        inputs = [x, g.one_d(g.scalar("k"))]
    else:
        inputs, refs["k"] = [x], "k"
    found = g.node("TopK", inputs, out=out, refs=refs)
    return found[0], found[1]
