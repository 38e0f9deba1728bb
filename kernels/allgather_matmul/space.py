"""`cost.agmm_space` built in numpy: the same tilings in the same order, in milliseconds.

`agmm_space` walks output tile x K panel x L0 step x accumulators x buffering x cores and asks
the kernel's buffer specs (`kernel._specs`) of each candidate: tens of thousands of Python calls
per space. Here the candidates are one numpy grid in the walk's order, the L1 / L0A / L0B /
L0C reservations of `_specs` are columns (`level_bytes`), a candidate that fits claims its
dedup key unless an earlier fitting one did (as the walk does), and the result is a
`TilingColumns` whose columns feed the bound (a tiling is made only where read).
`tests/costmodel/test_search_bounds.py` checks it equals `agmm_space` on awkward shapes.
"""

from __future__ import annotations

import numpy as np

from .._budget import capacity
from .._columns import TilingColumns, first_of_each
from .._cost_base import aligned_sizes, ceil_div, core_counts
from ..matmul.cost import even_splits
from ..npu.machine import Machine
from ..npu.memory import align
from ..npu.pipes import Level
from .bounds import FIELDS
from .kernel import AllGatherMatMulTiling, _Problem


def level_bytes(p: _Problem, cols: dict[str, np.ndarray]) -> dict[Level, np.ndarray]:
    """Bytes `kernel._specs` reserves per level, per candidate (the A and W panels and the
    biases in L1, the L0 operands, `acc_tiles` accumulators; double buffering counted)."""
    widest = max(lin.n for lin in p.lins)
    tm = np.minimum(cols["tile_m"], p.m)
    tn = np.minimum(cols["tile_n"], widest)
    tk = np.minimum(cols["tile_k"], p.ks)
    tk0 = np.minimum(cols["tile_k0"], tk)
    isz = p.dtype.itemsize
    depth = np.where(cols["double_buffer"] != 0, 2, 1)
    biases = sum(align(lin.n * isz) for lin in p.lins if lin.has_bias)
    return {
        Level.L1: align(tm * tk * isz) * depth + align(tk * tn * isz) * depth + biases,
        Level.L0A: align(tm * tk0 * isz) * depth,
        Level.L0B: align(tk0 * tn * isz) * depth,
        Level.L0C: align(tm * tn * 4) * cols["acc_tiles"],
    }


def agmm_space_fast(machine: Machine, p: _Problem) -> TilingColumns:
    """`agmm_space(machine, p)`, the same list (see the module docstring)."""
    k0 = machine.cube_k_block(p.dtype)
    ms = sorted({*aligned_sizes(p.m, machine.cube_m, (16, 32, 64, 128, 256)),
                 *even_splits(p.m, machine.cube_m)})  # fmt: skip
    widest = max(lin.n for lin in p.lins)
    ns = sorted({*aligned_sizes(widest, machine.cube_n, (16, 32, 64, 128, 256)),
                 *(s for lin in p.lins for s in even_splits(lin.n, machine.cube_n))})  # fmt: skip
    ks = aligned_sizes(p.ks, k0, (128, 256, 512, 1024))
    k0s = aligned_sizes(p.ks, k0, (32, 64, 128, 256))
    accs = (1, 2, 4, 8) if p.k_gather else (1, 2)
    axes = (ms, ns, ks, k0s, accs, (1, 0), core_counts(machine.cube_cores))
    names = ("tile_m", "tile_n", "tile_k", "tile_k0", "acc_tiles", "double_buffer", "cores")
    # itertools.product's order: the first axis slowest.
    grid = [g.ravel().astype(np.int64) for g in np.meshgrid(*axes, indexing="ij")]
    cols = dict(zip(names, grid, strict=True))
    used = level_bytes(p, cols)
    fit = cols["tile_k0"] <= cols["tile_k"]
    for level, nbytes in used.items():
        fit &= nbytes <= capacity(machine, level)
    cols = {k: v[fit] for k, v in cols.items()}
    tm = np.minimum(cols["tile_m"], p.m)
    tn = np.minimum(cols["tile_n"], widest)
    tk = np.minimum(cols["tile_k"], p.ks)
    tiles = sum(ceil_div(p.m, tm) * ceil_div(lin.n, tn) for lin in p.lins)
    per_core = ceil_div(tiles, np.minimum(cols["cores"], machine.cube_cores))
    acc = cols["acc_tiles"]
    key = np.stack([
        tm, tn, tk, np.minimum(cols["tile_k0"], tk),
        np.minimum(acc, per_core) if p.k_gather else np.minimum(acc, 2),
        cols["double_buffer"], cols["cores"],
    ])  # fmt: skip
    keep = first_of_each(*key)
    out = {k: v[keep] for k, v in cols.items()}
    out["staged"] = np.zeros(len(keep), dtype=np.int64)
    return TilingColumns(AllGatherMatMulTiling, {f: out[f] for f in FIELDS})
