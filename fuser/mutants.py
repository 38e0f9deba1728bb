"""Fused models broken on purpose at one fused node: what proves validation catches a bad fusion.

Each mutant changes one fused node and nothing else, in one family:
- `weight`: its first constant input of rank >= 2 (a Conv or MatMul weight) times 1.02;
- `bias`: its first constant rank-1 bias (Conv `B`, LayerNorm `bias`, a MatMul's `b_i`) + 0.05;
- `epsilon`: its `epsilon` where the node uses it (LayerNorm; BN not folded) times 10 plus 0.01
  (with `exact_epsilon=1`, the epsilon input the node reads instead of the attribute);
- `attribute`: a 0/1 switch of its semantics flipped (`relu`, `renormalize`).
A family that does not apply to a node makes no mutant of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from . import fusedop
from .modelio import LoadedModel, read_tensor

FAMILIES = ("weight", "bias", "epsilon", "attribute")
_SWITCHES = ("relu", "renormalize")
_BIAS_PARAMS = ("B", "bias")


@dataclass(frozen=True)
class Mutant:
    """A copy of the fused model with one node changed, and what was changed."""

    model: onnx.ModelProto
    family: str
    node: str
    op: str
    change: str


def mutants(fused: LoadedModel, families: tuple[str, ...] = FAMILIES) -> Iterator[Mutant]:
    """One mutant per applicable (fused node, family) of the main graph, in node order."""
    inits = {t.name: t for t in fused.model.graph.initializer}
    for index, node in enumerate(fused.model.graph.node):
        if node.domain != fusedop.DOMAIN:
            continue
        for family in families:
            made = _mutate(fused, index, node, family, inits)
            if made is not None:
                model, change = made
                yield Mutant(model, family, node.name, node.op_type, change)


def _param_names(node: onnx.NodeProto) -> list[str]:
    op = fusedop.get(node.op_type)
    fixed = [p.name for p in op.inputs if p.option != "variadic"]
    rest = len(node.input) - len(fixed)
    return fixed[: len(node.input)] + [f"weights[{i}]" for i in range(max(0, rest))]


def _mutate(
    fused: LoadedModel,
    index: int,
    node: onnx.NodeProto,
    family: str,
    inits: dict[str, onnx.TensorProto],
) -> tuple[onnx.ModelProto, str] | None:
    names = _param_names(node)
    attrs = {a.name: a for a in node.attribute}
    if family in ("weight", "bias"):
        for position, value in enumerate(node.input):
            tensor = inits.get(value)
            if tensor is None or position == 0:
                continue
            array = read_tensor(fused, tensor)
            if not np.issubdtype(array.dtype, np.floating):
                continue
            param = names[position] if position < len(names) else ""
            if family == "weight" and array.ndim >= 2:
                return _with_tensor(fused, index, position, array * 1.02), f"{value} x1.02"
            is_bias = param in _BIAS_PARAMS or (param.startswith("weights[") and array.ndim == 1)
            if family == "bias" and array.ndim == 1 and is_bias:
                return _with_tensor(fused, index, position, array + 0.05), f"{value} +0.05"
        return None
    if family == "epsilon" and "epsilon" in {a.name for a in fusedop.get(node.op_type).attributes}:
        if node.op_type == "ConvBnRelu" and (len(node.input) < 4 or not node.input[3]):
            return None  # BN folded into W and B: epsilon is not used
        if node.op_type == "SoftmaxTopK" and (
            "renormalize" not in attrs or not attrs["renormalize"].i
        ):
            return None  # epsilon is the renormalization's: unused without it
        if "exact_epsilon" in attrs and attrs["exact_epsilon"].i and node.input[-1] in inits:
            # epsilon is the trailing input (a double float32 cannot hold): that is changed
            value = read_tensor(fused, inits[node.input[-1]])
            changed = value * 10 + 0.01
            model = _with_tensor(fused, index, len(node.input) - 1, changed)
            return (
                model,
                f"epsilon {float(value.reshape(-1)[0]):g} -> {float(changed.reshape(-1)[0]):g}",
            )
        old = attrs["epsilon"].f if "epsilon" in attrs else 1e-5
        new = old * 10 + 0.01
        model = _copy(fused)
        _set_attribute(model.graph.node[index], onnx.helper.make_attribute("epsilon", new))
        return model, f"epsilon {old:g} -> {new:g}"
    if family == "attribute":
        order = attrs["order"].s.decode() if "order" in attrs else ""
        for switch in _SWITCHES:
            if switch == "renormalize" and order == "topk_softmax":
                continue  # a softmax over the k values sums to 1 already: no change
            if switch in {a.name for a in fusedop.get(node.op_type).attributes}:
                old_i = attrs[switch].i if switch in attrs else 0
                model = _copy(fused)
                attr = onnx.helper.make_attribute(switch, 1 - old_i)
                _set_attribute(model.graph.node[index], attr)
                return model, f"{switch} {old_i} -> {1 - old_i}"
    return None


def _copy(fused: LoadedModel) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(fused.model)
    return model


def _set_attribute(node: onnx.NodeProto, attr: onnx.AttributeProto) -> None:
    kept = [a for a in node.attribute if a.name != attr.name]
    del node.attribute[:]
    node.attribute.extend([*kept, attr])


def _with_tensor(
    fused: LoadedModel, index: int, position: int, array: np.ndarray
) -> onnx.ModelProto:
    """The model with the node's input `position` replaced by a new initializer `array`."""
    model = _copy(fused)
    node = model.graph.node[index]
    old = node.input[position]
    name = f"{old}__mutant"
    source = next(t for t in model.graph.initializer if t.name == old)
    model.graph.initializer.append(
        numpy_helper.from_array(
            np.asarray(array, dtype=array.dtype).astype(
                onnx.helper.tensor_dtype_to_np_dtype(source.data_type)
            ),
            name,
        )
    )
    node.input[position] = name
    return model
