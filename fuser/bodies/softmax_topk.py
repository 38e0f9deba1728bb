"""SoftmaxTopK's body: the score (Softmax, Sigmoid or LogSoftmax) and TopK in the op's order,
the optional Cast to float32 between them, the optional selection bias and expert-group limit
(DeepSeek-V3), the gather of the unbiased scores at the chosen indices, and the optional
renormalization (Div by ReduceSum, keepdims; `+ epsilon` when non-zero) and scale.

Dense (Llama-4, `dense=1`, topk_softmax order): the k values scattered (ScatterElements, opset
11+) into a row of X's shape filled with `fill` (Expand of the attribute, by reference from
opset 12) before the Sigmoid; variant `_dense`.

Variants: the order (`softmax_topk` or `topk_softmax`), the score when not softmax, then `_f32`
(the Cast), `_bias`, `_group` (with the mask value: `maskninf`, `mask0`, ...), `_renorm`,
`_eps`, `_scale`. axis, sorted, k, epsilon and scale are passed by reference (through a
Constant from opset 12; written in below), n_group and topk_group are written in (they shape
a Reshape) and name the variant. TopK always selects the largest (the pattern refuses
largest=0). Outputs: values, indices, and probs in `softmax_topk` order only.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from .builder import Body, BodyError, BodyGraph, BodyRequest

SOFTMAX_FIRST = "softmax_topk"
TOPK_FIRST = "topk_softmax"
_SCORE_OPS = {"softmax": "Softmax", "sigmoid": "Sigmoid", "log_softmax": "LogSoftmax"}


def build(request: BodyRequest) -> Body:
    g = BodyGraph(request)
    attrs = request.attributes
    order = str(attrs["order"])
    if order not in (SOFTMAX_FIRST, TOPK_FIRST):
        raise BodyError(f"SoftmaxTopK order '{order}' is neither {SOFTMAX_FIRST} nor {TOPK_FIRST}")
    score = str(attrs.get("score", "softmax"))
    if score not in _SCORE_OPS:
        raise BodyError(f"SoftmaxTopK score '{score}' is not one of {', '.join(_SCORE_OPS)}")
    to_float32 = bool(int(attrs["to_float32"]))
    renormalize = bool(int(attrs["renormalize"]))
    epsilon = float(attrs.get("epsilon", 0.0))
    scale = float(attrs.get("scale", 1.0))
    bias = request.has_input(1)
    n_group = int(attrs.get("n_group", 1))
    x_type = request.input_types[0] if request.input_types else 0
    values_type = TensorProto.FLOAT if to_float32 else x_type
    finishing = renormalize or scale != 1.0
    last = "values" if not finishing else None

    def cast(x: str, out: str | None = None) -> str:
        return g.op("Cast", x, to=TensorProto.FLOAT, out=out) if to_float32 else x

    def scored(x: str, out: str | None) -> str:
        refs = {"axis": "axis"} if score != "sigmoid" else {}
        return g.op(_SCORE_OPS[score], x, out=out, refs=refs)

    if order == SOFTMAX_FIRST:
        probs = scored("X", "probs")
        scores = cast(probs)
        if bias or n_group > 1:
            chosen = choice_scores(g, scores, values_type)  # gateforms: float32 bias
            choice = g.op("Add", chosen, "selection_bias") if bias else chosen
            if n_group > 1:
                choice = _group_limit(g, choice, choice_type(g, values_type))
            if g.opset < 11:
                raise BodyError("the gather of the unbiased scores needs opset 11+")
            _, indices = _topk(g, choice, None)
            values = g.op("GatherElements", scores, indices, out=last, refs={"axis": "axis"})
        else:
            values, _ = _topk(g, scores, last)
        outputs: tuple[str, ...] = ("values", "indices", "probs")
    elif int(attrs.get("dense", 0)):
        top, indices = _topk(g, "X", None)
        values = scored(cast(_scatter(g, top, indices, x_type)), last)
        outputs = ("values", "indices")
    else:
        top, _ = _topk(g, "X", None)
        values = scored(cast(top), last)
        outputs = ("values", "indices")
    if renormalize:
        if request.opset >= 13:
            total = g.op("ReduceSum", values, g.one_d(g.scalar("axis")), keepdims=1)
        else:
            total = g.reduce("ReduceSum", values, [int(attrs["axis"])], since=13)
            g.variant.append(f"axis{int(attrs['axis'])}")
        if epsilon:
            total = g.op("Add", total, _typed(g, "epsilon", values_type))
        values = g.op("Div", values, total, out=None if scale != 1.0 else "values")
    if scale != 1.0:
        g.op("Mul", values, _typed(g, "scale", values_type), out="values")
    mask = str(float(attrs.get("mask_value", float("-inf")))).replace("-", "n").replace(".", "p")
    return g.build(
        ("X", "selection_bias") if bias else ("X",),
        outputs,
        order,
        "" if score == "softmax" else score,
        "dense" if int(attrs.get("dense", 0)) else "",
        "f32" if to_float32 else "",
        "bias" if bias else "",
        f"group{n_group}of{int(attrs['topk_group'])}mask{mask.replace('-', 'n')}"
        if n_group > 1
        else "",
        "renorm" if renormalize else "",
        "eps" if renormalize and epsilon else "",
        "scale" if scale != 1.0 else "",
    )


def _typed(g: BodyGraph, source: str, elem_type: int) -> str:
    """The float attribute `source` as a scalar of the values' type."""
    value = g.scalar(source)
    return g.op("Cast", value, to=elem_type) if elem_type not in (0, TensorProto.FLOAT) else value


