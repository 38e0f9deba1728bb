"""Conv -> BatchNormalization (inference) -> activation, each of BN and activation optional
(at least one present)  =>  fuser.ConvBnRelu.

Math. Inference-mode BN is an affine map per output channel c:
    BN(y)_c = (y_c - mean_c) * scale_c / sqrt(var_c + eps) + bias_c
and Conv is linear in its weight, so with  a_c = scale_c / sqrt(var_c + eps):
    BN(Conv(x, W, B)) = Conv(x, W', B'),  W'[c] = W[c] * a_c,  B'_c = (B_c - mean_c) * a_c + bias_c.
When W, B and the four BN parameters are known at fuse time, the fused op gets W', B' and no BN
inputs (folded in float64, then cast to the weight's dtype). When any is computed at run time,
the fused op takes the BN parameters as inputs and applies BN itself in its epilogue.
The activation (`conv_activation`: Relu, Clip, LeakyRelu, HardSigmoid, HardSwish, SiLU, GELU,
Sigmoid, Tanh, in the forms `_conv_act_walk` finds), when only it reads the BN (or Conv)
output, is applied on the way out. `Identity` nodes between Conv, BN and the activation are
looked through.

Refused, with the reason: BN in training mode (training_mode=1 or extra outputs) or with
spatial=0, 3-D and higher convolutions, a weight whose rank is unknown, parameters of the wrong
size. If the BN output is read elsewhere, the activation is left out of the fusion rather than
refused, and the activation's node is a near-miss saying why; so is every activation-shaped
reader of a Conv that is not fused (PRelu, Mish, a non-constant Clip bound, ...).

ConvTranspose in place of Conv fuses the same way (`transposed=1`, its output_padding kept).
Its weight is [Cin, Cout/group, *k]: output channel (g, o) is column o of group g's rows, so
BN folds along axis 1 within each group. Refused with the reason: output_shape, and auto_pad
other than NOTSET (their pads depend on the run-time input size).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from fuser.bodies import conv_bn_relu as conv_bn_relu_body
from fuser.fusedop import FLOAT_TYPES, Attr, FusedOp, Param, TensorInfo
from fuser.graph import GraphIndex
from fuser.pattern import Match, Rejection, rejection

from . import _conv_act_walk as walk
from ._conv import conv, conv_output_spatial, conv_transpose, conv_transpose_output_spatial
from ._conv_fold import bn_epsilon, fold
from .conv_activation import Activation, apply, from_attributes

NAME = "conv_bn_relu"
PRIORITY = 10


def _infer(
    inputs: Sequence[TensorInfo | None], attrs: Mapping[str, Any]
) -> list[TensorInfo | None]:
    x, w = inputs[0], inputs[1]
    if x is None:
        return [None]
    if (
        x.shape is None
        or w is None
        or w.shape is None
        or not all(isinstance(d, int) for d in w.shape)
    ):
        return [TensorInfo(x.elem_type, None)]
    w_shape = [int(d) for d in w.shape]  # type: ignore[arg-type]
    if attrs.get("transposed", 0):
        spatial = conv_transpose_output_spatial(x.shape[2:], attrs, w_shape)
        cout = w_shape[1] * int(attrs.get("group") or 1)
        return [TensorInfo(x.elem_type, (x.shape[0], cout, *spatial))]
    spatial = conv_output_spatial(x.shape[2:], attrs, w_shape)
    return [TensorInfo(x.elem_type, (x.shape[0], w_shape[0], *spatial))]


def reference(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any]
) -> tuple[np.ndarray, ...]:
    """act(BN?(Conv(X, W, B))) with ONNX semantics, computed in float64.

    The pre-activation value is rounded to X's dtype first, as the original's Conv (or BN)
    output is; the activation is then computed in float64 and rounded once."""
    x, w, b = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
    assert x is not None
    assert w is not None
    activation = from_attributes(attrs)
    y = conv_transpose(x, w, b, attrs) if attrs.get("transposed", 0) else conv(x, w, b, attrs)
    bn = list(inputs[3:7]) if len(inputs) > 3 else []
    if any(p is not None for p in bn):
        scale, bias, mean, var = (np.asarray(p, dtype=np.float64) for p in bn)
        shape = (1, -1) + (1,) * (y.ndim - 2)
        y = (y - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + float(attrs["epsilon"]))
        y = y * scale.reshape(shape) + bias.reshape(shape)
    if activation.on_vector:
        y = y.astype(x.dtype).astype(np.float64)
    y = apply(activation, y)
    return (y.astype(x.dtype),)


CONV_BN_RELU = FusedOp(
    name="ConvBnRelu",
    doc=(
        "Conv, then inference BatchNormalization (folded or applied), then an optional "
        "activation (Relu, or `activation` with alpha/beta)."
    ),
    inputs=(
        Param("X", "T", "input, [N, C, *spatial]"),
        Param(
            "W",
            "T",
            "weight, [Cout, C/group, *kernel] (transposed: [C, Cout/group, *kernel]); "
            "BN-folded when no BN inputs",
        ),
        Param("B", "T", "bias, [Cout]", "optional"),
        Param("scale", "T", "BN scale, [Cout] (absent when folded)", "optional"),
        Param("bias", "T", "BN bias, [Cout]", "optional"),
        Param("mean", "T", "BN running mean, [Cout]", "optional"),
        Param("var", "T", "BN running variance, [Cout]", "optional"),
    ),
    outputs=(Param("Y", "T", "output, [N, Cout, *out_spatial]"),),
    attributes=(
        Attr("auto_pad", "string", "as Conv", "NOTSET"),
        Attr("dilations", "ints", "as Conv", []),
        Attr("group", "int", "as Conv", 1),
        Attr("kernel_shape", "ints", "as Conv", []),
        Attr("pads", "ints", "as Conv", []),
        Attr("strides", "ints", "as Conv", []),
        Attr("transposed", "int", "1 = the convolution is ONNX ConvTranspose", 0),
        Attr("output_padding", "ints", "as ConvTranspose (with transposed=1)", []),
        Attr("epsilon", "float", "BN epsilon (used with BN inputs)", 1e-5),
        Attr("relu", "int", "1 = apply Relu on the way out (the activation Relu)", 0),
        Attr(
            "activation",
            "string",
            "activation on the way out besides Relu: Clip, LeakyRelu, HardSigmoid, HardSwish, "
            "Silu, Gelu, GeluTanh, Sigmoid, Tanh (empty: as `relu` says)",
            "",
        ),
        Attr("alpha", "float", "Clip min, LeakyRelu / HardSigmoid / HardSwish alpha", 0.0),
        Attr("beta", "float", "Clip max, HardSigmoid / HardSwish beta", 0.0),
    ),
    type_constraints=(("T", FLOAT_TYPES, "float tensors"),),
    infer=_infer,
    reference=reference,
    body=conv_bn_relu_body.build,
)


@dataclass(frozen=True)
class ConvBnReluPattern:
    """Conv -> BatchNormalization (optional) -> activation (optional), anchored at the Conv;
    anchored at an activation-shaped op, the near-miss saying why it was left out."""

    name: str = NAME
    description: str = (
        "Conv -> BatchNormalization (inference) -> activation (Relu, Clip, LeakyRelu, "
        "HardSigmoid, HardSwish, SiLU, GELU, Sigmoid, Tanh), each optional => ConvBnRelu"
    )
    anchors: tuple[tuple[str, str], ...] = (
        ("", "Conv"),
        ("", "ConvTranspose"),
        *(("", op) for op in sorted(walk.ACTIVATION_OPS | {"Mul", "Div", "Pow"})),
    )
    ops: tuple[FusedOp, ...] = (CONV_BN_RELU,)

    def match(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None:
        node = graph.node(node_id)
        if node.op_type == "Conv":
            return self._match_conv(graph, node_id)
        if node.op_type == "ConvTranspose":
            return self._match_conv(graph, node_id)
        return self._unfused_activation(graph, node_id)

    def _match_conv(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None:
        nodes = graph.nodes
        conv_node = nodes[node_id]
        # each read of a proto's repeated field costs (~0.2 us an index): read once, as a list
        conv_in = conv_node.input[:]
        ids = [node_id]
        consumers = graph.consumers
        conv_out = conv_node.output[0]
        readers = consumers.get(conv_out, ())
        # the Identity walk only where the one reader is an Identity: it stops at once at any
        # other (`through_identity` stepping no node, a call saved per Conv)
        if len(readers) == 1 and nodes[next(iter(readers))].op_type == "Identity":
            conv_out = walk.through_identity(graph, conv_out, ids)
            readers = consumers.get(conv_out, ())
        bn_id = None
        for r in readers:  # a loop, not next(generator): a call less
            node = nodes[r]  # a standard BatchNormalization normalizing conv_out
            if (
                node.op_type == "BatchNormalization"
                and node.domain == ""
                and node.input[0] == conv_out
            ):
                bn_id = r
                break
        bn = nodes[bn_id] if bn_id is not None else None
        epsilon = 1e-5
        if bn is not None:
            ids.append(bn_id)  # type: ignore[arg-type]
            problem, epsilon = _bn_problem(graph, bn)
            if problem is not None:
                return rejection(self.name, graph, ids, *problem)
            act_in = bn.output[0]
        else:
            act_in = conv_out
        act = walk.find(graph, act_in)
        if bn is None and not isinstance(act, walk.Found):
            # A lone Conv is not this pattern; an activation left out says so at its node.
            return None
        w_name = conv_in[1]
        # `graph.shape`, its two calls inline (five lookups a match); an enclosing graph's
        # types are asked only from a subgraph, as `value_type` does
        own_type = graph.types.get
        vt = own_type(w_name) if graph.outer is None else graph.value_type(w_name)
        w_shape = None if vt is None else vt.shape
        op = conv_node.op_type
        # isinstance(d, int) for each dim, in one C loop (a generator is a call a dim)
        if w_shape is None or not all(map(int.__instancecheck__, w_shape)):
            return rejection(
                self.name,
                graph,
                ids,
                f"shape of {op} weight '{w_name}' is not known at fuse time",
                w_name,
            )
        if len(w_shape) not in (3, 4):
            return rejection(
                self.name,
                graph,
                ids,
                f"{len(w_shape) - 2}-D convolution (weight '{w_name}'); ConvBnRelu "
                "supports 1-D and 2-D",
                w_name,
            )
        attrs = {a.name: _attribute_value(a) for a in conv_node.attribute}
        transposed = op == "ConvTranspose"
        if transposed:
            refused = _transpose_problem(graph.describe(node_id), attrs)
            if refused is not None:
                return rejection(self.name, graph, ids, refused, conv_node.output[0])
            attrs["transposed"] = 1
        group = int(attrs.get("group") or 1)
        cout = int(w_shape[1]) * group if transposed else int(w_shape[0])  # type: ignore[arg-type]
        bn_params = tuple(bn.input[1:5]) if bn is not None else ()
        for param in bn_params:
            vt = own_type(param) if graph.outer is None else graph.value_type(param)
            shape = None if vt is None else vt.shape
            if shape is not None and tuple(shape) != (cout,):
                return rejection(
                    self.name,
                    graph,
                    ids,
                    f"BN parameter '{param}' has shape {list(shape)}, expected [{cout}] "
                    "(one value per Conv output channel)",
                    param,
                )
        notes: list[str] = []
        activation = Activation()
        out_value = act_in
        if isinstance(act, walk.Found):
            ids += act.nodes
            activation = act.activation
            out_value = act.out
        elif isinstance(act, walk.Refused):
            notes.append(act.reason)
        attrs.update(activation.attributes())
        if activation.name:
            notes.append(f"activation: {activation.describe()}")
        conv_b = conv_in[2] if len(conv_in) > 2 else ""
        if bn is None:
            inputs = (conv_in[0], w_name, conv_b)
            return Match(
                self.name, CONV_BN_RELU, tuple(ids), inputs, (out_value,), attrs,
                notes=tuple(notes),
            )  # fmt: skip
        # what the fold reads (W, the four BN parameters, B if any), from the inputs read above
        names = (w_name, *bn_params, conv_b) if conv_b else (w_name, *bn_params)
        folded = fold(graph, conv_node, bn, epsilon, group if transposed else 0, node_id, names)
        if isinstance(folded, tuple):
            w_new, b_new = folded
            return Match(
                self.name,
                CONV_BN_RELU,
                tuple(ids),
                (conv_in[0], w_new.name, b_new.name),
                (out_value,),
                attrs,
                new_initializers=(w_new, b_new),
                notes=tuple(notes),
            )
        x_type = graph.elem_type(conv_in[0])
        for param in bn_params:
            if graph.elem_type(param) != x_type:
                return rejection(
                    self.name,
                    graph,
                    ids,
                    f"BN parameter '{param}' is computed at run time and its dtype "
                    "differs from the Conv input's",
                    param,
                )
        attrs["epsilon"] = epsilon
        notes.append(f"BN kept as inputs: {folded}")
        inputs = (conv_in[0], w_name, conv_b, *bn_params)
        return Match(
            self.name, CONV_BN_RELU, tuple(ids), inputs, (out_value,), attrs, notes=tuple(notes)
        )

    def _unfused_activation(self, graph: GraphIndex, node_id: int) -> Rejection | None:
        """An activation-shaped node reading a Conv / BN / ConvBnRelu output that the Conv's
        match left out: the near-miss, with the reason (reported once, at its first node)."""
        node = graph.node(node_id)
        for value in dict.fromkeys(node.input[:2]):
            if not value:
                continue
            start = walk.back_through_identity(graph, value)
            producer = graph.producer_of(start)
            if producer is None or not _conv_like(graph, producer):
                continue
            found = walk.find(graph, start)
            if isinstance(found, walk.Refused) and found.head == node_id:
                return rejection(self.name, graph, [node_id], found.reason, found.value)
        return None


def _conv_like(graph: GraphIndex, node: onnx.NodeProto) -> bool:
    """A Conv, a fused ConvBnRelu, or a BatchNormalization reading a Conv's output."""
    if node.domain == "fuser":
        return node.op_type == CONV_BN_RELU.name
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in _CONVS:
        return True
    if node.op_type != "BatchNormalization":
        return False
    source = graph.producer_of(walk.back_through_identity(graph, node.input[0]))
    return source is not None and source.op_type in _CONVS and source.domain in ("", "ai.onnx")


