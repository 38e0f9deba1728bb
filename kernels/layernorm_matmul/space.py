"""`cost.lnmm_space` built in numpy: the same tilings in the same order, in milliseconds.

`lnmm_space` walks rows x buffering x N split x W tile x L0 step x A placement and asks the
kernel's buffer specs (`plan.specs`) of each candidate, some twice: tens of thousands of Python
calls per space, most of a search's time. Here the candidates of each (rows, buffering, split)
are a numpy grid in the same order, the L1 / L0A / L0B / L0C reservations of `plan.specs` are
columns (`level_bytes`; the UB queues depend on `vec_rows` only, found per row block as
`lnmm_space` finds them), the dedup keeps each key's first candidate, as the walk does, and the
result is a `ColumnSpace` (its columns feed the bound). `tests/costmodel/test_lnmm_bounds.py`
checks it equals `lnmm_space` on awkward shapes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from .._bounds import ColumnSpace, first_of_keys
from .._budget import capacity
from .._cost_base import aligned_sizes
from .._groups import vector_cores_per_group
from ..matmul.cost import even_splits
from ..npu.machine import Machine
from ..npu.memory import align
from ..npu.pipes import Level
from .bounds import FIELDS
from .plan import LayerNormMatMulTiling, Problem, n_blocks, round_up, specs


def ub_fits(machine: Machine, p: Problem, t: LayerNormMatMulTiling) -> bool:
    """True when the tiling's UB queues (`plan.specs`) fit a vector core's UB."""
    return sum(s.reserved for s in specs(p, t) if s.level is Level.UB) <= machine.ub_bytes


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


def lnmm_space_fast(machine: Machine, p: Problem) -> ColumnSpace[LayerNormMatMulTiling]:
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
    # (tile_k, tile_k0, a_resident) in the walk's order, the inner loops of every block.
    inner = np.array(list(itertools.product(tks, tk0s, (1, 0))), dtype=np.int64).T
    grids: list[np.ndarray] = []  # per (rows, db, split): rows, ns, vr, tn, tk, tk0, res, db, part
    for rows, db in itertools.product(rows_options, (1, 0)):
        if rows % p.q:
            continue
        vr = max(1, math.ceil(rows // p.q / vecs))
        probe = LayerNormMatMulTiling(rows, 1, vr, 16, k0, k0, 0, db, cores)
        while vr > 1 and not ub_fits(machine, p, probe):
            vr //= 2
            probe = dataclasses.replace(probe, vec_rows=vr)
        if not ub_fits(machine, p, probe):
            continue
        for ns in splits:
            part = min(round_up(math.ceil(p.max_n / ns), machine.cube_n), round_up(p.max_n, 16))
            tns = sorted(
                {w for w in (64, 128, 256) if w < part}
                | ({part} if part <= 512 else set())
                | even_splits(part, machine.cube_n)
            )
            # itertools.product(tns, tks, tk0s, (1, 0)): tile_n slowest.
            block = np.empty((9, len(tns) * inner.shape[1]), dtype=np.int64)
            block[[0, 1, 2, 7, 8]] = np.array([[rows], [ns], [vr], [db], [part]])
            block[3] = np.repeat(tns, inner.shape[1])
            block[4:7] = np.tile(inner, len(tns))
            grids.append(block)
    if not grids:
        return ColumnSpace.from_columns(LayerNormMatMulTiling, FIELDS, [np.zeros(0)] * len(FIELDS))
    grid = np.concatenate(grids, axis=1)
    grid = grid[:, grid[5] <= grid[4]]  # tile_k0 <= tile_k
    names = ("rows", "n_split", "vec_rows", "tile_n", "tile_k", "tile_k0", "a_resident",
             "double_buffer", "part")  # fmt: skip
    cols = dict(zip(names, grid, strict=True))
    db = cols["double_buffer"]
    # MatMul's per-level choice: L0C single when two blocks do not fit it.
    doubled = _fit(machine, level_bytes(p, cols, np.zeros_like(db)))
    l0c_single = ((db != 0) & ~doubled).astype(np.int64)
    # The walk's dedup key (`effective` fields, the part's tile width, the flags): first wins.
    tm = np.minimum(cols["rows"], max(p.q, p.m))
    tk = np.minimum(cols["tile_k"], p.k)
    key = np.stack([
        tm, np.minimum(cols["vec_rows"], np.maximum(1, tm // p.q)),
        np.minimum(cols["tile_n"], cols["part"]), tk, np.minimum(cols["tile_k0"], tk),
        cols["n_split"], cols["a_resident"], db, l0c_single,
    ])  # fmt: skip
    keep = np.zeros(grid.shape[1], dtype=bool)
    keep[first_of_keys(key)] = True
    keep &= _fit(machine, level_bytes(p, cols, l0c_single))
    n = int(keep.sum())
    out = {**{k: v[keep] for k, v in cols.items()}, "l0c_single": l0c_single[keep]}
    out["cores"] = np.full(n, cores)
    out["staged"] = np.zeros(n, dtype=np.int64)
    return ColumnSpace.from_columns(LayerNormMatMulTiling, FIELDS, [out[f] for f in FIELDS])
