"""Transformer builders: BERT (post-LN), GPT (pre-LN, gated MLP) and GPT-2 (Conv1D as Gemm).

LayerNorm is written either as the ``LayerNormalization`` op (opset >= 17) or decomposed the way
the TorchScript exporter writes ``nn.LayerNorm`` below opset 17::

    mean = ReduceMean(x, axes=[-1], keepdims=1)
    d    = Sub(x, mean)
    var  = ReduceMean(Pow(d, 2.0), axes=[-1], keepdims=1)     # or Mul(d, d)
    y    = Div(d, Sqrt(Add(var, eps)))                         # or Mul(d, Reciprocal(...))
    y    = Add(Mul(y, gamma), beta)                            # the affine part (optional)

At opset 18 ReduceMean takes ``axes`` as an input. Scalars (eps, 2.0) are ``Constant`` nodes, as
TorchScript emits them. With ``noop_casts`` the decomposition also carries the Casts that
``x.to(torch.float32)`` / ``y.to(input_dtype)`` leave in fp32 exports: one on the LN input and one
before the ``Mul gamma``.

Linear layers are ``MatMul`` (+ ``Add`` bias) on 3-D activations; the attention reshapes take
batch and sequence from ``Shape`` of the LayerNorm output, so LN outputs have ``Shape`` readers,
as in real exports. Every builder accepts symbolic batch/sequence dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto

from ._graph import Dim, DType, GraphBuilder


@dataclass(frozen=True)
class LayerNormStyle:
    """How a LayerNorm is written in the graph.

    ``kind="op"`` needs opset >= 17. ``divide``/``square``/``noop_casts`` only apply to
    ``kind="decomposed"``; ``affine=False`` drops gamma/beta (decomposed only, since the op
    always has a scale input).
    """

    kind: Literal["op", "decomposed"] = "decomposed"
    divide: Literal["div", "reciprocal"] = "div"
    square: Literal["pow", "mul"] = "pow"
    affine: bool = True
    noop_casts: bool = False


def default_ln_style(opset: int) -> LayerNormStyle:
    """What torch writes at this opset: the op from 17 on, the decomposition below."""
    return LayerNormStyle(kind="op" if opset >= 17 else "decomposed")


def layer_norm(b: GraphBuilder, x: str, hidden: int, style: LayerNormStyle, epsilon: float) -> str:
    """Append one LayerNorm over the last axis of ``x`` and return its output."""
    with b.scope("LayerNorm"):
        if style.kind == "op":
            if b.opset < 17:
                raise ValueError(f"LayerNormalization needs opset >= 17, got {b.opset}")
            gamma = b.uniform([hidden], "weight", 0.8, 1.2)
            beta = b.uniform([hidden], "bias", -0.1, 0.1)
            return b.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=epsilon)
        if style.noop_casts:
            x = b.cast(x, b.elem)

        def reduce_mean(v: str) -> str:
            if b.opset >= 18:
                return b.op("ReduceMean", v, b.ints([-1], "axes"), keepdims=1)
            return b.op("ReduceMean", v, axes=[-1], keepdims=1)

        d = b.op("Sub", x, reduce_mean(x))
        if style.square == "pow":
            sq = b.op("Pow", d, b.scalar(2.0, "Constant"))
        else:
            sq = b.op("Mul", d, d)
        std = b.op("Sqrt", b.op("Add", reduce_mean(sq), b.scalar(epsilon, "Constant")))
        if style.divide == "div":
            y = b.op("Div", d, std)
        else:
            y = b.op("Mul", d, b.op("Reciprocal", std))
        if not style.affine:
            return y
        if style.noop_casts:
            y = b.cast(y, b.elem)
        y = b.op("Mul", y, b.uniform([hidden], "weight", 0.8, 1.2))
        return b.op("Add", y, b.uniform([hidden], "bias", -0.1, 0.1))


def linear(
    b: GraphBuilder, x: str, d_in: int, d_out: int, name: str, *, bias: bool, bias_first: bool
) -> str:
    """``nn.Linear`` on a 3-D input: MatMul with a [d_in, d_out] weight, then Add bias.

    ``bias_first`` puts the bias as the Add's first operand, as TorchScript writes it.
    """
    with b.scope(name):
        y = b.op("MatMul", x, b.weight([d_in, d_out], "weight", fan_in=d_in))
        if not bias:
            return y
        bias_init = b.weight([d_out], "bias", fan_in=d_in * 4)
        return b.op("Add", bias_init, y) if bias_first else b.op("Add", y, bias_init)


@dataclass(frozen=True)
class _Dims:
    """Batch and sequence length read at run time (``Shape`` -> ``Gather`` -> ``Unsqueeze``)."""

    batch: str
    seq: str


def runtime_dims(b: GraphBuilder, x: str) -> _Dims:
    shape = b.op("Shape", x)
    zero = b.ints([0], "axes0")
    batch = b.op("Unsqueeze", b.op("Gather", shape, b.ints(0, "idx0"), axis=0), zero)
    seq = b.op("Unsqueeze", b.op("Gather", shape, b.ints(1, "idx1"), axis=0), zero)
    return _Dims(batch, seq)


def attention_core(
    b: GraphBuilder,
    q: str,
    k: str,
    v: str,
    dims: _Dims,
    *,
    heads: int,
    head_dim: int,
    additive_mask: str | None = None,
    where_mask: str | None = None,
) -> str:
    """Multi-head scaled dot-product attention on [B, S, H*D] q/k/v; returns [B, S, H*D]."""
    split = b.op("Concat", dims.batch, dims.seq, b.ints([heads, head_dim], "heads"), axis=0)

    def heads_first(t: str, perm: list[int]) -> str:
        return b.op("Transpose", b.op("Reshape", t, split), perm=perm)

    qh = heads_first(q, [0, 2, 1, 3])
    kh = heads_first(k, [0, 2, 3, 1])
    vh = heads_first(v, [0, 2, 1, 3])
    scores = b.op("Div", b.op("MatMul", qh, kh), b.scalar(math.sqrt(head_dim), "Constant"))
    if additive_mask is not None:
        scores = b.op("Add", scores, additive_mask)
    if where_mask is not None:
        scores = b.op("Where", where_mask, scores, b.scalar(-1e4, "Constant"))
    probs = b.op("Softmax", scores, axis=-1)
    ctx = b.op("Transpose", b.op("MatMul", probs, vh), perm=[0, 2, 1, 3])
    merge = b.op("Concat", dims.batch, dims.seq, b.ints([heads * head_dim], "hidden"), axis=0)
    return b.op("Reshape", ctx, merge)


def _gelu_erf(b: GraphBuilder, x: str) -> str:
    """GELU as TorchScript exports it below opset 20: x * 0.5 * (1 + erf(x / sqrt 2))."""
    e = b.op("Erf", b.op("Div", x, b.scalar(math.sqrt(2.0), "Constant")))
    return b.op(
        "Mul", b.op("Mul", x, b.op("Add", e, b.scalar(1.0, "Constant"))), b.scalar(0.5, "Constant")
    )


def _gelu_tanh(b: GraphBuilder, x: str) -> str:
    """GPT-2's gelu_new: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    cube = b.op("Pow", x, b.scalar(3.0, "Constant"))
    inner = b.op("Add", x, b.op("Mul", cube, b.scalar(0.044715, "Constant")))
    t = b.op("Tanh", b.op("Mul", inner, b.scalar(math.sqrt(2.0 / math.pi), "Constant")))
    half_x = b.op("Mul", x, b.scalar(0.5, "Constant"))
    return b.op("Mul", half_x, b.op("Add", t, b.scalar(1.0, "Constant")))


