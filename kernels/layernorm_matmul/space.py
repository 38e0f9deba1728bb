"""`cost.lnmm_space` built in numpy: the same tilings in the same order, in milliseconds.

`lnmm_space` walks rows x buffering x N split x W tile x L0 step x A placement and asks the
kernel's buffer specs (`plan.specs`) of each candidate, some twice: tens of thousands of Python
calls per space, most of a search's time. Here the candidates of each (rows, buffering, split)
are a numpy grid in the same order, the L1 / L0A / L0B / L0C reservations of `plan.specs` are
columns (`level_bytes`; the UB queues depend on `vec_rows` only, found per row block as
`lnmm_space` finds them), the dedup keeps each key's first candidate, as the walk does, and the
result is a `TilingColumns` (its columns feed the bound; a tiling is made only where read).
`tests/costmodel/test_search_bounds.py` checks it equals `lnmm_space` on awkward shapes.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from .._budget import capacity
from .._columns import TilingColumns, first_of_each
from .._cost_base import aligned_sizes, ceil_div
from .._groups import vector_cores_per_group
from ..api import TilingError
from ..matmul.cost import even_splits
from ..npu.machine import Machine
from ..npu.memory import align
from ..npu.pipes import Level
from .bounds import FIELDS
from .plan import OP, LayerNormMatMulTiling, Problem, estimate, n_blocks, round_up


def level_bytes(
    p: Problem, cols: dict[str, np.ndarray], l0c_single: np.ndarray
) -> dict[Level, np.ndarray]:
    """Bytes `plan.specs` reserves on the cube core's levels, per candidate (its queues as
    columns: the A block or panels and W tiles in L1 with the biases, the L0 operands, the
    accumulator, double buffering counted)."""
    rows, tn_t, tk_t, tk0_t, res, db = (
        cols[n] for n in ("rows", "tile_n", "tile_k", "tile_k0", "a_resident", "double_buffer")
    )
    tm = np.minimum(rows, max(p.q, p.m))
    tk = np.minimum(tk_t, p.k)
    tn = np.minimum(tn_t, p.max_n)
    tk0 = np.minimum(tk0_t, tk)
    isz = p.dtype.itemsize
    depth = np.where(db != 0, 2, 1)
    biases = sum(align(lin.n * isz) for lin in p.linears if lin.has_bias)
    a = np.where(res != 0, align(tm * p.k * isz), align(tm * tk * isz))
    return {
        Level.L1: a * depth + align(tk * tn * isz) * depth + biases,
        Level.L0A: align(tm * tk0 * isz) * depth,
        Level.L0B: align(tk0 * tn * isz) * depth,
        Level.L0C: align(tm * tn * 4) * np.where(l0c_single != 0, 1, depth),
    }


def _fit(machine: Machine, used: dict[Level, np.ndarray]) -> np.ndarray:
    ok = np.ones(len(next(iter(used.values()))), dtype=bool)
    for level, b in used.items():
        ok &= b <= capacity(machine, level)
    return ok


def lnmm_space_fast(machine: Machine, p: Problem) -> TilingColumns:
    """`lnmm_space(machine, p)`, the same list (see the module docstring)."""
    unit = math.lcm(machine.cube_m, p.q)
    top = round_up(max(1, p.m), unit)
    rows_options = sorted({min(top, unit * f) for f in (1, 2, 4, 8, 16)})
    most = n_blocks(p)
    splits = sorted({min(most, s) for s in (1, 2, 3, 4, 6, 8, 12, 16, 24)})
    k0 = machine.cube_k_block(p.dtype)
    tks = aligned_sizes(p.k, k0, (256, 512, 1024))
    tk0s = aligned_sizes(p.k, k0, (64, 128, 256))
    vecs = max(1, vector_cores_per_group(machine))
    cores = machine.cube_cores
    # Per split, in the walk's order (itertools.product(tns, tks, tk0s, (1, 0)): tile_n
    # slowest): ns, part, tile_n, tile_k, tile_k0, a_resident. The same for every row block.
    inner = np.array(list(itertools.product(tks, tk0s, (1, 0))), dtype=np.int64).T
    per_split: list[np.ndarray] = []
    for ns in splits:
        part = min(round_up(math.ceil(p.max_n / ns), machine.cube_n), round_up(p.max_n, 16))
        tns = sorted(
            {w for w in (64, 128, 256) if w < part}
            | ({part} if part <= 512 else set())
            | even_splits(part, machine.cube_n)
        )
        block = np.empty((6, len(tns) * inner.shape[1]), dtype=np.int64)
        block[:2] = np.array([[ns], [part]])
        block[2] = np.repeat(tns, inner.shape[1])
        block[3:] = np.tile(inner, len(tns))
        per_split.append(block)
    splits_block = np.concatenate(per_split, axis=1)
    splits_block = splits_block[:, splits_block[4] <= splits_block[3]]  # tile_k0 <= tile_k
    # Per row block (rows, db): the most rows per vector step that fit UB, halved until they
    # do (the UB queues depend on vec_rows only), every halving's UB bytes at once.
    probes = []  # (row block, rows, vec_rows, db), the halvings of a block in order
    for h, (rows, db) in enumerate(itertools.product(rows_options, (1, 0))):
        if rows % p.q:
            continue
        vr = max(1, math.ceil(rows // p.q / vecs))
        probes.append((h, rows, vr, db))
        while vr > 1:
            vr //= 2
            probes.append((h, rows, vr, db))
    heads: list[tuple[int, int, int]] = []  # (rows, vec_rows, db) of each row block, in order
    if probes:
        block, prows, pvr, pdb = np.array(probes, dtype=np.int64).T
        fit = np.flatnonzero(ub_bytes(p, prows, pvr, pdb) <= machine.ub_bytes)
        first = fit[np.unique(block[fit], return_index=True)[1]]  # a block's first that fits
        heads = [(int(prows[i]), int(pvr[i]), int(pdb[i])) for i in first.tolist()]
    if not heads:
        return TilingColumns(LayerNormMatMulTiling, {f: np.zeros(0) for f in FIELDS})
    # Every row block followed by every split's candidates: rows, db slowest, as the walk.
    width = splits_block.shape[1]
    grid = np.empty((9, width * len(heads)), dtype=np.int64)
    grid[[0, 2, 7]] = np.repeat(np.array(heads, dtype=np.int64).T, width, axis=1)
    grid[[1, 8, 3, 4, 5, 6]] = np.tile(splits_block, len(heads))
    names = ("rows", "n_split", "vec_rows", "tile_n", "tile_k", "tile_k0", "a_resident",
             "double_buffer", "part")  # fmt: skip
    cols = dict(zip(names, grid, strict=True))
    db = cols["double_buffer"]
    # MatMul's per-level choice: L0C single when two blocks do not fit it.
    used = level_bytes(p, cols, np.zeros_like(db))
    doubled = _fit(machine, used)
    l0c_single = ((db != 0) & ~doubled).astype(np.int64)
    # `level_bytes(p, cols, l0c_single)`: a single L0C slot (only where double-buffered) is
    # half the two slots' bytes, the other levels unchanged.
    used[Level.L0C] = np.where(l0c_single != 0, used[Level.L0C] // 2, used[Level.L0C])
    # The walk's dedup key (`effective` fields, the part's tile width, the flags): first wins.
    tm = np.minimum(cols["rows"], max(p.q, p.m))
    tk = np.minimum(cols["tile_k"], p.k)
    key = np.stack([
        tm, np.minimum(cols["vec_rows"], np.maximum(1, tm // p.q)),
        np.minimum(cols["tile_n"], cols["part"]), tk, np.minimum(cols["tile_k0"], tk),
        cols["n_split"], cols["a_resident"], db, l0c_single,
    ])  # fmt: skip
    keep = np.zeros(grid.shape[1], dtype=bool)
    keep[first_of_each(*key)] = True
    keep &= _fit(machine, used)
    n = int(keep.sum())
    out = {**{k: v[keep] for k, v in cols.items()}, "l0c_single": l0c_single[keep]}
    out["cores"] = np.full(n, cores)
    out["staged"] = np.zeros(n, dtype=np.int64)
    return TilingColumns(LayerNormMatMulTiling, {f: out[f] for f in FIELDS})


def ub_bytes(p: Problem, rows: np.ndarray, vec_rows: np.ndarray, db: np.ndarray) -> np.ndarray:
    """Bytes `plan.specs` reserves in a vector core's UB, per candidate (X and N per step,
    double-buffered, the float32 scratch, LayerNorm's scale and bias)."""
    tm = np.minimum(rows, max(p.q, p.m))
    vr = np.minimum(vec_rows, np.maximum(1, tm // p.q))
    d, xsz, isz = p.ln.width, p.x_size, p.dtype.itemsize
    depth = np.where(db != 0, 2, 1)
    params = sum(align(d * xsz) for present in (p.ln.has_scale, p.ln.has_bias) if present)
    return (
        align(vr * d * xsz) * depth
        + align(vr * d * max(xsz, isz)) * depth
        + align(vr * d * p.ln.work.itemsize)
        + params
    )


def default_tiling_fast(p: Problem, machine: Machine) -> LayerNormMatMulTiling:
    """`plan.default_tiling(p, machine)`, its `fit` shrink loops run over numpy columns: every
    (rows, split, placement) start shrinks, step by step, what fills the first level that
    overflows (`_levels.LEVELS` order) by `fit`'s rules, until it fits or nothing is left to
    shrink; the survivors are ranked by `plan.estimate` (over their columns), the first
    cheapest kept."""
    unit = math.lcm(machine.cube_m, p.q)
    top = round_up(max(1, p.m), p.q)
    rows_options = sorted({min(top, unit * 2**i) for i in range(5)})
    most = min(machine.cube_cores, n_blocks(p))
    splits = [s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if s <= most]
    starts = np.array(list(itertools.product(rows_options, splits, (1, 0))), dtype=np.int64)
    rows, ns, res = starts.T if len(starts) else (np.zeros(0, dtype=np.int64),) * 3
    k0, cn = machine.cube_k_block(p.dtype), machine.cube_n
    vecs = max(1, vector_cores_per_group(machine))
    vr = np.maximum(1, ceil_div(rows // p.q, vecs))
    tn = np.minimum(ceil_div(ceil_div(p.max_n, ns), cn) * cn, 256)
    tk = np.full(len(rows), min(round_up(max(1, p.k), k0), 1024))
    tk0 = np.full(len(rows), min(round_up(max(1, p.k), k0), 512 // p.dtype.itemsize))
    db = np.ones(len(rows), dtype=np.int64)
    alive = np.ones(len(rows), dtype=bool)
    # UB is the first level `fit` looks at and holds only the vector rows: while it overflows
    # `fit` halves vec_rows, then turns double buffering off, then gives up; and what it
    # shrinks later (the cube's tiles, double buffering) never grows UB. So the first steps
    # of every start are these, found on the UB bytes alone.
    while (over_ub := alive & (ub_bytes(p, rows, vr, db) > capacity(machine, Level.UB))).any():
        halve = over_ub & (vr > 1)
        single = over_ub & ~halve & (db != 0)
        alive &= ~(over_ub & ~halve & ~single)
        vr = np.where(halve, vr // 2, vr)
        db = np.where(single, 0, db)
    levels = (Level.L1, Level.L0A, Level.L0B, Level.L0C)  # `_levels.LEVELS` after UB
    while True:
        cols = {"rows": rows, "tile_n": tn, "tile_k": tk, "tile_k0": tk0, "a_resident": res,
                "double_buffer": db}  # fmt: skip
        used = level_bytes(p, cols, np.zeros_like(db))
        over = [used[level] > capacity(machine, level) for level in levels]
        todo = alive & functools.reduce(np.logical_or, over)
        if not todo.any():
            break
        is_, earlier = {}, ~todo  # the first level that overflows
        for level, o in zip(levels, over, strict=True):
            is_[level] = o & ~earlier
            earlier = earlier | o
        r2 = is_[Level.L1] & (tk > tk0)
        r3 = ~r2 & (is_[Level.L0A] | is_[Level.L0B]) & (tk0 > 2 * k0)
        r4 = ~r2 & ~r3 & (is_[Level.L0B] | is_[Level.L0C] | is_[Level.L1]) & (tn > 2 * cn)
        r5 = todo & ~r2 & ~r3 & ~r4 & (db != 0)
        alive &= ~(todo & ~(r2 | r3 | r4 | r5))  # nothing left to shrink: no tiling
        tk = np.where(r2, np.maximum(tk0, ceil_div(tk // 2, tk0) * tk0), tk)
        half = np.maximum(1, tk0 // 2)
        tk = np.where(r3, ceil_div(tk, half) * half, tk)
        tk0 = np.where(r3, half, tk0)
        tn = np.where(r4, ceil_div(tn // 2, cn) * cn, tn)
        db = np.where(r5, 0, db)
    fitted = TilingColumns(
        LayerNormMatMulTiling,
        {"rows": rows, "n_split": ns, "vec_rows": vr, "tile_n": tn, "tile_k": tk, "tile_k0": tk0,
         "a_resident": res, "double_buffer": db, "cores": machine.cube_cores},
    ).take(np.flatnonzero(alive))  # fmt: skip
    if not fitted:
        raise TilingError(f"{OP}: no tiling fits {machine.name}")
    # Every fitted start priced at once; the first cheapest wins, as `default_tiling`'s loop
    # keeps it (starts that shrank to the same tiling price the same).
    best = fitted[int(np.argmin(estimate(p, fitted, machine)))]
    assert isinstance(best, LayerNormMatMulTiling)
    return best
