"""Cost model of the implicit-GEMM convolutions: `ConvBnRelu` (fused) and ONNX `Conv`.

Refines `tiling.estimate_cycles` (the kernel's own first-order estimate) into the stream
form of `_cost_base`, following the kernel's program step by step: per output block of
`tile_h` x `tile_w` pixels x `tile_co` channels, per K chunk of `tile_ci` channels one input
copy (halo rows included, clipped to the image) and one weight copy (skipped when a single
chunk holds all of the block's weights and the previous block had the same channels), per
kernel tap two MTE1 loads and one Cube multiply; FixPipe writes the block; per channel block
the parameters are copied (and BN folded on the scalar unit). The slowest core holds
`ceil(blocks / cores)` blocks.

Space: tile_co on 16-multiples {16 .. 256}, tile_ci on k0 (32-byte) multiples {16 .. 256},
tile_w in {8, 16, 32, 64, 128, 256, Wo}, tile_h in {1, 2, 4, 8, 16, 32, the most that fit},
single or double buffering, all / half / a quarter of the cube cores, filtered by the kernel's
buffer specs and deduplicated by the effective (clipped) sizes. Where the input channels are not
a multiple of the Cube's k0 (a 3-channel stem), the same shapes with the taps folded into K
(`fold_taps`, L0 steps of {32 .. 256} rows of K = channels x taps) too. Where a block holds a
whole output map, 2 and 4 images per block (`tile_n`) too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from fuser.patterns.conv_activation import Activation

from .._columns import TilingColumns, first_of_each
from .._cost_base import (
    LastProblem,
    Stage,
    Stream,
    aligned_sizes,
    ceil_div,
    copy_in_heads,
    core_counts,
    cube_blocks,
    dma,
    dma_out,
    field_columns,
    fitting,
    kernel_cycles,
)
from .._groups import vector_cores_per_group
from ..api import TensorMeta, Tiling
from ..npu.machine import Machine
from ..registry import get_kernel
from .epilogue import epilogue_cycles
from .geometry import ConvGeometry
from .kernel import _ConvKernel
from .tiling import ConvTiling, conv_fits, conv_specs, effective, fold_saves, images, n_items

NO_ACTIVATION = Activation()


def conv_cycles(
    machine: Machine,
    g: ConvGeometry,
    dtype: np.dtype,
    has_b: bool,
    has_bn: bool,
    t: ConvTiling,
    act: Activation = NO_ACTIVATION,
) -> float:
    """Predicted cycles of `t` (see the module docstring)."""
    th, tw, co, ci = effective(g, t)
    isz = dtype.itemsize
    items = n_items(g, t)
    cores = max(1, min(t.cores, items))
    per_core = math.ceil(items / cores)
    k0 = machine.cube_k_block(dtype)
    lo, hi = g.channel_range(0, co)
    width = hi - lo
    rows, cols = g.halo(th, tw)
    nimg = images(g, t)
    m = th * tw * nimg
    x_rows, x_cols = min(rows, g.h), min(cols, g.w)
    per_block = math.ceil(g.n / nimg) * math.ceil(g.ho / th) * math.ceil(g.wo / tw)
    # Channel blocks a core meets: a contiguous share of L blocks crosses (L - 1) / B block
    # boundaries on average.
    co_changes = min(float(per_core), 1 + (per_core - 1) / per_block)
    s = Stream()
    single = width <= ci or bool(t.fold_taps)
    # Parameter copies (and BN folding) once per channel block the core meets.
    params = {"MTE2": 0.0, "SCALAR": 0.0}
    if has_b or has_bn:
        params["MTE2"] = dma(machine, (5 if has_bn else 1) * co * isz, cores, True)
        if has_bn:
            params["SCALAR"] = 4 * co * machine.scalar_op_cycles
    chunks = [(width, 1)] if t.fold_taps else [(ci, width // ci), (width % ci, 1)]
    chunk_steps = per_core * (1 if t.fold_taps else math.ceil(width / ci))
    for cc, count in chunks:
        if cc <= 0 or count <= 0:
            continue
        x_bytes = nimg * cc * x_rows * x_cols * isz
        w_bytes = co * cc * g.taps * isz
        # L0 steps of the chunk: one per tap of cc channels, or (taps folded into K) steps of
        # ci rows of K = cc x taps.
        full, tail = divmod(cc * g.taps, ci)
        l0_steps = [(ci, full), (tail, 1 if tail else 0)] if t.fold_taps else [(cc, g.taps), (0, 0)]
        n_l0 = sum(c for _, c in l0_steps)
        mte1 = sum(
            c * (2 * machine.l1_to_l0_startup_cycles
                 + m * kk * isz / machine.l1_to_l0a_bytes_per_cycle
                 + kk * co * isz / machine.l1_to_l0b_bytes_per_cycle)
            for kk, c in l0_steps
        )  # fmt: skip
        cube = sum(c * cube_blocks(m, kk, co, k0) for kk, c in l0_steps)
        # Weights: every chunk, or (one chunk holding all) only when the channels change;
        # parameters when the channels change. Spread over the chunk steps so one step stands
        # for the stream's mix (its fill and drain).
        w_share = co_changes / chunk_steps if single else 1.0
        mte2 = (
            dma(machine, x_bytes, cores, True)
            + w_share * dma(machine, w_bytes, cores, True)
            + params["MTE2"] * co_changes / chunk_steps
        )
        pipes = {"MTE2": mte2, "MTE1": mte1, "CUBE": cube}
        if params["SCALAR"]:
            pipes["SCALAR"] = params["SCALAR"] * co_changes / chunk_steps
        s.add(pipes, count * per_core)
        # Within a chunk the taps pipeline (MTE1 of tap j+1 under the Cube of tap j): the
        # fill and drain see one tap of MTE1 and Cube, and the chunk's copy.
        # The first chunk also waits for the block's parameters and its whole weight copy.
        if s.first is not None and s.first.pipes.get("MTE2") == mte2:
            prologue = (
                dma(machine, x_bytes, cores, True)
                + dma(machine, w_bytes, cores, True)
                + params["MTE2"]
            )
            s.first = Stage({"MTE2": prologue, "MTE1": mte1 / n_l0, "CUBE": cube / n_l0})
            # After a copy-bound stream, the last chunk's taps (MTE1 and Cube overlapping)
            # still run: as MTE1 the longer of the two, as Cube one tap.
            s.last = Stage(
                {"MTE2": mte2, "MTE1": max(mte1, cube) - cube / n_l0, "CUBE": cube / n_l0}
            )
    fix = dma_out(machine, m * co * isz, cores, machine.l0c_to_gm_bytes_per_cycle)
    s.busy["FIXP"] = fix * per_core
    s.drain = fix
    gm = isz * (g.n * g.cin * g.src_pixels + g.cout * g.cin_g * g.taps + g.n * g.cout * g.ho * g.wo)
    first_in = nimg * (width if t.fold_taps else min(ci, width)) * x_rows * x_cols * isz
    if not act.on_vector:
        return kernel_cycles(machine, s.time(bool(t.double_buffer)), gm, first_in, cores)
    # The activation on the group's vector cores, after FixPipe wrote each block to the L2.
    heads = machine.copy_in_head(int(first_in), cores) + machine.copy_out_head_cycles
    per_group = vector_cores_per_group(machine) or 1
    end = epilogue_cycles(
        machine, act, dtype, m * co, per_core, per_group, cores * per_group, heads,
        s.time(bool(t.double_buffer)),
    )  # fmt: skip
    return machine.kernel_launch_cycles + max(end, machine.hbm_cycles(gm))


def conv_space(
    machine: Machine, g: ConvGeometry, dtype: np.dtype, has_params: bool
) -> TilingColumns:
    """Fitting tilings on aligned steps (see the module docstring), built as numpy columns:
    per output-channel block the unfolded tilings, then (where folding saves Cube blocks) the
    folded ones, then the whole-map tilings with 2 and 4 images per block; each filtered by
    the kernel's own fit rule (`conv_fits`, the one `check_tiling` applies) and deduplicated
    by what the kernel would run, keeping the first (the order the scalar loops listed)."""
    k0 = machine.cube_k_block(dtype)
    isz = dtype.itemsize
    cos = aligned_sizes(g.cout, machine.cube_n, (16, 32, 64, 128, 256))
    tws = sorted({min(g.wo, w) for w in (8, 16, 32, 64, 128, 256)} | {g.wo})
    parts = []
    for co in cos:
        lo, hi = g.channel_range(0, min(co, g.cout))
        cis = aligned_sizes(hi - lo, k0, (16, 32, 64, 128, 256))
        parts.append(_grid(machine, g, isz, co, cis, tws, fold=0))
        if fold_saves(g, hi - lo, k0):
            ks = aligned_sizes((hi - lo) * g.taps, k0, (32, 64, 128, 256))
            parts.append(_grid(machine, g, isz, co, ks, tws, fold=1))
    raw = TilingColumns.concat(ConvTiling, parts)
    out = _kept(machine, g, dtype, has_params, raw)
    # Whole-map blocks with 2 or 4 images per block (`tile_n`: small maps such as 7x7 get
    # more GEMM rows per weight copy), after every single-image tiling.
    th, tw = effective(g, out)[:2]
    whole = out.take(np.flatnonzero((th >= g.ho) & (tw >= g.wo) & (out.tile_n == 1)))
    tns = np.array([tn for tn in (2, 4) if tn <= g.n], dtype=np.int64)
    rows = np.repeat(np.arange(len(whole)), len(tns))
    batched = whole.take(rows)
    batched.columns["tile_n"] = np.tile(tns, len(whole))
    return TilingColumns.concat(ConvTiling, [out, _kept(machine, g, dtype, has_params, batched)])


def _grid(
    machine: Machine,
    g: ConvGeometry,
    isz: int,
    co: int,
    k_steps: Sequence[int],
    tws: Sequence[int],
    fold: int,
) -> TilingColumns:
    """The candidates of one output-channel block, in loop order: per K step (input channels,
    or with `fold` rows of the folded K) and tile_w, the tile_h options ascending (a few fixed
    rows and the most L0A holds), double then single buffering, every core count."""
    kk, tw = (a.ravel() for a in np.meshgrid(k_steps, tws, indexing="ij"))
    m_max = np.maximum(1, machine.l0a_bytes // np.maximum(1, kk * isz))
    fixed = np.minimum(g.ho, np.array([1, 2, 4, 8, 16, 32]))
    ths = np.sort(
        np.column_stack([np.broadcast_to(fixed, (len(kk), 6)),
                         np.maximum(1, np.minimum(g.ho, m_max // tw))]),
        axis=1,
    )  # fmt: skip
    cores = np.array(core_counts(machine.cube_cores), dtype=np.int64)
    per_th = 2 * len(cores)
    n_th = ths.shape[1]
    return TilingColumns(
        ConvTiling,
        {
            "tile_h": np.repeat(ths.ravel(), per_th),
            "tile_w": np.repeat(tw, n_th * per_th),
            "tile_co": co,
            "tile_ci": np.repeat(kk, n_th * per_th),
            "double_buffer": np.tile(np.repeat([1, 0], len(cores)), len(kk) * n_th),
            "cores": np.tile(cores, len(kk) * n_th * 2),
            "fold_taps": fold,
        },
    )


def _kept(
    machine: Machine, g: ConvGeometry, dtype: np.dtype, has_params: bool, cands: TilingColumns
) -> TilingColumns:
    """The candidates that fit, the first of each set the kernel would run identically (same
    clipped sizes, buffering, cores used, folding, images per block)."""
    ok = cands.take(np.flatnonzero(conv_fits(g, dtype, has_params, cands, machine)))
    key = (*effective(g, ok), ok.double_buffer, np.minimum(ok.cores, n_items(g, ok)),
           ok.fold_taps, ok.tile_n)  # fmt: skip
    return ok.take(first_of_each(*key))


class _ConvModel:
    def __init__(self, domain: str, op_type: str) -> None:
        self.domain = domain
        self.op_type = op_type
        self._last = LastProblem()

    def _setup(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[ConvGeometry, np.dtype, bool, bool]:
        k = get_kernel(self.domain, self.op_type)
        assert isinstance(k, _ConvKernel)
        g, x, has_b, has_bn = k._geometry(metas, attrs)
        return g, x.dtype, has_b, has_bn

    def _activation(self, attrs: Mapping[str, Any]) -> Activation:
        k = get_kernel(self.domain, self.op_type)
        assert isinstance(k, _ConvKernel)
        return k.activation(attrs)

    def space(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> TilingColumns:
        g, dtype, has_b, has_bn = self._setup(metas, attrs)
        return conv_space(machine, g, dtype, has_b or has_bn)

    def cost(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> float:
        assert isinstance(tiling, ConvTiling)
        g, dtype, has_b, has_bn = self._last.get(metas, attrs, lambda: self._setup(metas, attrs))
        return conv_cycles(machine, g, dtype, has_b, has_bn, tiling, self._activation(attrs))

    def rule_of_thumb(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Tiling | None:
        """The MatMul rule carried to the implicit GEMM: a 128-pixel x 128-channel block
        (tile_w up to 16, rows to fill 128 pixels), K chunks of 128 channels, double-buffered;
        halved until it fits."""
        g, dtype, has_b, has_bn = self._setup(metas, attrs)
        tw = min(g.wo, 16)
        t = ConvTiling(max(1, 128 // tw), tw, 128, 128, 1, machine.cube_cores)
        while not fitting(machine, conv_specs(g, dtype, has_b or has_bn, t)):
            if t.tile_ci > 16:
                t = ConvTiling(t.tile_h, t.tile_w, t.tile_co, t.tile_ci // 2, 1, t.cores)
            elif t.tile_h > 1:
                t = ConvTiling(t.tile_h // 2, t.tile_w, t.tile_co, t.tile_ci, 1, t.cores)
            elif t.tile_co > 16:
                t = ConvTiling(t.tile_h, t.tile_w, t.tile_co // 2, t.tile_ci, 1, t.cores)
            else:
                return None
        return t

    #: The tiling fields `lower_bounds` understands (`search.Bounded`).
    bound_fields = frozenset(f.name for f in dataclasses.fields(ConvTiling))

    def lower_bounds(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tilings: Sequence[Tiling],
        machine: Machine,
    ) -> np.ndarray:
        """Cycles each tiling's `cost` never goes below (`conv_lower_bounds`)."""
        g, dtype, _, _ = self._last.get(metas, attrs, lambda: self._setup(metas, attrs))
        return conv_lower_bounds(machine, g, dtype, tilings)


