"""MoE gates as exporters write them (onnx.helper, seeded): Sigmoid/Softmax/LogSoftmax scores,
DeepSeek-V3's selection bias and expert-group limit (the TorchScript and the dynamo form of the
mask), GatherElements of the unbiased scores, renormalization (with or without + epsilon) and
the routed scaling factor; each part switchable, and each trap a keyword."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


@dataclass(frozen=True)
class Gate:
    """What the gate computes; the defaults are DeepSeek-V3's (16 experts here)."""

    dtype: str = "float32"
    score: str = "Sigmoid"
    experts: int = 16
    k: int = 4
    bias: str | None = "const"  # "const", "input" (a trap), None
    groups: tuple[int, int] | None = (4, 2)  # (n_group, topk_group)
    split: tuple[int, int] | None = None  # the Reshape's [G, E/G] (default from groups)
    # "ts": Cast -> Not -> Cast, Expand of ones; "dynamo": Not, ConstantOfShape of ones
    mask_form: str = "ts"
    fill: float = float("-inf")
    renorm: str | None = "eps"  # "eps", "plain", None
    epsilon: float = 1e-20
    scale: float | None = 2.5
    tokens: int | str = "N"
    sorted: int = 0
    gather_from: str = "scores"  # "scores" or "choice" (a trap)
    read_choice_values: bool = False  # the TopK's biased values also an output (a trap)
    read_weights: bool = False  # the gathered weights also an output (renormalization left out)
    read_normalized: bool = False  # the renormalized weights also an output (scale left out)
    seed: int = 0
    # gateforms lane: the group split / flatten as written ([0, G, -1], [0, -1], ...; None:
    # [-1, G, E/G] and [-1, E]), their allowzero (None: no attribute), and the bias in float32
    # on float16 scores ("float32": Cast(scores) + bias chooses, the weights gathered from the
    # float16 scores, or from the Cast when gather_from is "cast")
    split_shape: tuple[int, ...] | None = None
    flat_shape: tuple[int, ...] | None = None
    allowzero: int | None = None
    bias_dtype: str | None = None


