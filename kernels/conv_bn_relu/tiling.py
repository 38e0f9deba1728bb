"""Tiling of the implicit-GEMM convolution: the tiling type, its buffer footprint, a rough
analytical cost, and the host-side default (the cheapest fitting candidate by that cost).

The cost is a first-order model (per output block: DMA heads and bytes, Cube blocks, MTE1
loads, FixPipe; blocks in waves over the cores, the slowest stage setting the pace when double
buffered). It only ranks candidates for the default; the simulator gives the real number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._budget import QueueSpec, fits, fits_each
from .._columns import TilingColumns, greater, lesser, pick
from .._cost_base import ceil_div
from ..api import Tiling, TilingError
from ..npu.machine import Machine
from ..npu.pipes import Level
from .geometry import ConvGeometry


@dataclass(frozen=True)
class ConvTiling(Tiling):
    """Output block `tile_h` x `tile_w` pixels x `tile_co` channels; K step `tile_ci` input
    channels per tap; double buffering (0/1) of L1, L0 and L0C; cube cores used.
    `fold_taps` 1: the taps folded into K (small Cin): all of a block's input channels in one
    L1 chunk, and K = channels x taps walked in L0 steps of `tile_ci` rows of it (img2col
    over every tap at once), so a 3-channel 7x7 stem multiplies K = 147 (10 blocks of 16)
    instead of 49 taps each padded from 3 to 16 channels. `tile_n` images per block (small
    images: a block of several whole 7x7 maps multiplies more rows per weight copy, so the
    weights are re-read for every `tile_n` images instead of every image)."""

    tile_h: int
    tile_w: int
    tile_co: int
    tile_ci: int
    double_buffer: int
    cores: int
    fold_taps: int = 0
    tile_n: int = 1


#: A tiling, or a whole space of them as columns: the fit rule and the clipped sizes below are
#: one function for both (`_columns`), ints in and ints out for one tiling.
Tilings = ConvTiling | TilingColumns


def effective(g: ConvGeometry, t: Tilings) -> tuple[Any, Any, Any, Any]:
    """Tile sizes clipped to the problem: (rows, cols, out channels, K step: channels per
    tap, or with `fold_taps` rows of the folded K = channels x taps)."""
    th, tw, co = lesser(t.tile_h, g.ho), lesser(t.tile_w, g.wo), lesser(t.tile_co, g.cout)
    lo, hi = g.channel_range(0, co)
    return th, tw, co, lesser(t.tile_ci, pick(t.fold_taps, (hi - lo) * g.taps, hi - lo))


def images(g: ConvGeometry, t: Tilings) -> Any:
    """Images per block, clipped to the batch."""
    return greater(1, lesser(t.tile_n, g.n))


def fold_saves(g: ConvGeometry, width: int, k0: int) -> bool:
    """Whether folding the taps into K needs fewer Cube K blocks than one multiply per tap
    (input channels `width` not a multiple of the Cube's k0)."""
    return g.group == 1 and g.taps > 1 and -(-width * g.taps // k0) < g.taps * -(-width // k0)


def conv_queues(
    g: ConvGeometry, dtype: np.dtype, has_params: bool, t: Tilings
) -> list[tuple[Level, str, Any, Any]]:
    """(level, name, slot bytes, depth) of the queues a tiling reserves in L1, L0A, L0B and
    L0C: ints for one tiling, columns for a space (see `Tilings`)."""
    th, tw, co, ci = effective(g, t)
    # A channel block may straddle one more group than a block starting at 0.
    ci = lesser(t.tile_ci, ci + g.cin_g) if g.group > 1 else ci
    isz = dtype.itemsize
    depth = pick(t.double_buffer, 2, 1)
    rows, cols = g.halo(th, tw)
    nimg = images(g, t)
    m = th * tw * nimg
    # Folded: the chunk holds all of the block's channels (`ci` is then the folded K step).
    cx = pick(t.fold_taps, g.channel_range(0, co)[1], ci)
    queues = [
        (Level.L1, "x", nimg * cx * rows * cols * isz, depth),
        (Level.L1, "w", co * cx * g.taps * isz, depth),
        (Level.L0A, "a", m * ci * isz, depth),
        (Level.L0B, "b", ci * co * isz, depth),
        (Level.L0C, "acc", m * co * 4, depth),
    ]
    if has_params:
        # Raw per-channel parameters (B and BN's four) and the folded scale and shift.
        queues.append((Level.L1, "params", co * (5 * isz + 8), depth))
    return queues


def conv_specs(
    g: ConvGeometry, dtype: np.dtype, has_params: bool, t: ConvTiling
) -> list[QueueSpec]:
    """The queues a tiling reserves in L1, L0A, L0B and L0C (`conv_queues` of one tiling)."""
    return [QueueSpec(*q) for q in conv_queues(g, dtype, has_params, t)]


def conv_fits(
    g: ConvGeometry, dtype: np.dtype, has_params: bool, t: Tilings, machine: Machine
) -> Any:
    """Whether each tiling's queues fit the core's buffers (`_budget.fits_each`)."""
    return fits_each(machine, [(lv, b, d) for lv, _, b, d in conv_queues(g, dtype, has_params, t)])


def n_items(g: ConvGeometry, t: Tilings) -> Any:
    """Output blocks of a tiling."""
    th, tw, co, _ = effective(g, t)
    return (
        ceil_div(g.n, images(g, t)) * ceil_div(g.ho, th) * ceil_div(g.wo, tw)
        * ceil_div(g.cout, co)
    )  # fmt: skip


def estimate_cycles(g: ConvGeometry, dtype: np.dtype, t: ConvTiling, machine: Machine) -> float:
    """Rough kernel cycles of a tiling (see module docstring)."""
    th, tw, co, ci = effective(g, t)
    isz = dtype.itemsize
    items = n_items(g, t)
    cores = min(t.cores, items)
    waves = math.ceil(items / cores)
    bw = machine.read_bytes_per_cycle
    lo, hi = g.channel_range(0, co)
    chunks = math.ceil((hi - lo) / ci)
    rows, cols = g.halo(th, tw)
    m = th * tw
    x_bytes = ci * min(rows, g.h) * min(cols, g.w) * isz
    w_bytes = co * ci * g.taps * isz
    w_copy = machine.copy_in_transfer(True) + w_bytes / bw
    if chunks == 1:
        # Weights of one K step stay in L1 across a core's blocks of the same channels.
        co_blocks = math.ceil(g.cout / co)
        w_copy *= min(1.0, (1 + waves * co_blocks / items) / waves)
    dma = chunks * (machine.copy_in_transfer(True) + x_bytes / bw + w_copy)
    k0 = machine.cube_k_block(dtype)
    cube = chunks * g.taps * math.ceil(m / 16) * math.ceil(ci / k0) * math.ceil(co / 16)
    mte1 = chunks * g.taps * (
        2 * machine.l1_to_l0_startup_cycles + m * ci * isz / machine.l1_to_l0a_bytes_per_cycle
        + ci * co * isz / machine.l1_to_l0b_bytes_per_cycle
    )  # fmt: skip
    fix = machine.copy_out_transfer_cycles + m * co * isz / min(
        machine.l0c_to_gm_bytes_per_cycle, machine.write_bytes_per_cycle
    )
    stages = (dma, cube, mte1, fix)
    per_item = max(stages) if t.double_buffer else sum(stages)
    heads = machine.copy_in_head(x_bytes, cores) + machine.copy_out_head_cycles
    return machine.kernel_launch_cycles + heads + waves * per_item + (sum(stages) - max(stages))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def candidate_tilings(
    g: ConvGeometry, dtype: np.dtype, has_params: bool, machine: Machine
) -> list[ConvTiling]:
    """Fitting double-buffered tilings on hardware-aligned steps (a small space)."""
    isz = dtype.itemsize
    k0, cn = machine.cube_k_block(dtype), machine.cube_n
    cos = sorted({min(_round_up(g.cout, cn), c) for c in (16, 32, 64, 128, 256)})
    out: list[ConvTiling] = []
    for co in cos:
        lo, hi = g.channel_range(0, min(co, g.cout))
        ci = min(_round_up(hi - lo, k0), 256)
        while ci > k0 and (
            2 * ci * co * isz > machine.l0b_bytes
            or 2 * co * ci * g.taps * isz > machine.l1_bytes // 2
        ):
            ci = max(k0, _round_up(ci // 2, k0))
        m_max = max(1, min(machine.l0a_bytes // (2 * ci * isz), machine.l0c_bytes // (2 * co * 4)))
        tws = {min(g.wo, m_max)} | {w for w in (16, 32, 64) if w < min(g.wo, m_max)}
        for tw in sorted(tws):
            ths = {1, max(1, min(g.ho, m_max // tw))}
            ths |= {h for h in (2, 4, 8, 16, 32) if h * tw <= m_max and h < g.ho}
            for th in sorted(ths):
                t = ConvTiling(th, tw, co, ci, 1, machine.cube_cores)
                if fits(machine, conv_specs(g, dtype, has_params, t)):
                    out.append(t)
    return out


def default_conv_tiling(
    g: ConvGeometry, dtype: np.dtype, has_params: bool, machine: Machine, op: str
) -> ConvTiling:
    """The candidate with the lowest estimated cycles (ties: fewer blocks)."""
    cands = candidate_tilings(g, dtype, has_params, machine)
    if not cands:
        k0 = machine.cube_k_block(dtype)
        t = ConvTiling(1, 1, machine.cube_n, k0, 0, machine.cube_cores)
        if fits(machine, conv_specs(g, dtype, has_params, t)):
            return t
        raise TilingError(f"{op}: no tiling fits {machine.name}")
    return min(cands, key=lambda t: (estimate_cycles(g, dtype, t, machine), n_items(g, t)))