MODELS = (
    _ConvModel("", "Conv"),
    _ConvModel("", "ConvTranspose"),
    _ConvModel("fuser", "ConvBnRelu"),
)


def conv_lower_bounds(
    machine: Machine, g: ConvGeometry, dtype: np.dtype, tilings: Sequence[Tiling]
) -> np.ndarray:
    """A lower bound on `conv_cycles` of every tiling at once (numpy over the space's fields),
    for the exact branch and bound of `search.best`. Per core it counts only work every
    schedule of `conv_cycles` pays: the Cube's multiplies and MTE1's loads of every K step,
    each chunk's input copy (not the weights, whose reuse varies) and the FixPipe writes.
    Double-buffered the stream takes at least its busiest pipe; single-buffered at least the
    copies, loads and multiplies in turn plus one write. Then launch, the pipes' start-up heads
    and the HBM floor as `kernel_cycles` adds them."""
    tile_h, tile_w, tile_co, tile_ci, db, cores_t, fold, tile_n = field_columns(
        tilings,
        ("tile_h", "tile_w", "tile_co", "tile_ci", "double_buffer", "cores", "fold_taps", "tile_n"),
    )
    isz = dtype.itemsize
    k0 = machine.cube_k_block(dtype)
    th, tw, co = np.minimum(tile_h, g.ho), np.minimum(tile_w, g.wo), np.minimum(tile_co, g.cout)
    width = ((co - 1) // g.cout_g + 1) * g.cin_g  # channel_range(0, co)
    folded = fold != 0
    ci = np.where(folded, np.minimum(tile_ci, width * g.taps), np.minimum(tile_ci, width))
    nimg = np.maximum(1, np.minimum(tile_n, g.n))
    items = ceil_div(g.n, nimg) * ceil_div(g.ho, th) * ceil_div(g.wo, tw) * ceil_div(g.cout, co)
    cores = np.maximum(1, np.minimum(cores_t, items))
    per_core = ceil_div(items, cores)
    m = th * tw * nimg
    rows = (th - 1) * g.sh + (g.kh - 1) * g.dh + 1
    cols = (tw - 1) * g.sw + (g.kw - 1) * g.dw + 1
    x_px = nimg * np.minimum(rows, g.h) * np.minimum(cols, g.w) * isz  # bytes per channel

    def cube(kk: np.ndarray) -> np.ndarray:
        return ceil_div(m, 16) * ceil_div(kk, k0) * ceil_div(co, 16)

    def mte1(kk: np.ndarray) -> np.ndarray:
        moved = (2 * machine.l1_to_l0_startup_cycles
                 + m * kk * isz / machine.l1_to_l0a_bytes_per_cycle
                 + kk * co * isz / machine.l1_to_l0b_bytes_per_cycle)  # fmt: skip
        return np.where(kk > 0, moved, 0.0)

    def copy(cc: np.ndarray) -> np.ndarray:
        nbytes = cc * x_px
        return np.where(
            nbytes > 0, machine.copy_in_transfer(True) + nbytes / machine.read_bytes_per_cycle, 0.0
        )

    # Unfolded: chunks of ci channels (and the tail), one L0 step per tap.
    full, rest = width // ci, width % ci
    cube_u = g.taps * (full * cube(ci) + cube(rest))
    mte1_u = g.taps * (full * mte1(ci) + mte1(rest))
    copy_u = full * copy(ci) + copy(rest)
    # Folded: one chunk of every channel, L0 steps of ci rows of K = channels x taps.
    steps, tail = np.divmod(width * g.taps, ci)
    cube_f = steps * cube(ci) + cube(tail)
    mte1_f = steps * mte1(ci) + mte1(tail)
    copy_f = copy(width)
    busy_cube = per_core * np.where(folded, cube_f, cube_u)
    busy_mte1 = per_core * np.where(folded, mte1_f, mte1_u)
    busy_mte2 = per_core * np.where(folded, copy_f, copy_u)
    fix = machine.copy_out_transfer_cycles + m * co * isz / min(
        machine.write_bytes_per_cycle, machine.l0c_to_gm_bytes_per_cycle
    )
    core = np.where(
        db != 0,
        np.maximum.reduce([busy_cube, busy_mte1, busy_mte2, per_core * fix]),
        busy_cube + busy_mte1 + busy_mte2 + fix,
    )
    first_in = np.where(folded, width, np.minimum(ci, width)) * x_px
    heads = copy_in_heads(machine, first_in, cores)
    # HBM reads the input as it sits in GM (a ConvTranspose's zeros are never read), as
    # conv_cycles counts it: the floor must not count bytes the kernel does not move.
    gm = isz * (g.n * g.cin * g.src_pixels + g.cout * g.cin_g * g.taps + g.n * g.cout * g.ho * g.wo)
    floor = machine.hbm_cycles(gm)
    return machine.kernel_launch_cycles + np.maximum(
        core + heads + machine.copy_out_head_cycles, floor
    )
