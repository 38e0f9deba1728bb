"""Mixture-of-experts builders: router Softmax -> TopK (-> renormalize) -> expert mix.

The router is written the way transformers' Mixtral/Qwen2-MoE blocks export::

    logits  = MatMul(tokens, W_router)                  # [T, E], also the output router_logits
    probs   = Softmax(logits, axis=-1)                   # then Cast to float32 if dtype=float
    w, idx  = TopK(probs, k, axis=-1, largest=1, sorted=1)
    w       = Div(w, ReduceSum(w, axes=[-1], keepdims=1))  # renormalize (Mixtral; not Qwen)

or, for ``order="topk_softmax"``, ``TopK(logits)`` then ``Softmax`` of the k values. The top-k
weights become a dense [T, E] combine matrix (``OneHot`` x weights, or ``ScatterElements`` into
zeros), and the experts run as batched MatMuls over all experts ([E, T, ...]), like
``experts_implementation="batched_mm"``; the combine matrix weights and sums their outputs.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import onnx
from onnx import TensorProto

from ._graph import Dim, DType, GraphBuilder


def router(
    b: GraphBuilder,
    logits: str,
    *,
    top_k: int,
    order: Literal["softmax_topk", "topk_softmax"],
    renormalize: bool,
    softmax_cast: bool,
) -> tuple[str, str]:
    """Top-k routing weights (model dtype) and expert indices (int64) from router logits."""
    k = b.ints([top_k], "k")
    if order == "topk_softmax":
        values, indices = b.nodes("TopK", [logits, k], n_out=2, axis=-1, largest=1, sorted=1)
        return b.op("Softmax", values, axis=-1), indices
    probs = b.op("Softmax", logits, axis=-1)
    if softmax_cast:  # F.softmax(logits, dtype=torch.float): TopK runs on float32
        probs = b.cast(probs, TensorProto.FLOAT)
    values, indices = b.nodes("TopK", [probs, k], n_out=2, axis=-1, largest=1, sorted=1)
    if renormalize:
        total = b.op("ReduceSum", values, b.ints([-1], "axes"), keepdims=1)
        values = b.op("Div", values, total)
    if softmax_cast:  # routing_weights.to(hidden_states.dtype)
        values = b.cast(values, b.elem)
    return values, indices


def combine_matrix(
    b: GraphBuilder,
    logits: str,
    values: str,
    indices: str,
    experts: int,
    how: Literal["onehot", "scatter"],
) -> str:
    """Dense [T, E] routing matrix with the top-k weights at their experts, zeros elsewhere."""
    if how == "scatter":
        zero = onnx.numpy_helper.from_array(np.zeros(1, dtype=b.np_dtype), "value")
        zeros = b.op("ConstantOfShape", b.op("Shape", logits), value=zero)
        return b.op("ScatterElements", zeros, indices, values, axis=1)
    on_off = b.floats([0.0, 1.0], "onehot_values")
    hot = b.op("OneHot", indices, b.ints(experts, "num_experts"), on_off, axis=-1)  # [T, k, E]
    weighted = b.op("Mul", hot, b.op("Unsqueeze", values, b.ints([-1], "axes")))
    return b.op("ReduceSum", weighted, b.ints([1], "axes"), keepdims=0)


def batched_experts(
    b: GraphBuilder, tokens: str, combine: str, hidden: int, intermediate: int, experts: int
) -> str:
    """All experts as batched SwiGLU MLPs ([E, T, *]), mixed by the [T, E] combine matrix."""
    x = b.op("Unsqueeze", tokens, b.ints([0], "axes"))  # [1, T, h]
    gate = b.op("MatMul", x, b.weight([experts, hidden, intermediate], "w1", fan_in=hidden))
    up = b.op("MatMul", x, b.weight([experts, hidden, intermediate], "w3", fan_in=hidden))
    act = b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up)
    out = b.op("MatMul", act, b.weight([experts, intermediate, hidden], "w2", fan_in=intermediate))
    weights = b.op("Unsqueeze", b.op("Transpose", combine, perm=[1, 0]), b.ints([-1], "axes"))
    return b.op("ReduceSum", b.op("Mul", out, weights), b.ints([0], "axes"), keepdims=0)


def moe(
    *,
    batch: Dim = "batch",
    seq: Dim = "seq",
    hidden: int = 32,
    intermediate: int = 48,
    experts: int = 4,
    top_k: int = 2,
    order: Literal["softmax_topk", "topk_softmax"] = "softmax_topk",
    renormalize: bool = True,
    softmax_cast: bool = False,
    combine: Literal["onehot", "scatter"] = "onehot",
    shared_expert: bool = False,
    opset: int = 13,
    seed: int = 0,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """Sparse MoE block on ``hidden_states`` [batch, seq, hidden] (``example:moe`` and variants).

    Defaults are Mixtral's: Softmax -> TopK(k=2) -> renormalize, OneHot combine, batched SwiGLU
    experts. ``softmax_cast`` adds the Cast to float32 between Softmax and TopK (and back to the
    model dtype after renormalizing) that ``softmax(dtype=float)`` exports; ``shared_expert``
    adds Qwen2-MoE's sigmoid-gated shared expert MLP. Contains exactly one router chain:
    Softmax->TopK (``order="softmax_topk"``) or TopK->Softmax (``"topk_softmax"``), the latter
    never renormalized. Outputs ``output`` [batch, seq, hidden] and ``router_logits`` [T, E].
    """
    if opset < 13:
        raise ValueError(f"moe needs opset >= 13 (ReduceSum axes as input), got {opset}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")
    b = GraphBuilder("moe", opset=opset, dtype=dtype, seed=seed)
    x = b.input("hidden_states", [batch, seq, hidden])
    tokens = b.op("Reshape", x, b.ints([-1, hidden], "flat_shape"))
    with b.scope("gate"):
        logits = b.op("MatMul", tokens, b.weight([hidden, experts], "weight", fan_in=hidden))
    with b.scope("router"):
        values, indices = router(
            b, logits, top_k=top_k, order=order, renormalize=renormalize, softmax_cast=softmax_cast
        )
        mix = combine_matrix(b, logits, values, indices, experts, combine)
    with b.scope("experts"):
        y = batched_experts(b, tokens, mix, hidden, intermediate, experts)
    if shared_expert:
        with b.scope("shared_expert"):
            w_gate = b.weight([hidden, intermediate], "gate_proj", fan_in=hidden)
            w_up = b.weight([hidden, intermediate], "up_proj", fan_in=hidden)
            g = b.op("MatMul", tokens, w_gate)
            act = b.op("Mul", b.op("Mul", g, b.op("Sigmoid", g)), b.op("MatMul", tokens, w_up))
            w_down = b.weight([intermediate, hidden], "down_proj", fan_in=intermediate)
            s = b.op("MatMul", act, w_down)
            w_sg = b.weight([hidden, 1], "shared_expert_gate", fan_in=hidden)
            y = b.op("Add", y, b.op("Mul", b.op("Sigmoid", b.op("MatMul", tokens, w_sg)), s))
    y = b.op("Reshape", y, b.op("Shape", x))
    tokens_dim: Dim = batch * seq if isinstance(batch, int) and isinstance(seq, int) else "tokens"
    b.graph_output(y, "output", [batch, seq, hidden])
    b.graph_output(logits, "router_logits", [tokens_dim, experts])
    return b.build(moe.__doc__ or "")


def qwen_router(**kwargs: Any) -> onnx.ModelProto:
    """Qwen2-MoE-style block (``example:qwen-router``): 8 experts, top-4 **without**
    renormalization, ScatterElements combine, sigmoid-gated shared expert. Keyword arguments
    override these defaults and are passed to ``moe``."""
    options: dict[str, Any] = {
        "experts": 8,
        "top_k": 4,
        "renormalize": False,
        "combine": "scatter",
        "shared_expert": True,
    }
    options.update(kwargs)
    return moe(**options)
