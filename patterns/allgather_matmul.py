"""com.microsoft AllGather -> MatMul (-> Add bias)  =>  fuser.AllGatherMatMul.

Math. Rank r of a group of G holds the shard X_r; AllGather concatenates the shards in rank
order along `axis`, and a Linear layer follows:
    G_all = concat(X_0, ..., X_{G-1}, axis),   Y = G_all @ W (+ B)
with W (and B) constant on this rank. Tensor parallelism gathers on the hidden (last) axis,
sequence parallelism on the sequence axis; the math is the same. One fused op lets the kernel
overlap the exchange with the matmul (each arriving shard's rows, or its slice of the
contraction, can be multiplied at once). The plugin passes `reference` all shards stacked on a
new leading axis ([G, *shard], `FusedOp.collective_input`), so it concatenates them itself.

`axis`: the AllGather schema says the default is 1 but onnxruntime's shape inference and kernel
use 0 and accept no negative axis. fuser follows onnxruntime (an absent axis is 0, noted in
the report) and stores a non-negative axis, normalized against the rank of the shard as shape
inference knows it.

Refused, with the reason: AllGather without group_size (or < 1), a negative axis on a shard of
unknown rank, an axis out of range, the gathered tensor only as the right operand of its
MatMuls, a weight computed at run time (or an overridable graph input). A bias Add that does
not fit (computed at run time, broadcasting beyond [.., N], or a MatMul output read elsewhere)
is left out of the fusion, with a note, rather than refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from fuser.patterns.allgather_linears import linears
from onnx import helper, numpy_helper

from fuser.bodies import allgather_matmul as allgather_matmul_body
from fuser.fusedop import FLOAT_TYPES, Attr, Dim, FusedOp, Param, TensorInfo
from fuser.graph import GraphIndex
from fuser.pattern import Match, Rejection, rejection

NAME = "allgather_matmul"
PRIORITY = 40
MS_DOMAIN = "com.microsoft"
# onnxruntime's AllGather (shape inference and kernel) defaults to 0, not the schema's 1.
RUNTIME_DEFAULT_AXIS = 0


# -- the fused op ---------------------------------------------------------------------------------


def _infer(
    inputs: Sequence[TensorInfo | None], attrs: Mapping[str, Any]
) -> list[TensorInfo | None]:
    specs = linears(attrs, inputs)
    x = inputs[0] if inputs else None
    if x is None:
        return [None] * (len(specs) + 1)
    gathered: tuple[Dim, ...] | None = None
    if x.shape is not None:
        axis, group = int(attrs["axis"]), int(attrs["group_size"])
        dim = x.shape[axis]
        gathered = (
            *x.shape[:axis],
            dim * group if isinstance(dim, int) else None,
            *x.shape[axis + 1 :],
        )
    ys: list[TensorInfo | None] = []
    for spec in specs:
        w = inputs[spec.w] if spec.w < len(inputs) else None
        if gathered is None or w is None or w.shape is None or len(w.shape) != 2:
            ys.append(TensorInfo(x.elem_type, None))
            continue
        lead: tuple[Dim, ...] = gathered[:-1]
        if spec.flatten:
            known = all(isinstance(d, int) for d in lead)
            lead = (int(np.prod(lead, dtype=np.int64)) if known else None,)  # type: ignore[arg-type]
        n = w.shape[0] if spec.trans_b else w.shape[1]
        ys.append(TensorInfo(x.elem_type, (*lead, n)))
    return [ys[0], TensorInfo(x.elem_type, gathered), *ys[1:]]


def reference(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any]
) -> tuple[np.ndarray, ...]:
    """(Y_0, gathered, Y_1, ...): input 0 holds every rank's shard, stacked [group_size, *shard].

    A MatMul Linear's MatMul and Add are each computed in float64 and rounded to the input
    dtype, as the two original ops round their results; a Gemm Linear computes
    alpha * A @ W' + beta * b in float64 and rounds once, as one Gemm does.
    """
    shards = inputs[0]
    assert shards is not None
    gathered = np.concatenate(list(shards), axis=int(attrs["axis"]))
    dtype = gathered.dtype
    ys = []
    for spec in linears(attrs, inputs):
        w, b = inputs[spec.w], None if spec.b is None else inputs[spec.b]
        assert w is not None
        a = gathered.reshape(-1, gathered.shape[-1]) if spec.flatten else gathered
        w64 = (w.T if spec.trans_b else w).astype(np.float64)
        y64 = np.matmul(a.astype(np.float64), w64)
        if spec.gemm:
            y64 = spec.alpha * y64
            if b is not None:
                y64 = y64 + spec.beta * b.astype(np.float64)
            y = y64.astype(dtype)
        else:
            y = y64.astype(dtype)
            if b is not None:
                y = (y.astype(np.float64) + b.astype(np.float64)).astype(dtype)
        ys.append(y)
    return ys[0], gathered, *ys[1:]


ALLGATHER_MATMUL = FusedOp(
    name="AllGatherMatMul",
    doc=(
        "AllGather of the ranks' shards along axis, then every Linear (MatMul (+ bias) or Gemm) "
        "on the gathered value with a constant weight: one gather for all of them."
    ),
    inputs=(
        Param("X", "T", "this rank's shard"),
        Param(
            "weights",
            "T",
            "W_0 [K, N_0] ([N_0, K] if trans_b[0]), b_0 [N_0] (if has_bias[0]; without "
            "has_bias: iff given), W_1, ...",
            "variadic",
        ),
    ),
    outputs=(
        Param("Y", "T", "Y_0 = concat(shards, axis) @ W_0 (+ b_0); 2-D if flatten[0]"),
        Param(
            "more",
            "T",
            'gathered = concat(shards, axis) ("" unless read outside the match), then the other '
            "Linears' Y_1, Y_2, ... (one variadic tail: only the last formal output may be "
            "variadic, and the one-Linear layout (Y, gathered) is kept)",
            "variadic",
            0,
        ),
    ),
    attributes=(
        Attr("group_size", "int", "number of ranks gathered"),
        Attr("axis", "int", "gather axis, non-negative (normalized at fuse time)"),
        Attr("has_bias", "ints", "per Linear: 1 if b_i follows W_i (absent: one Linear)", []),
        Attr("flatten", "ints", "per Linear: 1 if Y_i is 2-D [prod(leading dims), N_i]", []),
        Attr("trans_b", "ints", "per Linear: 1 if W_i is stored [N_i, K] (Gemm transB)", []),
        Attr("gemm", "ints", "per Linear: 1 for a Gemm (alpha, beta; one rounding)", []),
        Attr("alpha", "floats", "per Linear: Gemm alpha", []),
        Attr("beta", "floats", "per Linear: Gemm beta", []),
    ),
    type_constraints=(("T", FLOAT_TYPES, "float tensors"),),
    infer=_infer,
    reference=reference,
    body=allgather_matmul_body.build,
    collective_input=0,
)


# -- the pattern ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    """Why a check failed, and the value at fault (becomes a Rejection)."""

    reason: str
    value: str | None


def _attr(node: onnx.NodeProto, name: str) -> Any:
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return None


def _gather_attributes(
    graph: GraphIndex, gather: onnx.NodeProto
) -> tuple[int, int, list[str]] | _Problem:
    """(group_size, non-negative axis, notes) of an AllGather, or why they cannot be known."""
    name, x = gather.name or "AllGather", gather.input[0]
    group_size = _attr(gather, "group_size")
    if group_size is None:
        return _Problem(f"AllGather '{name}' has no group_size attribute", gather.output[0])
    if int(group_size) < 1:
        return _Problem(f"AllGather '{name}' has group_size={group_size}", gather.output[0])
    notes: list[str] = []
    axis = _attr(gather, "axis")
    if axis is None:
        axis = RUNTIME_DEFAULT_AXIS
        notes.append(
            f"AllGather '{name}' has no axis: used onnxruntime's default 0 (the schema says 1)"
        )
    axis = int(axis)
    shape = graph.shape(x)
    if shape is None:
        if axis < 0:
            return _Problem(
                f"AllGather '{name}' has axis={axis} and the rank of its input '{x}' is unknown "
                "to shape inference: cannot normalize the axis (onnxruntime accepts no "
                "negative axis)",
                x,
            )
        return int(group_size), axis, notes
    rank = len(shape)
    if not -rank <= axis < rank:
        return _Problem(f"AllGather '{name}' axis={axis} is out of range for rank-{rank} '{x}'", x)
    if axis < 0:
        notes.append(f"AllGather '{name}' axis {axis} normalized to {axis % rank} (rank {rank})")
    return int(group_size), axis % rank, notes


def _weight_problem(graph: GraphIndex, matmul_id: int) -> _Problem | None:
    w = graph.node(matmul_id).input[1]
    value = graph.constant(w)
    if value is not None and value.ndim != 2:
        # The kernel multiplies the gathered rows by one [K, N] matrix on the Cube.
        return _Problem(
            f"weight '{w}' of MatMul '{graph.describe(matmul_id)}' has shape "
            f"{list(value.shape)}; AllGatherMatMul takes a 2-D [K, N] weight",
            w,
        )
    if value is not None:
        return None
    why = "an overridable graph input" if w in graph.graph_inputs else "computed at run time"
    return _Problem(
        f"weight '{w}' of MatMul '{graph.describe(matmul_id)}' is {why}; AllGatherMatMul needs "
        "a constant weight",
        w,
    )


@dataclass(frozen=True)
class _Bias:
    """The bias Add joining the fusion (or a note saying why not), and the [N] initializer
    made for a bias that broadcasts from fewer values ([] or [1])."""

    add: int | None = None
    name: str = ""
    note: str = ""
    new: tuple[onnx.TensorProto, ...] = ()


def _bias(graph: GraphIndex, matmul_id: int) -> _Bias:
    """The bias Add after the MatMul, if it can join the fusion."""
    found = _bias_add(graph, matmul_id)
    add_id, bias, note = found
    if add_id is None:
        return _Bias(note=note)
    value = graph.constant(bias)
    weight = graph.constant(graph.node(matmul_id).input[1])
    assert value is not None
    assert weight is not None
    n = int(weight.shape[-1])
    if value.size == n:
        return _Bias(add_id, bias)
    # The kernel adds one [N] row: a scalar bias is spelled out to N values (same sum).
    row = np.ascontiguousarray(np.broadcast_to(value.reshape(-1), (n,)))
    name = graph.unique_value_name(f"{graph.describe(add_id)}.bias_broadcast")
    return _Bias(add_id, name, "", (numpy_helper.from_array(row, name),))


def _bias_add(graph: GraphIndex, matmul_id: int) -> tuple[int | None, str, str]:
    """(Add id, bias name, note): the bias Add after the MatMul, if it can join the fusion."""
    y = graph.node(matmul_id).output[0]
    readers = graph.readers(y)
    adds = [r for r in readers if graph.node(r).op_type == "Add" and graph.node(r).domain == ""]
    if not adds:
        return None, "", ""
    add_id = adds[0]
    add = graph.node(add_id)
    bias = add.input[1] if add.input[0] == y else add.input[0]
    left_out = f"bias Add '{graph.describe(add_id)}' left unfused: "
    if bias == y:
        return None, "", left_out + "it adds the MatMul output to itself"
    if len(readers) > 1 or graph.is_graph_output(y):
        return None, "", left_out + f"the MatMul output '{y}' is also read elsewhere"
    value = graph.constant(bias)
    if value is None:
        return None, "", left_out + f"'{bias}' is not a constant"
    weight = graph.constant(graph.node(matmul_id).input[1])
    n = weight.shape[-1] if weight is not None and weight.ndim >= 2 else None
    y_shape = graph.shape(y)
    # A bias only adds along Y's last axis: it may not broadcast Y to a larger shape.
    fits = value.ndim == 0 or (
        all(d == 1 for d in value.shape[:-1])
        and value.shape[-1] in (1, n)
        and (value.ndim == 1 or (y_shape is not None and value.ndim <= len(y_shape)))
    )
    if not fits:
        return (
            None,
            "",
            left_out
            + (f"'{bias}' of shape {list(value.shape)} is not a bias over the last axis ({n})"),
        )
    return add_id, bias, ""


@dataclass(frozen=True)
class _Lin:
    """One Linear joining the fusion: its nodes, inputs (W (, b)), output and attributes."""

    nodes: tuple[int, ...]
    inputs: tuple[str, ...]
    output: str
    flatten: int = 0
    trans_b: int = 0
    gemm: int = 0
    alpha: float = 1.0
    beta: float = 1.0
    note: str = ""
    new: tuple[onnx.TensorProto, ...] = ()


def _is(graph: GraphIndex, node_id: int, op_type: str) -> bool:
    node = graph.node(node_id)
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def _matmul_linear(graph: GraphIndex, matmul_id: int, flatten: int) -> _Lin | _Problem:
    problem = _weight_problem(graph, matmul_id)
    if problem is not None:
        return problem
    matmul = graph.node(matmul_id)
    bias = _bias(graph, matmul_id)
    nodes = (matmul_id, *([bias.add] if bias.add is not None else []))
    return _Lin(
        nodes, (matmul.input[1], *([bias.name] if bias.name else [])),
        graph.node(nodes[-1]).output[0], flatten=flatten, note=bias.note, new=bias.new,
    )  # fmt: skip


def _gemm_linear(graph: GraphIndex, gemm_id: int, k: int | None) -> _Lin | _Problem:
    """A Gemm reading the gathered (or flattened) value as A: transA=0, constant B, and a C
    that is a bias row ([N], [1, N] or one value) or absent."""
    gemm, name = graph.node(gemm_id), graph.describe(gemm_id)
    if int(_attr(gemm, "transA") or 0):
        return _Problem(
            f"Gemm '{name}' has transA=1: it contracts the gathered rows, not the last axis "
            "AllGatherMatMul multiplies",
            gemm.input[0],
        )
    w = graph.constant(gemm.input[1])
    if w is None or w.ndim != 2:
        why = "not a constant" if w is None else f"of shape {list(w.shape)}"
        return _Problem(
            f"B '{gemm.input[1]}' of Gemm '{name}' is {why}; AllGatherMatMul needs a constant "
            "2-D weight",
            gemm.input[1],
        )
    trans_b = int(_attr(gemm, "transB") or 0)
    n, kw = (w.shape[0], w.shape[1]) if trans_b else (w.shape[1], w.shape[0])
    if k is not None and kw != k:
        return _Problem(
            f"Gemm '{name}' weight K={kw} differs from the gathered K={k}", gemm.input[1]
        )
    alpha = float(_attr(gemm, "alpha") if _attr(gemm, "alpha") is not None else 1.0)
    beta = float(_attr(gemm, "beta") if _attr(gemm, "beta") is not None else 1.0)
    c = gemm.input[2] if len(gemm.input) > 2 else ""
    inputs: tuple[str, ...] = (gemm.input[1],)
    new: tuple[onnx.TensorProto, ...] = ()
    if c:
        value = graph.constant(c)
        if value is None:
            return _Problem(f"C '{c}' of Gemm '{name}' is computed at run time", c)
        if not (value.size == 1 or (value.size == n and value.shape[-1] == n)):
            return _Problem(
                f"C '{c}' of Gemm '{name}' has shape {list(value.shape)}: not a bias row over "
                f"N={n} (AllGatherMatMul adds one [N] row to every output row)",
                c,
            )
        if value.size == n:
            inputs += (c,)
        else:  # one value: spelled out to N (the same sum)
            row = np.full((n,), value.reshape(-1)[0], value.dtype)
            bname = graph.unique_value_name(f"{name}.bias_broadcast")
            inputs += (bname,)
            new = (numpy_helper.from_array(row, bname),)
    return _Lin(
        (gemm_id,), inputs, gemm.output[0], flatten=1, trans_b=trans_b, gemm=1,
        alpha=alpha, beta=beta, new=new,
    )  # fmt: skip


def _gathered_k(graph: GraphIndex, x: str, axis: int, group_size: int) -> int | None:
    """The gathered value's last dim, from the shard's shape (the gathered value itself often
    has no value_info: onnx has no schema for AllGather)."""
    shape = graph.shape(x)
    if shape is None or not isinstance(shape[-1], int):
        return None
    return shape[-1] * (group_size if axis == len(shape) - 1 else 1)


def _reshape_problem(graph: GraphIndex, reshape_id: int, k: int | None) -> _Problem | None:
    """None if the Reshape only merges the gathered value's leading dims into rows, keeping its
    last axis: then Reshape(g) @ W is (g @ W) with the same rows, and the fused op computes it
    exactly (flatten). A Reshape that changes the last axis mixes rows (or the gathered axis)
    into the contraction: not what AllGatherMatMul computes."""
    reshape, name = graph.node(reshape_id), graph.describe(reshape_id)
    target = graph.constant(reshape.input[1]) if len(reshape.input) > 1 else None
    if target is None:
        return _Problem(
            f"Reshape '{name}' of the gathered value takes its shape at run time: cannot prove "
            "it keeps the last axis",
            reshape.input[0],
        )
    dims = [int(d) for d in target.reshape(-1)]
    if len(dims) != 2:
        return _Problem(
            f"Reshape '{name}' to {dims}: AllGatherMatMul fuses only a flatten to 2-D "
            "[rows, K] of the gathered value",
            reshape.output[0],
        )
    if k is None:
        return _Problem(
            f"Reshape '{name}' to {dims}: the last dim of the gathered value is unknown, so it "
            "cannot be proved to keep the last axis",
            reshape.input[0],
        )
    if dims[-1] != k:
        return _Problem(
            f"Reshape '{name}' to {dims} changes the last axis of the gathered value (K={k}): "
            "it mixes rows or the gathered axis into the contraction",
            reshape.output[0],
        )
    return None


@dataclass(frozen=True)
class AllGatherMatMulPattern:
    """com.microsoft AllGather -> every MatMul (gathered tensor on the left, -> Add bias), Gemm
    (transA=0) or Reshape (keeping the last axis) -> MatMul/Gemm reading the gathered value;
    anchored at the AllGather. All of them join one fused node: one gather."""

    name: str = NAME
    description: str = (
        "com.microsoft AllGather -> [Reshape ->] MatMul (-> Add bias) / Gemm, one or several "
        "(QKV) => AllGatherMatMul"
    )
    anchors: tuple[tuple[str, str], ...] = ((MS_DOMAIN, "AllGather"),)
    ops: tuple[FusedOp, ...] = (ALLGATHER_MATMUL,)

    @staticmethod
    def _through_reshape(
        graph: GraphIndex,
        reshape_id: int,
        k: int | None,
        linear: Callable[[int, int], _Lin | _Problem],
    ) -> list[_Lin] | _Problem:
        """The Linears after a Reshape of the gathered value, the Reshape joining the first;
        all or none (the Reshape cannot stay for some readers once it is fused)."""
        out = graph.node(reshape_id).output[0]
        problem = _reshape_problem(graph, reshape_id, k)
        if problem is not None:
            return problem
        inner = graph.readers(out)
        mine = [c for c in inner if (_is(graph, c, "MatMul") or _is(graph, c, "Gemm"))
                and graph.node(c).input[0] == out]  # fmt: skip
        if len(mine) != len(inner) or graph.is_graph_output(out):
            others = [graph.describe(c) for c in inner if c not in mine]
            where = "as a graph output" if not others else "by " + ", ".join(others)
            return _Problem(
                f"Reshape '{graph.describe(reshape_id)}' output '{out}' is also read {where}: "
                "its Linears left unfused",
                out,
            )
        found: list[_Lin] = []
        for c in mine:
            lin = linear(c, 1)
            if isinstance(lin, _Problem):
                return _Problem(
                    f"Reshape '{graph.describe(reshape_id)}' feeds "
                    f"'{graph.describe(c)}', which cannot join: {lin.reason}",
                    lin.value,
                )
            found.append(lin)
        first = found[0]
        found[0] = dataclasses.replace(first, nodes=(reshape_id, *first.nodes))
        return found

    def match(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None:
        gather = graph.node(node_id)
        gathered = gather.output[0]
        readers = list(dict.fromkeys(graph.readers(gathered)))  # a node reading it twice: once
        reshapes = [
            r for r in readers if _is(graph, r, "Reshape") and graph.node(r).input[0] == gathered
        ]
        consumers = [
            r
            for r in [
                *readers,
                *(c for rs in reshapes for c in graph.readers(graph.node(rs).output[0])),
            ]
            if _is(graph, r, "MatMul") or _is(graph, r, "Gemm")
        ]
        if not consumers:
            return None
        sources = {gathered, *(graph.node(r).output[0] for r in reshapes)}
        if not any(graph.node(r).input[0] in sources for r in consumers):
            first = consumers[0]
            return rejection(
                self.name, graph, [node_id, first],
                f"gathered tensor '{gathered}' is the right operand of "
                f"{graph.node(first).op_type} '{graph.describe(first)}'; AllGatherMatMul "
                "gathers the left operand",
                gathered,
            )  # fmt: skip
        found = _gather_attributes(graph, gather)
        if isinstance(found, _Problem):
            return rejection(self.name, graph, [node_id, consumers[0]], found.reason, found.value)
        group_size, axis, notes = found
        k = _gathered_k(graph, gather.input[0], axis, group_size)
        lins: list[_Lin] = []
        problems: list[tuple[int, _Problem]] = []

        def linear(r: int, flatten: int) -> _Lin | _Problem:
            if _is(graph, r, "Gemm"):
                return _gemm_linear(graph, r, k)
            return _matmul_linear(graph, r, flatten)

        for r in readers:
            if _is(graph, r, "MatMul") or _is(graph, r, "Gemm"):
                if graph.node(r).input[0] != gathered:
                    continue  # the gathered value as B: not a Linear on it (read elsewhere)
                found_lin = linear(r, 0)
                if isinstance(found_lin, _Problem):
                    problems.append((r, found_lin))
                else:
                    lins.append(found_lin)
            elif r in reshapes:
                found_lins = self._through_reshape(graph, r, k, linear)
                if isinstance(found_lins, _Problem):
                    problems.append((r, found_lins))
                else:
                    lins += found_lins
        if not lins:
            where, problem = problems[0]
            return rejection(self.name, graph, [node_id, where], problem.reason, problem.value)
        taken = {n for lin in lins for n in lin.nodes}
        others = [graph.describe(r) for r in readers if r not in taken]
        if others:
            notes.append(f"'{gathered}' is also read by {', '.join(others)}: output as 'gathered'")
        notes += [f"{graph.describe(n)} left unfused: {p.reason}" for n, p in problems]
        notes += [lin.note for lin in lins if lin.note]
        has_bias = [int(len(lin.inputs) > 1) for lin in lins]
        attributes: dict[str, Any] = {"group_size": group_size, "axis": axis}
        plain = len(lins) == 1 and not lins[0].flatten and not lins[0].gemm
        if not plain:  # the one-MatMul form keeps its attribute-free layout (X, W, B)
            attributes.update(has_bias=has_bias, flatten=[lin.flatten for lin in lins])
        if any(lin.gemm for lin in lins):
            attributes.update(
                trans_b=[lin.trans_b for lin in lins], gemm=[lin.gemm for lin in lins],
                alpha=[lin.alpha for lin in lins], beta=[lin.beta for lin in lins],
            )  # fmt: skip
        outputs = [lin.output for lin in lins]
        return Match(
            self.name, ALLGATHER_MATMUL,
            (node_id, *(n for lin in lins for n in lin.nodes)),
            (gather.input[0], *(i for lin in lins for i in lin.inputs)),
            (outputs[0], "", *outputs[1:]), attributes,
            exportable={gathered: 1}, notes=tuple(notes),
            new_initializers=tuple(t for lin in lins for t in lin.new),
        )  # fmt: skip


PATTERN = AllGatherMatMulPattern()
