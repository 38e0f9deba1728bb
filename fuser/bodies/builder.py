"""What a function body builder gets and gives, and the helpers every builder shares.

A fused op's body is the original chain in standard ONNX ops, as a model-local FunctionProto
in domain `fuser`. One FunctionProto cannot branch on an attribute, so each structural variant
of an op (Relu or not, BN folded or applied, which MatMuls have a bias, the TopK order, ...)
gets its own body, told apart by the function's `overload` (ONNX IR 10): the fused node keeps
its op type and says which body it means in `NodeProto.overload`. Everything a standard op can
take as an attribute (Conv's pads, BN's epsilon, TopK's sorted, ...) is passed by reference
(`ref_attr_name`), so one body serves every node of its variant.

Bodies use the model's own opset (the checker requires a function's imports to agree with the
model's), so the helpers here write each op in the form that opset defines (axes as attribute
or input, Constant by reference only from opset 12). Where an opset cannot take a value by
reference, the value is written into the body and becomes part of the variant's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

if TYPE_CHECKING:
    from ..fusedop import FusedOp

# onnx AttributeProto type per FusedOp attribute kind
ATTR_TYPES = {
    "int": onnx.AttributeProto.INT,
    "float": onnx.AttributeProto.FLOAT,
    "string": onnx.AttributeProto.STRING,
    "ints": onnx.AttributeProto.INTS,
    "floats": onnx.AttributeProto.FLOATS,
}


class BodyError(ValueError):
    """The op's variant cannot be written in standard ops at this opset (says why)."""


@dataclass(frozen=True)
class BodyRequest:
    """One fused node, as far as its body depends on it."""

    op: FusedOp
    attributes: Mapping[str, Any]  # every declared attribute, defaults filled in
    inputs: tuple[bool, ...]  # per node input position: present (not "")
    outputs: tuple[bool, ...]  # per node output position: present
    input_types: tuple[int, ...]  # TensorProto element type per input position (0: unknown)
    opset: int  # the model's default-domain opset, which the body must use
    domains: Mapping[str, int] = field(default_factory=dict)  # the model's other imports

    def has_input(self, position: int) -> bool:
        return position < len(self.inputs) and self.inputs[position]


@dataclass(frozen=True)
class Body:
    """A body: formal inputs/outputs (positional, as the node's), nodes, what it references."""

    variant: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[onnx.NodeProto, ...]
    references: tuple[str, ...]  # fused-op attributes the body reads by reference
    domains: tuple[tuple[str, int], ...] = ()  # opsets besides the default one


BodyBuilder = Callable[[BodyRequest], Body]


