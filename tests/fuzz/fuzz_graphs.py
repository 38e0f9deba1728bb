"""Seeded generator of trap graphs: every fusion family, in surroundings that try to break it.

`make_case(seed)` builds one small ONNX model from one seed (numpy's Generator, so the same seed
gives the same model on any machine). It plants one or two fusion families:

    conv_bn_relu      Conv -> BatchNormalization (-> Relu)
    conv_act          Conv (-> BatchNormalization) (-> Identity) -> an activation in one of
                      the forms exporters write (Clip with constant / CastLike / run-time
                      bounds, LeakyRelu, HardSigmoid, HardSwish op or x * HardSigmoid(x),
                      x * Sigmoid(x), the erf GELU, Sigmoid, Tanh, PRelu, Softplus)
    ln_op             LayerNormalization (opset 17+) -> MatMul(s) (-> Add bias) / Reshape -> Gemm
    ln_decomposed     ReduceMean/Sub/Pow|Mul/ReduceMean/Add/Sqrt/Div|Reciprocal (-> Mul/Add)
    softmax_topk      Softmax -> TopK (-> renormalize), with an optional Cast between
    topk_softmax      TopK -> Softmax
    allgather_matmul  com.microsoft AllGather -> MatMul (-> Add bias), run on 2 ranks
    allgather_linears AllGather -> several MatMuls (QKV) / Reshape -> MatMul|Gemm / Gemm, 2 ranks
    sigmoid_gate      Sigmoid (+ selection bias) (-> DeepSeek-V3 group limit) -> TopK ->
                      GatherElements of the scores (-> renormalize), or TopK -> Sigmoid

and surrounds them with traps: internal values read elsewhere (a Relu, a Shape, a ReduceSum) or
made graph outputs; constants as initializer, Constant node, constant subgraph (a Cast of a
Constant), overridable initializer or plain graph input; weights shared between instances;
parameters that broadcast ([1, K], [1], []); attributes at odd values (strides, dilations, pads,
auto_pad, groups, epsilons from 0 to 0.5, LN axis, stash_type, TopK largest/sorted, Gemm
transB/alpha/beta, AllGather axis absent or negative, Softmax axis); opsets 11-18; float16,
float32 and float64; symbolic dims; the family inside an If branch or a Loop body; and decoy
values or nodes named as fuser names what it creates (`<conv>.W_bn_folded`, ...), in the same
graph, an enclosing one or a subgraph.

Traps added after the seeds' cases were fixed (a group split written [0, g, -1], a float32
bias on float16 scores) draw from a side stream, and families added after them (`dense_gate`)
join the pool only with the later traps: `make_case(seed, later_traps=False)` is the case a
seed gave before them.

The generator writes what it planted into `Case.planted`; what fuser actually fuses may be less
(refusals are expected on many traps). The checks are in `fuzz_check.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FAMILIES = (
    "conv_bn_relu",
    "ln_op",
    "ln_decomposed",
    "softmax_topk",
    "topk_softmax",
    "allgather_matmul",
    "conv_act",
    "allgather_linears",
)
# fused-op pattern name of each planted family
PATTERN_OF = {
    "conv_bn_relu": "conv_bn_relu",
    "ln_op": "layernorm_matmul",
    "ln_decomposed": "layernorm_matmul",
    "softmax_topk": "softmax_topk",
    "topk_softmax": "softmax_topk",
    "allgather_matmul": "allgather_matmul",
    "conv_act": "conv_bn_relu",
    "allgather_linears": "allgather_matmul",
}
GATHERING = ("allgather_matmul", "allgather_linears")  # run on GROUP ranks, alone
DTYPES = (np.float32, np.float16, np.float64)
GROUP = 2  # ranks of an allgather case


@dataclass
class InputSpec:
    """How to feed one graph input: `role` is activation (the input sets apply), positive
    (BN variance and such), bool (an If condition) or param (any values)."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    role: str


@dataclass
class Case:
    """One generated model and how to run it."""

    seed: int
    model: onnx.ModelProto
    inputs: list[InputSpec]
    group_size: int
    planted: list[str]
    traps: list[str]
    # outputs whose order along the last axis ONNX leaves open (from a TopK with sorted=0)
    unordered: frozenset[str] = frozenset()


@dataclass
class _Scope:
    """Nodes, initializers and outputs of one graph being built (main graph or a subgraph)."""

    serial: int = 0  # which scope (weights are shared within one scope only)
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


