"""Cost model of the Cube GEMM kernels: ONNX `MatMul` and `Gemm` (`kernel.py` beside it).

A work item is one `tile_m` x `tile_n` output block; per `tile_k` chunk of K the A and B panels
are copied into L1 (two MTE2 copies), per `tile_k0` step both go to L0A/L0B (MTE1) and the Cube
accumulates; FixPipe writes the block once. Per level: with L0A/B double-buffered a chunk's
loads run under its multiplies (`max`), else in turn (`sum`); with L1 double-buffered the next
chunk's copy runs under this chunk's work; with L0C single the next block waits for this
block's FixPipe. The slowest core holds `ceil(blocks / cores)` blocks. The space: tile_m,
tile_n on 16-multiples in {16 .. 256} plus the even splits of M and N between 128 and 256 (fewer
idle cores in the last wave), tile_k in {64 .. 1024} and tile_k0 in {32 .. 256} on k0
(32-byte) multiples, each level single or double buffered, all / half / a quarter of the cube
cores; filtered by the kernel's own buffer specs. From K >= `SPLIT_K_MIN`, tilings whose last
wave is partly filled also come with `split_k` in `SPLIT_K` (`splitk.py`): the full waves as
above, the cut blocks' slices (fp32 partials: FixPipe writes 4 bytes an element), the workspace
both ways over HBM, and the reduce pass on the vector cores after a barrier (a launch head).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._budget import fits_each
from .._columns import TilingColumns, first_of_each
from .._cost_base import (
    LastProblem,
    aligned_sizes,
    ceil_div,
    core_counts,
    cube_blocks,
    dma,
    dma_out,
    field_columns,
    kernel_cycles,
    round_up,
)
from ..api import TensorMeta, Tiling
from ..npu.machine import Machine
from ..registry import get_kernel
from .kernel import GemmProblem, MatMulTiling, _CubeGemm, gemm_queues
from .splitk import Block, cut_slices, reduce_cycles, reduce_elems, reduce_items, split_of


def gemm_cycles(
    machine: Machine,
    p: GemmProblem,
    t: MatMulTiling,
    gm_extra: float = 0.0,
    alpha: float = 1.0,
    beta: float = 1.0,
) -> float:
    """Predicted cycles of `t` on problem `p` (see the module docstring)."""
    isz = p.dtype.itemsize
    tm, tn = min(t.tile_m, p.m), min(t.tile_n, p.n)
    tk = min(t.tile_k, p.k)
    items = p.batch_size * math.ceil(p.m / tm) * math.ceil(p.n / tn)
    cores = max(1, min(t.cores, items))
    split = split_of(items, p.k, t.split_k, min(t.cores, machine.cube_cores),
                     machine.cube_k_block(p.dtype))  # fmt: skip
    fix = dma_out(machine, tm * tn * isz, cores, machine.l0c_to_gm_bytes_per_cycle)
    block, fill = _block_walk(machine, p, t, p.k, cores)
    if p.has_c:
        block += 0.0 if t.db_l1 else dma(machine, tm * tn * isz, cores, True)
    # L0C single: the next block's first multiply waits for this block's FixPipe.
    steady = block + (0.0 if t.db_l0c else fix)
    if split.slices == 1:
        per_core = math.ceil(items / cores)
        core = max(per_core * steady, per_core * fix) + fill + (fix if t.db_l0c else 0.0)
        gm = isz * p.batch_size * (p.m * p.k + p.k * p.n + p.m * p.n) + gm_extra
        return kernel_cycles(machine, core, gm, tm * tk * isz, cores)
    # Split-K (`splitk.py`): full waves of whole blocks, then the cut blocks' slices (fp32
    # partials to the workspace), then the reduce pass after a barrier.
    cores = min(t.cores, machine.cube_cores)
    waves = split.full // cores
    cut = items - split.full
    slices_per_core = math.ceil(cut * split.slices / cores)
    fix_s = dma_out(machine, tm * tn * 4, cores, machine.l0c_to_gm_bytes_per_cycle)
    block_s, fill_s = _block_walk(machine, p, t, split.slice_k, cores)
    steady_s = block_s + (0.0 if t.db_l0c else fix_s)
    core = max(waves * steady + slices_per_core * steady_s, waves * fix + slices_per_core * fix_s)
    core += (fill if waves else fill_s) + ((fix_s if slices_per_core else fix) if t.db_l0c else 0.0)
    out_full = p.batch_size * p.m * p.n * split.full / items
    gm = (isz * (p.batch_size * (p.m * p.k + p.k * p.n) + out_full) + gm_extra
          + 4 * split.slices * cut * tm * tn)  # fmt: skip
    cube = kernel_cycles(machine, core, gm, tm * tk * isz, cores)
    blocks = [_block_at(p, tm, tn, i) for i in range(split.full, items)]
    reduce = reduce_items(blocks, reduce_elems(machine, isz))
    return cube + reduce_cycles(machine, reduce, split.slices, p.dtype, alpha, beta, p.has_c)


def _block_walk(
    machine: Machine, p: GemmProblem, t: MatMulTiling, k: int, cores: int
) -> tuple[float, float]:
    """(steady cycles, pipeline fill) of one block's walk over `k` of K."""
    isz = p.dtype.itemsize
    tm, tn = min(t.tile_m, p.m), min(t.tile_n, p.n)
    tk = min(t.tile_k, k)
    tk0 = min(t.tile_k0, tk)
    k0 = machine.cube_k_block(p.dtype)
    block = 0.0  # one block's K walk, steady state
    fill = 0.0
    for kk, count in _chunks(k, tk):
        steps = _chunks(kk, tk0)
        mv = [
            2 * machine.l1_to_l0_startup_cycles
            + tm * ss * isz / machine.l1_to_l0a_bytes_per_cycle
            + ss * tn * isz / machine.l1_to_l0b_bytes_per_cycle
            for ss, _ in steps
        ]
        cu = [cube_blocks(tm, ss, tn, k0) for ss, _ in steps]
        n_steps = sum(c for _, c in steps)
        mte1 = sum(m * c for m, (_, c) in zip(mv, steps, strict=True))
        cube = sum(x * c for x, (_, c) in zip(cu, steps, strict=True))
        # L0 double-buffered: loads run under the multiplies (one step of fill); else in turn.
        inner = max(mte1, cube) + min(mv[0], cu[0]) if t.db_l0 and n_steps > 1 else mte1 + cube
        mte2 = dma(machine, tm * kk * isz, cores, True) + dma(machine, kk * tn * isz, cores, True)
        # L1 double-buffered: the next chunk's copy runs under this chunk's work.
        block += count * (max(mte2, inner) if t.db_l1 else mte2 + inner)
        fill = fill or (mte2 if t.db_l1 else 0.0)
    return block, fill