def _check_opset(opset: int) -> None:
    if opset < 13:
        raise ValueError(f"transformer builders need opset >= 13 (axes as inputs), got {opset}")


# -- BERT --------------------------------------------------------------------------------------


def bert(
    *,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    intermediate: int = 64,
    vocab: int = 64,
    max_positions: int = 32,
    batch: Dim = "batch",
    seq: Dim = "seq",
    opset: int = 13,
    ln: LayerNormStyle | None = None,
    epsilon: float | None = None,
    seed: int = 0,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """BERT-style post-LN encoder (``example:bert``, ``bert17``, ``bert18``).

    Embeddings (word + position + token type) -> LayerNorm, then per layer: Q/K/V Linear,
    attention with the padding mask, output Linear, residual Add -> LayerNorm, intermediate
    Linear -> GELU (Erf) -> output Linear, residual Add -> LayerNorm; pooler on token 0.
    Linear biases are the first operand of their Add (TorchScript order).

    LayerNorms: ``1 + 2*layers``. LayerNorm->MatMul chains: ``2*layers`` with
    ``4*layers`` MatMuls: the embedding LN feeds Q, K, V; each attention LN feeds the
    intermediate MatMul; each output LN but the last feeds the next Q, K, V. Every LN output
    except the last also feeds a residual Add, and the LN outputs that feed Q/K/V a ``Shape``.
    The last LN is the graph output ``last_hidden_state`` (it reaches the pooler through Gather).
    ``ln`` defaults to the op at opset >= 17, else decomposed; ``epsilon`` to 1e-12 (1e-5 in
    float16, where 1e-12 would round to 0).
    """
    _check_opset(opset)
    style = ln or default_ln_style(opset)
    eps = epsilon if epsilon is not None else (1e-12 if dtype == "float32" else 1e-5)
    head_dim = hidden // heads
    b = GraphBuilder("bert", opset=opset, dtype=dtype, seed=seed)
    ids = b.input("input_ids", [batch, seq], TensorProto.INT64)
    mask = b.input("attention_mask", [batch, seq], TensorProto.INT64)

    with b.scope("embeddings"):
        words = b.op("Gather", b.weight([vocab, hidden], "word_embeddings", fan_in=1), ids)
        seq_len = b.op("Slice", b.op("Shape", ids), b.ints([1], "one"), b.ints([2], "two"))
        pos_ids = b.op(
            "Slice", b.ints(np.arange(max_positions)[None], "position_ids"), b.ints([0], "zero"),
            seq_len, b.ints([1], "axis1"),
        )  # fmt: skip
        pos = b.op(
            "Gather", b.weight([max_positions, hidden], "position_embeddings", fan_in=1), pos_ids
        )
        h = b.op(
            "Add", b.op("Add", words, pos), b.weight([hidden], "token_type_embeddings", fan_in=1)
        )
        h = layer_norm(b, h, hidden, style, eps)
    with b.scope("extended_mask"):
        m = b.op("Unsqueeze", mask, b.ints([1, 2], "axes"))
        m = b.cast(m, b.elem)
        m = b.op("Mul", b.op("Sub", b.scalar(1.0, "Constant"), m), b.scalar(-1e4, "Constant"))

    for i in range(layers):
        with b.scope(f"encoder/layer.{i}"):
            with b.scope("attention"):
                dims = runtime_dims(b, h)
                q = linear(b, h, hidden, hidden, "query", bias=True, bias_first=True)
                k = linear(b, h, hidden, hidden, "key", bias=True, bias_first=True)
                v = linear(b, h, hidden, hidden, "value", bias=True, bias_first=True)
                ctx = attention_core(
                    b, q, k, v, dims, heads=heads, head_dim=head_dim, additive_mask=m
                )
                out = linear(b, ctx, hidden, hidden, "output/dense", bias=True, bias_first=True)
                a = layer_norm(b, b.op("Add", out, h), hidden, style, eps)
            with b.scope("intermediate"):
                inter = _gelu_erf(
                    b, linear(b, a, hidden, intermediate, "dense", bias=True, bias_first=True)
                )
            with b.scope("output"):
                out = linear(b, inter, intermediate, hidden, "dense", bias=True, bias_first=True)
                h = layer_norm(b, b.op("Add", out, a), hidden, style, eps)

    with b.scope("pooler"):
        first = b.op("Gather", h, b.ints(0, "first_token"), axis=1)
        pooled = b.op("Tanh", linear(b, first, hidden, hidden, "dense", bias=True, bias_first=True))
    b.graph_output(h, "last_hidden_state", [batch, seq, hidden])
    b.graph_output(pooled, "pooler_output", [batch, hidden])
    return b.build(bert.__doc__ or "")


# -- GPT (pre-LN, gated MLP) -------------------------------------------------------------------


def causal_additive_mask(b: GraphBuilder, dims: _Dims, max_positions: int) -> str:
    """Slice a [P, P] additive causal mask buffer (0 / -1e4) to [S, S] with the run-time length."""
    buf = np.triu(np.full((max_positions, max_positions), -1e4, dtype=np.float32), k=1)
    zeros = b.ints([0, 0], "starts")
    ends = b.op("Concat", dims.seq, dims.seq, axis=0)
    return b.op("Slice", b.floats(buf, "causal_mask"), zeros, ends, b.ints([0, 1], "axes"))


def pre_ln_attention(
    b: GraphBuilder,
    h: str,
    *,
    hidden: int,
    heads: int,
    style: LayerNormStyle,
    epsilon: float,
    max_positions: int,
) -> str:
    """``h + o_proj(causal_attention(q, k, v))`` with q, k, v MatMuls on ``LN(h)``."""
    with b.scope("input_layernorm"):
        n = layer_norm(b, h, hidden, style, epsilon)
    with b.scope("self_attn"):
        dims = runtime_dims(b, n)
        q = linear(b, n, hidden, hidden, "q_proj", bias=False, bias_first=False)
        k = linear(b, n, hidden, hidden, "k_proj", bias=False, bias_first=False)
        v = linear(b, n, hidden, hidden, "v_proj", bias=False, bias_first=False)
        mask = causal_additive_mask(b, dims, max_positions)
        head_dim = hidden // heads
        ctx = attention_core(b, q, k, v, dims, heads=heads, head_dim=head_dim, additive_mask=mask)
        out = linear(b, ctx, hidden, hidden, "o_proj", bias=False, bias_first=False)
        return b.op("Add", h, out)


def pre_ln_gated_mlp(
    b: GraphBuilder,
    h: str,
    *,
    hidden: int,
    intermediate: int,
    style: LayerNormStyle,
    epsilon: float,
) -> str:
    """``h + down(SiLU(gate(LN(h))) * up(LN(h)))``: one LN feeding two MatMuls."""
    with b.scope("post_attention_layernorm"):
        n = layer_norm(b, h, hidden, style, epsilon)
    with b.scope("mlp"):
        gate = linear(b, n, hidden, intermediate, "gate_proj", bias=False, bias_first=False)
        up = linear(b, n, hidden, intermediate, "up_proj", bias=False, bias_first=False)
        act = b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up)
        out = linear(b, act, intermediate, hidden, "down_proj", bias=False, bias_first=False)
        return b.op("Add", h, out)


