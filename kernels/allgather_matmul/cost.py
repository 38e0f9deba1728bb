"""Cost model of `AllGatherMatMul`: the matmul of each shard overlapped with the ring gather.

Per core, per output tile: the K panels of A and W are copied into L1 (MTE2), loaded into
L0A/L0B in `tile_k0` steps (MTE1) and multiplied (Cube); FixPipe writes the tile (per shard for
a leading-axis gather, once after the last shard for a K gather). Shard j can be worked on only
once ring step j has landed (`_link.ring_arrivals`), so a core's makespan is
`max over j of (arrival_j + the work of shards j..p-1)` plus one step's fill/drain: that is
npu-model.md's `T_mm(m/p) + sum over p-1 steps of max(T_mm(m/p), alpha + S/beta)` written for
uneven steps. For a K gather with more output tiles than `acc_tiles` L0C slots, later passes
find every shard landed and cost their work alone.

Space: tile_m, tile_n on 16-multiples {16 .. 256}, tile_k in {128 .. 1024} and tile_k0 in
{32 .. 256} on k0 multiples, acc_tiles in {1, 2, 4, 8} (K gather; 1 or 2 for M), single or
double buffering, all / half / a quarter of the cube cores, filtered by the kernel's buffer specs
and deduplicated.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._cost_base import (
    LastProblem,
    Stream,
    aligned_sizes,
    core_counts,
    cube_blocks,
    dma,
    dma_out,
    fitting,
    kernel_cycles,
)
from .._link import ring_arrivals
from ..api import TensorMeta, Tiling
from ..matmul.cost import even_splits
from ..npu.machine import Machine
from .kernel import AllGatherMatMulTiling, _effective, _Problem, _problem, _specs
from .staged import staged_cycles

OP = "AllGatherMatMul"


def agmm_cycles(machine: Machine, p: _Problem, t: AllGatherMatMulTiling) -> float:
    """Predicted cycles of `t` (see the module docstring)."""
    tm, _, tk, tk0 = _effective(p, t)
    isz = p.dtype.itemsize
    cores = max(1, min(t.cores, machine.cube_cores))
    k0 = machine.cube_k_block(p.dtype)
    shards = p.g.group_size
    db = bool(t.double_buffer)

    def pace(s: Stream) -> float:
        return max(s.busy.values()) if db else s.single()

    # Per Linear: its tiles' work (tile_n capped by its own N). Several Linears share one work
    # list, so a core's share is priced at the mean work of a tile.
    tiles, work, fixes, fill = 0, 0.0, 0.0, 0.0
    for lin in p.lins:
        tn = min(t.tile_n, lin.n)
        count_i = math.ceil(p.m / tm) * math.ceil(lin.n / tn)
        tile = Stream()
        for kk, count in _chunks(p.ks, tk):
            steps = _chunks(kk, tk0)
            mte1 = sum(
                c * (2 * machine.l1_to_l0_startup_cycles
                     + tm * s * isz / machine.l1_to_l0a_bytes_per_cycle
                     + s * tn * isz / machine.l1_to_l0b_bytes_per_cycle)
                for s, c in steps
            )  # fmt: skip
            cube = sum(c * cube_blocks(tm, s, tn, k0) for s, c in steps)
            mte2 = dma(machine, tm * kk * isz, cores, True) + dma(
                machine, kk * tn * isz, cores, True
            )
            tile.add({"MTE2": mte2, "MTE1": mte1, "CUBE": cube}, count)
        fix_i = dma_out(machine, tm * tn * isz, cores, machine.l0c_to_gm_bytes_per_cycle)
        tiles += count_i
        work += count_i * pace(tile)
        fixes += count_i * fix_i
        if not fill and db and tile.first:
            fill = tile.first.total - tile.first.slowest
    w_tile, fix = work / tiles, fixes / tiles
    arrivals = [0.0] + [end for _, end in ring_arrivals(machine, shards, p.g.shard_bytes)]
    if not p.k_gather:
        # Rotation evens the tails out over the shards, but a core still owns whole tiles:
        # from shard j on, the busiest core holds ceil((p - j) * tiles / cores) of them.
        w = w_tile + (fix if not db else 0.0)
        core = max(a + math.ceil((shards - j) * tiles / cores) * w for j, a in enumerate(arrivals))
        fix_total = math.ceil(tiles * shards / cores) * fix if db else 0.0
        core = max(core, fix_total) + fill + (fix if db else 0.0)
    else:
        mine = math.ceil(tiles / cores)
        batch = min(mine, t.acc_tiles)
        passes = math.ceil(mine / batch)
        w = batch * w_tile
        first = max(a + (shards - j) * w for j, a in enumerate(arrivals))
        core = first + (passes - 1) * shards * w + mine * fix + fill
    gm = isz * (shards * p.m * p.ks + p.ks * (shards if p.k_gather else 1) * p.n
                + p.m * p.n * (1 if p.k_gather else shards))  # fmt: skip
    return kernel_cycles(machine, core, gm, tm * tk * isz, cores)


def _chunks(total: int, step: int) -> list[tuple[int, int]]:
    full, tail = divmod(total, step)
    out = [(step, full)] if full else []
    if tail:
        out.append((tail, 1))
    return out


def agmm_space(machine: Machine, p: _Problem) -> list[AllGatherMatMulTiling]:
    """Fitting tilings (see the module docstring)."""
    k0 = machine.cube_k_block(p.dtype)
    # As MatMul's space: the even splits between 128 and 256 too (fuller last waves).
    ms = sorted({*aligned_sizes(p.m, machine.cube_m, (16, 32, 64, 128, 256)),
                 *even_splits(p.m, machine.cube_m)})  # fmt: skip
    widest = max(lin.n for lin in p.lins)
    ns = sorted({*aligned_sizes(widest, machine.cube_n, (16, 32, 64, 128, 256)),
                 *(s for lin in p.lins for s in even_splits(lin.n, machine.cube_n))})  # fmt: skip
    ks = aligned_sizes(p.ks, k0, (128, 256, 512, 1024))
    k0s = aligned_sizes(p.ks, k0, (32, 64, 128, 256))
    accs = (1, 2, 4, 8) if p.k_gather else (1, 2)
    seen: set[tuple[int, ...]] = set()
    out: list[AllGatherMatMulTiling] = []
    for tm, tn, tk, tk0, acc, db, cores in itertools.product(
        ms, ns, ks, k0s, accs, (1, 0), core_counts(machine.cube_cores)
    ):
        if tk0 > tk:
            continue
        t = AllGatherMatMulTiling(tm, tn, tk, tk0, acc, db, cores)
        eff = _effective(p, t)
        tiles = sum(math.ceil(p.m / eff[0]) * math.ceil(lin.n / eff[1]) for lin in p.lins)
        per_core = math.ceil(tiles / min(cores, machine.cube_cores))
        key = (*eff, min(acc, per_core) if p.k_gather else min(acc, 2), db, cores)
        if key in seen or not fitting(machine, _specs(p, t)):
            continue
        seen.add(key)
        out.append(t)
    return out


class _AgmmModel:
    domain = "fuser"
    op_type = OP

    def __init__(self) -> None:
        self._last = LastProblem()
        self._staged = LastProblem()

    def space(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Sequence[Tiling]:
        p = _problem(OP, metas, attrs, machine)
        space: list[Tiling] = list(agmm_space(machine, p))
        # The unfused chain's schedule (one chunk) is always a candidate: never priced slower.
        base = space[0] if space else AllGatherMatMulTiling(16, 16, 16, 16, 1, 0, 1)
        assert isinstance(base, AllGatherMatMulTiling)
        space.append(dataclasses.replace(base, staged=1))
        return space

    def cost(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> float:
        assert isinstance(tiling, AllGatherMatMulTiling)
        p = self._last.get(metas, attrs, lambda: _problem(OP, metas, attrs, machine))
        if tiling.staged:  # memo keyed by the machine too: the price is the machine's
            return float(
                self._staged.get([*metas, machine], attrs, lambda: staged_cycles(machine, p, metas))
            )
        return agmm_cycles(machine, p, tiling)

    def rule_of_thumb(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Tiling | None:
        """The MatMul rule: 128 x 128 output tiles, tile_k 256, L0 steps of 128, two L0C
        accumulators, double-buffered on every core."""
        p = _problem(OP, metas, attrs, machine)
        t = AllGatherMatMulTiling(128, 128, 256, 128, 2, 1, machine.cube_cores)
        return t if fitting(machine, _specs(p, t)) else None


MODELS = (_AgmmModel(),)


# The lower bound of the exact search (`search.Bounded`): `bounds.agmm_lower_bounds`.
import numpy as np  # noqa: E402

from .._columns import TilingColumns  # noqa: E402
from .bounds import agmm_lower_bounds  # noqa: E402
from .space import agmm_space_fast  # noqa: E402


class _BoundedAgmmModel(_AgmmModel):
    """`_AgmmModel` with its space built in numpy and a lower bound over it (`search.best`
    prunes with it)."""

    def space(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> TilingColumns:
        """`_AgmmModel.space`, the tilings from `agmm_space_fast` (numpy columns: a tiling is
        made only where read)."""
        p = _problem(OP, metas, attrs, machine)
        space = agmm_space_fast(machine, p)
        base = space[0] if space else AllGatherMatMulTiling(16, 16, 16, 16, 1, 0, 1)
        assert isinstance(base, AllGatherMatMulTiling)
        return space.extended([dataclasses.replace(base, staged=1)])

    #: The tiling fields `lower_bounds` understands (`search.Bounded`).
    bound_fields = frozenset(f.name for f in dataclasses.fields(AllGatherMatMulTiling))

    def lower_bounds(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tilings: Sequence[Tiling],
        machine: Machine,
    ) -> np.ndarray:
        """Cycles each tiling's `cost` never goes below (`agmm_lower_bounds`)."""
        p = self._last.get(metas, attrs, lambda: _problem(OP, metas, attrs, machine))
        return agmm_lower_bounds(machine, p, tilings)


MODELS = (_BoundedAgmmModel(),)
