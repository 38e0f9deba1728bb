"""Large synthetic graphs of a requested node count, for the fusion-speed benchmarks.

Both builders repeat small, realistic blocks (tiny channel counts and hidden sizes, so a
100k-node model stays a few tens of MB at most and builds in a few seconds) until the graph has
about ``n_nodes`` nodes (within half a block, far inside 10%). Each block holds instances of the
fusable chains among ordinary ops. Every copy of a block has its own freshly drawn weights (no
initializer is shared), as in a real export; blocks are copied through ``_repeat`` for speed.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import TensorProto

from ._graph import Dim, DType, GraphBuilder
from ._repeat import BlockTemplate, block_value, make_template, repeat_blocks
from .cnn import ConvSpec, conv_bn
from .moe import batched_experts, combine_matrix, router
from .transformer import LayerNormStyle, layer_norm, linear, pre_ln_attention, pre_ln_gated_mlp

Block = Callable[[GraphBuilder, str], str]


def _plan(sizes: list[int], n_nodes: int, fixed: int) -> list[int]:
    """Cycle through block kinds while that brings the total closer to ``n_nodes``."""
    order: list[int] = []
    total = fixed
    while True:
        kind = len(order) % len(sizes)
        if abs(total + sizes[kind] - n_nodes) >= abs(total - n_nodes):
            return order
        order.append(kind)
        total += sizes[kind]


# -- CNN ---------------------------------------------------------------------------------------


def _cnn_blocks(c: int) -> list[Block]:
    def residual(b: GraphBuilder, x: str) -> str:
        z = conv_bn(b, x, c, ConvSpec(c, 3))
        z = conv_bn(b, z, c, ConvSpec(c, 3, relu=False))
        return b.op("Relu", b.op("Add", z, x))

    def depthwise(b: GraphBuilder, x: str) -> str:
        return conv_bn(b, x, c, ConvSpec(c, 3, group=c))

    def silu(b: GraphBuilder, x: str) -> str:
        z = conv_bn(b, x, c, ConvSpec(c, 1, bias=True, relu=False))
        return b.op("Mul", z, b.op("Sigmoid", z))

    return [residual, depthwise, silu]


def cnn_graph(
    n_nodes: int = 1000,
    *,
    batch: Dim = "N",
    channels: int = 4,
    image_size: int = 4,
    seed: int = 0,
    opset: int = 13,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """A deep CNN of about ``n_nodes`` nodes at constant resolution.

    A stem Conv+BN+Relu (3 -> ``channels``), then blocks cycling through:

    - residual basic block (7 nodes): Conv+BN+Relu, Conv+BN, Add, Relu;
    - depthwise block (3 nodes): depthwise 3x3 Conv (group = channels) + BN + Relu;
    - SiLU block (4 nodes): 1x1 Conv (with bias) + BN, Sigmoid, Mul.

    So per 14 nodes: 2 Conv->BN->Relu and 2 Conv->BN. Input ``input`` [batch, 3, H, W], output
    ``output`` [batch, channels, H, W].
    """
    b = GraphBuilder("synthetic_cnn", opset=opset, dtype=dtype, seed=seed)
    x = b.input("input", [batch, 3, image_size, image_size])
    with b.scope("stem"):
        y = conv_bn(b, x, 3, ConvSpec(channels, 3))
    b.rename(y, block_value(0, "block"))
    blocks = _cnn_blocks(channels)
    templates = [
        make_template(block, scope="block", opset=opset, dtype=dtype, seed=seed + 1 + i)
        for i, block in enumerate(blocks)
    ]
    order = _plan([t.node_count for t in templates], n_nodes, b.node_count)
    last = repeat_blocks(b, templates, order)
    b.graph_output(block_value(last, "block"), "output", [batch, channels, image_size, image_size])
    return b.build(cnn_graph.__doc__ or "")


# -- transformer -------------------------------------------------------------------------------

_STYLES = (
    LayerNormStyle(kind="op"),
    LayerNormStyle(),
    LayerNormStyle(divide="reciprocal", square="mul", noop_casts=True),
    LayerNormStyle(kind="op"),
)


def _moe_mlp(b: GraphBuilder, h: str, hidden: int, intermediate: int) -> str:
    """Pre-LN Mixtral MoE MLP: LN -> Reshape -> router Softmax->TopK(2)->renormalize -> experts."""
    with b.scope("post_attention_layernorm"):
        n = layer_norm(b, h, hidden, LayerNormStyle(kind="op"), 1e-5)
    with b.scope("moe"):
        tokens = b.op("Reshape", n, b.ints([-1, hidden], "flat_shape"))
        logits = b.op("MatMul", tokens, b.weight([hidden, 4], "gate", fan_in=hidden))
        values, indices = router(
            b, logits, top_k=2, order="softmax_topk", renormalize=True, softmax_cast=False
        )
        mix = combine_matrix(b, logits, values, indices, 4, "onehot")
        y = batched_experts(b, tokens, mix, hidden, intermediate, 4)
        return b.op("Add", h, b.op("Reshape", y, b.op("Shape", h)))


def _decoder_layers(hidden: int, heads: int, intermediate: int, max_positions: int) -> list[Block]:
    def make(kind: int) -> Block:
        style = _STYLES[kind]

        def layer(b: GraphBuilder, h: str) -> str:
            h = pre_ln_attention(
                b, h, hidden=hidden, heads=heads, style=style, epsilon=1e-5,
                max_positions=max_positions,
            )  # fmt: skip
            if kind == 3:
                return _moe_mlp(b, h, hidden, intermediate)
            return pre_ln_gated_mlp(
                b, h, hidden=hidden, intermediate=intermediate, style=style, epsilon=1e-5
            )

        return layer

    return [make(kind) for kind in range(len(_STYLES))]


def transformer_graph(
    n_nodes: int = 1000,
    *,
    batch: Dim = "batch",
    seq: Dim = "seq",
    hidden: int = 8,
    heads: int = 2,
    intermediate: int = 16,
    vocab: int = 16,
    max_positions: int = 16,
    seed: int = 0,
    opset: int = 17,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """A pre-LN decoder stack of about ``n_nodes`` nodes, cycling four layer kinds:

    0. LayerNormalization op before attention (Q, K, V) and before a gated MLP (gate, up);
    1. the same with decomposed LayerNorms (Pow, Div);
    2. decomposed LayerNorms with Reciprocal+Mul, Mul(x, x) and no-op Casts;
    3. LN op before attention, then a Mixtral MoE MLP (Softmax->TopK->renormalize router)
       whose LN feeds a Reshape to tokens (not a LayerNorm->MatMul chain).

    Per 4 layers: 7 LayerNorm->MatMul chains (3 MatMuls on each attention LN, 2 on each
    gated-MLP LN), 1 LN feeding the MoE, 1 Softmax->TopK; then a final LN -> lm_head MatMul.
    Needs opset >= 17. Input ``input_ids``, output ``logits`` [batch, seq, vocab].
    """
    if opset < 17:
        raise ValueError(f"transformer_graph mixes in LayerNormalization: opset >= 17, got {opset}")
    b = GraphBuilder("synthetic_transformer", opset=opset, dtype=dtype, seed=seed)
    ids = b.input("input_ids", [batch, seq], TensorProto.INT64)
    h = b.op("Gather", b.weight([vocab, hidden], "embed_tokens", fan_in=1), ids)
    b.rename(h, block_value(0, "layers"))
    templates: list[BlockTemplate] = [
        make_template(layer, scope="layers", opset=opset, dtype=dtype, seed=seed + 1 + i)
        for i, layer in enumerate(_decoder_layers(hidden, heads, intermediate, max_positions))
    ]
    tail = 2  # the final LayerNormalization and lm_head MatMul
    order = _plan([t.node_count for t in templates], n_nodes, b.node_count + tail)
    last = repeat_blocks(b, templates, order)
    with b.scope("norm"):
        n = layer_norm(b, block_value(last, "layers"), hidden, _STYLES[0], 1e-5)
    logits = linear(b, n, hidden, vocab, "lm_head", bias=False, bias_first=False)
    b.graph_output(logits, "logits", [batch, seq, vocab])
    return b.build(transformer_graph.__doc__ or "")