def _scatter(g: BodyGraph, top: str, indices: str, elem_type: int) -> str:
    """ScatterElements(fill like X, indices, top, axis): the dense row of the Llama-4 router."""
    if g.opset < 11:
        raise BodyError("the dense row needs ScatterElements (opset 11+)")
    attrs = g.request.attributes
    if bool(int(attrs["renormalize"])) or float(attrs.get("scale", 1.0)) != 1.0:
        raise BodyError("dense=1 takes neither renormalize nor scale")
    filled = g.op("Expand", _typed(g, "fill", elem_type), g.op("Shape", "X"))
    return g.op("ScatterElements", filled, indices, top, refs={"axis": "axis"})


def _group_limit(g: BodyGraph, choice: str, elem_type: int) -> str:
    """DeepSeek-V3's group limit on a [N, E] choice: [N, G, E/G], the sum of each group's top-2,
    the topk_group best groups (TopK), a 0/1 mask scattered there, broadcast back to the experts,
    the other experts' choice replaced by mask_value."""
    if g.opset < 11:
        raise BodyError("the expert-group limit needs ScatterElements (opset 11+)")
    attrs = g.request.attributes
    n_group, topk_group = int(attrs["n_group"]), int(attrs["topk_group"])
    grouped = g.op("Reshape", choice, g.constant([0, n_group, -1]))
    top2 = g.node("TopK", [grouped, g.constant([2])], n_out=2, axis=-1)[0]
    if g.opset >= 13:
        group_scores = g.op("ReduceSum", top2, g.constant([-1]), keepdims=0)
    else:
        group_scores = g.op("ReduceSum", top2, axes=[-1], keepdims=0)
    kept = g.node("TopK", [group_scores, g.constant([topk_group])], n_out=2, axis=-1)[1]
    zeros = g.op("ConstantOfShape", g.op("Shape", group_scores))
    ones = g.op(
        "ConstantOfShape",
        g.op("Shape", kept),
        value=numpy_helper.from_array(np.ones(1, np.float32)),
    )
    keep = g.op("ScatterElements", zeros, kept, ones, axis=-1)
    if g.opset >= 13:
        keep = g.op("Unsqueeze", keep, g.constant([-1]))
    else:
        keep = g.op("Unsqueeze", keep, axes=[-1])
    keep = g.op("Expand", keep, g.op("Shape", grouped))
    keep = g.op("Cast", g.op("Reshape", keep, g.op("Shape", choice)), to=TensorProto.BOOL)
    fill = g.constant(
        float(attrs["mask_value"]), helper.tensor_dtype_to_np_dtype(elem_type or TensorProto.FLOAT)
    )
    return g.op("Where", keep, choice, fill)


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


# -- gateforms: a float32 selection bias on float16 scores ----------------------------------------


def choice_type(g: BodyGraph, values_type: int) -> int:
    """The type the choice is made in: float32 when a float32 `selection_bias` meets float16
    scores (the original's Cast(scores, float32) before the Add), else the values' type."""
    types = g.request.input_types
    bias_type = types[1] if g.request.has_input(1) and len(types) > 1 else 0
    if bias_type == TensorProto.FLOAT and values_type == TensorProto.FLOAT16:
        return TensorProto.FLOAT
    return values_type


def choice_scores(g: BodyGraph, scores: str, values_type: int) -> str:
    """The scores the choice reads: cast to float32 for a float32 bias on float16 scores (the
    variant then named `bias32`; the values are still gathered from the uncast scores)."""
    if choice_type(g, values_type) == values_type:
        return scores
    g.variant.append("bias32")
    return g.op("Cast", scores, to=TensorProto.FLOAT)
