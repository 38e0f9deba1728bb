"""Geometry of an ONNX Conv: attributes resolved to explicit sizes (1-D convs as H = 1).

A ConvTranspose (`transposed=1`) is described as the convolution it equals: over its input
with `stride - 1` zeros inserted between pixels (`up_h`, `up_w`; h and w are then the dilated
sizes), padded by dilation * (k - 1) - pad at the start and that plus output_padding at the
end (a negative pad crops), stride 1, the same dilation, and the weight flipped spatially with
its in/out channels swapped per group (`transposed_weight`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..api import KernelError, TensorMeta


@dataclass(frozen=True)
class ConvGeometry:
    """A 2-D convolution (a 1-D one has h = kh = 1), pads resolved from `auto_pad`."""

    n: int
    cin: int
    cout: int
    group: int
    h: int
    w: int
    kh: int
    kw: int
    sh: int
    sw: int
    dh: int
    dw: int
    pad_top: int
    pad_left: int
    ho: int
    wo: int
    spatial_rank: int
    up_h: int = 1  # zeros inserted: a ConvTranspose's strides (1 for a Conv)
    up_w: int = 1
    transposed: bool = False  # a ConvTranspose's equivalent convolution (W to transform)

    @property
    def src_pixels(self) -> int:
        """Pixels per channel of the input as it sits in GM (before zero insertion)."""
        return ((self.h - 1) // self.up_h + 1) * ((self.w - 1) // self.up_w + 1)

    @property
    def cin_g(self) -> int:
        """Input channels per group."""
        return self.cin // self.group

    @property
    def cout_g(self) -> int:
        """Output channels per group."""
        return self.cout // self.group

    @property
    def taps(self) -> int:
        """Kernel positions kh * kw."""
        return self.kh * self.kw

    def out_shape(self) -> tuple[int, ...]:
        """ONNX output shape (N, Cout, [Ho,] Wo)."""
        if self.spatial_rank == 1:
            return (self.n, self.cout, self.wo)
        return (self.n, self.cout, self.ho, self.wo)

    def halo(self, rows: int, cols: int) -> tuple[int, int]:
        """Input rows and columns (padded coordinates) that `rows` x `cols` outputs read."""
        return (rows - 1) * self.sh + (self.kh - 1) * self.dh + 1, (cols - 1) * self.sw + (
            self.kw - 1
        ) * self.dw + 1

    def channel_range(self, co0: int, co1: int) -> tuple[int, int]:
        """Input channels [lo, hi) feeding output channels [co0, co1) (their groups')."""
        g0, g1 = co0 // self.cout_g, (co1 - 1) // self.cout_g + 1
        return g0 * self.cin_g, g1 * self.cin_g


def _ints(attrs: Mapping[str, Any], name: str, default: Sequence[int]) -> list[int]:
    v = attrs.get(name)
    if v is None:
        return list(default)
    return [int(x) for x in v]


def _taps(
    attrs: Mapping[str, Any], w: TensorMeta, op: str
) -> tuple[list[int], list[int], list[int]]:
    """(kernel_shape, strides, dilations) with ONNX defaults; the kernel must be W's."""
    rank = len(w.shape) - 2
    kernel = _ints(attrs, "kernel_shape", w.shape[2:])
    if list(kernel) != list(w.shape[2:]):
        raise KernelError(f"{op}: kernel_shape {kernel} differs from W {w.shape}")
    return kernel, _ints(attrs, "strides", [1] * rank), _ints(attrs, "dilations", [1] * rank)


def conv_geometry(x: TensorMeta, w: TensorMeta, attrs: Mapping[str, Any], op: str) -> ConvGeometry:
    """Resolve ONNX Conv attributes for input `x` and weight `w`; `KernelError` if invalid."""
    if attrs.get("transposed", 0):
        return _transposed_geometry(x, w, attrs, op)
    rank = len(x.shape) - 2
    if rank not in (1, 2):
        raise KernelError(f"{op}: only 1-D and 2-D convolutions are supported, X is {x.shape}")
    if len(w.shape) != rank + 2:
        raise KernelError(f"{op}: W {w.shape} does not match X {x.shape}")
    group = int(attrs.get("group", 1))
    n, cin = x.shape[:2]
    cout, cin_g = w.shape[:2]
    if group <= 0 or cin % group or cout % group or cin_g != cin // group:
        raise KernelError(f"{op}: group={group} does not fit X channels {cin} and W {w.shape}")
    kernel, strides, dil = _taps(attrs, w, op)
    spatial = list(x.shape[2:])
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    begin: list[int] = []
    out: list[int] = []
    for d in range(rank):
        extent = (kernel[d] - 1) * dil[d] + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-spatial[d] // strides[d])
            total = max(0, (o - 1) * strides[d] + extent - spatial[d])
            b = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
        elif auto_pad == "VALID":
            b, total = 0, 0
            o = (spatial[d] - extent) // strides[d] + 1
        elif auto_pad == "NOTSET":
            pads = _ints(attrs, "pads", [0] * (2 * rank))
            if len(pads) != 2 * rank:
                raise KernelError(f"{op}: pads {pads} needs {2 * rank} values")
            b, total = pads[d], pads[d] + pads[d + rank]
            o = (spatial[d] + total - extent) // strides[d] + 1
        else:
            raise KernelError(f"{op}: unknown auto_pad '{auto_pad}'")
        if o <= 0:
            raise KernelError(f"{op}: output size {o} along spatial axis {d} is not positive")
        begin.append(b)
        out.append(o)
    if rank == 1:
        kernel, strides, dil, spatial, begin, out = (
            [1, *kernel],
            [1, *strides],
            [1, *dil],
            [1, *spatial],
            [0, *begin],
            [1, *out],
        )
    return ConvGeometry(
        n=n, cin=cin, cout=cout, group=group, h=spatial[0], w=spatial[1], kh=kernel[0],
        kw=kernel[1], sh=strides[0], sw=strides[1], dh=dil[0], dw=dil[1], pad_top=begin[0],
        pad_left=begin[1], ho=out[0], wo=out[1], spatial_rank=rank,
    )  # fmt: skip


def _transposed_geometry(
    x: TensorMeta, w: TensorMeta, attrs: Mapping[str, Any], op: str
) -> ConvGeometry:
    """The convolution a ConvTranspose equals (see the module docstring)."""
    rank = len(x.shape) - 2
    if rank not in (1, 2):
        raise KernelError(f"{op}: only 1-D and 2-D convolutions are supported, X is {x.shape}")
    if len(w.shape) != rank + 2:
        raise KernelError(f"{op}: W {w.shape} does not match X {x.shape}")
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if (auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad) != "NOTSET":
        raise KernelError(f"{op}: transposed with auto_pad={auto_pad!r} (explicit pads only)")
    if attrs.get("output_shape"):
        raise KernelError(f"{op}: transposed with output_shape (explicit pads only)")
    group = int(attrs.get("group", 1))
    n, cin = x.shape[:2]
    cin_w, cout_g = w.shape[:2]
    if group <= 0 or cin % group or cin_w != cin:
        raise KernelError(f"{op}: group={group} does not fit X channels {cin} and W {w.shape}")
    kernel, strides, dil = _taps(attrs, w, op)
    pads = _ints(attrs, "pads", [0] * (2 * rank))
    extra = _ints(attrs, "output_padding", [0] * rank)
    if len(pads) != 2 * rank or len(extra) != rank:
        raise KernelError(f"{op}: pads {pads} / output_padding {extra} do not fit rank {rank}")
    spatial, begin, out = [], [], []
    for d in range(rank):
        span = (kernel[d] - 1) * dil[d]
        o = strides[d] * (x.shape[2 + d] - 1) + extra[d] + span + 1 - pads[d] - pads[d + rank]
        if o <= 0:
            raise KernelError(f"{op}: output size {o} along spatial axis {d} is not positive")
        spatial.append((x.shape[2 + d] - 1) * strides[d] + 1)
        begin.append(span - pads[d])
        out.append(o)
    if rank == 1:
        kernel, strides, dil, spatial, begin, out = (
            [1, *kernel], [1, *strides], [1, *dil], [1, *spatial], [0, *begin], [1, *out],
        )  # fmt: skip
    return ConvGeometry(
        n=n, cin=cin, cout=cout_g * group, group=group, h=spatial[0], w=spatial[1],
        kh=kernel[0], kw=kernel[1], sh=1, sw=1, dh=dil[0], dw=dil[1], pad_top=begin[0],
        pad_left=begin[1], ho=out[0], wo=out[1], spatial_rank=rank, up_h=strides[0],
        up_w=strides[1], transposed=True,
    )  # fmt: skip


def transposed_weight(w: np.ndarray, group: int) -> np.ndarray:
    """A ConvTranspose weight [Cin, Cout/group, *k] as the weight of the convolution it equals,
    [Cout, Cin/group, *k]: per group in/out channels swapped, taps flipped."""
    cin, cout_g = w.shape[:2]
    k = w.shape[2:]
    wg = w.reshape(group, cin // group, cout_g, *k).swapaxes(1, 2)
    flipped = wg[(slice(None),) * 3 + (slice(None, None, -1),) * len(k)]
    return np.ascontiguousarray(flipped.reshape(group * cout_g, cin // group, *k))


def zero_inserted(x: np.ndarray, g: ConvGeometry) -> np.ndarray:
    """[N, C, H, W] input with up - 1 zeros between pixels: what the transposed kernel's DMA
    writes into L1 (the zeros are written, not read from GM)."""
    if g.up_h == 1 and g.up_w == 1:
        return x
    out = np.zeros((*x.shape[:2], g.h, g.w), x.dtype)
    out[:, :, :: g.up_h, :: g.up_w] = x
    return out
