"""Convolution as implicit GEMM on the Cube: `ConvBnRelu` (fused) and ONNX `Conv`.

    Y = relu?( BN?( Conv(X, W, B) ) ),  GEMM view: M = N*Ho*Wo, K = Cin/group*Kh*Kw, N = Cout

A work item is one output block: `tile_n` images, `tile_h` x `tile_w` output pixels each (the
GEMM's m), `tile_co` output channels (its n). Items are split over the cube cores in balanced
ranges. For each item the core walks the K dimension: per chunk of `tile_ci` input channels it
copies the input rows the block reads, halo included ((rows - 1) * stride + (Kh - 1) * dilation
+ 1), and the weights into L1 (MTE2); then, per kernel tap, MTE1 builds the L0A operand from L1
(img2col, as Load3D does) and loads the tap's weights into L0B, and the Cube accumulates in L0C
(float32, also for float16 inputs). With `fold_taps` (small Cin) the chunk holds all the block's
channels and K = channels x taps is walked in steps instead (one img2col over every tap), so the
Cube no longer pads each tap's few channels to its k0. FixPipe writes the block to GM through
the epilogue: per-channel scale and shift (BN folded, or bias) and Relu, cast to the output
dtype.

Grouped convolutions (depthwise included) run as dense GEMMs over the groups a channel block
covers, with block-diagonal weights: the Cube pays for the zeros, as group packing does on
hardware. The packed weight layout is prepared once per run, as weights are converted to the
Cube's format at model load. With BN inputs the core folds scale / sqrt(var + eps) and the
shift on its scalar unit once per channel block.

Transposed (`transposed=1`, ONNX ConvTranspose): the same program over the convolution it
equals (geometry.py): the input with stride - 1 zeros between pixels, the weight flipped and
its channels swapped per group (prepared once, as any weight conversion). The zero insertion
happens in the DMA into L1: each halo copy is priced at the bytes it writes, zeros included,
and the Cube multiplies the zeros too (about stride_h * stride_w times the useful work).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, ClassVar, NamedTuple

import numpy as np
from fuser.patterns.conv_activation import Activation, from_attributes

from .._budget import QueueSpec, check_flag, check_positive, require_fits
from .._groups import Group, launch_groups
from ..api import (
    Kernel,
    KernelError,
    KernelRun,
    MachineLimitError,
    TensorMeta,
    Tiling,
    TilingError,
)
from ..npu.core import Core
from ..npu.launch import launch
from ..npu.machine import Machine
from ..npu.memory import Tile
from ..npu.pipes import Level
from ..search import Searched
from .epilogue import WORKSPACE, VectorEpilogue
from .geometry import ConvGeometry, conv_geometry, transposed_weight, zero_inserted
from .tiling import ConvTiling, conv_specs, default_conv_tiling, effective, images


class _Item(NamedTuple):
    n: int
    n1: int  # images n..n1 (tile_n per block)
    h0: int
    h1: int
    w0: int
    w1: int
    co0: int
    co1: int


class _ConvKernel(Kernel):
    """Implicit-GEMM convolution; subclasses say which inputs and epilogue they have."""

    tiling_type = ConvTiling
    fused: ClassVar[bool]

    # -- inputs and shapes ------------------------------------------------------------------
    def _metas(
        self, inputs_meta: Sequence[TensorMeta | None]
    ) -> tuple[TensorMeta, TensorMeta, TensorMeta | None, bool]:
        """(X, W, B, has_bn) after checking presence and dtypes."""
        metas = list(inputs_meta) + [None] * (7 - len(inputs_meta))
        x, w, b = metas[0], metas[1], metas[2]
        if x is None or w is None:
            raise KernelError(f"{self.op_type}: X and W are required")
        bn = metas[3:7] if self.fused else []
        present = [m is not None for m in bn]
        if any(present) and not all(present):
            raise KernelError(f"{self.op_type}: BN inputs scale, bias, mean, var: all four or none")
        if x.dtype not in (np.float16, np.float32):
            error = MachineLimitError if x.dtype == np.float64 else KernelError
            raise error(f"{self.op_type}: the Cube takes float16 or float32, got {x.dtype}")
        if w.dtype != x.dtype:
            raise KernelError(f"{self.op_type}: W dtype {w.dtype} differs from X dtype {x.dtype}")
        return x, w, b, all(present) and bool(bn)

    def _geometry(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[ConvGeometry, TensorMeta, bool, bool]:
        x, w, b, has_bn = self._metas(inputs_meta)
        g = conv_geometry(x, w, attrs, self.op_type)
        cout = g.cout
        if b is not None and b.shape != (cout,):
            raise KernelError(f"{self.op_type}: B must have shape ({cout},), got {b.shape}")
        if has_bn:
            for i, name in zip(range(3, 7), ("scale", "bias", "mean", "var"), strict=True):
                m = inputs_meta[i]
                if m is not None and m.shape != (cout,):
                    raise KernelError(
                        f"{self.op_type}: {name} must have shape ({cout},), got {m.shape}"
                    )
        return g, x, b is not None, has_bn

    def activation(self, attrs: Mapping[str, Any]) -> Activation:
        """The activation the attributes say (none for plain Conv); `KernelError` if bad."""
        if not self.fused:
            return Activation()
        try:
            return from_attributes(attrs)
        except ValueError as e:
            raise KernelError(f"{self.op_type}: {e}") from None

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        g, x, _, _ = self._geometry(inputs_meta, attrs)
        return (TensorMeta(g.out_shape(), x.dtype),)

    # -- tiling -----------------------------------------------------------------------------
    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, ConvTiling)
        t = tiling
        check_positive(
            self.op_type, tile_h=t.tile_h, tile_w=t.tile_w, tile_co=t.tile_co, tile_ci=t.tile_ci,
            cores=t.cores,
        )  # fmt: skip
        check_flag(self.op_type, double_buffer=t.double_buffer, fold_taps=t.fold_taps)
        check_positive(self.op_type, tile_n=t.tile_n)
        if t.cores > machine.cube_cores:
            raise TilingError(
                f"{self.op_type}: tiling uses {t.cores} cores, {machine.name} has "
                f"{machine.cube_cores} cube cores"
            )
        g, x, has_b, has_bn = self._geometry(inputs_meta, attrs)
        if t.fold_taps and g.group > 1:
            raise TilingError(f"{self.op_type}: fold_taps needs group = 1, got {g.group}")
        require_fits(self.op_type, machine, conv_specs(g, x.dtype, has_b or has_bn, t))

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> ConvTiling:
        """Host tiling: the fitting candidate with the lowest estimated cycles."""
        g, x, has_b, has_bn = self._geometry(inputs_meta, attrs)
        return default_conv_tiling(g, x.dtype, has_b or has_bn, machine, self.op_type)

    # -- the program ------------------------------------------------------------------------
    def simulate(
        self,
        machine: Machine,
        inputs: Sequence[np.ndarray | None],
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        functional: bool,
        timeline: bool,
    ) -> KernelRun:
        assert isinstance(tiling, ConvTiling)
        g, x, has_b, has_bn = self._geometry(inputs_meta, attrs)
        th, tw, co, _ = effective(g, tiling)
        tn = images(g, tiling)
        # Channel blocks outermost: a core's consecutive blocks share their weights.
        work = [
            _Item(
                n,
                min(n + tn, g.n),
                h0,
                min(h0 + th, g.ho),
                w0,
                min(w0 + tw, g.wo),
                c0,
                min(c0 + co, g.cout),
            )
            for c0 in range(0, g.cout, co)
            for n in range(0, g.n, tn)
            for h0 in range(0, g.ho, th)
            for w0 in range(0, g.wo, tw)
        ]
        data = None
        y = None
        if functional:
            X, W = inputs[0], inputs[1]
            assert X is not None
            assert W is not None
            y = np.empty(g.out_shape(), x.dtype)
            if g.transposed:
                W = transposed_weight(W, g.group)
            src = X.reshape(g.n, g.cin, (g.h - 1) // g.up_h + 1, (g.w - 1) // g.up_w + 1)
            data = _RunData(
                x=zero_inserted(src, g),
                packed=_pack_weights(W.reshape(g.cout, g.cin_g, g.kh, g.kw), g, co),
                params=self._raw_params(inputs, g) if (has_b or has_bn) else None,
                y=y.reshape(g.n, g.cout, g.ho, g.wo),
            )
        specs = conv_specs(g, x.dtype, has_b or has_bn, tiling)
        act = self.activation(attrs)
        relu = act.name == "Relu"
        eps = float(attrs.get("epsilon", 1e-5))
        program = partial(_program, g, x.dtype, specs, tiling, has_b, has_bn, relu, eps, data)
        sizes = _gm_sizes(inputs_meta)
        if act.on_vector:
            sizes[WORKSPACE] = 0  # written by this kernel into the L2 just before it is read
            stats = launch_groups(
                machine,
                self.op_type,
                work,
                partial(_grouped, program, act, x.dtype),
                max_groups=tiling.cores,
                functional=functional,
                timeline=timeline,
                gm_sizes=sizes,
            )
        else:
            stats = launch(
                machine,
                self.op_type,
                work,
                program,
                max_cores=tiling.cores,
                functional=functional,
                signature=partial(_signature, g),
                timeline=timeline,
                gm_sizes=sizes,
            )
        return KernelRun((y,) if y is not None else (), stats)

    def _raw_params(self, inputs: Sequence[np.ndarray | None], g: ConvGeometry) -> np.ndarray:
        """[5, Cout] rows B, scale, bias, mean, var (B = 0 when absent; zeros without BN, and
        then only row B is copied in), in the input dtype as they sit in GM."""
        X = inputs[0]
        assert X is not None
        rows = [inputs[2] if len(inputs) > 2 and inputs[2] is not None else np.zeros(g.cout)]
        for i in range(3, 7):
            v = inputs[i] if len(inputs) > i else None
            rows.append(v if v is not None else np.zeros(g.cout))
        return np.stack([np.asarray(r, X.dtype).reshape(g.cout) for r in rows])


class _RunData(NamedTuple):
    x: np.ndarray
    packed: dict[int, np.ndarray]
    params: np.ndarray | None
    y: np.ndarray


def _program(
    g: ConvGeometry,
    dtype: np.dtype,
    specs: list[QueueSpec],
    t: ConvTiling,
    has_b: bool,
    has_bn: bool,
    relu: bool,
    eps: float,
    data: _RunData | None,
    core: Core,
    items: Sequence[_Item],
    vector: VectorEpilogue | None = None,
) -> None:
    bufs = {Level.L1: core.l1, Level.L0A: core.l0a, Level.L0B: core.l0b, Level.L0C: core.l0c}
    q = {s.name: bufs[s.level].queue(s.name, s.slot_bytes, s.depth) for s in specs}
    isz = dtype.itemsize
    params: Tile | None = None
    params_block = -1
    wt: Tile | None = None
    w_block = -1
    for it in items:
        rows_out, cols_out, nco = it.h1 - it.h0, it.w1 - it.w0, it.co1 - it.co0
        nimg = it.n1 - it.n
        m = rows_out * cols_out * nimg
        ci_lo, ci_hi = g.channel_range(it.co0, it.co1)
        # Per-channel parameters stay in L1 while consecutive blocks share their channels.
        if (has_b or has_bn) and it.co0 != params_block:
            params_block = it.co0
            params = q["params"].alloc()
            nrows = 5 if has_bn else 1
            core.copy_in(
                params,
                nrows * nco * isz,
                None if data is None or data.params is None
                else data.params[:nrows, it.co0 : it.co1],
                label="in params", gm="P",
            )  # fmt: skip
            if has_bn:
                # scale / sqrt(var + eps) and (B - mean) * that + bias, per channel.
                core.scalar(4 * nco, (params,), (params,), partial(_fold_bn, eps), label="fold bn")
        acc = q["acc"].alloc()
        first = True
        rows, cols = g.halo(rows_out, cols_out)
        step = ci_hi - ci_lo if t.fold_taps else t.tile_ci
        for c0 in range(ci_lo, ci_hi, step):
            c1 = min(c0 + step, ci_hi)
            cc = c1 - c0
            xt = q["x"].alloc()
            core.copy_in(
                xt,
                _valid_bytes(g, it, c1 - c0, rows, cols, isz),
                None if data is None else partial(_halo_tile, g, data.x, it, c0, c1, rows, cols),
                label="in x",
                gm="X",
            )
            # One K step holding all of a block's weights: consecutive blocks of the same
            # channels reuse the L1 copy instead of fetching it again.
            single = c1 == ci_hi and c0 == ci_lo
            if not (single and w_block == it.co0 and wt is not None):
                wt = q["w"].alloc()
                core.copy_in(
                    wt,
                    nco * cc * g.taps * isz,
                    None if data is None
                    else data.packed[it.co0][:, c0 - ci_lo : c1 - ci_lo],
                    label="in w", gm="W",
                )  # fmt: skip
                w_block = it.co0 if single else -1
            a_bytes, b_bytes = m * cc * isz, cc * nco * isz
            qa, qb = q["a"], q["b"]
            functional = data is not None
            if t.fold_taps:
                # K = channels x taps in steps of tile_ci rows (one Load3D over every tap).
                kf = cc * g.taps
                for s0 in range(0, kf, t.tile_ci):
                    s1 = min(s0 + t.tile_ci, kf)
                    a = qa.alloc()
                    cols_fn = (
                        partial(_img2col_folded, g, nimg, rows_out, cols_out, s0, s1)
                        if functional
                        else None
                    )
                    core.load_l0(a, xt, m * (s1 - s0) * isz, cols_fn, label="img2col")
                    b = qb.alloc()
                    rows_fn = partial(_taps_folded, s0, s1) if functional else None
                    core.load_l0(b, wt, (s1 - s0) * nco * isz, rows_fn, label="load w")
                    core.mmad(acc, a, b, m, s1 - s0, nco, dtype, init=first)
                    first = False
                continue
            for i in range(g.kh):
                for j in range(g.kw):
                    # The L1 -> L0 transforms are numpy work: built only in functional mode.
                    a = qa.alloc()
                    img2col = (
                        partial(_img2col_images, g, nimg, i, j, rows_out, cols_out)
                        if functional
                        else None
                    )
                    core.load_l0(a, xt, a_bytes, img2col, label="img2col")
                    b = qb.alloc()
                    tap = partial(_tap, i, j) if functional else None
                    core.load_l0(b, wt, b_bytes, tap, label="load w")
                    core.mmad(acc, a, b, m, cc, nco, dtype, init=first)
                    first = False
        dst = (
            None
            if data is None
            else data.y[it.n : it.n1, it.co0 : it.co1, it.h0 : it.h1, it.w0 : it.w1]
        )
        epilogue = partial(_epilogue, dtype, relu, nimg, rows_out, cols_out, has_b or has_bn)
        reads = (params,) if params is not None else ()
        if vector is not None:
            vector.run(core, acc, reads, m * nco, dst, epilogue)
            continue
        core.fixpipe(acc, m * nco * isz, dst, epilogue, reads=reads, label="fixpipe out")


def _grouped(
    program: Any, act: Activation, dtype: np.dtype, group: Group, items: Sequence[_Item]
) -> None:
    """One group's share: the convolution on its cube core, the activation on its vector
    cores (`epilogue`)."""
    program(group.cube, items, VectorEpilogue(group.vecs, act, dtype))


def _fold_bn(eps: float, p: np.ndarray) -> np.ndarray:
    """Rows (B, scale, bias, mean, var) -> rows (shift, scale') in float32."""
    b, scale, bias, mean, var = (r.astype(np.float32) for r in p)
    s = scale / np.sqrt(var + np.float32(eps))
    return np.stack([(b - mean) * s + bias, s])


def _epilogue(
    dtype: np.dtype, relu: bool, nimg: int, rows: int, cols: int, has_params: bool,
    acc: np.ndarray, *params: np.ndarray,
) -> np.ndarray:  # fmt: skip
    y = acc
    if has_params:
        p = params[0]
        shift = p[0].astype(np.float32)
        y = y * p[1].astype(np.float32) + shift if p.shape[0] == 2 else y + shift
    if relu:
        y = np.maximum(y, 0.0)
    # L0C holds [images x pixels, co]; GM wants [images, co, rows, cols] (FixPipe's layout
    # conversion).
    return (
        y.astype(dtype)
        .reshape(nimg, rows * cols, -1)
        .transpose(0, 2, 1)
        .reshape(nimg, -1, rows, cols)
    )


def _valid_bytes(g: ConvGeometry, it: _Item, cc: int, rows: int, cols: int, isz: int) -> int:
    """Bytes the DMA really reads: the halo window clipped to the unpadded input."""
    r0 = it.h0 * g.sh - g.pad_top
    c0 = it.w0 * g.sw - g.pad_left
    vr = max(0, min(r0 + rows, g.h) - max(r0, 0))
    vc = max(0, min(c0 + cols, g.w) - max(c0, 0))
    return max(1, (it.n1 - it.n) * cc * vr * vc * isz)


def _halo_tile(
    g: ConvGeometry, x: np.ndarray, it: _Item, c0: int, c1: int, rows: int, cols: int
) -> np.ndarray:
    """The input window of a block with its halo, zeros where it falls in the padding."""
    r0 = it.h0 * g.sh - g.pad_top
    q0 = it.w0 * g.sw - g.pad_left
    tile = np.zeros((it.n1 - it.n, c1 - c0, rows, cols), x.dtype)
    a, b = max(r0, 0), min(r0 + rows, g.h)
    c, d = max(q0, 0), min(q0 + cols, g.w)
    if a < b and c < d:
        tile[:, :, a - r0 : b - r0, c - q0 : d - q0] = x[it.n : it.n1, c0:c1, a:b, c:d]
    return tile


def _img2col(g: ConvGeometry, i: int, j: int, rows: int, cols: int, xt: np.ndarray) -> np.ndarray:
    """L0A operand [m, cc] of tap (i, j): the strided window of the L1 tile."""
    r, c = i * g.dh, j * g.dw
    win = xt[:, r : r + (rows - 1) * g.sh + 1 : g.sh, c : c + (cols - 1) * g.sw + 1 : g.sw]
    return win.reshape(xt.shape[0], rows * cols).T


def _img2col_images(
    g: ConvGeometry, nimg: int, i: int, j: int, rows: int, cols: int, xt: np.ndarray
) -> np.ndarray:
    """L0A operand [images x m, cc] of tap (i, j) for the block's images, image-major."""
    return np.concatenate([_img2col(g, i, j, rows, cols, xt[n]) for n in range(nimg)])


def _img2col_folded(
    g: ConvGeometry, nimg: int, rows: int, cols: int, s0: int, s1: int, xt: np.ndarray
) -> np.ndarray:
    """L0A operand [images x m, s1 - s0]: columns s0..s1 of the block's img2col over every
    tap, K in W's order (channel, tap row, tap column)."""
    taps = [
        _img2col_images(g, nimg, i, j, rows, cols, xt) for i in range(g.kh) for j in range(g.kw)
    ]
    full = np.stack(taps, axis=2)  # [m, channels, taps]
    return full.reshape(full.shape[0], -1)[:, s0:s1]


def _taps_folded(s0: int, s1: int, wt: np.ndarray) -> np.ndarray:
    """L0B operand [s1 - s0, co]: rows s0..s1 of the weights with K = channels x taps."""
    return wt.reshape(wt.shape[0], -1)[:, s0:s1].T


def _tap(i: int, j: int, wt: np.ndarray) -> np.ndarray:
    """L0B operand [cc, co] of tap (i, j) from the L1 weight tile [co, cc, kh, kw]."""
    return wt[:, :, i, j].T


def _pack_weights(w: np.ndarray, g: ConvGeometry, tile_co: int) -> dict[int, np.ndarray]:
    """Per channel block co0: dense [co, K channels of its groups, kh, kw] weights."""
    packed: dict[int, np.ndarray] = {}
    for co0 in range(0, g.cout, tile_co):
        co1 = min(co0 + tile_co, g.cout)
        if g.group == 1:
            packed[co0] = w[co0:co1]
            continue
        lo, hi = g.channel_range(co0, co1)
        dense = np.zeros((co1 - co0, hi - lo, g.kh, g.kw), w.dtype)
        for co in range(co0, co1):
            start = (co // g.cout_g) * g.cin_g - lo
            dense[co - co0, start : start + g.cin_g] = w[co]
        packed[co0] = dense
    return packed


def _signature(g: ConvGeometry, it: _Item) -> tuple[int, ...]:
    # Timing depends on the block's sizes, its K range, how much of its halo is padding (DMA
    # bytes) and its channel block (weights and parameters are reloaded when it changes from
    # one block to the next), not on which pixels it covers.
    rows, cols = g.halo(it.h1 - it.h0, it.w1 - it.w0)
    lo, hi = g.channel_range(it.co0, it.co1)
    return (
        it.n1 - it.n, it.h1 - it.h0, it.w1 - it.w0, it.co0, it.co1 - it.co0, hi - lo,
        _valid_bytes(g, it, 1, rows, cols, 1),
    )  # fmt: skip


def _gm_sizes(metas: Sequence[TensorMeta | None]) -> dict[str, int]:
    """Bytes of the GM tensors the program names: X (halos overlap), W and the parameters
    (re-read per block) are read more than once, the repeats hitting the L2."""
    sizes = {name: m.nbytes for name, m in zip(("X", "W"), metas, strict=False) if m is not None}
    sizes["P"] = sum(m.nbytes for m in metas[2:] if m is not None)
    return sizes


class Conv(_ConvKernel):
    """ONNX Conv: inputs X, W, B (optional); bias added in the FixPipe epilogue."""

    op_type = "Conv"
    domain = ""
    fused = False


class ConvTranspose(_ConvKernel):
    """ONNX ConvTranspose (explicit pads; auto_pad and output_shape refused): the transposed
    program ConvBnRelu runs with transposed=1, bias added in the FixPipe epilogue."""

    op_type = "ConvTranspose"
    domain = ""
    fused = False

    def _geometry(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[ConvGeometry, TensorMeta, bool, bool]:
        return super()._geometry(inputs_meta, {**attrs, "transposed": 1})


class ConvBnRelu(Searched, _ConvKernel):
    """Fused Conv -> BatchNormalization -> Relu (docs/fused-ops.md): inputs X, W, B, then
    scale, bias, mean, var (all four or none); attributes as Conv plus epsilon and relu."""

    op_type = "ConvBnRelu"
    domain = "fuser"
    fused = True


KERNELS = (Conv(), ConvTranspose(), ConvBnRelu())
