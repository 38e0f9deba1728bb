"""ResNet/MobileNet-style CNN builders with Conv -> BatchNormalization (-> Relu) chains.

Every Conv below is followed by an inference-mode BatchNormalization, written the way the
TorchScript exporter writes it with ``training=TrainingMode.PRESERVE`` (BN kept, not folded).

| builder       | what it contains                                                                |
|---------------|---------------------------------------------------------------------------------|
| ``resnet``    | stem Conv+BN+Relu, MaxPool, basic and bottleneck blocks with residual Adds,     |
|               | Conv+BN without Relu before each Add, projection shortcuts (Conv+BN), odd       |
|               | channel counts, bias-free Convs, GlobalAveragePool + Gemm head                  |
| ``mobilenet`` | inverted residual blocks: 1x1 expand Conv+BN+Relu, depthwise (group=channels)   |
|               | Conv+BN+Relu with auto_pad SAME_UPPER, 1x1 project Conv+BN, residual Adds;      |
|               | Convs with bias                                                                 |
| ``cnn_edge``  | the corner cases, one per chain: Conv output also a graph output, BN scale      |
|               | computed at run time from a graph input, BN scale = Mul of two initializers,    |
|               | BN parameters from a Constant node and ConstantOfShape, SAME_UPPER, depthwise   |
|               | strided Conv+BN without bias feeding SiLU                                       |
| ``conv1d``    | 1-D temporal CNN on a symbolic length: Conv1d+BN+Relu, dilated Conv1d,          |
|               | SAME_UPPER, strided projection shortcut, residual Add                           |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import onnx

from ._graph import Dim, DType, GraphBuilder


@dataclass(frozen=True)
class ConvSpec:
    """One Conv (any rank) followed by BatchNormalization and optionally Relu."""

    out_channels: int
    kernel: int
    stride: int = 1
    group: int = 1
    dilation: int = 1
    bias: bool = False
    relu: bool = True
    auto_pad: str | None = None  # None: explicit symmetric pads ("same" for odd kernels)


def conv_bn(
    b: GraphBuilder,
    x: str,
    in_channels: int,
    spec: ConvSpec,
    *,
    spatial_dims: int = 2,
    bn_params: tuple[str, str, str, str] | None = None,
    epsilon: float = 1e-5,
) -> str:
    """Append Conv -> BatchNormalization (-> Relu) and return the last output.

    ``bn_params`` (scale, bias, mean, var) overrides the random BN initializers, for BN whose
    parameters come from elsewhere in the graph.
    """
    c = spec.out_channels
    kernel = [spec.kernel] * spatial_dims
    w = b.weight(
        [c, in_channels // spec.group, *kernel],
        "weight",
        fan_in=in_channels // spec.group * spec.kernel**spatial_dims,
    )
    inputs = [x, w]
    if spec.bias:
        inputs.append(b.weight([c], "bias", fan_in=16))
    pad = spec.dilation * (spec.kernel - 1) // 2
    attrs: dict[str, Any] = {
        "kernel_shape": kernel,
        "strides": [spec.stride] * spatial_dims,
        "dilations": [spec.dilation] * spatial_dims if spec.dilation != 1 else None,
        "group": spec.group if spec.group != 1 else None,
    }
    if spec.auto_pad is not None:
        attrs["auto_pad"] = spec.auto_pad
    else:
        attrs["pads"] = [pad] * (2 * spatial_dims)
    y = b.op("Conv", *inputs, **attrs)
    if bn_params is None:
        bn_params = (
            b.uniform([c], "bn.weight", 0.5, 1.5),
            b.uniform([c], "bn.bias", -0.5, 0.5),
            b.uniform([c], "bn.running_mean", -0.2, 0.2),
            b.uniform([c], "bn.running_var", 0.5, 1.5),
        )
    y = b.op("BatchNormalization", y, *bn_params, epsilon=epsilon)
    return b.op("Relu", y) if spec.relu else y


# -- ResNet ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockSpec:
    """A residual block: ``basic`` (3x3, 3x3) or ``bottleneck`` (1x1, 3x3, 1x1)."""

    kind: Literal["basic", "bottleneck"]
    out_channels: int
    stride: int = 1
    mid_channels: int | None = None  # bottleneck width; defaults to out_channels // 4


DEFAULT_BLOCKS: tuple[BlockSpec, ...] = (
    BlockSpec("basic", 8),  # identity shortcut
    BlockSpec("basic", 16, stride=2),  # projection shortcut Conv+BN
    BlockSpec("bottleneck", 21, stride=2, mid_channels=7),  # odd channel counts
)


def _residual_block(b: GraphBuilder, x: str, c_in: int, block: BlockSpec) -> str:
    c_out = block.out_channels
    if block.kind == "basic":
        y = conv_bn(b, x, c_in, ConvSpec(c_out, 3, block.stride))
        y = conv_bn(b, y, c_out, ConvSpec(c_out, 3, relu=False))
    else:
        mid = block.mid_channels or max(1, c_out // 4)
        y = conv_bn(b, x, c_in, ConvSpec(mid, 1))
        y = conv_bn(b, y, mid, ConvSpec(mid, 3, block.stride))
        y = conv_bn(b, y, mid, ConvSpec(c_out, 1, relu=False))
    if block.stride != 1 or c_in != c_out:
        with b.scope("downsample"):
            x = conv_bn(b, x, c_in, ConvSpec(c_out, 1, block.stride, relu=False))
    return b.op("Relu", b.op("Add", y, x))


def resnet(
    *,
    batch: Dim = "N",
    image_size: int = 32,
    in_channels: int = 3,
    stem_channels: int = 8,
    blocks: tuple[BlockSpec, ...] = DEFAULT_BLOCKS,
    num_classes: int = 10,
    seed: int = 0,
    opset: int = 13,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """ResNet-style classifier (``example:resnet``).

    Contains, with the default blocks: 5 Conv->BN->Relu (stem, first conv of each block, the
    bottleneck's 3x3), 5 Conv->BN without Relu (last conv of each block feeding the residual
    Add, and two projection shortcuts), 3 residual Adds, odd channel counts (7, 21), no Conv
    bias; then MaxPool, GlobalAveragePool, Flatten, Gemm. Input ``input`` [batch, 3, H, W],
    output ``logits`` [batch, num_classes].
    """
    b = GraphBuilder("resnet", opset=opset, dtype=dtype, seed=seed)
    x = b.input("input", [batch, in_channels, image_size, image_size])
    with b.scope("stem"):
        y = conv_bn(b, x, in_channels, ConvSpec(stem_channels, 7, stride=2))
        y = b.op("MaxPool", y, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    c = stem_channels
    for i, block in enumerate(blocks):
        with b.scope(f"layer{i + 1}"):
            y = _residual_block(b, y, c, block)
        c = block.out_channels
    with b.scope("head"):
        y = b.op("Flatten", b.op("GlobalAveragePool", y), axis=1)
        w = b.weight([num_classes, c], "fc.weight", fan_in=c)
        y = b.nodes("Gemm", [y, w, b.weight([num_classes], "fc.bias")], prefix="fc", transB=1)[0]
    b.graph_output(y, "logits", [batch, num_classes])
    return b.build(resnet.__doc__ or "")


# -- MobileNet ---------------------------------------------------------------------------------


def mobilenet(
    *,
    batch: Dim = "N",
    image_size: int = 32,
    in_channels: int = 3,
    blocks: tuple[tuple[int, int, int], ...] = ((2, 8, 1), (3, 12, 2), (3, 12, 1)),
    seed: int = 0,
    opset: int = 13,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """MobileNetV2-style net: depthwise convs, SAME_UPPER padding (``example:mobilenet``).

    ``blocks`` are (expansion, out_channels, stride). With the defaults it contains 7
    Conv->BN->Relu (stem 3x3/2, and per block the 1x1 expand and the depthwise 3x3 with
    group = channels, auto_pad SAME_UPPER), 3 Conv->BN without Relu (1x1 projections), 2
    residual Adds (stride-1 blocks with equal channels); every Conv has a bias. Output
    ``features`` [batch, C, H/4, W/4].
    """
    b = GraphBuilder("mobilenet", opset=opset, dtype=dtype, seed=seed)
    x = b.input("input", [batch, in_channels, image_size, image_size])
    c = 8
    with b.scope("stem"):
        y = conv_bn(b, x, in_channels, ConvSpec(c, 3, 2, bias=True, auto_pad="SAME_UPPER"))
    size = image_size // 2
    for i, (t, c_out, stride) in enumerate(blocks):
        with b.scope(f"block{i}"):
            hidden = c * t
            z = conv_bn(b, y, c, ConvSpec(hidden, 1, bias=True))
            z = conv_bn(
                b, z, hidden, ConvSpec(hidden, 3, stride, hidden, bias=True, auto_pad="SAME_UPPER")
            )
            z = conv_bn(b, z, hidden, ConvSpec(c_out, 1, bias=True, relu=False))
            y = b.op("Add", z, y) if stride == 1 and c == c_out else z
        c = c_out
        size = -(-size // stride)
    b.graph_output(y, "features", [batch, c, size, size])
    return b.build(mobilenet.__doc__ or "")


# -- edge cases --------------------------------------------------------------------------------


def cnn_edge(
    *,
    batch: Dim = "N",
    image_size: int = 16,
    channels: int = 8,
    seed: int = 0,
    opset: int = 13,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """Conv+BN corner cases in one chain of five Convs (``example:cnn-edge``).

    1. Conv (with bias) -> BN -> Relu, where the Conv output is also the graph output ``conv1``.
    2. Conv -> BN -> Relu whose BN scale is computed at run time: ``gamma * Sigmoid(gate)``
       with ``gate`` a graph input [channels] (cannot be folded).
    3. Conv 1x1 -> BN -> Relu whose BN scale is ``Mul`` of two initializers (a constant
       subgraph, foldable).
    4. Conv (auto_pad SAME_UPPER) -> BN -> Relu whose BN bias is a ``Constant`` node and whose
       variance is ``ConstantOfShape`` (value 1).
    5. depthwise Conv (group = channels, stride 2, SAME_UPPER, no bias) -> BN, no Relu; its
       output feeds SiLU (Sigmoid, Mul), so the BN output has two readers.
    Totals: 4 Conv->BN->Relu, 1 Conv->BN. Outputs ``output`` and ``conv1``.
    """
    b = GraphBuilder("cnn_edge", opset=opset, dtype=dtype, seed=seed)
    c = channels
    x = b.input("input", [batch, 3, image_size, image_size])
    gate = b.input("gate", [c])

    def bn_random(
        *, scale: str | None = None, bias: str | None = None, var: str | None = None
    ) -> tuple[str, str, str, str]:
        return (
            scale or b.uniform([c], "bn.weight", 0.5, 1.5),
            bias or b.uniform([c], "bn.bias", -0.5, 0.5),
            b.uniform([c], "bn.running_mean", -0.2, 0.2),
            var or b.uniform([c], "bn.running_var", 0.5, 1.5),
        )

    with b.scope("conv1"):
        w = b.weight([c, 3, 3, 3], "weight", fan_in=27)
        y = b.op("Conv", x, w, b.weight([c], "bias"), kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        y = b.graph_output(y, "conv1", [batch, c, image_size, image_size])
        y = b.op("Relu", b.op("BatchNormalization", y, *bn_random(), epsilon=1e-5))
    with b.scope("conv2"):
        scale = b.op("Mul", b.uniform([c], "gamma", 0.5, 1.5), b.op("Sigmoid", gate))
        y = conv_bn(b, y, c, ConvSpec(c, 3), bn_params=bn_random(scale=scale))
    with b.scope("conv3"):
        scale = b.op("Mul", b.uniform([c], "gamma_a", 0.5, 1.5), b.uniform([c], "gamma_b", 0.5, 1))
        y = conv_bn(b, y, c, ConvSpec(c, 1), bn_params=bn_random(scale=scale), epsilon=1e-3)
    with b.scope("conv4"):
        bias = b.constant(b.rng.uniform(-0.5, 0.5, c).astype(b.np_dtype), "bn_bias")
        shape = b.constant(np.array([c], dtype=np.int64), "bn_var_shape")
        one = onnx.numpy_helper.from_array(np.ones(1, dtype=b.np_dtype), "value")
        var = b.op("ConstantOfShape", shape, value=one)
        y = conv_bn(
            b, y, c, ConvSpec(c, 3, auto_pad="SAME_UPPER"), bn_params=bn_random(bias=bias, var=var)
        )
    with b.scope("conv5"):
        y = conv_bn(b, y, c, ConvSpec(c, 3, 2, group=c, relu=False, auto_pad="SAME_UPPER"))
        y = b.op("Mul", y, b.op("Sigmoid", y))
    half = -(-image_size // 2)
    b.graph_output(y, "output", [batch, c, half, half])
    return b.build(cnn_edge.__doc__ or "")


# -- 1-D ---------------------------------------------------------------------------------------


def conv1d(
    *,
    batch: Dim = "N",
    length: Dim = "L",
    in_channels: int = 6,
    channels: int = 12,
    seed: int = 0,
    opset: int = 13,
    dtype: DType = "float32",
) -> onnx.ModelProto:
    """1-D temporal CNN block on [batch, in_channels, length] (``example:conv1d``).

    Contains 3 Conv1d->BN->Relu (k=3; dilated k=3 d=2; k=5 SAME_UPPER with bias) and 2
    Conv1d->BN without Relu (strided k=3 and its strided 1x1 projection shortcut), 1 residual
    Add. Output ``output`` [batch, channels, ceil(length/2)] (symbolic when length is).
    """
    b = GraphBuilder("conv1d", opset=opset, dtype=dtype, seed=seed)
    x = b.input("input", [batch, in_channels, length])
    c = channels
    y = conv_bn(b, x, in_channels, ConvSpec(c, 3), spatial_dims=1)
    y = conv_bn(b, y, c, ConvSpec(c, 3, dilation=2), spatial_dims=1)
    y = conv_bn(b, y, c, ConvSpec(c, 5, bias=True, auto_pad="SAME_UPPER"), spatial_dims=1)
    z = conv_bn(b, y, c, ConvSpec(c, 3, stride=2, relu=False), spatial_dims=1)
    with b.scope("downsample"):
        s = conv_bn(b, x, in_channels, ConvSpec(c, 1, stride=2, relu=False), spatial_dims=1)
    y = b.op("Relu", b.op("Add", z, s))
    out_len: Dim = -(-length // 2) if isinstance(length, int) else "L_out"
    b.graph_output(y, "output", [batch, c, out_len])
    return b.build(conv1d.__doc__ or "")