def _block_at(p: GemmProblem, tm: int, tn: int, i: int) -> Block:
    """Output block i in the kernel's work order (batch, then rows, then columns)."""
    mb, nb = math.ceil(p.m / tm), math.ceil(p.n / tn)
    b, rest = divmod(i, mb * nb)
    mi, ni = divmod(rest, nb)
    return Block(b, mi * tm, min(p.m, (mi + 1) * tm), ni * tn, min(p.n, (ni + 1) * tn))


def _chunks(total: int, step: int) -> list[tuple[int, int]]:
    """(size, count) of the chunks of `total` in steps of `step`: the full ones and the tail."""
    full, tail = divmod(total, step)
    out = [(step, full)] if full else []
    if tail:
        out.append((tail, 1))
    return out


def even_splits(dim: int, unit: int) -> set[int]:
    """Block sizes strictly between 128 and 256 that cut `dim` into equal `unit`-aligned parts:
    e.g. 176 for 1024 (6 blocks), where 128 leaves a second wave of cores half busy and 256
    too few blocks for the cores (1024 x 1024 output: 32 blocks of 128 x 256 on 24 cores)."""
    sizes = (round_up(-(-dim // j), unit) for j in range(2, 17))
    return {b for b in sizes if 128 < b < 256}


#: K slices tried for split-K, and the K from which it is tried (below, the workspace and the
#: reduce pass cost more than a fuller last wave saves).
SPLIT_K = (2, 3, 4, 8)
SPLIT_K_MIN = 1024


def gemm_space(machine: Machine, p: GemmProblem, kernel: _CubeGemm) -> TilingColumns:
    """Fitting tilings on aligned steps, deduplicated by what the kernel would run (the first
    kept), as numpy columns in the order of a loop over tile_m, tile_n, tile_k, tile_k0, the
    three buffering switches, the core counts and split_k. The fit (`gemm_queues`, the rule
    `check_tiling` applies) does not depend on the cores or split_k: it filters the sizes
    first, then the survivors take every core count and split."""
    k0 = machine.cube_k_block(p.dtype)
    ms = sorted({*aligned_sizes(p.m, machine.cube_m, (16, 32, 64, 128, 256)),
                 *even_splits(p.m, machine.cube_m)})  # fmt: skip
    ns = sorted({*aligned_sizes(p.n, machine.cube_n, (16, 32, 64, 128, 256)),
                 *even_splits(p.n, machine.cube_n)})  # fmt: skip
    ks = aligned_sizes(p.k, k0, (64, 128, 256, 512, 1024))
    k0s = aligned_sizes(p.k, k0, (32, 64, 128, 256))
    grid = np.meshgrid(ms, ns, ks, k0s, [1, 0], [1, 0], [0, 1], indexing="ij")
    names = ("tile_m", "tile_n", "tile_k", "tile_k0", "db_l1", "db_l0", "db_l0c")
    columns: dict[str, Any] = {n: g.ravel() for n, g in zip(names, grid, strict=True)}
    sizes = TilingColumns(MatMulTiling, {**columns, "cores": machine.cube_cores})
    ok = (sizes.tile_k0 <= sizes.tile_k) & fits_each(
        machine, [(lv, b, d) for lv, _, b, d in gemm_queues(p, sizes)]
    )
    sizes = sizes.take(np.flatnonzero(ok))
    cores = np.array(core_counts(machine.cube_cores), dtype=np.int64)
    splits = np.array((1, *SPLIT_K) if p.k >= SPLIT_K_MIN else (1,), dtype=np.int64)
    per = len(cores) * len(splits)
    t = sizes.take(np.repeat(np.arange(len(sizes)), per))
    t.columns["cores"] = np.tile(np.repeat(cores, len(splits)), len(sizes))
    t.columns["split_k"] = np.tile(splits, len(sizes) * len(cores))
    tm, tn = np.minimum(t.tile_m, p.m), np.minimum(t.tile_n, p.n)
    items = p.batch_size * ceil_div(p.m, tm) * ceil_div(p.n, tn)
    split = cut_slices(items, p.k, t.split_k, np.minimum(t.cores, machine.cube_cores), k0)
    # split-K only where a wave is partly filled (else it is the same tiling)
    keep = np.flatnonzero((t.split_k == 1) | (split != 1))
    t, tm, tn, items, split = t.take(keep), tm[keep], tn[keep], items[keep], split[keep]
    tk = np.minimum(t.tile_k, p.k)
    key = (tm, tn, tk, np.minimum(t.tile_k0, tk), t.db_l1, t.db_l0, t.db_l0c,
           np.minimum(t.cores, items), split)  # fmt: skip
    return t.take(first_of_each(*key))


def gemm_rule_of_thumb(machine: Machine, p: GemmProblem) -> MatMulTiling:
    """The articles' MatMul rule: tile_m = tile_n = 128 (within [64, 256]), tile_k = 256
    (within [128, 512]), double-buffered on every core."""
    return MatMulTiling(128, 128, 256, 128, 1, 1, 1, machine.cube_cores)


class _GemmModel:
    """MatMul / Gemm: the problem comes from the kernel itself."""

    def __init__(self, op_type: str) -> None:
        self.domain = ""
        self.op_type = op_type
        self._last = LastProblem()

    def _kernel(self) -> _CubeGemm:
        k = get_kernel(self.domain, self.op_type)
        assert isinstance(k, _CubeGemm)
        return k

    def space(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> TilingColumns:
        k = self._kernel()
        return gemm_space(machine, k.problem(metas, attrs), k)

    def cost(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> float:
        assert isinstance(tiling, MatMulTiling)
        p = self._last.get(metas, attrs, lambda: self._kernel().problem(metas, attrs))
        alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
        return gemm_cycles(machine, p, tiling, alpha=alpha, beta=beta)

    def rule_of_thumb(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Tiling | None:
        return gemm_rule_of_thumb(machine, self._kernel().problem(metas, attrs))

    #: The tiling fields `lower_bounds` understands (`search.Bounded`).
    bound_fields = frozenset(f.name for f in dataclasses.fields(MatMulTiling))

    def lower_bounds(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tilings: Sequence[Tiling],
        machine: Machine,
    ) -> np.ndarray:
        """Cycles each tiling's `cost` never goes below (`gemm_lower_bounds`)."""
        p = self._last.get(metas, attrs, lambda: self._kernel().problem(metas, attrs))
        return gemm_lower_bounds(machine, p, tilings)


MODELS = (_GemmModel("MatMul"), _GemmModel("Gemm"))


def gemm_lower_bounds(machine: Machine, p: GemmProblem, tilings: Sequence[Tiling]) -> np.ndarray:
    """A lower bound on `gemm_cycles` of every tiling at once (numpy over the space's fields),
    for the exact branch and bound of `search.best`. Per block it counts the work every
    schedule of `gemm_cycles` pays: each K chunk's two panel copies (MTE2), each L0 step's two
    loads (MTE1) and multiply (Cube); with L1 double-buffered the block takes at least the
    busier of the copies and the chunk's loads and multiplies (those overlapping when L0 is
    double-buffered, else in turn), single-buffered their sum; the core at least its blocks
    (or their FixPipe writes) in turn. Then launch, heads and the HBM floor (`kernel_cycles`)."""
    tile_m, tile_n, tile_k, tile_k0, db_l1, db_l0, cores_t = field_columns(
        tilings, ("tile_m", "tile_n", "tile_k", "tile_k0", "db_l1", "db_l0", "cores")
    )
    isz = p.dtype.itemsize
    k0 = machine.cube_k_block(p.dtype)
    tm, tn = np.minimum(tile_m, p.m), np.minimum(tile_n, p.n)
    tk = np.minimum(tile_k, p.k)
    tk0 = np.minimum(tile_k0, tk)
    items = p.batch_size * ceil_div(p.m, tm) * ceil_div(p.n, tn)
    cores = np.maximum(1, np.minimum(cores_t, items))
    per_core = ceil_div(items, cores)
    per_k = isz * (tm / machine.l1_to_l0a_bytes_per_cycle + tn / machine.l1_to_l0b_bytes_per_cycle)
    blocks_mn = ceil_div(tm, 16) * ceil_div(tn, 16)

    def chunk(kk: np.ndarray) -> np.ndarray:
        """Lower bound on one K chunk of `kk` (0: no chunk) in the block's walk."""
        full, tail = np.divmod(kk, tk0)
        steps = full + (tail > 0)
        mte1 = steps * 2 * machine.l1_to_l0_startup_cycles + kk * per_k
        cube = blocks_mn * (full * ceil_div(tk0, k0) + ceil_div(tail, k0))
        inner = np.where(db_l0 != 0, np.maximum(mte1, cube), mte1 + cube)
        mte2 = 2 * machine.copy_in_transfer(True) + (tm + tn) * kk * isz / (
            machine.read_bytes_per_cycle
        )
        return np.where(kk > 0, np.where(db_l1 != 0, np.maximum(mte2, inner), mte2 + inner), 0.0)

    n_full, k_tail = np.divmod(p.k, tk)
    block = n_full * chunk(tk) + chunk(k_tail)
    fix = machine.copy_out_transfer_cycles + tm * tn * isz / min(
        machine.write_bytes_per_cycle, machine.l0c_to_gm_bytes_per_cycle
    )
    core = per_core * np.maximum(block, fix)
    heads = np.array(
        [machine.copy_in_head(int(b), int(c)) for b, c in zip(tm * tk * isz, cores, strict=True)]
    )
    gm = isz * p.batch_size * (p.m * p.k + p.k * p.n + p.m * p.n)
    return machine.kernel_launch_cycles + np.maximum(
        core + heads + machine.copy_out_head_cycles, machine.hbm_cycles(gm)
    )
