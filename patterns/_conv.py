"""ONNX Conv semantics in numpy, and the output-shape arithmetic shape inference shares.

Computed in float64 and cast back to the input dtype: the reference is the exact composition of
the original ops, so that every kernel and every rewrite is compared against the ideal result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

Dim = int | str | None


def resolve_pads(
    spatial: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    auto_pad: str,
    pads: Sequence[int] | None,
) -> list[int]:
    """Explicit begin/end pads, ONNX layout [b1, b2, ..., e1, e2, ...], for any auto_pad."""
    rank = len(spatial)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for size, k, s, d in zip(spatial, kernel, strides, dilations, strict=True):
            out = math.ceil(size / s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            small, large = total // 2, total - total // 2
            begins.append(small if auto_pad == "SAME_UPPER" else large)
            ends.append(large if auto_pad == "SAME_UPPER" else small)
        return begins + ends
    if auto_pad == "VALID":
        return [0] * (2 * rank)
    return list(pads) if pads else [0] * (2 * rank)


def conv_attrs(attrs: Mapping[str, Any], w_shape: Sequence[int]) -> dict[str, Any]:
    """Conv attributes with ONNX defaults filled in for a weight of shape `w_shape`."""
    rank = len(w_shape) - 2
    return {
        "kernel_shape": list(attrs.get("kernel_shape") or w_shape[2:]),
        "strides": list(attrs.get("strides") or [1] * rank),
        "dilations": list(attrs.get("dilations") or [1] * rank),
        "group": int(attrs.get("group") or 1),
        "auto_pad": str(attrs.get("auto_pad") or "NOTSET"),
        "pads": list(attrs.get("pads") or [0] * (2 * rank)),
    }


def conv_output_spatial(
    spatial: Sequence[Dim], attrs: Mapping[str, Any], w_shape: Sequence[int]
) -> tuple[Dim, ...]:
    """Output spatial dims; a symbolic or unknown input dim gives an unknown output dim."""
    a = conv_attrs(attrs, w_shape)
    out: list[Dim] = []
    for i, size in enumerate(spatial):
        if not isinstance(size, int):
            out.append(None)
            continue
        s, d, k = a["strides"][i], a["dilations"][i], a["kernel_shape"][i]
        if a["auto_pad"] in ("SAME_UPPER", "SAME_LOWER"):
            out.append(math.ceil(size / s))
            continue
        pads = resolve_pads(
            [size], [k], [s], [d], a["auto_pad"], [a["pads"][i], a["pads"][i + len(spatial)]]
        )
        out.append((size + pads[0] + pads[1] - ((k - 1) * d + 1)) // s + 1)
    return tuple(out)


def conv(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, attrs: Mapping[str, Any]
) -> np.ndarray:
    """ONNX Conv (1-D, 2-D or 3-D; groups, strides, dilations, pads, auto_pad), in float64."""
    a = conv_attrs(attrs, w.shape)
    rank = w.ndim - 2
    spatial = x.shape[2:]
    pads = resolve_pads(
        spatial, a["kernel_shape"], a["strides"], a["dilations"], a["auto_pad"], a["pads"]
    )
    xp = np.pad(
        x.astype(np.float64),
        [(0, 0), (0, 0)] + [(pads[i], pads[i + rank]) for i in range(rank)],
    )
    span = [(k - 1) * d + 1 for k, d in zip(a["kernel_shape"], a["dilations"], strict=True)]
    # windows: [N, C, *out_full, *span] -> keep dilated taps and strided positions
    windows = sliding_window_view(xp, span, axis=tuple(range(2, 2 + rank)))
    index: list[slice] = [slice(None), slice(None)]
    index += [slice(None, None, s) for s in a["strides"]]
    index += [slice(None, None, d) for d in a["dilations"]]
    windows = windows[tuple(index)]
    n, c = x.shape[:2]
    group = a["group"]
    cout = w.shape[0]
    out_spatial = windows.shape[2 : 2 + rank]
    cin_g, cout_g = c // group, cout // group
    w64 = w.astype(np.float64)
    # [N, G, Cin_g, *out, *k] x [G, Cout_g, Cin_g, *k] -> [N, G, Cout_g, *out]
    wins = windows.reshape(n, group, cin_g, *out_spatial, *windows.shape[2 + rank :])
    ws = w64.reshape(group, cout_g, cin_g, *w.shape[2:])
    letters = "abcdefghijklmnopqrstuvwxyz"
    sp, ks = letters[:rank], letters[rank : 2 * rank]
    y = np.einsum(f"NGC{sp}{ks},GOC{ks}->NGO{sp}", wins, ws, optimize=True)
    y = y.reshape(n, cout, *out_spatial)
    if b is not None:
        y = y + b.astype(np.float64).reshape(1, cout, *([1] * rank))
    return y


def conv_transpose_attrs(attrs: Mapping[str, Any], w_shape: Sequence[int]) -> dict[str, Any]:
    """ConvTranspose attributes with ONNX defaults filled in for a weight [Cin, Cout/group,
    *kernel] (auto_pad and output_shape are not resolved: callers refuse them)."""
    a = conv_attrs(attrs, w_shape)
    rank = len(w_shape) - 2
    a["output_padding"] = list(attrs.get("output_padding") or [0] * rank)
    return a


def conv_transpose_output_spatial(
    spatial: Sequence[Dim], attrs: Mapping[str, Any], w_shape: Sequence[int]
) -> tuple[Dim, ...]:
    """ONNX ConvTranspose output dims with explicit pads:
    stride * (size - 1) + output_padding + (k - 1) * dilation + 1 - pad_begin - pad_end."""
    a = conv_transpose_attrs(attrs, w_shape)
    rank = len(spatial)
    out: list[Dim] = []
    for i, size in enumerate(spatial):
        if not isinstance(size, int):
            out.append(None)
            continue
        s, d, k = a["strides"][i], a["dilations"][i], a["kernel_shape"][i]
        full = s * (size - 1) + a["output_padding"][i] + (k - 1) * d + 1
        out.append(full - a["pads"][i] - a["pads"][i + rank])
    return tuple(out)


def conv_transpose(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, attrs: Mapping[str, Any]
) -> np.ndarray:
    """ONNX ConvTranspose (1-D or 2-D, explicit pads; groups, strides, dilations,
    output_padding), in float64, computed as the scatter ONNX defines it: input pixel p of
    channel c adds W[c, o, k] * x[c, p] to output position p * stride + k * dilation - pad."""
    a = conv_transpose_attrs(attrs, w.shape)
    rank = w.ndim - 2
    n, cin = x.shape[:2]
    group = a["group"]
    cin_g, cout_g = cin // group, w.shape[1]
    spatial = list(x.shape[2:])
    kernel, strides, dil = a["kernel_shape"], a["strides"], a["dilations"]
    full = [
        s * (size - 1) + op + (k - 1) * d + 1
        for size, s, d, k, op in zip(
            spatial, strides, dil, kernel, a["output_padding"], strict=True
        )
    ]
    y = np.zeros((n, group, cout_g, *full))
    xg = x.astype(np.float64).reshape(n, group, cin_g, *spatial)
    wg = w.astype(np.float64).reshape(group, cin_g, cout_g, *kernel)
    for tap in np.ndindex(*kernel):
        # [N, G, Cin_g, *spatial] x [G, Cin_g, Cout_g] -> [N, G, Cout_g, *spatial]
        contrib = np.einsum("NGC...,GCO->NGO...", xg, wg[(slice(None),) * 3 + tap])
        index = [slice(None)] * 3 + [
            slice(t * d, t * d + s * (size - 1) + 1, s)
            for t, d, s, size in zip(tap, dil, strides, spatial, strict=True)
        ]
        y[tuple(index)] += contrib
    crop = [slice(None)] * 3 + [
        slice(a["pads"][i], full[i] - a["pads"][i + rank]) for i in range(rank)
    ]
    y = y[tuple(crop)].reshape(n, group * cout_g, *y[tuple(crop)].shape[3:])
    if b is not None:
        y = y + b.astype(np.float64).reshape(1, -1, *([1] * rank))
    return y
