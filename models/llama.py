"""Llama-style decoder builder: RMSNorm (op or decomposed) before the QKV and gate/up MatMuls.

transformers' ``LlamaRMSNorm`` (Qwen, Mistral and T5 write the same) is::

    x32 = x.to(float32);  ms = x32.pow(2).mean(-1, keepdim=True)
    y   = weight * (x32 * rsqrt(ms + eps)).to(x.dtype)

and the exporters write it decomposed::

    x32 = Cast(x, to=float)                          # float16 models only
    ms  = ReduceMean(Pow(x32, 2), axes=[-1], keepdims=1)   # or Mul(x32, x32)
    r   = Sqrt(Add(ms, eps))
    n   = Mul(x32, Div(1, r))                        # TorchScript's rsqrt; Reciprocal(r): dynamo
    y   = Mul(weight, Cast(n, to=float16))           # the Cast only in float16 models

or, with ``RmsNormStyle(kind=...)``, as onnxruntime's ``SimplifiedLayerNormalization`` or the
opset-23 ``RMSNormalization`` op. Attention and MLP are those of ``transformer.gpt`` (QKV on the
first norm of a layer, a ``Shape`` reader for the run-time dims, gate/up on the second, a final
norm feeding lm_head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto

from ._graph import Dim, DType, GraphBuilder
from .transformer import attention_core, causal_additive_mask, runtime_dims
from .transformer import linear as dense


@dataclass(frozen=True)
class RmsNormStyle:
    """How an RMSNorm is written: ``kind`` op forms need opset 23 (``rms_op``) or any opset
    (``simplified``, onnxruntime's op in the ONNX domain); ``inverse``/``square`` apply to the
    decomposed form."""

    kind: Literal["decomposed", "simplified", "rms_op"] = "decomposed"
    inverse: Literal["div_one", "reciprocal", "div"] = "div_one"
    square: Literal["pow", "mul"] = "pow"


def rms_norm(b: GraphBuilder, x: str, hidden: int, style: RmsNormStyle, epsilon: float) -> str:
    """Append one RMSNorm over the last axis of ``x`` and return its output."""
    with b.scope("RMSNorm"):
        weight = b.uniform([hidden], "weight", 0.8, 1.2)
        if style.kind == "rms_op":
            if b.opset < 23:
                raise ValueError(f"RMSNormalization needs opset >= 23, got {b.opset}")
            return b.op("RMSNormalization", x, weight, axis=-1, epsilon=epsilon)
        if style.kind == "simplified":
            return b.op("SimplifiedLayerNormalization", x, weight, axis=-1, epsilon=epsilon)
        half = b.elem != TensorProto.FLOAT
        xs = b.cast(x, TensorProto.FLOAT) if half else x

        def const(value: float) -> str:  # statistics constants are float32 in both dtypes
            return b.constant(np.array(value, dtype=np.float32), "Constant")

        sq = b.op("Pow", xs, const(2.0)) if style.square == "pow" else b.op("Mul", xs, xs)
        if b.opset >= 18:
            ms = b.op("ReduceMean", sq, b.ints([-1], "axes"), keepdims=1)
        else:
            ms = b.op("ReduceMean", sq, axes=[-1], keepdims=1)
        r = b.op("Sqrt", b.op("Add", ms, const(epsilon)))
        if style.inverse == "div":
            n = b.op("Div", xs, r)
        elif style.inverse == "reciprocal":
            n = b.op("Mul", xs, b.op("Reciprocal", r))
        else:
            n = b.op("Mul", xs, b.op("Div", const(1.0), r))
        if half:
            n = b.cast(n, b.elem)
        return b.op("Mul", weight, n)


def llama(
    *,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    intermediate: int = 48,
    vocab: int = 64,
    max_positions: int = 32,
    batch: Dim = "batch",
    seq: Dim = "seq",
    opset: int = 14,
    norm: RmsNormStyle | None = None,
    epsilon: float = 1e-6,
    seed: int = 0,
    dtype: DType = "float32",
    autocast: bool = False,
) -> onnx.ModelProto:
    """Llama-style pre-RMSNorm decoder (``example:llama``, ``llama-fp16``, ``llama-op``).

    ``autocast``: a float32 model exported under mixed precision (torch.autocast): every
    Linear is ``Cast(x, float16) -> MatMul(float16 weight) -> Cast(float32)``, so each RMSNorm
    (float32) reaches its Linears through one Cast(float16) per Linear.

    Per layer: ``n = RMSNorm1(h)`` feeds the Q, K, V MatMuls and a ``Shape``; residual Add;
    ``n2 = RMSNorm2(h)`` feeds gate and up; SiLU(gate) * up -> down; residual Add. A final
    RMSNorm feeds lm_head. RMSNorms: ``2*layers + 1``, each an RMSNorm->MatMul chain with
    ``5*layers + 1`` MatMuls on them in total. Output ``logits`` [batch, seq, vocab].
    """
    style = norm or RmsNormStyle()
    b = GraphBuilder("llama", opset=opset, dtype=dtype, seed=seed)

    def linear(b: GraphBuilder, x: str, d_in: int, d_out: int, name: str, **kw: bool) -> str:
        if not autocast:
            return dense(b, x, d_in, d_out, name, **kw)
        with b.scope(name):
            w = (b.rng.standard_normal((d_in, d_out)) / np.sqrt(d_in)).astype(np.float16)
            y = b.op("MatMul", b.cast(x, TensorProto.FLOAT16), b.initializer(w, "weight"))
            return b.cast(y, b.elem)

    ids = b.input("input_ids", [batch, seq], TensorProto.INT64)
    h = b.op("Gather", b.weight([vocab, hidden], "embed_tokens", fan_in=1), ids)
    for i in range(layers):
        with b.scope(f"layers.{i}"):
            with b.scope("input_layernorm"):
                n = rms_norm(b, h, hidden, style, epsilon)
            with b.scope("self_attn"):
                dims = runtime_dims(b, n)
                q, k, v = (
                    linear(b, n, hidden, hidden, f"{p}_proj", bias=False, bias_first=False)
                    for p in "qkv"
                )
                mask = causal_additive_mask(b, dims, max_positions)
                ctx = attention_core(
                    b, q, k, v, dims, heads=heads, head_dim=hidden // heads, additive_mask=mask
                )
                h = b.op(
                    "Add", h, linear(b, ctx, hidden, hidden, "o_proj", bias=False, bias_first=False)
                )
            with b.scope("post_attention_layernorm"):
                n2 = rms_norm(b, h, hidden, style, epsilon)
            with b.scope("mlp"):
                gate = linear(
                    b, n2, hidden, intermediate, "gate_proj", bias=False, bias_first=False
                )
                up = linear(b, n2, hidden, intermediate, "up_proj", bias=False, bias_first=False)
                act = b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up)
                down = linear(
                    b, act, intermediate, hidden, "down_proj", bias=False, bias_first=False
                )
                h = b.op("Add", h, down)
    with b.scope("norm"):
        n = rms_norm(b, h, hidden, style, epsilon)
    logits = linear(b, n, hidden, vocab, "lm_head", bias=False, bias_first=False)
    b.graph_output(logits, "logits", [batch, seq, vocab])
    return b.build(llama.__doc__ or "")