def gpt(
    *,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    intermediate: int = 48,
    vocab: int = 64,
    max_positions: int = 32,
    batch: Dim = "batch",
    seq: Dim = "seq",
    opset: int = 17,
    ln: LayerNormStyle | None = None,
    epsilon: float = 1e-5,
    seed: int = 0,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """GPT-style pre-LN decoder with a gated MLP (``example:gpt``, ``gpt-noaffine``).

    Per layer: ``n = LN1(h)`` feeds the Q, K, V MatMuls (no bias) and a ``Shape``; the residual
    Add goes around it (``h + attn``); ``n2 = LN2(h)`` feeds the gate and up MatMuls;
    SiLU(gate) * up -> down MatMul; residual Add. A final LN feeds the lm_head MatMul.

    LayerNorms: ``2*layers + 1``, every one a LayerNorm->MatMul chain, with ``5*layers + 1``
    MatMuls in total (3 on each LN1, 2 on each LN2, 1 on the final LN); no LN output has a
    reader other than MatMuls and ``Shape``. Output ``logits`` [batch, seq, vocab].
    """
    _check_opset(opset)
    style = ln or default_ln_style(opset)
    b = GraphBuilder("gpt", opset=opset, dtype=dtype, seed=seed)
    ids = b.input("input_ids", [batch, seq], TensorProto.INT64)
    h = b.op("Gather", b.weight([vocab, hidden], "embed_tokens", fan_in=1), ids)
    for i in range(layers):
        with b.scope(f"layers.{i}"):
            h = pre_ln_attention(
                b, h, hidden=hidden, heads=heads, style=style, epsilon=epsilon,
                max_positions=max_positions,
            )  # fmt: skip
            h = pre_ln_gated_mlp(
                b, h, hidden=hidden, intermediate=intermediate, style=style, epsilon=epsilon
            )
    with b.scope("norm"):
        n = layer_norm(b, h, hidden, style, epsilon)
    logits = linear(b, n, hidden, vocab, "lm_head", bias=False, bias_first=False)
    b.graph_output(logits, "logits", [batch, seq, vocab])
    return b.build(gpt.__doc__ or "")


# -- GPT-2 (Conv1D = Reshape -> Gemm -> Reshape) -----------------------------------------------


def conv1d_gemm(b: GraphBuilder, x: str, d_in: int, d_out: int, name: str) -> str:
    """GPT-2's ``Conv1D`` as exported: Reshape to [-1, d_in] -> Gemm (weight [d_in, d_out],
    bias) -> Reshape to ``x.shape[:-1] + [d_out]``, the target shape read from ``Shape(x)``."""
    with b.scope(name):
        size_out = b.op(
            "Concat",
            b.op("Slice", b.op("Shape", x), b.ints([0], "start"), b.ints([-1], "end")),
            b.ints([d_out], "nf"),
            axis=0,
        )
        flat = b.op("Reshape", x, b.ints([-1, d_in], "flat_shape"))
        w = b.weight([d_in, d_out], "weight", fan_in=d_in)
        y = b.op("Gemm", flat, w, b.weight([d_out], "bias", fan_in=d_in * 4))
        return b.op("Reshape", y, size_out)


def gpt2(
    *,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    vocab: int = 64,
    max_positions: int = 32,
    batch: Dim = "batch",
    seq: Dim = "seq",
    opset: int = 13,
    ln: LayerNormStyle | None = None,
    epsilon: float = 1e-5,
    seed: int = 0,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """GPT-2-style pre-LN decoder whose Linear layers are Conv1D (``example:gpt2``, ``gpt2-ln``).

    Per layer: ``ln_1`` -> Reshape(flatten leading dims) -> Gemm (c_attn, 3*hidden) -> Reshape
    back (shape from ``Shape`` of the LN output) -> Split into q/k/v, causal attention via Where,
    c_proj Conv1D, residual Add; ``ln_2`` -> c_fc Conv1D -> gelu_new (tanh) -> c_proj Conv1D,
    residual Add. ``ln_f`` -> lm_head MatMul (tied embedding, transposed).

    LayerNorms: ``2*layers + 1``; LN->Reshape->Gemm chains: ``2*layers`` (each LN output is read
    by the Reshape and a ``Shape``); LN->MatMul chains: 1 (ln_f). Output ``logits``.
    """
    _check_opset(opset)
    style = ln or default_ln_style(opset)
    head_dim = hidden // heads
    b = GraphBuilder("gpt2", opset=opset, dtype=dtype, seed=seed)
    ids = b.input("input_ids", [batch, seq], TensorProto.INT64)
    wte_values = (b.rng.standard_normal((vocab, hidden), dtype=np.float32) * 0.5).astype(b.np_dtype)
    wte = b.initializer(wte_values, "wte.weight")
    with b.scope("embeddings"):
        seq_len = b.op("Gather", b.op("Shape", ids), b.ints(1, "idx1"), axis=0)
        pos_ids = b.op("Range", b.ints(0, "start"), seq_len, b.ints(1, "delta"))
        pos = b.op("Gather", b.weight([max_positions, hidden], "wpe.weight", fan_in=4), pos_ids)
        h = b.op("Add", b.op("Gather", wte, ids), pos)
    causal = np.tril(np.ones((max_positions, max_positions), dtype=bool))[None, None]
    bias_buf = b.initializer(causal, "attn.bias")
    for i in range(layers):
        with b.scope(f"h.{i}"):
            with b.scope("ln_1"):
                n = layer_norm(b, h, hidden, style, epsilon)
            with b.scope("attn"):
                dims = runtime_dims(b, n)
                qkv = conv1d_gemm(b, n, hidden, 3 * hidden, "c_attn")
                q, k, v = b.nodes("Split", [qkv, b.ints([hidden] * 3, "split")], n_out=3, axis=2)
                ends = b.op("Concat", dims.seq, dims.seq, axis=0)
                mask = b.op(
                    "Slice", bias_buf, b.ints([0, 0], "starts"), ends, b.ints([2, 3], "axes")
                )
                ctx = attention_core(
                    b, q, k, v, dims, heads=heads, head_dim=head_dim, where_mask=mask
                )
                h = b.op("Add", conv1d_gemm(b, ctx, hidden, hidden, "c_proj"), h)
            with b.scope("ln_2"):
                n = layer_norm(b, h, hidden, style, epsilon)
            with b.scope("mlp"):
                f = _gelu_tanh(b, conv1d_gemm(b, n, hidden, 4 * hidden, "c_fc"))
                h = b.op("Add", h, conv1d_gemm(b, f, 4 * hidden, hidden, "c_proj"))
    with b.scope("ln_f"):
        n = layer_norm(b, h, hidden, style, epsilon)
    logits = b.op("MatMul", n, b.initializer(np.ascontiguousarray(wte_values.T), "lm_head.weight"))
    b.graph_output(logits, "logits", [batch, seq, vocab])
    return b.build(gpt2.__doc__ or "")