class BodyGraph:
    """Collects a body's nodes; names internal values `t0, t1, ...` (function-local)."""

    def __init__(self, request: BodyRequest) -> None:
        self.request = request
        self.opset = request.opset
        self.nodes: list[onnx.NodeProto] = []
        self.references: set[str] = set()
        self.variant: list[str] = []  # parts of the variant name, in order
        self._kinds = {a.name: a.kind for a in request.op.attributes}
        self._count = 0

    def _fresh(self) -> str:
        self._count += 1
        return f"t{self._count - 1}"

    def node(
        self,
        op_type: str,
        inputs: Sequence[str],
        *,
        out: str | Sequence[str] | None = None,
        n_out: int = 1,
        domain: str = "",
        refs: Mapping[str, str] | None = None,
        **attrs: Any,
    ) -> list[str]:
        """Append a node; `refs` maps the node's attribute to the fused op's attribute it reads."""
        if out is None:
            outputs = [self._fresh() for _ in range(n_out)]
        else:
            outputs = [out] if isinstance(out, str) else list(out)
        node = helper.make_node(op_type, list(inputs), outputs, domain=domain or None, **attrs)
        for name, source in (refs or {}).items():
            node.attribute.append(self.reference(name, source))
        self.nodes.append(node)
        return outputs

    def op(self, op_type: str, *inputs: str, out: str | None = None, **kw: Any) -> str:
        """One-output `node`, returning the output name."""
        return self.node(op_type, inputs, out=out, **kw)[0]

    def reference(self, name: str, source: str) -> onnx.AttributeProto:
        self.references.add(source)
        return onnx.AttributeProto(
            name=name, ref_attr_name=source, type=ATTR_TYPES[self._kinds[source]]
        )

    def constant(self, value: Any, dtype: Any = np.int64) -> str:
        return self.op("Constant", value=onnx.numpy_helper.from_array(np.asarray(value, dtype)))

    def scalar(self, source: str) -> str:
        """A scalar tensor holding the fused op's int or float attribute `source`: a Constant
        reading it by reference (opset 12+), or its value written in (named in the variant)."""
        kind = self._kinds[source]
        if self.opset >= 12:
            field_name = "value_int" if kind == "int" else "value_float"
            return self.node("Constant", [], refs={field_name: source})[0]
        value = self.request.attributes[source]
        self.variant.append(f"{source}{value!r}")
        return self.constant(value, np.int64 if kind == "int" else np.float32)

    def one_d(self, scalar: str) -> str:
        """[value] from a scalar (Reshape: the same op in every opset)."""
        return self.op("Reshape", scalar, self.constant([1]))

    def reduce(self, op_type: str, x: str, axes: Sequence[int], *, since: int) -> str:
        """Reduce*(x, axes, keepdims=1); axes move from attribute to input at opset `since`."""
        if self.opset >= since:
            return self.op(op_type, x, self.constant(list(axes)), keepdims=1)
        return self.op(op_type, x, axes=list(axes), keepdims=1)

    def build(
        self,
        inputs: Sequence[str],
        outputs: Sequence[str],
        *extra: str,
        domains: Sequence[tuple[str, int]] = (),
    ) -> Body:
        """The Body; `extra` are variant name parts given by the builder (structure first).

        A node may omit trailing optional inputs and outputs, and onnxruntime binds a node to a
        function position by position and wants no more outputs than the node has: formal
        parameters past the node's count are dropped (an omitted input reads as absent, an
        omitted output stays internal), and what was dropped is named in the variant.
        """
        n_in, n_out = len(self.request.inputs), len(self.request.outputs)
        dropped_inputs = set(inputs[n_in:])
        for node in self.nodes:
            for i, name in enumerate(node.input):
                if name in dropped_inputs:
                    node.input[i] = ""
        dropped = [*inputs[n_in:], *outputs[n_out:]]
        parts = [*extra, *self.variant, *(f"no{name}" for name in dropped)]
        return Body(
            variant="_".join(p for p in parts if p) or "default",
            inputs=tuple(inputs[:n_in]),
            outputs=tuple(outputs[:n_out]),
            nodes=tuple(self.nodes),
            references=tuple(sorted(self.references)),
            domains=tuple(domains),
        )


def dtype_name(elem_type: int) -> str:
    """float16, float, double, ... (the short name variants carry)."""
    return helper.tensor_dtype_to_np_dtype(elem_type).name if elem_type else "unknown"


def linears(
    g: BodyGraph,
    n: str,
    has_bias: Sequence[int],
    flatten: Sequence[int],
    inputs: list[str],
    outputs: list[str],
) -> list[str]:
    """The variadic Linears of a normalization + MatMul body: per Linear i, `[Flatten(-1)] ->
    MatMul(W_i) [-> Add(b_i)]` into `Y_i`, its inputs and output appended to `inputs` and
    `outputs`; returns the overload name parts (`mm`, `b` bias, `f` flattened) in order."""
    parts = []
    for i, (bias, flat_i) in enumerate(zip(has_bias, flatten, strict=True)):
        inputs.append(f"W_{i}")
        a = g.op("Flatten", n, axis=-1) if flat_i else n
        y = g.op("MatMul", a, f"W_{i}", out=None if bias else f"Y_{i}")
        if bias:
            inputs.append(f"b_{i}")
            g.op("Add", y, f"b_{i}", out=f"Y_{i}")
        outputs.append(f"Y_{i}")
        parts.append("mm" + ("b" if bias else "") + ("f" if flat_i else ""))
    return parts