class Builder:
    """Builds one case: names, constants, traps; subgraphs share the name counter."""

    def __init__(self, seed: int, later_traps: bool = True) -> None:
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.dtype: Any = DTYPES[int(self.rng.choice(3, p=[0.6, 0.3, 0.1]))]
        self.elem = helper.np_dtype_to_tensor_dtype(np.dtype(self.dtype))
        self.opset = int(self.rng.integers(11, 19))
        self.symbolic = bool(self.rng.random() < 0.5)
        self.counter = 0
        self.main = _Scope()
        self.scope = self.main
        self.inputs: list[InputSpec] = []
        self.graph_inputs: list[onnx.ValueInfoProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self.traps: list[str] = []
        self.planted: list[str] = []
        self.decoys: list[str] = []  # names fuser may want for what it creates
        self.shared: dict[tuple[int, ...], str] = {}  # a weight reused by a later instance
        self.unsorted_topk = False  # the family being built has a TopK with sorted=0
        self.unordered: set[str] = set()
        # traps added after the main stream was fixed draw from their own stream, so that
        # every seed keeps its case without them (`make_case(seed, later_traps=False)`: the
        # regressions named by seed)
        self.side = np.random.default_rng([seed, 1]) if later_traps else None

    # -- names and nodes -----------------------------------------------------------------------

    def name(self, base: str) -> str:
        self.counter += 1
        return f"{base}{self.counter}"

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def later(self, p: float) -> bool:
        """A later trap's chance (from the side stream; never without later traps)."""
        return self.side is not None and bool(self.side.random() < p)

    def pick(self, options: list[Any] | tuple[Any, ...]) -> Any:
        return options[int(self.rng.integers(len(options)))]

    def node(
        self, op: str, inputs: list[str], n_out: int = 1, name: str = "", **attrs: Any
    ) -> list[str]:
        base = name or self.name(op.lower())
        outs = [f"{base}_out{i}" if n_out > 1 else f"{base}_out" for i in range(n_out)]
        domain = "com.microsoft" if op == "AllGather" else ""
        kept = {k: v for k, v in attrs.items() if v is not None}
        self.scope.nodes.append(
            helper.make_node(op, inputs, outs, name=base, domain=domain, **kept)
        )
        return outs

    def one(self, op: str, inputs: list[str], name: str = "", **attrs: Any) -> str:
        return self.node(op, inputs, 1, name, **attrs)[0]

    # -- inputs and constants ------------------------------------------------------------------

    def dim(self, size: int, symbol: str) -> int | str:
        """A symbolic dim of its own per input (inputs of different families differ in size)."""
        return f"{symbol}{self.counter}" if self.symbolic else size

    def graph_input(self, shape: list[int], dims: list[int | str], role: str, dtype: Any) -> str:
        name = self.name("in")
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        self.graph_inputs.append(helper.make_tensor_value_info(name, elem, dims))
        self.inputs.append(InputSpec(name, tuple(shape), dtype, role))
        return name

    def activation(self, shape: list[int], symbols: list[str | None] | None = None) -> str:
        """A graph input of the case's dtype; dims listed in `symbols` may be symbolic."""
        symbols = symbols or [None] * len(shape)
        dims = [self.dim(s, sym) if sym else s for s, sym in zip(shape, symbols, strict=True)]
        return self.graph_input(shape, dims, "activation", self.dtype)

    def const(self, array: np.ndarray, base: str, *, allow_input: bool = True,
              role: str = "param") -> str:  # fmt: skip
        """`array` as one of the ways a graph holds a constant (or a run-time input)."""
        modes = ["init"] * 5 + ["constant"] * 2 + ["subgraph"]
        if allow_input:
            modes += ["overridable", "input"]
        mode = self.pick(modes)
        name = self.name(base)
        if mode == "init" or (mode == "overridable" and self.scope is not self.main):
            self.scope.inits.append(numpy_helper.from_array(array, name))
        elif mode == "constant":
            value = numpy_helper.from_array(array, name + "_t")
            self.scope.nodes.append(helper.make_node("Constant", [], [name], value=value))
        elif mode == "subgraph":  # Cast(Constant(float64)) to the dtype: a folded cone
            wide = numpy_helper.from_array(array.astype(np.float64), name + "_t")
            self.scope.nodes.append(helper.make_node("Constant", [], [name + "_w"], value=wide))
            elem = helper.np_dtype_to_tensor_dtype(array.dtype)
            self.scope.nodes.append(helper.make_node("Cast", [name + "_w"], [name], to=elem))
        elif mode == "overridable":  # an initializer also listed as a graph input
            self.main.inits.append(numpy_helper.from_array(array, name))
            self.graph_inputs.append(
                helper.make_tensor_value_info(
                    name, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape)
                )
            )
        else:  # a graph input fed at run time (always in the main graph)
            elem = helper.np_dtype_to_tensor_dtype(array.dtype)
            self.graph_inputs.append(helper.make_tensor_value_info(name, elem, list(array.shape)))
            self.inputs.append(InputSpec(name, tuple(array.shape), array.dtype, role))
        self.traps.append(f"{base}:{mode}")
        return name

    def weight(self, shape: tuple[int, ...], base: str, scale: float | None = None) -> str:
        """A weight, sometimes the same tensor as an earlier one of that shape (shared)."""
        key = (*shape, self.elem, self.scope.serial)
        if key in self.shared and self.chance(0.4):
            self.traps.append("shared weight")
            return self.shared[key]
        fan = shape[0] if shape else 1
        array = self.rng.standard_normal(shape) * (scale or 1 / np.sqrt(max(fan, 1)))
        name = self.const(array.astype(self.dtype), base)
        self.shared[key] = name
        return name

    # -- traps ---------------------------------------------------------------------------------

    def expose(self, value: str, p: float = 0.15) -> None:
        """Maybe make an internal value escape: a graph output, or read by another node."""
        if not self.chance(p):
            return
        how = self.pick(["output", "relu", "shape", "reduce"])
        self.traps.append(f"{value} read: {how}")
        if how == "output":
            self.scope.outputs.append(value)
        elif how == "relu":
            self.scope.outputs.append(self.one("Relu", [value]))
        elif how == "shape":
            self.scope.outputs.append(self.one("Shape", [value]))
        else:
            self.scope.outputs.append(self.one("ReduceSum", [value], keepdims=1))

    def decoy(self, name: str) -> None:
        """Remember a name fuser may pick for what it creates; `finish` defines it somewhere."""
        self.decoys.append(name)


# -- families ------------------------------------------------------------------------------------


