"""Tensor- and sequence-parallel MLPs whose first Linear reads a com.microsoft ``AllGather``.

Each model is one rank's graph: ``AllGather(x_shard)`` concatenates the ``group_size`` ranks'
shards along ``axis``, then a column-parallel Linear (``MatMul`` with the gathered tensor as left
operand and a constant weight shard, + bias ``Add``), an activation, and a row-parallel Linear
whose partial sums a real model would all-reduce (left out: the output is the partial sum).

onnxruntime's CPU package has no AllGather kernel, so these models only run with fuser's own
communicator. The gathered value carries a ``value_info`` so shape inference continues past the
AllGather (onnx has no schema for it). Note the schema's default axis is 1 but onnxruntime uses
0; the builders always write ``axis`` explicitly.
"""

from __future__ import annotations

from typing import Literal

import onnx

from ._graph import MS_DOMAIN, Dim, DType, GraphBuilder
from .transformer import LayerNormStyle, default_ln_style, layer_norm


def _gathered_dim(dim: Dim, group_size: int, name: str) -> Dim:
    return dim * group_size if isinstance(dim, int) else name


def _shard_dim(dim: Dim, group_size: int, name: str) -> Dim:
    if isinstance(dim, int):
        if dim % group_size:
            raise ValueError(f"{name}={dim} is not divisible by group_size={group_size}")
        return dim // group_size
    return f"{dim}_shard"


def _mlp_after_gather(
    b: GraphBuilder, gathered: str, hidden: int, intermediate: int, group_size: int, bias: bool
) -> str:
    """Column-parallel Linear -> Relu -> row-parallel Linear, on this rank's weight shards."""
    shard = intermediate // group_size
    with b.scope("fc1"):
        y = b.op("MatMul", gathered, b.weight([hidden, shard], "weight", fan_in=hidden))
        if bias:
            y = b.op("Add", y, b.weight([shard], "bias", fan_in=hidden * 4))
    y = b.op("Relu", y)
    with b.scope("fc2"):
        return b.op("MatMul", y, b.weight([shard, hidden], "weight", fan_in=intermediate))