_CONVS = ("Conv", "ConvTranspose")


def _transpose_problem(name: str, attrs: Mapping[str, Any]) -> str | None:
    """Why ConvTranspose `name` is not fused (output_shape and auto_pad are not resolved:
    their pads depend on the run-time input size), or None."""
    if attrs.get("output_shape"):
        return (
            f"ConvTranspose '{name}' gives output_shape {list(attrs['output_shape'])}: "
            "ConvBnRelu takes explicit pads only"
        )
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if auto_pad != "NOTSET":
        return (
            f"ConvTranspose '{name}' has auto_pad={auto_pad}: ConvBnRelu takes explicit pads only"
        )
    return None


_INT, _INTS = onnx.AttributeProto.INT, onnx.AttributeProto.INTS
_FLOAT, _STRING = onnx.AttributeProto.FLOAT, onnx.AttributeProto.STRING


def _attribute_value(a: onnx.AttributeProto) -> Any:
    """onnx.helper.get_attribute_value, strings decoded, with the plain types Conv and BN carry
    read directly (the helper's generality costs more than the rest of a Conv's match)."""
    kind = a.type
    if kind == _INTS:
        return a.ints[:]  # a list, made in one C call (list() iterates the field)
    if kind == _INT:
        return a.i
    if kind == _STRING:
        return a.s.decode()
    if kind == _FLOAT:
        return a.f
    value = onnx.helper.get_attribute_value(a)
    return value.decode() if isinstance(value, bytes) else value


