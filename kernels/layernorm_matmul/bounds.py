"""Lower bounds of `lnmm_cycles` over a whole tiling space (numpy; `search.Bounded`).

`lnmm_lower_bounds` is `cost.lnmm_cycles` written over numpy columns of the space's fields,
term by term in the same order (the vector side's per-block and whole-share streams, the
cube side's item stream and the group's share of it, the overlap of the two, launch, heads and
HBM floor through `_bounds`): it is the model's price up to rounding, so `search.best` prices
only the cheapest few tilings. A staged tiling (the unfused chain's schedule, one per space)
is bounded by 0: it is priced first, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._bounds import VecStream, as_column, k_chunk, kernel_floor
from .._cost_base import ceil_div, dma, dma_out, field_columns, l2_spill
from .._groups import vector_cores_per_group
from .._rows import VecStep
from ..api import Tiling
from ..npu.machine import Machine
from .plan import Problem, n_blocks, part_columns

#: Every field of `LayerNormMatMulTiling`, in the order `lnmm_lower_bounds` reads them.
FIELDS = ("rows", "n_split", "vec_rows", "tile_n", "tile_k", "tile_k0", "a_resident",
          "double_buffer", "cores", "staged", "l0c_single")  # fmt: skip


def _per_parts(parts: np.ndarray, n: int, end: bool) -> np.ndarray:
    """`part_columns(n, 0, parts)` (its end, or its width) per tiling, once per distinct parts
    (a space has a few split counts: a lookup table indexed by them, no sort)."""
    table = np.zeros(int(parts.max()) + 1 if len(parts) else 1, dtype=np.int64)
    for k in np.flatnonzero(np.bincount(parts)).tolist():
        c0, c1 = part_columns(n, 0, k)
        table[k] = c1 if end else max(1, c1 - c0)
    return table[parts]


def lnmm_lower_bounds(
    machine: Machine, p: Problem, tilings: Sequence[Tiling], vector_steps: Sequence[VecStep] = ()
) -> np.ndarray:
    """For each tiling, cycles `lnmm_cycles(machine, p, t, vector_steps)` never goes below
    (see the module docstring)."""
    rows_t, ns_t, vr_t, tn_t, tk_t, tk0_t, res, db, cores_t, staged, l0c_single = field_columns(
        tilings, FIELDS
    )
    n = len(tilings)
    # `effective`
    tm = np.minimum(rows_t, max(p.q, p.m))
    tk = np.minimum(tk_t, p.k)
    vr = np.minimum(vr_t, np.maximum(1, tm // p.q))
    tn = np.minimum(tn_t, p.max_n)
    tk0 = np.minimum(tk0_t, tk)
    isz = p.dtype.itemsize
    blocks = ceil_div(p.m, tm)
    parts = np.minimum(ns_t, n_blocks(p))
    items = blocks * parts
    groups = np.maximum(1, np.minimum(np.minimum(cores_t, machine.cube_cores), items))
    per_group = ceil_div(items, groups)
    row_blocks = np.minimum(per_group, ceil_div(per_group, parts) + (per_group % parts != 0))
    vecs = vector_cores_per_group(machine)
    separate = vecs > 0
    vecs = max(1, vecs)
    k0 = machine.cube_k_block(p.dtype)
    d = p.ln.width

    # Vector side.
    slices = tm // p.q
    subs = ceil_div(slices, vr)
    sub_bytes = vr * d * isz
    x_sub = vr * d * p.x_size
    active_vec = groups * vecs if separate else groups
    # The vector instructions of a sub-block depend on vec_rows alone, which takes a few
    # values in a space: summed per value (the model's sum, in its order), then looked up.
    ops = [(*machine.vector_cost(op, step.dtype), step.per_row)
           for step in vector_steps or p.steps for op in step.ops]  # fmt: skip
    per_vr = np.zeros(int(vr.max()) + 1 if n else 1)
    for v in np.flatnonzero(np.bincount(vr)).tolist():
        total = 0.0
        for k, b, per_row in ops:
            total = total + (k * v * per_row + b)
        per_vr[v] = total
    vec_ops = per_vr[vr]
    hand = (
        dma_out(machine, sub_bytes, active_vec)
        if separate
        else machine.l1_to_l0_startup_cycles + sub_bytes / machine.ub_to_l1_bytes_per_cycle
    )
    if p.emit_normalized:
        hand = hand + dma_out(machine, x_sub, active_vec)
    vec_sub = {"MTE2": dma(machine, x_sub, active_vec), "VECTOR": vec_ops, "MTE3": hand}
    subs_per_vec = ceil_div(subs, vecs)
    v_block = VecStream(n)
    v_block.add(vec_sub, subs_per_vec)
    v_all = VecStream(n)
    v_all.add(vec_sub, subs_per_vec * row_blocks)

    # Cube side: one item's matmuls, then the group's share.
    item = VecStream(n)
    if separate:
        resident = dma(machine, sub_bytes, groups, True)
        item.add({"MTE2": resident}, np.where(res != 0, subs / parts, 0.0))
    full_k, tail_k = np.divmod(p.k, tk)
    # K chunks: the full ones, then the tail where there is one (a chunk of count 0 adds
    # nothing to a stream, so a space without tails skips it).
    chunks = [(tk, full_k)] + ([(tail_k, (tail_k > 0).astype(np.int64))] if tail_k.any() else [])
    steps: dict[int, tuple[Any, ...]] = {}  # per N: Linears of one width cost the same
    for lin in p.linears:
        if lin.n not in steps:
            cols = _per_parts(parts, lin.n, end=False)
            width = np.minimum(tn, cols)
            per_chunk = []
            for kk, count in chunks:
                mte1, cube = k_chunk(machine, tm, width, kk, tk0, isz, k0)
                mte2 = dma(machine, kk * width * isz, groups, True) + np.where(
                    res != 0, 0.0, dma(machine, tm * kk * isz, groups, True)
                )
                per_chunk.append(({"MTE2": mte2, "MTE1": mte1, "CUBE": cube}, count))
            steps[lin.n] = (ceil_div(cols, tn), width, per_chunk)
        n_tiles, width, per_chunk = steps[lin.n]
        for pipes, count in per_chunk:
            item.add(pipes, count * n_tiles)
        fix = dma_out(machine, tm * width * isz, groups, machine.l0c_to_gm_bytes_per_cycle)
        item.add_busy("FIXP", fix * n_tiles)
        item.add_busy("CUBE", np.where((l0c_single != 0) & (db != 0), fix * n_tiles, 0.0))
        item.drain = as_column(fix, n)
    share = item.scaled(per_group)
    one_item = item.time(db)
    first_block = v_block.time(db)
    v_params = sum(
        (dma(machine, d * p.x_size, active_vec) for present in (p.ln.has_scale, p.ln.has_bias)
         if present),
        np.zeros(n),
    )  # fmt: skip
    c_params = sum(
        (dma(machine, lin.n * isz, groups, True) for lin in p.linears if lin.has_bias),
        np.zeros(n),
    )
    first_block = first_block + v_params
    first_w = tk * np.minimum(tn, _per_parts(parts, p.max_n, end=True)) * isz
    ahead = np.where(res != 0, 0.0, dma(machine, first_w, groups, True))
    start = np.where(
        res != 0, np.maximum(first_block, c_params), np.maximum(first_block, c_params + ahead)
    )
    share_time = share.time(db)
    group_time = np.maximum(
        start + share_time - ahead, v_params + v_all.time(db) + one_item - ahead
    )
    group_time = np.where(
        db != 0, group_time, np.maximum(group_time, row_blocks * first_block + share_time)
    )
    n_total = sum(lin.n for lin in p.linears)
    x_bytes, w_bytes = p.x_size * p.ln.rows * d, isz * p.k * n_total
    again = x_bytes * (np.minimum(parts, groups) - 1) + w_bytes * (blocks - 1)
    gm = x_bytes + w_bytes + isz * p.m * n_total + l2_spill(machine, x_bytes + w_bytes, again)
    bound = kernel_floor(machine, group_time, gm, sub_bytes, active_vec)
    # The staged schedule is priced as the chain's stages are: priced first, not bounded.
    return np.where(staged != 0, 0.0, bound)
