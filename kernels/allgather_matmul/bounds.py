"""Lower bounds of `agmm_cycles` over a whole tiling space (numpy; `search.Bounded`).

`agmm_lower_bounds` is `cost.agmm_cycles` written over numpy columns of the space's fields in
the same order (each Linear's output tile as a stream of K chunks, paced by its busiest pipe or
summed; the slowest core's shards after each ring arrival, per leading-axis or K gather;
launch, heads and HBM floor through `_bounds`): the model's price up to rounding, so
`search.best` prices only the cheapest few. A staged tiling (the unfused chain's schedule) is
bounded by 0: priced first, once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._bounds import VecStream, k_chunk, kernel_floor
from .._cost_base import ceil_div, dma, dma_out, field_columns
from .._link import ring_arrivals
from ..api import Tiling
from ..npu.machine import Machine
from .kernel import _Problem

#: The fields of `AllGatherMatMulTiling`, in the order `agmm_lower_bounds` reads them.
FIELDS = ("tile_m", "tile_n", "tile_k", "tile_k0", "acc_tiles", "double_buffer", "cores",
          "staged")  # fmt: skip


def agmm_lower_bounds(machine: Machine, p: _Problem, tilings: Sequence[Tiling]) -> np.ndarray:
    """For each tiling, cycles `agmm_cycles(machine, p, t)` never goes below (see the module
    docstring); `tilings` carry `FIELDS`."""
    tile_m, tile_n, tile_k, tile_k0, acc, db, cores_t, staged = field_columns(tilings, FIELDS)
    count = len(tilings)
    tm = np.minimum(tile_m, p.m)
    tk = np.minimum(tile_k, p.ks)
    tk0 = np.minimum(tile_k0, tk)
    isz = p.dtype.itemsize
    cores = np.maximum(1, np.minimum(cores_t, machine.cube_cores))
    k0 = machine.cube_k_block(p.dtype)
    shards = p.g.group_size
    piped = db != 0
    full_k, tail_k = np.divmod(p.ks, tk)
    tiles = np.zeros(count, dtype=np.int64)
    work, fixes, fill = np.zeros(count), np.zeros(count), np.zeros(count)
    for lin in p.lins:
        tn = np.minimum(tile_n, lin.n)
        count_i = ceil_div(p.m, tm) * ceil_div(lin.n, tn)
        tile = VecStream(count)
        for kk, n_chunks in ((tk, full_k), (tail_k, (tail_k > 0).astype(np.int64))):
            mte1, cube = k_chunk(machine, tm, tn, kk, tk0, isz, k0)
            a_in, w_in = tm * kk * isz, kk * tn * isz
            mte2 = dma(machine, a_in, cores, True) + dma(machine, w_in, cores, True)
            tile.add({"MTE2": mte2, "MTE1": mte1, "CUBE": cube}, n_chunks)
        pace = np.where(piped, np.max(np.stack(list(tile.busy.values())), axis=0), tile.single())
        fix_i = dma_out(machine, tm * tn * isz, cores, machine.l0c_to_gm_bytes_per_cycle)
        tiles = tiles + count_i
        work = work + count_i * pace
        fixes = fixes + count_i * fix_i
        fill = np.where((fill == 0) & piped, tile.first_total - tile.first_slowest(), fill)
    w_tile, fix = work / tiles, fixes / tiles
    arrivals = [0.0] + [end for _, end in ring_arrivals(machine, shards, p.g.shard_bytes)]
    if not p.k_gather:
        w = w_tile + np.where(piped, 0.0, fix)
        core = np.max(
            np.stack([a + ceil_div((shards - j) * tiles, cores) * w for j, a in
                      enumerate(arrivals)]), axis=0,
        )  # fmt: skip
        fix_total = np.where(piped, ceil_div(tiles * shards, cores) * fix, 0.0)
        core = np.maximum(core, fix_total) + fill + np.where(piped, fix, 0.0)
    else:
        mine = ceil_div(tiles, cores)
        batch = np.minimum(mine, acc)
        passes = ceil_div(mine, batch)
        w = batch * w_tile
        first = np.max(np.stack([a + (shards - j) * w for j, a in enumerate(arrivals)]), axis=0)
        core = first + (passes - 1) * shards * w + mine * fix + fill
    gm = isz * (shards * p.m * p.ks + p.ks * (shards if p.k_gather else 1) * p.n
                + p.m * p.n * (1 if p.k_gather else shards))  # fmt: skip
    bound = kernel_floor(machine, core, gm, tm * tk * isz, cores)
    return np.where(staged != 0, 0.0, bound)