def conv_bn_relu(b: Builder) -> None:
    rank = 1 if b.chance(0.3) else 2
    cin = int(b.rng.integers(1, 5))
    group = 1
    cout = int(b.rng.integers(1, 6))
    if b.chance(0.25) and cin > 1:
        group = cin
        cout = cin * int(b.rng.integers(1, 3))
    spatial = [int(b.rng.integers(2, 8)) for _ in range(rank)]
    kernel = [int(b.rng.integers(1, min(4, s) + 1)) for s in spatial]
    batch = int(b.rng.integers(1, 3))
    x = b.activation([batch, cin, *spatial], ["batch", None, *(["h", "w"][:rank])])
    attrs: dict[str, Any] = {}
    if b.chance(0.4):
        attrs["strides"] = [int(b.rng.integers(1, 3)) for _ in range(rank)]
    if b.chance(0.3):
        attrs["dilations"] = [int(b.rng.integers(1, 3)) for _ in range(rank)]
        # dilated kernel must fit the input
        attrs["dilations"] = [
            d if (k - 1) * d + 1 <= s else 1
            for d, k, s in zip(attrs["dilations"], kernel, spatial, strict=True)
        ]
    pad_mode = b.pick(["none", "pads", "SAME_UPPER", "SAME_LOWER", "VALID"])
    if pad_mode == "pads":  # begins then ends, each below the kernel size
        attrs["pads"] = [int(b.rng.integers(0, k)) for k in (*kernel, *kernel)]
    elif pad_mode != "none":
        attrs["auto_pad"] = pad_mode
        attrs.pop("dilations", None)  # SAME with dilation: keep it simple and valid
    if group > 1:
        attrs["group"] = group
    attrs["kernel_shape"] = kernel if b.chance(0.5) else None
    w = b.weight((cout, cin // group, *kernel), "W")
    ins = [x, w]
    if b.chance(0.5):
        ins.append(b.weight((cout,), "B", scale=1.0))
    name = b.name("conv")
    b.decoy(f"{name}.W_bn_folded")
    b.decoy(f"{name}.B_bn_folded")
    y = b.one("Conv", ins, name=name, **attrs)
    b.expose(y)
    bn_params = [
        b.const(b.rng.uniform(0.5, 2, cout).astype(b.dtype), "scale"),
        b.const(b.rng.standard_normal(cout).astype(b.dtype), "bias"),
        b.const(b.rng.standard_normal(cout).astype(b.dtype), "mean"),
        b.const(b.rng.uniform(0.3, 2, cout).astype(b.dtype), "var", role="positive"),
    ]
    eps = b.pick([None, 1e-5, 1e-3, 1e-12, 0.5])
    training = 1 if b.opset >= 14 and b.chance(0.05) else None  # then 3 outputs
    bn = b.node(
        "BatchNormalization", [y, *bn_params], 3 if training else 1, epsilon=eps,
        momentum=b.pick([None, 0.1, 0.99]), training_mode=training,
    )[0]  # fmt: skip
    b.expose(bn)
    out = b.one("Relu", [bn]) if b.chance(0.6) else bn
    b.scope.outputs.append(out)


def _linears(b: Builder, n: str, lead: list[int], k: int, flat_ok: bool) -> None:
    """1-3 consumers of the normalized value: MatMul (+ Add bias) or Reshape -> Gemm."""
    for _ in range(int(b.rng.integers(1, 4))):
        n_out = int(b.rng.integers(1, 6))
        if flat_ok and b.chance(0.25):
            target = b.const(np.array([-1, k], np.int64), "shape", allow_input=False)
            flat = b.one("Reshape", [n, target])
            trans_b = int(b.chance(0.5))
            w = b.weight((n_out, k) if trans_b else (k, n_out), "W")
            gname = b.name("gemm")
            b.decoy(f"{gname}.W_folded")
            b.decoy(f"{gname}.bias_folded")
            ins = [flat, w]
            if b.chance(0.6):
                bshape = b.pick([(n_out,), (1,), (1, n_out)])
                ins.append(b.weight(bshape, "C", scale=1.0))
            y = b.one(
                "Gemm", ins, name=gname, transB=trans_b,
                alpha=b.pick([None, 1.0, 0.5, -2.0]), beta=b.pick([None, 1.0, 0.25]),
            )  # fmt: skip
            b.scope.outputs.append(y)
            continue
        w = b.weight((k, n_out), "W")
        if b.chance(0.15):  # LN -> Reshape keeping the shape -> MatMul (GPT-2's lm_head form)
            b.traps.append("reshape before matmul")
            keep = np.array([0] * len(lead) + [k], np.int64)
            n = b.one("Reshape", [n, b.const(keep, "same_shape", allow_input=False)])
        mname = b.name("matmul")
        b.decoy(f"{mname}.bias")
        y = b.one("MatMul", [n, w], name=mname)
        if b.chance(0.6):
            b.expose(y)
            bshape = b.pick([(n_out,), (n_out,), (1,), (), (1, n_out)])
            bias = b.weight(bshape, "b", scale=1.0)
            y = b.one("Add", [y, bias] if b.chance(0.5) else [bias, y])
        b.scope.outputs.append(y)


def _ln_shape(b: Builder) -> tuple[list[int], list[str | None]]:
    k = int(b.pick([1, 3, 4, 7, 8, 12]))
    if b.chance(0.5):
        lead = [int(b.rng.integers(1, 3)), int(b.rng.integers(1, 5))]
        return [*lead, k], ["batch", "seq", None]
    return [int(b.rng.integers(1, 6)), k], ["batch", None]


def _gamma_shape(b: Builder, k: int, rank: int, up: int) -> tuple[int, ...]:
    """gamma's or beta's shape: [K] or [1, K]; with K = 1 sometimes [up], which broadcasts
    the normalized value up to `up` (one `up` per LayerNorm, so gamma and beta agree)."""
    options: list[tuple[int, ...]] = [(k,), (k,), (k,), (1, k)]
    if k == 1:
        options.append((up,))
    shape = b.pick(options)
    return shape if len(shape) <= rank else (k,)


def ln_op(b: Builder) -> None:
    shape, symbols = _ln_shape(b)
    k = shape[-1]
    x = b.activation(shape, symbols)
    axis = -1 if b.chance(0.8) else b.pick([len(shape) - 1, -2 if len(shape) > 1 else -1])
    scale = b.weight((k,) if axis in (-1, len(shape) - 1) else tuple(shape[axis:]), "g", 1.0)
    ins = [x, scale]
    if b.chance(0.7):
        ins.append(b.weight((k,) if len(ins) and axis in (-1, len(shape) - 1)
                            else tuple(shape[axis:]), "beta", 1.0))  # fmt: skip
    eps = b.pick([None, 1e-5, 1e-12, 0.0, 0.5, 1e-6])
    name = b.name("ln")
    n = b.one(
        "LayerNormalization", ins, name=name, axis=None if axis == -1 else axis, epsilon=eps,
        stash_type=b.pick([None, 1, 0]),
    )  # fmt: skip
    b.expose(n, 0.25)
    _linears(b, n, shape[:-1], k, flat_ok=True)


def ln_decomposed(b: Builder) -> None:
    shape, symbols = _ln_shape(b)
    k = shape[-1]
    x = b.activation(shape, symbols)
    axes = [-1] if b.chance(0.85) else [len(shape) - 1]

    def mean(v: str) -> str:
        keep = None if b.chance(0.9) else 1
        if b.opset >= 18:
            ax = b.const(np.array(axes, np.int64), "axes", allow_input=False)
            return b.one("ReduceMean", [v, ax], keepdims=keep)
        return b.one("ReduceMean", [v], axes=axes, keepdims=keep)

    mu = mean(x)
    b.expose(mu, 0.08)
    d = b.one("Sub", [x, mu])
    b.expose(d, 0.08)
    if b.chance(0.5):
        sq = b.one("Pow", [d, b.const(np.array(2.0, b.dtype), "two", allow_input=False)])
    else:
        sq = b.one("Mul", [d, d])
    var = mean(sq)
    b.expose(var, 0.08)
    eps_value = b.pick([1e-5, 1e-12, 1e-6, 0.5, 0.0])
    eps = b.const(np.array(eps_value, b.dtype).reshape(b.pick([(), (1,)])), "eps")
    var_eps = b.one("Add", [var, eps] if b.chance(0.5) else [eps, var])
    if b.chance(0.25):  # Sqrt written as Pow(v, 0.5); sometimes another exponent (a near-miss)
        half = b.pick([0.5, 0.5, 0.5, 0.25])
        std = b.one("Pow", [var_eps, b.const(np.array(half, b.dtype), "half", allow_input=False)])
    else:
        std = b.one("Sqrt", [var_eps])
    reciprocal = b.chance(0.3)  # d * Reciprocal(std), else d / std
    n = b.one("Mul", [d, b.one("Reciprocal", [std])]) if reciprocal else b.one("Div", [d, std])
    widths = [k]
    up = int(b.rng.integers(2, 5))
    if b.chance(0.8):
        shape_g = _gamma_shape(b, k, len(shape), up)
        widths.append(shape_g[-1])
        gamma = b.weight(shape_g, "g", 1.0)
        n = b.one("Mul", [n, gamma] if b.chance(0.5) else [gamma, n])
        if b.chance(0.8):
            shape_b = _gamma_shape(b, k, len(shape), up)
            widths.append(shape_b[-1])
            beta = b.weight(shape_b, "beta", 1.0)
            n = b.one("Add", [n, beta] if b.chance(0.5) else [beta, n])
    b.expose(n, 0.25)
    # gamma or beta may have broadcast the last dim up: the Linears then see that width
    k_out = max(k, *widths)
    _linears(b, n, shape[:-1], k_out, flat_ok=k_out == k)


def _softmax(b: Builder, v: str, rank: int) -> str:
    if b.opset < 13:
        axis = b.pick([rank - 1, -1]) if b.chance(0.85) else None  # None: default 1
    else:
        axis = b.pick([None, -1, rank - 1]) if b.chance(0.9) else 0
    return b.one("Softmax", [v], axis=axis)


def _topk(b: Builder, v: str, shape: list[int]) -> tuple[str, str]:
    rank = len(shape)
    axis = b.pick([None, -1, rank - 1]) if b.chance(0.95) else 0
    k = int(b.rng.integers(1, shape[0 if axis == 0 else -1] + 1))
    kname = b.const(np.array([k], np.int64), "k", allow_input=False)
    largest = None if b.chance(0.9) else 0
    sorted_ = None if b.chance(0.85) else 0
    b.unsorted_topk |= sorted_ == 0
    vals, idx = b.node("TopK", [v, kname], 2, axis=axis, largest=largest, sorted=sorted_)
    return vals, idx


def _row_shape(b: Builder) -> tuple[list[int], list[str | None]]:
    n = int(b.pick([2, 3, 4, 5, 8, 9]))
    if b.chance(0.5):
        return [int(b.rng.integers(1, 4)), int(b.rng.integers(1, 4)), n], ["batch", "seq", None]
    return [int(b.rng.integers(1, 6)), n], ["batch", None]


def softmax_topk(b: Builder) -> None:
    shape, symbols = _row_shape(b)
    x = b.activation(shape, symbols)
    p = _softmax(b, x, len(shape))
    b.expose(p, 0.2)
    if b.chance(0.15) and b.dtype == np.float16:
        p = b.one("Cast", [p], to=TensorProto.FLOAT)
    vals, idx = _topk(b, p, shape)
    b.scope.outputs.append(idx)
    if b.chance(0.4):
        b.expose(vals, 0.15)
        if b.opset >= 13:
            ax = b.const(np.array([-1], np.int64), "axes", allow_input=False)
            total = b.one("ReduceSum", [vals, ax], keepdims=b.pick([None, 1]))
        else:
            total = b.one("ReduceSum", [vals], axes=[-1], keepdims=b.pick([None, 1]))
        vals = b.one("Div", [vals, total])
    b.scope.outputs.append(vals)


def topk_softmax(b: Builder) -> None:
    shape, symbols = _row_shape(b)
    x = b.activation(shape, symbols)
    vals, idx = _topk(b, x, shape)
    b.expose(vals, 0.2)
    b.scope.outputs.append(idx)
    b.scope.outputs.append(_softmax(b, vals, len(shape)))


def allgather_matmul(b: Builder) -> None:
    rank = 2 if b.chance(0.6) else 3
    shard = [int(b.rng.integers(1, 4)) for _ in range(rank - 1)] + [int(b.rng.integers(1, 6))]
    x = b.activation(shard, [None] * rank)
    axis = b.pick([None, 0, -1, rank - 1, 1 if rank == 3 else 0])
    gathered = list(shard)
    gathered[0 if axis is None else axis % rank] *= GROUP
    name = b.name("allgather")
    g = b.one("AllGather", [x], name=name, group_size=GROUP, axis=axis)
    b.value_info.append(helper.make_tensor_value_info(g, b.elem, gathered))
    b.expose(g, 0.15)
    k = gathered[-1]
    n_out = int(b.rng.integers(1, 6))
    wshape = (k, n_out) if b.chance(0.9) else (gathered[0], k, n_out)
    y = b.one("MatMul", [g, b.weight(wshape, "W")])
    if b.chance(0.6):
        b.expose(y, 0.1)
        add = b.name("add")
        b.decoy(f"{add}.bias_broadcast")
        bias = b.weight(b.pick([(n_out,), (1,), (), (1, n_out)]), "b", scale=1.0)
        y = b.one("Add", [y, bias], name=add)
    b.scope.outputs.append(y)


# -- conv_act: Conv (+BN) + activation forms (issue 8) -------------------------------------------


def _act_scalar(b: Builder, value: float, base: str) -> str:
    """A one-value constant of the case's dtype (any of the ways a graph holds one)."""
    return b.const(np.array(value, b.dtype), base)


def _activation_form(b: Builder, x: str) -> str:
    """One activation of `x`, in a form exporters write (or one fuser must refuse)."""
    forms = ["clip", "leaky", "hardsigmoid", "silu", "gelu", "sigmoid", "tanh", "hs_mul",
             "prelu", "softplus"]  # fmt: skip
    if b.opset >= 14:
        forms.append("hardswish")
    form = b.pick(forms)
    b.traps.append(f"activation:{form}")
    if form == "clip":
        lo, hi = b.pick([(0.0, 6.0), (-1.0, 1.0), (None, 2.0), (0.5, None)])
        bounds = []
        for value, what in ((lo, "lo"), (hi, "hi")):
            if value is None:
                bounds.append("")
            elif b.opset >= 15 and b.chance(0.4):  # the dynamo exporter's CastLike(bound, x)
                b.traps.append("castlike bound")
                bound = b.const(np.array(value, np.float32), what)
                bounds.append(b.one("CastLike", [bound, x]))
            else:
                bounds.append(_act_scalar(b, value, what))
        while bounds and bounds[-1] == "":
            bounds.pop()
        return b.one("Clip", [x, *bounds])
    if form == "leaky":
        return b.one("LeakyRelu", [x], alpha=b.pick([None, 0.01, 0.2, 1.5]))
    if form == "hardsigmoid":
        return b.one("HardSigmoid", [x], alpha=b.pick([None, 0.3]), beta=b.pick([None, 0.4]))
    if form == "hardswish":
        return b.one("HardSwish", [x])
    if form == "hs_mul":
        h = b.one("HardSigmoid", [x], alpha=1 / 6, beta=0.5)
        return b.one("Mul", b.pick([[x, h], [h, x]]))
    if form == "silu":
        s = b.one("Sigmoid", [x])
        b.expose(s, 0.1)
        return b.one("Mul", b.pick([[x, s], [s, x]]))
    if form == "gelu":
        d = b.one("Div", [x, _act_scalar(b, float(np.sqrt(2.0)), "sqrt2")])
        e = b.one("Erf", [d])
        p = b.one("Add", [e, _act_scalar(b, 1.0, "one")])
        m = b.one("Mul", [x, p])
        return b.one("Mul", [m, _act_scalar(b, 0.5, "half")])
    if form == "prelu":
        return b.one("PRelu", [x, _act_scalar(b, 0.1, "slope")])
    if form == "softplus":
        return b.one("Softplus", [x])
    return b.one("Sigmoid" if form == "sigmoid" else "Tanh", [x])


def conv_act(b: Builder) -> None:
    cin = int(b.rng.integers(1, 5))
    cout = int(b.rng.integers(1, 6))
    group = 1
    if b.chance(0.25) and cin > 1:
        group, cout = cin, cin
    spatial = [int(b.rng.integers(3, 8)) for _ in range(2)]
    x = b.activation([int(b.rng.integers(1, 3)), cin, *spatial], ["batch", None, "h", "w"])
    attrs: dict[str, Any] = {"pads": [1, 1, 1, 1], "group": group if group > 1 else None}
    ins = [x, b.weight((cout, cin // group, 3, 3), "W")]
    if b.chance(0.5):
        ins.append(b.weight((cout,), "B", scale=1.0))
    name = b.name("conv")
    b.decoy(f"{name}.W_bn_folded")
    b.decoy(f"{name}.B_bn_folded")
    y = b.one("Conv", ins, name=name, **attrs)
    if b.chance(0.2):
        b.traps.append("identity after conv")
        y = b.one("Identity", [y])
    if b.chance(0.6):
        params = [
            b.const(b.rng.uniform(0.5, 2, cout).astype(b.dtype), "scale"),
            b.const(b.rng.standard_normal(cout).astype(b.dtype), "bias"),
            b.const(b.rng.standard_normal(cout).astype(b.dtype), "mean"),
            b.const(b.rng.uniform(0.3, 2, cout).astype(b.dtype), "var", role="positive"),
        ]
        y = b.one("BatchNormalization", [y, *params], epsilon=b.pick([None, 1e-3]))
        if b.chance(0.2):
            b.traps.append("identity after bn")
            y = b.one("Identity", [y])
    b.expose(y, 0.2)  # the activation's input read elsewhere
    b.scope.outputs.append(_activation_form(b, y))


# -- allgather_linears (lane tp): the forms tensor/sequence-parallel exports write -------------


def allgather_linears(b: Builder) -> None:
    """One gathered value read by several Linears, through a Reshape, or by a Gemm; traps: no
    value_info on the gathered value, a Reshape that changes the last axis or goes to rank 3, a
    Gemm with transA, a C per row, alpha/beta, weights as graph inputs, the gathered value or
    the Reshape output read elsewhere."""
    rank = 2 if b.chance(0.5) else 3
    shard = [int(b.rng.integers(1, 4)) for _ in range(rank - 1)] + [2 * int(b.rng.integers(1, 4))]
    x = b.activation(shard, [None] * rank)
    axis = b.pick([0, rank - 1, *([1] if rank == 3 else [])])
    gathered = list(shard)
    gathered[axis] *= GROUP
    g = b.one("AllGather", [x], name=b.name("allgather"), group_size=GROUP, axis=axis)
    # Else no value_info, as exporters write it (onnx has no AllGather schema). Shape inference
    # then stops at g: the values after it are typed here (the full check needs outputs typed).
    typed = b.chance(0.5)

    def out(value: str, shape: list[int], *, expose: float = 0.0) -> str:
        b.value_info.append(helper.make_tensor_value_info(value, b.elem, shape))
        if expose:
            b.expose(value, expose)
        else:
            b.scope.outputs.append(value)
        return value

    if typed:
        out(g, gathered, expose=0.15)
    elif b.chance(0.15):
        out(g, gathered)
    k, rows = gathered[-1], int(np.prod(gathered[:-1]))
    form = b.pick(["several", "reshape", "gemm"] if rank == 2 else ["several", "reshape"])
    if form == "several":
        for _ in range(int(b.rng.integers(2, 4))):
            n = int(b.rng.integers(1, 6))
            y = b.one("MatMul", [g, b.weight((k, n), "W")])
            if b.chance(0.5):
                y = b.one("Add", [y, b.weight(b.pick([(n,), (1,), (1, n)]), "b", scale=1.0)])
            out(y, [*gathered[:-1], n])
        return
    a = g
    if form == "reshape":
        target = b.pick([[-1, k], [-1, k], [rows, k], [-1, k // 2], [1, -1, k]])
        a = b.one("Reshape", [g, b.const(np.array(target, np.int64), "shape", allow_input=False)])
        size = rows * k
        k = target[-1]
        shape = [1, size // k, k] if len(target) == 3 else [size // k, k]
        b.value_info.append(helper.make_tensor_value_info(a, b.elem, shape))
        b.expose(a, 0.1)
        if len(target) == 3:
            out(b.one("MatMul", [a, b.weight((k, 3), "W")]), [*shape[:-1], 3])
            return
        rows = size // k
    n = int(b.rng.integers(1, 6))
    if form == "reshape" and b.chance(0.5):
        out(b.one("MatMul", [a, b.weight((k, n), "W")]), [rows, n])
        return
    trans_a, trans_b = int(b.chance(0.1)), int(b.chance(0.7))
    m_, k_ = (k, rows) if trans_a else (rows, k)
    ins = [a, b.weight((n, k_) if trans_b else (k_, n), "W")]
    c = b.pick([(n,), (1, n), (1,), None, (m_, n)])
    if c is not None:
        ins.append(b.weight(c, "C", scale=1.0))
    attrs: dict[str, Any] = {"transA": trans_a or None, "transB": trans_b}
    if b.chance(0.4):
        attrs.update(alpha=float(b.pick([0.5, 2.0])), beta=float(b.pick([0.0, 1.5])))
    out(b.one("Gemm", ins, **attrs), [m_, n])


BUILDERS: dict[str, Callable[[Builder], None]] = {
    "conv_bn_relu": conv_bn_relu,
    "ln_op": ln_op,
    "ln_decomposed": ln_decomposed,
    "softmax_topk": softmax_topk,
    "topk_softmax": topk_softmax,
    "allgather_matmul": allgather_matmul,
    "conv_act": conv_act,
    "allgather_linears": allgather_linears,
}


# -- gating lane: MoE gates beyond softmax (DeepSeek-V3 sigmoid + bias + groups, TopK -> Sigmoid)


def _axes_op(b: Builder, op: str, v: str, **attrs: Any) -> str:
    """ReduceSum/Unsqueeze over the last axis: axes as input from opset 13, attribute before."""
    if b.opset >= 13:
        return b.one(op, [v, b.const(np.array([-1], np.int64), "axes", allow_input=False)], **attrs)
    return b.one(op, [v], axes=[-1], **attrs)


def _group_limit(b: Builder, choice: str, e: int, dtype: Any) -> str:
    """DeepSeek-V3's group limit as the TorchScript exporter writes it (Expand of ones, Cast ->
    Not -> Cast) or dynamo (ConstantOfShape of ones, Not); mask value -inf or 0."""
    g = int(b.pick([d for d in (2, 3, 4, 6) if e % d == 0 and e // d >= 2]))
    # the group split as exporters write it: [-1, g, E/g], or keeping the token dim (0)
    # with the group size or the group count inferred (-1)
    form = [-1, g, e // g]
    if b.later(0.5):
        form = [0, g, -1] if b.later(0.5) else [0, g, e // g]
        b.traps.append(f"group split {form}")
    split = b.const(np.array(form, np.int64), "split", allow_input=False)
    top2 = b.node(
        "TopK",
        [
            b.one("Reshape", [choice, split]),
            b.const(np.array([2], np.int64), "two", allow_input=False),
        ],
        2,
    )[0]
    scores = _axes_op(b, "ReduceSum", top2, keepdims=0)
    kept = b.node(
        "TopK",
        [
            scores,
            b.const(
                np.array([int(b.rng.integers(1, g + 1))], np.int64), "topk_group", allow_input=False
            ),
        ],
        2,
        sorted=0,
    )[1]
    zeros = b.one("ConstantOfShape", [b.one("Shape", [scores])])
    one = numpy_helper.from_array(np.ones(1, np.float32))
    ones = b.one("ConstantOfShape", [b.one("Shape", [kept])], value=one)
    mask = _axes_op(b, "Unsqueeze", b.one("ScatterElements", [zeros, kept, ones], axis=1))
    mask = b.one("Expand", [mask, b.const(np.array([1, g, e // g], np.int64), "to_experts",
                                          allow_input=False)])  # fmt: skip
    flat = b.const(np.array([0, -1] if b.later(0.3) else [-1, e], np.int64), "flat",
                   allow_input=False)  # fmt: skip
    drop = b.one("Not", [b.one("Cast", [b.one("Reshape", [mask, flat])], to=TensorProto.BOOL)])
    if b.chance(0.5):
        drop = b.one("Cast", [drop], to=TensorProto.BOOL)
    fill = np.array(b.pick([-np.inf, 0.0]), dtype=dtype)
    b.traps.append(f"group limit {g}")
    return b.one("Where", [drop, b.const(fill, "fill", allow_input=False), choice])


def sigmoid_gate(b: Builder) -> None:
    """Sigmoid scores [-> Cast float32] [+ bias] [-> group limit] -> TopK (k up to E) ->
    GatherElements of the scores [-> renormalize (+ eps)] [-> Mul scale]; or TopK -> Sigmoid.
    Traps: a bias as graph input or overridable, the scores / choice / weights read elsewhere,
    ties (a zero or repeated bias), sorted=0, k = E."""
    e = int(b.pick([8, 12, 16]))
    tokens = int(b.rng.integers(1, 6))
    x = b.activation([tokens, e], ["tokens", None])
    if b.chance(0.2):  # Llama-4 style: top-k of the logits, then their sigmoid
        vals, idx = _topk(b, x, [tokens, e])
        b.scope.outputs += [idx, b.one("Sigmoid", [vals])]
        return
    scores = b.one("Sigmoid", [x])
    dtype = b.dtype
    if b.dtype == np.float16 and b.chance(0.3):
        scores, dtype = b.one("Cast", [scores], to=TensorProto.FLOAT), np.float32
    b.expose(scores, 0.1)
    choice, cdtype = scores, dtype
    if b.chance(0.8):
        bias = b.pick([np.zeros(e), np.repeat(b.rng.random(e // 2), 2), b.rng.random(e) * 0.2])
        biased = scores
        if dtype == np.float16 and b.later(0.4):
            # a float32 bias on float16 scores: the choice in float32, the weights gathered
            # from the float16 scores
            biased, cdtype = b.one("Cast", [scores], to=TensorProto.FLOAT), np.float32
            b.traps.append("float32 bias on float16 scores")
        choice = b.one("Add", [biased, b.const(bias.astype(cdtype), "bias")])
        b.expose(choice, 0.1)
    if choice == scores or b.chance(0.6):
        choice = _group_limit(b, choice, e, cdtype) if b.opset >= 11 else choice
    k = int(b.pick([1, 2, e // 2, e]))
    sorted_ = None if b.chance(0.7) else 0
    b.unsorted_topk |= sorted_ == 0
    kname = b.const(np.array([k], np.int64), "k", allow_input=False)
    idx = b.node("TopK", [choice, kname], 2, sorted=sorted_)[1]
    b.scope.outputs.append(idx)
    w = b.one("GatherElements", [scores, idx], axis=b.pick([1, -1]))
    b.expose(w, 0.15)
    if b.chance(0.6):
        total = _axes_op(b, "ReduceSum", w, keepdims=1)
        if b.chance(0.5):
            eps = b.pick([1e-20, 1e-6, 0.01])
            total = b.one("Add", [total, b.const(np.array(eps, dtype), "eps")])
        w = b.one("Div", [w, total])
    if b.chance(0.5):
        w = b.one("Mul", [w, b.const(np.array(b.pick([2.5, 1.0, 16.0]), dtype), "scale")])
    b.scope.outputs.append(w)


FAMILIES += ("sigmoid_gate",)
PATTERN_OF["sigmoid_gate"] = "softmax_topk"
BUILDERS["sigmoid_gate"] = sigmoid_gate


# -- llama4 lane: Llama-4's dense router (TopK -> ScatterElements into a fill -> Sigmoid) --------


def dense_gate(b: Builder) -> None:
    """TopK (largest, k up to E, sorted or not: the scatter undoes the order) ->
    ScatterElements into ConstantOfShape / Expand(fill, Shape(x)) -> [Cast float32] ->
    Sigmoid [-> Cast back] [-> Transpose]; rows [T, E] or [B, S, E]. Traps: fills -inf, 0,
    -1e4, +inf; the TopK values or the scattered row read elsewhere; indices of another TopK
    (largest=0); a scatter with a reduction (opset 16+); largest=0; the fill tensor shared."""
    e = int(b.pick([5, 8, 15, 16]))
    if b.chance(0.3):
        shape, symbols = [int(b.rng.integers(1, 4)), int(b.rng.integers(1, 4)), e], [
            "batch", "seq", None]  # fmt: skip
    else:
        shape, symbols = [int(b.rng.integers(1, 6)), e], ["tokens", None]
    rank = len(shape)
    x = b.activation(shape, symbols)
    k = int(b.pick([1, 1, 2, e]))
    kname = b.const(np.array([k], np.int64), "k", allow_input=False)
    largest = None if b.chance(0.92) else 0
    axis = b.pick([None, -1, rank - 1])
    sorted_ = b.pick([None, 0])
    vals, idx = b.node("TopK", [x, kname], 2, axis=axis, largest=largest, sorted=sorted_)
    if b.chance(0.08):
        idx = b.node("TopK", [x, kname], 2, axis=axis, largest=0)[1]
        b.traps.append("dense: indices of another TopK")
    b.expose(vals, 0.08)
    fill = float(b.pick([-np.inf, -np.inf, -np.inf, 0.0, -1e4, np.inf]))
    shape_of = b.one("Shape", [x])
    if b.chance(0.5):
        value = numpy_helper.from_array(np.array([fill], b.dtype))
        data = b.one("ConstantOfShape", [shape_of], value=value)
    else:
        scalar = b.const(np.array(fill, b.dtype), "fill", allow_input=False)
        data = b.one("Expand", [scalar, shape_of])
    b.expose(data, 0.05)
    b.traps.append(f"dense fill {fill}")
    reduction = None
    if b.opset >= 16 and b.chance(0.08):
        reduction = b.pick(["add", "mul"] + (["max", "min"] if b.opset >= 18 else []))
        b.traps.append(f"dense scatter reduction {reduction}")
    row = b.one("ScatterElements", [data, idx, vals], axis=b.pick([-1, rank - 1]),
                reduction=reduction)  # fmt: skip
    b.expose(row, 0.05)
    casts = b.chance(0.5)
    scores = b.one("Cast", [row], to=TensorProto.FLOAT) if casts else row
    scores = b.one("Sigmoid", [scores])
    if casts and b.chance(0.8):
        scores = b.one("Cast", [scores], to=b.elem)
    if b.chance(0.5):
        perm = list(range(rank))[::-1]
        scores = b.one("Transpose", [scores], perm=perm)
    b.scope.outputs.append(scores)
    if b.chance(0.2):  # the indices of a sorted=0 TopK come in an order ONNX leaves open
        b.scope.outputs.append(idx)
        b.unsorted_topk |= sorted_ == 0


FAMILIES += ("dense_gate",)
#: Families added after the seeds' cases were fixed: `make_case(seed, later_traps=False)`
#: leaves them out of the pool, so that a seed keeps the case it gave before them.
LATER_FAMILIES = frozenset({"dense_gate"})
PATTERN_OF["dense_gate"] = "softmax_topk"
BUILDERS["dense_gate"] = dense_gate


# -- placement: main graph, If branch, Loop body -------------------------------------------------


def _in_subgraph(b: Builder, family: str, kind: str) -> None:
    """Build `family` inside an If (both branches: the second a renamed copy) or a Loop body."""
    outer = b.scope
    inner = _Scope(serial=b.counter + 1)
    b.scope = inner
    BUILDERS[family](b)
    b.scope = outer
    typed = _infer_outputs(b, inner, list(dict.fromkeys(inner.outputs)))
    outs = [v.name for v in typed]
    if kind == "if":
        then = helper.make_graph(inner.nodes, b.name("then"), [], typed, inner.inits)
        other = _renamed(then, f"_e{b.counter}")
        cond = b.graph_input([], [], "bool", np.bool_)
        results = b.node("If", [cond], len(outs), then_branch=then, else_branch=other)
    else:
        it, cond_in = b.name("iter"), b.name("cond")
        cond_out = b.name("cond_out")
        nodes = [helper.make_node("Identity", [cond_in], [cond_out]), *inner.nodes]
        body = helper.make_graph(
            nodes,
            b.name("body"),
            [
                helper.make_tensor_value_info(it, TensorProto.INT64, []),
                helper.make_tensor_value_info(cond_in, TensorProto.BOOL, []),
            ],
            [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []), *typed],
            inner.inits,
        )
        trips = b.const(np.array(2, np.int64), "trips", allow_input=False)
        results = b.node("Loop", [trips, ""], len(outs), body=body)
    outer.outputs.extend(results)
    b.traps.append(f"{family} in {kind}")


def _infer_outputs(b: Builder, inner: _Scope, outs: list[str]) -> list[onnx.ValueInfoProto]:
    """Types of a subgraph's outputs: shape inference on its nodes as a graph of their own,
    with the main graph's inputs and initializers (all a family's subgraph reads outside)."""
    graph = helper.make_graph(
        inner.nodes, "probe", b.graph_inputs, [_untyped(o) for o in outs],
        [*b.main.inits, *inner.inits], value_info=b.value_info,
    )  # fmt: skip
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", b.opset)])
    inferred = onnx.shape_inference.infer_shapes(probe)
    known = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.output)}
    _type_outputs(probe.graph, known)
    _rank_unknown_outputs(probe, b)
    return list(probe.graph.output)


def _untyped(name: str) -> onnx.ValueInfoProto:
    """A subgraph output: its type is filled in by shape inference in `finish`."""
    return onnx.ValueInfoProto(name=name)


def _renamed(graph: onnx.GraphProto, suffix: str) -> onnx.GraphProto:
    """A copy of `graph` whose own values and nodes carry `suffix` (SSA across branches)."""
    out = copy.deepcopy(graph)
    own = {t.name for t in out.initializer} | {o for n in out.node for o in n.output}
    rename = {name: name + suffix for name in own if name}
    for t in out.initializer:
        t.name = rename.get(t.name, t.name)
    for n in out.node:
        n.name = n.name + suffix if n.name else n.name
        n.input[:] = [rename.get(i, i) for i in n.input]
        n.output[:] = [rename.get(o, o) for o in n.output]
    for o in out.output:
        o.name = rename.get(o.name, o.name)
    out.name = graph.name + suffix
    return out


def _define_decoys(b: Builder, rng: np.random.Generator) -> None:
    """Define some decoy names: in the main graph, or inside a small If of the main graph."""
    src = next((s.name for s in b.inputs if s.role == "activation"), None)
    if src is None:
        return
    for name in b.decoys:
        if rng.random() >= 0.3:
            continue
        if rng.random() < 0.5:
            b.main.nodes.append(helper.make_node("Neg", [src], [name], name=name + "_node"))
            b.main.outputs.append(name)
        else:
            body = helper.make_graph(
                [helper.make_node("Neg", [src], [name])], b.name("decoy"), [], [_untyped(name)]
            )
            cond = b.graph_input([], [], "bool", np.bool_)
            other = _renamed(body, "_e")
            b.main.outputs.extend(b.node("If", [cond], 1, then_branch=body, else_branch=other))
        b.traps.append(f"decoy {name}")


def make_case(seed: int, later_traps: bool = True) -> Case:
    """The case of `seed`: one model, its inputs, the ranks it runs on (without the traps
    added later, the case the seed gave before them)."""
    b = Builder(seed, later_traps)
    if b.chance(0.12):
        families = [b.pick(GATHERING)]
    else:
        pool = [
            f for f in FAMILIES if f not in GATHERING and (later_traps or f not in LATER_FAMILIES)
        ]
        if b.opset < 17:
            pool.remove("ln_op")
        if b.dtype == np.float64:  # onnxruntime's CPU provider has no double Conv
            pool.remove("conv_bn_relu")
            pool.remove("conv_act")
        families = [b.pick(pool) for _ in range(1 if b.chance(0.7) else 2)]
    for family in families:
        b.planted.append(family)
        where = "main"
        if family not in GATHERING:
            where = b.pick(["main"] * 6 + ["if", "loop"])
        before = len(b.main.outputs)
        b.unsorted_topk = False
        if where == "main":
            BUILDERS[family](b)
        else:
            _in_subgraph(b, family, where)
        if b.unsorted_topk:
            b.unordered.update(b.main.outputs[before:])
    _define_decoys(b, b.rng)
    model = _finish(b)
    return Case(
        seed,
        model,
        b.inputs,
        GROUP if set(families) & set(GATHERING) else 1,
        b.planted,
        b.traps,
        frozenset(b.unordered),
    )


def _finish(b: Builder) -> onnx.ModelProto:
    """The model, with every output typed from shape inference (the full check needs it)."""
    outputs = list(dict.fromkeys(b.main.outputs))
    graph = helper.make_graph(
        b.main.nodes,
        f"fuzz{b.seed}",
        b.graph_inputs,
        [_untyped(o) for o in outputs],
        b.main.inits,
        value_info=b.value_info,
    )
    opsets = [helper.make_opsetid("", b.opset)]
    if any(n.domain == "com.microsoft" for n in b.main.nodes):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v for v in (*b.value_info, *inferred.graph.value_info)}
    known |= {v.name: v for v in inferred.graph.output if v.type.HasField("tensor_type")}
    _type_outputs(model.graph, known)
    _rank_unknown_outputs(model, b)
    return model


def _rank_unknown_outputs(model: onnx.ModelProto, b: Builder) -> None:
    """Outputs shape inference gave no rank (a Reshape to a computed shape, say): the rank
    from one onnxruntime run, every dim symbolic (the full check needs a shape field)."""
    missing = [o for o in model.graph.output if not o.type.tensor_type.HasField("shape")]
    if not missing:
        return
    import onnxruntime

    feeds = {
        s.name: (np.array(True) if s.role == "bool" else np.ones(s.shape, s.dtype))
        for s in b.inputs
    }
    try:
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        sess = onnxruntime.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        names = [o.name for o in sess.get_outputs()]
        ranks = {n: np.asarray(v).ndim for n, v in zip(names, sess.run(None, feeds), strict=True)}
    except Exception:  # not runnable (say, a collective): such outputs are dropped
        ranks = {}
    for out in missing:
        if out.name in ranks:
            shape = out.type.tensor_type.shape
            shape.SetInParent()
            for i in range(ranks[out.name]):
                shape.dim.add().dim_param = f"{out.name}_d{i}"
    kept = [o for o in model.graph.output if o.type.tensor_type.HasField("shape")]
    del model.graph.output[:]
    model.graph.output.extend(kept)


def _type_outputs(graph: onnx.GraphProto, known: dict[str, onnx.ValueInfoProto]) -> None:
    for out in graph.output:
        info = known.get(out.name)
        if info is not None and info.type.HasField("tensor_type"):
            out.type.CopyFrom(info.type)


# -- gateforms lane: grouped gates as real exports spell them -------------------------------------
# Not in FAMILIES (every seed keeps its case): `make_gate_forms_case(seed)` plants this family
# alone, judged by tests/fuzz/test_gate_forms_fuzz.py.


def gate_forms(b: Builder) -> None:
    """Sigmoid [-> view Reshape [-1, E] / [0, E]] [-> Cast(float32) + float32 bias | + bias] ->
    group limit with the split [0, g, -1] / [0, g, E/g] / [-1, g, E/g] / [0, -1, E/g] (allowzero
    0 or 1 from opset 14), the mask expanded to a constant or to Concat(tokens, g, E/g) computed
    at run time, the flatten [0, -1] / [-1, E] / [0, E] -> TopK -> GatherElements of the scores
    (before or after the Cast) [-> renormalize, float16 sums in float32 as dynamo writes them].
    Traps (each an original that runs): the token count written as a constant dim 0 (fused only
    when the tokens are static), allowzero=1 on shapes without a 0, a float32 bias Cast from
    float64 scores, the Cast read elsewhere. (allowzero=1 with a 0 fails in the original: a
    pattern test.)"""
    e = int(b.pick([8, 12, 16]))
    tokens = int(b.rng.integers(1, 6))
    x = b.activation([tokens, e], ["tokens", None])
    scores = b.one("Sigmoid", [x])
    allowzero = int(b.chance(0.3)) if b.opset >= 14 else None

    def zero(shape: list[int]) -> dict[str, int]:  # allowzero=1 only where no 0 is copied
        return {} if allowzero is None else {"allowzero": allowzero * int(0 not in shape)}

    shaped = scores
    if b.chance(0.2):  # the view scores.view(bsz * seq_len, -1) as a constant
        view = b.pick([[-1, e], [0, e], [0, -1]])
        shaped = b.one("Reshape", [scores, b.const(np.array(view, np.int64), "view",
                                                   allow_input=False)], **zero(view))  # fmt: skip
        b.traps.append(f"view {view} allowzero {allowzero}")
    choice, cdtype, cast = shaped, b.dtype, None
    if b.dtype != np.float32 and b.chance(0.5):
        cast = b.one("Cast", [shaped], to=TensorProto.FLOAT)
        choice, cdtype = cast, np.float32
        b.traps.append(f"float32 bias on {np.dtype(b.dtype).name} scores")
        b.expose(cast, 0.1)
    if b.chance(0.85):
        bias = b.rng.random(e) * 0.2
        choice = b.one("Add", [choice, b.const(bias.astype(cdtype), "bias", allow_input=False)])
    g = int(b.pick([d for d in (2, 3, 4, 6) if e % d == 0 and e // d >= 2]))
    split = b.pick([[0, g, -1], [0, g, e // g], [-1, g, e // g], [0, -1, e // g]])
    if b.chance(0.1):  # the token count as a constant: right when the tokens are static
        split = [tokens, g, -1]
    b.traps.append(f"group split {split} allowzero {allowzero}")
    grouped = b.one("Reshape", [choice, b.const(np.array(split, np.int64), "split",
                                                allow_input=False)], **zero(split))  # fmt: skip
    two = b.const(np.array([2], np.int64), "two", allow_input=False)
    top2 = b.node("TopK", [grouped, two], 2)[0]
    gs = _axes_op(b, "ReduceSum", top2, keepdims=0)
    top = np.array([int(b.rng.integers(1, g + 1))], np.int64)
    kept = b.node("TopK", [gs, b.const(top, "topk_group", allow_input=False)], 2, sorted=0)[1]
    zeros = b.one("ConstantOfShape", [b.one("Shape", [gs])])
    ones = b.one("ConstantOfShape", [b.one("Shape", [kept])],
                 value=numpy_helper.from_array(np.ones(1, np.float32)))  # fmt: skip
    mask = _axes_op(b, "Unsqueeze", b.one("ScatterElements", [zeros, kept, ones], axis=1))
    if b.chance(0.3):  # expand(bsz * seq_len, g, E/g): a shape computed at run time
        first = b.const(np.array([0], np.int64), "zero", allow_input=False)
        rows = b.one("Gather", [b.one("Shape", [x]), first], axis=0)
        size = b.const(np.array([g, e // g], np.int64), "to_groups", allow_input=False)
        to = b.one("Concat", [rows, size], axis=0)
        b.traps.append("expand to a run-time shape")
    else:
        to = b.const(np.array([1, g, e // g], np.int64), "to_experts", allow_input=False)
    mask = b.one("Expand", [mask, to])
    flat = b.pick([[0, -1], [-1, e], [0, e]])
    b.traps.append(f"flatten {flat}")
    flat_name = b.const(np.array(flat, np.int64), "flat", allow_input=False)
    keep = b.one("Cast", [b.one("Reshape", [mask, flat_name], **zero(flat))], to=TensorProto.BOOL)
    fill = np.array(b.pick([-np.inf, 0.0]), dtype=cdtype)
    masked = b.one("Where", [b.one("Not", [keep]), b.const(fill, "fill", allow_input=False),
                             choice])  # fmt: skip
    k = int(b.pick([1, 2, e // 2, e]))
    sorted_ = None if b.chance(0.7) else 0
    b.unsorted_topk |= sorted_ == 0
    idx = b.node("TopK", [masked, b.const(np.array([k], np.int64), "k", allow_input=False)], 2,
                 sorted=sorted_)[1]  # fmt: skip
    b.scope.outputs.append(idx)
    source = scores if cast is None or b.chance(0.7) else cast
    w = b.one("GatherElements", [source, idx], axis=1)
    wdtype = np.float32 if source == cast else b.dtype
    if b.chance(0.6):
        if wdtype == np.float16 and b.chance(0.5):  # dynamo: the float16 sum in float32
            total32 = _axes_op(b, "ReduceSum", b.one("Cast", [w], to=TensorProto.FLOAT),
                               keepdims=1)  # fmt: skip
            total = b.one("Cast", [total32], to=TensorProto.FLOAT16)
            b.traps.append("float16 sum in float32")
        else:
            total = _axes_op(b, "ReduceSum", w, keepdims=1)
        w = b.one("Div", [w, total])
    b.scope.outputs.append(w)


PATTERN_OF["gate_forms"] = "softmax_topk"
BUILDERS["gate_forms"] = gate_forms


def make_gate_forms_case(seed: int) -> Case:
    """A case planting the `gate_forms` family alone (in the main graph)."""
    b = Builder(seed)
    b.planted.append("gate_forms")
    gate_forms(b)
    if b.unsorted_topk:
        b.unordered.update(b.main.outputs)
    return Case(seed, _finish(b), b.inputs, 1, b.planted, b.traps, frozenset(b.unordered))