def tp_mlp(
    *,
    batch: Dim = "batch",
    seq: Dim = "seq",
    hidden: int = 32,
    intermediate: int = 64,
    group_size: int = 2,
    negative_axis: bool = False,
    bias: bool = True,
    opset: int = 13,
    seed: int = 0,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """Tensor-parallel MLP (``example:tp-mlp``, ``tp-mlp-negaxis``): the input is sharded on the
    hidden (last) axis, ``x_shard`` [batch, seq, hidden/group_size]; ``AllGather(axis=2)`` (or
    ``axis=-1`` with ``negative_axis``, which onnxruntime itself rejects) -> MatMul (+ bias).
    Contains 1 AllGather->MatMul. Output ``output`` [batch, seq, hidden] (partial sum)."""
    b = GraphBuilder("tp_mlp", opset=opset, dtype=dtype, seed=seed, domains={MS_DOMAIN: 1})
    x = b.input("x_shard", [batch, seq, _shard_dim(hidden, group_size, "hidden")])
    gathered = b.op(
        "AllGather", x, domain=MS_DOMAIN, group_size=group_size, axis=-1 if negative_axis else 2
    )
    b.value_info(gathered, [batch, seq, hidden])
    y = _mlp_after_gather(b, gathered, hidden, intermediate, group_size, bias)
    b.graph_output(y, "output", [batch, seq, hidden])
    return b.build(tp_mlp.__doc__ or "")


def sp_mlp(
    *,
    batch: Dim = "batch",
    seq: Dim = 8,
    hidden: int = 32,
    intermediate: int = 64,
    group_size: int = 2,
    layout: Literal["sbh", "bsh"] = "sbh",
    bias: bool = True,
    ln: LayerNormStyle | None = None,
    opset: int = 17,
    seed: int = 0,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """Sequence-parallel MLP (``example:sp-mlp``, ``sp-mlp-bsh``), Megatron style: LayerNorm on
    this rank's sequence shard, ``AllGather`` on the sequence axis (0 for ``layout="sbh"``
    [seq, batch, hidden], Megatron's; 1 for ``"bsh"``), then MatMul (+ bias). Contains 1
    AllGather->MatMul and 1 LayerNorm, which feeds the AllGather (not a MatMul). Output
    ``output`` with the full sequence (partial sum over the intermediate shards)."""
    b = GraphBuilder("sp_mlp", opset=opset, dtype=dtype, seed=seed, domains={MS_DOMAIN: 1})
    shard = _shard_dim(seq, group_size, "seq")
    full = _gathered_dim(shard, group_size, "seq") if isinstance(shard, int) else seq
    axis = 0 if layout == "sbh" else 1
    shard_shape = [shard, batch, hidden] if layout == "sbh" else [batch, shard, hidden]
    full_shape = [full, batch, hidden] if layout == "sbh" else [batch, full, hidden]
    x = b.input("x_shard", shard_shape)
    with b.scope("norm"):
        n = layer_norm(b, x, hidden, ln or default_ln_style(opset), 1e-5)
    gathered = b.op("AllGather", n, domain=MS_DOMAIN, group_size=group_size, axis=axis)
    b.value_info(gathered, full_shape)
    y = _mlp_after_gather(b, gathered, hidden, intermediate, group_size, bias)
    b.graph_output(y, "output", full_shape)
    return b.build(sp_mlp.__doc__ or "")


def tp_attention(
    *,
    batch: Dim = "batch",
    seq: Dim = "seq",
    hidden: int = 32,
    heads: int = 4,
    group_size: int = 2,
    bias: bool = True,
    opset: int = 17,
    seed: int = 0,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """Tensor-parallel attention (``example:tp-attention``), Megatron style with a sequence-
    parallel input: ``x_shard`` [batch, seq/group_size, hidden] is gathered on the sequence
    axis (``AllGather(axis=1)``), and the gathered value feeds the Q, K and V projections (this
    rank's ``heads/group_size`` heads: three column-parallel MatMuls, + bias) with NO value_info
    (onnx has no AllGather schema; exporters then write none). Per head: scores = Q K^T /
    sqrt(d), Softmax, @ V; then the row-parallel output projection (partial sum, all-reduce left
    out). Contains 1 AllGather feeding 3 MatMuls (the QKV form). Output ``output``
    [batch, seq, hidden]."""
    if heads % group_size:
        raise ValueError(f"heads={heads} is not divisible by group_size={group_size}")
    b = GraphBuilder("tp_attention", opset=opset, dtype=dtype, seed=seed, domains={MS_DOMAIN: 1})
    local, d = heads // group_size, hidden // heads
    x = b.input("x_shard", [batch, _shard_dim(seq, group_size, "seq"), hidden])
    gathered = b.op("AllGather", x, domain=MS_DOMAIN, group_size=group_size, axis=1)
    proj = []
    for name in ("q", "k", "v"):
        with b.scope(f"{name}_proj"):
            y = b.op("MatMul", gathered, b.weight([hidden, local * d], "weight", fan_in=hidden))
            if bias:
                y = b.op("Add", y, b.weight([local * d], "bias", fan_in=hidden * 4))
        # [batch, seq, local, d] -> [batch, local, seq, d]
        y = b.op("Reshape", y, b.ints([0, 0, local, d], "heads_shape"))
        proj.append(b.op("Transpose", y, perm=[0, 2, 1, 3]))
    q, k, v = proj
    scores = b.op("MatMul", q, b.op("Transpose", k, perm=[0, 1, 3, 2]))
    scores = b.op("Div", scores, b.floats(float(d) ** 0.5, "scale"))
    ctx = b.op("MatMul", b.op("Softmax", scores, axis=-1), v)
    ctx = b.op("Reshape", b.op("Transpose", ctx, perm=[0, 2, 1, 3]), b.ints([0, 0, -1], "merge"))
    with b.scope("o_proj"):
        y = b.op("MatMul", ctx, b.weight([local * d, hidden], "weight", fan_in=hidden))
    b.graph_output(y, "output", [batch, seq, hidden])
    return b.build(tp_attention.__doc__ or "")


def tp_linear(
    *,
    tokens: Dim = "tokens",
    batch: Dim = "batch",
    seq: Dim = 8,
    hidden: int = 32,
    intermediate: int = 64,
    group_size: int = 2,
    form: Literal["gemm", "reshape-gemm", "reshape-matmul"] = "gemm",
    opset: int = 13,
    seed: int = 0,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """nn.Linear as exporters write it after an AllGather (``example:tp-gemm``,
    ``sp-reshape-gemm``, ``sp-reshape-matmul``):

    - ``form="gemm"``: 2-D activations ``x_shard`` [tokens, hidden/group_size] gathered on the
      hidden axis, ``Gemm(transB=1)`` with bias, alpha 1, beta 1;
    - ``"reshape-gemm"`` / ``"reshape-matmul"``: ``x_shard`` [batch, seq/group_size, hidden]
      gathered on the sequence axis, ``Reshape(-1, hidden)`` (keeps the last axis), then
      ``Gemm(transB=1)`` with bias, or MatMul + bias Add.

    Then Relu and the row-parallel Linear (partial sum). Contains 1 AllGather -> Linear. Output
    ``output`` 2-D [rows, hidden]."""
    b = GraphBuilder("tp_linear", opset=opset, dtype=dtype, seed=seed, domains={MS_DOMAIN: 1})
    shard_n = intermediate // group_size
    if form == "gemm":
        x = b.input("x_shard", [tokens, _shard_dim(hidden, group_size, "hidden")])
        a = b.op("AllGather", x, domain=MS_DOMAIN, group_size=group_size, axis=1)
        rows: Dim = tokens
    else:
        shard = _shard_dim(seq, group_size, "seq")
        x = b.input("x_shard", [batch, shard, hidden])
        gathered = b.op("AllGather", x, domain=MS_DOMAIN, group_size=group_size, axis=1)
        a = b.op("Reshape", gathered, b.ints([-1, hidden], "flat_shape"))
        rows = "rows"
    with b.scope("fc1"):
        if form == "reshape-matmul":
            y = b.op("MatMul", a, b.weight([hidden, shard_n], "weight", fan_in=hidden))
            y = b.op("Add", y, b.weight([shard_n], "bias", fan_in=hidden * 4))
        else:
            w = b.weight([shard_n, hidden], "weight", fan_in=hidden)
            y = b.op("Gemm", a, w, b.weight([shard_n], "bias", fan_in=hidden * 4), transB=1)
    y = b.op("Relu", y)
    with b.scope("fc2"):
        w2 = b.weight([hidden, shard_n], "weight", fan_in=intermediate)
        y = b.op("Gemm", y, w2, transB=1)
    b.graph_output(y, "output", [rows, hidden])
    return b.build(tp_linear.__doc__ or "")
