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