_BN_MODES = ("training_mode", "spatial")


def _bn_problem(
    graph: GraphIndex, bn: onnx.NodeProto
) -> tuple[tuple[str, str | None] | None, float]:
    """Why `bn` cannot be fused (the reason and the value at fault), or None; and its epsilon
    (`bn_epsilon`'s: the attributes are read once for both)."""
    attrs: dict[str, Any] = {}
    epsilon: float | None = None
    for a in bn.attribute:
        name = a.name
        if name in _BN_MODES:
            attrs[name] = _attribute_value(a)
        elif name == "epsilon" and epsilon is None:
            epsilon = float(a.f)
    if epsilon is None:
        epsilon = bn_epsilon(bn)
    if attrs.get("training_mode", 0) == 1:
        return (
            f"BatchNormalization '{bn.name}' is in training mode (training_mode=1)",
            bn.output[0],
        ), epsilon
    extra = [o for o in bn.output[1:] if o]
    if extra:
        return (
            f"BatchNormalization '{bn.name}' outputs running statistics ('{extra[0]}'): "
            "training mode",
            extra[0],
        ), epsilon
    if attrs.get("spatial", 1) == 0:
        return (
            f"BatchNormalization '{bn.name}' has spatial=0 (per-activation statistics)",
            None,
        ), epsilon
    bn_in = bn.input
    if len(bn_in) < 5 or not all(bn_in[1:5]):
        why = f"BatchNormalization '{bn.name}' lacks one of scale, bias, mean, var"
        return (why, None), epsilon
    return None, epsilon


PATTERN = ConvBnReluPattern()