class _Builder:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.np = np.dtype(gate.dtype)
        self.elem = helper.np_dtype_to_tensor_dtype(self.np)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs = [helper.make_tensor_value_info("x", self.elem, [gate.tokens, gate.experts])]
        self.outputs: list[str] = []
        self.rng = np.random.default_rng(gate.seed)

    def const(self, value: Any, name: str, dtype: Any = None) -> str:
        array = np.asarray(value, dtype=dtype or self.np)
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs: Any) -> Any:
        name = f"{op_type}_{len(self.nodes)}"
        outs = [f"{name}_out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs[0] if n_out == 1 else outs

    def model(self, name: str, opset: int) -> onnx.ModelProto:
        """The graph built so far as a model, its outputs typed by shape inference."""
        untyped = [
            helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in self.outputs
        ]
        graph = helper.make_graph(self.nodes, name, self.inputs, untyped, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        inferred = onnx.shape_inference.infer_shapes(model)
        del model.graph.output[:]
        model.graph.output.extend(inferred.graph.output)
        return model

    def filled(self, like: str, value: float) -> str:
        shape = self.op("Shape", like)
        if self.gate.mask_form == "ts" and value == 1.0:
            return self.op("Expand", self.const(value, f"fill{len(self.inits)}", np.float32), shape)
        tensor = numpy_helper.from_array(np.array([value], np.float32))
        return self.op("ConstantOfShape", shape, value=tensor)


def gate_model(gate: Gate, opset: int = 17) -> onnx.ModelProto:
    """The gate as one model: outputs the weights and the indices (and the traps' extras)."""
    b = _Builder(gate)
    e = gate.experts
    axes = b.const([-1], "axes", np.int64)

    def reduce_sum(x: str, keepdims: int) -> str:  # axes as input from opset 13
        if opset >= 13:
            return str(b.op("ReduceSum", x, axes, keepdims=keepdims))
        return str(b.op("ReduceSum", x, axes=[-1], keepdims=keepdims))

    scores = b.op(gate.score, "x", **({} if gate.score == "Sigmoid" else {"axis": -1}))
    choice = scores
    cast: str | None = None
    if gate.bias_dtype is not None and gate.bias == "const":
        to = helper.np_dtype_to_tensor_dtype(np.dtype(gate.bias_dtype))
        cast = b.op("Cast", scores, to=to)
        bias = b.const(b.rng.random(e) * 0.2, "e_score_correction_bias", gate.bias_dtype)
        choice = b.op("Add", cast, bias)
    elif gate.bias == "const":
        bias = b.const(b.rng.random(e) * 0.2, "e_score_correction_bias")
        choice = b.op("Add", scores, bias)
    elif gate.bias == "input":
        b.inputs.append(helper.make_tensor_value_info("bias", b.elem, [e]))
        choice = b.op("Add", scores, "bias")
    masked = choice
    if gate.groups is not None:
        n_group, topk_group = gate.groups
        split = gate.split or (n_group, e // n_group)
        zero: dict[str, Any] = {} if gate.allowzero is None else {"allowzero": gate.allowzero}
        split_to = gate.split_shape or (-1, *split)
        grouped = b.op("Reshape", choice, b.const(list(split_to), "split", np.int64), **zero)
        top2 = b.op("TopK", grouped, b.const([2], "two", np.int64), n_out=2)[0]
        group_scores = reduce_sum(top2, 0)
        kept = b.op("TopK", group_scores, b.const([topk_group], "topk_group", np.int64),
                    n_out=2, sorted=0)[1]  # fmt: skip
        zeros, ones = b.filled(group_scores, 0.0), b.filled(kept, 1.0)
        mask = b.op("ScatterElements", zeros, kept, ones, axis=1)
        mask = b.op("Unsqueeze", mask, axes) if opset >= 13 else b.op("Unsqueeze", mask, axes=[-1])
        mask = b.op("Expand", mask, b.const([1, *split], "to_experts", np.int64))
        flat = b.const(list(gate.flat_shape or (-1, e)), "flat", np.int64)
        mask = b.op("Cast", b.op("Reshape", mask, flat, **zero), to=9)
        drop = b.op("Not", mask)
        if gate.mask_form == "ts":
            drop = b.op("Cast", drop, to=TensorProto.BOOL)
        fill_type = gate.bias_dtype if cast is not None else None
        masked = b.op("Where", drop, b.const(gate.fill, "fill", fill_type), choice)
    values, indices = b.op("TopK", masked, b.const([gate.k], "k", np.int64), n_out=2,
                           sorted=gate.sorted)  # fmt: skip
    if gate.read_choice_values:
        b.outputs.append(values)
    weights = values
    if gate.bias or gate.groups:
        source = {"scores": scores, "cast": cast or scores}.get(gate.gather_from, choice)
        weights = b.op("GatherElements", source, indices, axis=1)
    if gate.read_weights:
        b.outputs.append(weights)
    # the weights' type: float32 when gathered from the Cast of float16 scores
    w_type = gate.bias_dtype if gate.gather_from == "cast" and cast is not None else None
    if gate.renorm:
        total = reduce_sum(weights, 1)
        if gate.renorm == "eps":
            total = b.op("Add", total, b.const(gate.epsilon, "eps", w_type))
        weights = b.op("Div", weights, total)
        if gate.read_normalized:
            b.outputs.append(weights)
    if gate.scale is not None:
        weights = b.op("Mul", weights, b.const(gate.scale, "scale", w_type))
    b.outputs[:0] = [weights, indices]
    return b.model("gate", opset)


# -- Llama-4's dense router (llama4 lane) ----------------------------------------------------------


@dataclass(frozen=True)
class DenseGate:
    """Llama-4's router after its logits: TopK -> ScatterElements into a row of `fill` ->
    [Cast float32] -> Sigmoid [-> Cast back] [-> Transpose]; the defaults are the TorchScript
    form of transformers' Llama4Router (16 experts, top-1). Each trap a keyword."""

    dtype: str = "float32"
    experts: int = 16
    k: int = 1
    tokens: int | str = "N"
    fill_form: str = "ConstantOfShape"  # or "Expand" (dynamo), "logits" (a trap: no fill)
    fill: float = float("-inf")
    casts: bool = True  # Cast(float32) before the Sigmoid and back to dtype after
    cast_back: bool = True  # with casts: the Cast back after the Sigmoid
    cast_to: int = TensorProto.FLOAT  # the Cast before the Sigmoid (another type: a trap)
    transpose: bool = True
    scatter_axis: int = 1  # 0: a trap
    indices_from: str = "topk"  # "other": a second TopK's (largest=0) indices, a trap
    largest: int = 1  # 0: a trap
    read_values: bool = False  # the TopK values also a graph output (a trap)
    read_indices: bool = False  # the TopK indices also a graph output (fine)
    reduction: str | None = None  # ScatterElements reduction ("add": a trap)


def dense_gate_model(gate: DenseGate, opset: int = 14) -> onnx.ModelProto:
    """The dense router as one model: outputs the (transposed) dense scores, and the traps'
    extras."""
    b = _Builder(Gate(dtype=gate.dtype, experts=gate.experts, tokens=gate.tokens))
    k = b.const([gate.k], "k", np.int64)
    values, indices = b.op("TopK", "x", k, n_out=2, axis=1, largest=gate.largest, sorted=1)
    if gate.indices_from == "other":
        indices = b.op("TopK", "x", k, n_out=2, axis=1, largest=0)[1]
    if gate.fill_form == "logits":
        data = "x"
    elif gate.fill_form == "Expand":
        data = b.op("Expand", b.const(gate.fill, "fill"), b.op("Shape", "x"))
    else:
        tensor = numpy_helper.from_array(np.array([gate.fill], b.np))
        data = b.op("ConstantOfShape", b.op("Shape", "x"), value=tensor)
    extra: dict[str, Any] = {"reduction": gate.reduction} if gate.reduction else {}
    row = b.op("ScatterElements", data, indices, values, axis=gate.scatter_axis, **extra)
    scores = b.op("Cast", row, to=gate.cast_to) if gate.casts else row
    scores = b.op("Sigmoid", scores)
    if gate.casts and gate.cast_back:
        scores = b.op("Cast", scores, to=b.elem)
    if gate.transpose:
        scores = b.op("Transpose", scores, perm=[1, 0])
    b.outputs = [scores]
    if gate.read_values:
        b.outputs.append(values)
    if gate.read_indices:
        b.outputs.append(indices)
    return b.model("dense_gate", opset)
