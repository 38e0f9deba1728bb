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
import functools
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
    copy_in_heads,
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
from .splitk import (
    Block,
    cut_slices,
    reduce_cycles,
    reduce_elems,
    reduce_items,
    slice_k_of,
    split_of,
)


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
    return cube + _reduce_pass(machine, p, tm, tn, split.full, items, split.slices, alpha, beta)


@functools.lru_cache(maxsize=4096)
def _reduce_pass(
    machine: Machine,
    p: GemmProblem,
    tm: int,
    tn: int,
    full: int,
    items: int,
    slices: int,
    alpha: float,
    beta: float,
) -> float:
    """Cycles of split-K's reduce pass over blocks[full:items] (memoized: the tilings a
    search prices share a few block shapes and splits)."""
    blocks = [_block_at(p, tm, tn, i) for i in range(full, items)]
    reduce = reduce_items(blocks, reduce_elems(machine, p.dtype.itemsize))
    return reduce_cycles(machine, reduce, slices, p.dtype, alpha, beta, p.has_c)


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
    # Every size row with every (cores, split_k), as a 2-D grid of rows x combinations:
    # split-K only where a wave is partly filled (else it is the same tiling).
    combo_cores = np.repeat(cores, len(splits))
    combo_split = np.tile(splits, len(cores))
    tm_s, tn_s = np.minimum(sizes.tile_m, p.m), np.minimum(sizes.tile_n, p.n)
    items_s = p.batch_size * ceil_div(p.m, tm_s) * ceil_div(p.n, tn_s)
    used = np.minimum(combo_cores, machine.cube_cores)
    split2 = cut_slices(items_s[:, None], p.k, combo_split[None, :], used[None, :], k0)
    flat = np.flatnonzero((combo_split == 1)[None, :] | (split2 != 1))
    row, combo = np.divmod(flat, len(combo_cores))
    t = sizes.take(row)
    t.columns["cores"] = combo_cores[combo]
    t.columns["split_k"] = combo_split[combo]
    tm, tn, items, split = tm_s[row], tn_s[row], items_s[row], split2.ravel()[flat]
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
    for the exact branch and bound of `search.best`.

    Without split-K it follows `gemm_cycles` term by term (one block's K walk: each chunk's
    two panel copies, each L0 step's loads and multiply, overlapped per level as the
    buffering says; Gemm's C copy; the FixPipe write, under the next block or not; the L1
    fill; launch, heads and the HBM floor as `kernel_cycles` adds them), so it is the cost
    itself up to the order of floating-point operations. With split-K (the blocks of a
    partly filled last wave cut into K slices) it counts the full waves' blocks and the
    slices' walks on the same terms, the workspace in the HBM floor, and for the reduce pass
    only its launch and its HBM traffic."""
    tile_m, tile_n, tile_k, tile_k0, db_l1, db_l0, db_l0c, cores_t, split_k = field_columns(
        tilings,
        ("tile_m", "tile_n", "tile_k", "tile_k0", "db_l1", "db_l0", "db_l0c", "cores", "split_k"),
    )
    isz = p.dtype.itemsize
    k0 = machine.cube_k_block(p.dtype)
    bw = machine.read_bytes_per_cycle
    startup = 2 * machine.l1_to_l0_startup_cycles
    tm, tn = np.minimum(tile_m, p.m), np.minimum(tile_n, p.n)
    items = p.batch_size * ceil_div(p.m, tm) * ceil_div(p.n, tn)
    per_k = isz * (tm / machine.l1_to_l0a_bytes_per_cycle + tn / machine.l1_to_l0b_bytes_per_cycle)
    blocks_mn = ceil_div(tm, 16) * ceil_div(tn, 16)

    def copies(kk: np.ndarray) -> np.ndarray:
        """The two panel copies of a K chunk of `kk` (MTE2)."""
        return 2 * machine.copy_in_transfer(True) + (tm + tn) * kk * isz / bw

    def chunk(kk: np.ndarray, tk0: np.ndarray) -> np.ndarray:
        """One K chunk of `kk` (0: no chunk) in L0 steps of `tk0`, as `_block_walk` walks it."""
        full, tail = np.divmod(kk, tk0)
        steps = full + (tail > 0)
        mte1 = steps * startup + kk * per_k
        cube = blocks_mn * (full * ceil_div(tk0, k0) + ceil_div(tail, k0))
        first = np.where(full > 0, tk0, tail)  # the first L0 step (the pipeline's fill)
        fill = np.minimum(startup + first * per_k, blocks_mn * ceil_div(first, k0))
        inner = np.where((db_l0 != 0) & (steps > 1), np.maximum(mte1, cube) + fill, mte1 + cube)
        m2 = copies(kk)
        return np.where(kk > 0, np.where(db_l1 != 0, np.maximum(m2, inner), m2 + inner), 0.0)

    def walk(k: Any) -> tuple[np.ndarray, np.ndarray]:
        """(steady cycles, L1 fill) of one block's walk over `k` of K (`_block_walk`)."""
        tk = np.minimum(tile_k, k)
        tk0 = np.minimum(tile_k0, tk)
        n_full, tail = np.divmod(k, tk)
        return n_full * chunk(tk, tk0) + chunk(tail, tk0), np.where(db_l1 != 0, copies(tk), 0.0)

    out_bw = min(machine.write_bytes_per_cycle, machine.l0c_to_gm_bytes_per_cycle)
    fix = machine.copy_out_transfer_cycles + tm * tn * isz / out_bw
    block, fill = walk(p.k)
    if p.has_c:
        block = block + np.where(
            db_l1 != 0, 0.0, machine.copy_in_transfer(True) + tm * tn * isz / bw
        )
    db_c = db_l0c != 0
    steady = block + np.where(db_c, 0.0, fix)
    # Unsplit: the slowest core's blocks in turn (or their FixPipe writes), plus the fill and
    # the last write when it overlaps the next block.
    cores = np.maximum(1, np.minimum(cores_t, items))
    per_core = ceil_div(items, cores)
    core = per_core * np.maximum(steady, fix) + fill + np.where(db_c, fix, 0.0)
    gm = isz * p.batch_size * (p.m * p.k + p.k * p.n + p.m * p.n)
    first_in = tm * np.minimum(tile_k, p.k) * isz
    whole = core + copy_in_heads(machine, first_in, cores) + machine.copy_out_head_cycles
    plain = machine.kernel_launch_cycles + np.maximum(whole, machine.hbm_cycles(gm))
    # Split-K: the full waves' blocks, then the cut blocks' slices (fp32 partials).
    used = np.minimum(cores_t, machine.cube_cores)
    slices = cut_slices(items, p.k, split_k, used, k0)
    cut_rows = np.flatnonzero(slices > 1)
    if not len(cut_rows):
        return plain
    out = plain.copy()

    def sub(x: Any) -> Any:
        """`x` on the split tilings only."""
        return x[cut_rows] if isinstance(x, np.ndarray) else x

    (tile_m, tile_n, tile_k, tile_k0, db_l1, db_l0, db_l0c, split_k, used) = (
        sub(x) for x in (tile_m, tile_n, tile_k, tile_k0, db_l1, db_l0, db_l0c, split_k, used)
    )
    tm, tn, items, per_k, blocks_mn = sub(tm), sub(tn), sub(items), sub(per_k), sub(blocks_mn)
    fix, steady, fill, slices, db_c = sub(fix), sub(steady), sub(fill), sub(slices), sub(db_c)
    full = (items // used) * used
    waves, cut = full // used, items - full
    spc = ceil_div(cut * slices, used)
    fix_s = machine.copy_out_transfer_cycles + tm * tn * 4 / out_bw
    block_s, fill_s = walk(slice_k_of(p.k, split_k, k0))
    steady_s = block_s + np.where(db_c, 0.0, fix_s)
    core_s = np.maximum(waves * steady + spc * steady_s, waves * fix + spc * fix_s)
    core_s += np.where(waves > 0, fill, fill_s) + np.where(db_c, np.where(spc > 0, fix_s, fix), 0.0)
    out_full = p.batch_size * p.m * p.n * full / items
    gm_s = isz * (p.batch_size * (p.m * p.k + p.k * p.n) + out_full) + 4 * slices * cut * tm * tn
    first_s = tm * np.minimum(tile_k, p.k) * isz
    whole_s = core_s + copy_in_heads(machine, first_s, used) + machine.copy_out_head_cycles
    cube_s = machine.kernel_launch_cycles + np.maximum(whole_s, machine.hbm_cycles(gm_s))
    # The reduce pass reads every plane and writes the cut blocks (each at least the smallest
    # block: the last rows and columns).
    rm, rn = p.m - (ceil_div(p.m, tm) - 1) * tm, p.n - (ceil_div(p.n, tn) - 1) * tn
    elems = cut * rm * rn
    reduce_gm = elems * (slices * 4 + isz + (isz if p.has_c else 0))
    # Its vector cores share at least every cut block's plane copies, adds and write (a
    # block is at least one item); the slowest core takes at least the mean.
    k_add, b_add = machine.vector_cost("Add", np.dtype(np.float32))
    c_in = (machine.copy_in_transfer(False) + isz * rm * rn / bw) if p.has_c else 0.0
    mte2 = cut * (slices * (machine.copy_in_transfer(False) + 4 * rm * rn / bw) + c_in)
    vec = (slices - 1) * (cut * b_add + elems * k_add)
    mte3 = cut * machine.copy_out_transfer_cycles + elems * isz / machine.write_bytes_per_cycle
    busy = np.maximum.reduce([mte2, vec, mte3]) / max(1, machine.vector_cores)
    reduce = machine.kernel_launch_cycles + np.maximum(
        busy + machine.copy_out_head_cycles, machine.hbm_cycles(reduce_gm)
    )
    out[cut_rows] = cube_s + reduce
    return out
