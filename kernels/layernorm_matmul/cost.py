"""Cost model of `LayerNormMatMul` (fused LayerNorm on the Vector unit, its Linears on the Cube).

Follows the kernel's program (`layernorm_matmul`), per group of one cube core and its vector
cores, per work item (a row block of `rows` matmul rows x one of `n_split` column parts):

- vector cores, once per row block: per sub-block of `vec_rows` normalized rows (alternating
  between the group's vector cores) copy X in, run the LayerNorm instructions, and hand the
  rows to the Cube through the GM/L2 workspace (910B) at L2 rate;
- cube core: the normalized block lands in L1 (`a_resident`), or `rows` x `tile_k` panels are
  read from the workspace per W tile; per W tile (`tile_k` x `tile_n`) one copy, per `tile_k0`
  step two MTE1 loads and a Cube multiply; FixPipe per output tile.

The two sides overlap: the group takes the longer of (the first block's normalization + the
cube's stream) and (all of its normalization + one block's matmuls). Each stream is pipelined
or summed per `_cost_base.Stream`.

Space: rows on lcm(16, D/K) multiples x {1, 2, 4, 8, 16}, n_split in {1, 2, 3, 4, 6, 8, 12, 16,
24} (up to the 16-column blocks), tile_n on 16-multiples {64, 128, 256} and each split's part
width (up to 512), tile_k on k0 multiples
{256, 512, 1024}, tile_k0 in {64, 128, 256}, vec_rows the most that fit UB (halved until they
do), A resident or streamed, single or double buffering, on all cube cores (fewer groups lose
both their Cube and their vector cores; kept out to keep the space small). Filtered by the
kernel's buffer specs and its own row-multiple rule, deduplicated by what the kernel runs.
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
    cube_blocks,
    dma,
    dma_out,
    fitting,
    kernel_cycles,
    l2_spill,
)
from .._groups import vector_cores_per_group
from .._rows import VecStep
from ..api import TensorMeta, Tiling
from ..matmul.cost import even_splits
from ..npu.machine import Machine
from ..npu.pipes import Level
from .plan import (
    LayerNormMatMulTiling,
    Problem,
    default_tiling,
    effective,
    n_blocks,
    part_columns,
    problem,
    round_up,
    specs,
)
from .staged import staged_cycles


def lnmm_cycles(
    machine: Machine, p: Problem, t: LayerNormMatMulTiling, vector_steps: Sequence[VecStep] = ()
) -> float:
    """Predicted cycles of `t` (see the module docstring); `vector_steps` replaces the LayerNorm's
    vector instructions (RmsNormMatMul runs this program with its own)."""
    tm, vr, tn, tk, tk0 = effective(p, t)
    isz = p.dtype.itemsize
    blocks = math.ceil(p.m / tm)
    parts = min(t.n_split, n_blocks(p))
    items = blocks * parts
    groups = max(1, min(t.cores, machine.cube_cores, items))
    per_group = math.ceil(items / groups)
    # Row blocks a group meets (its share of the block-major item list).
    row_blocks = min(per_group, math.ceil(per_group / parts) + (per_group % parts != 0))
    vecs = vector_cores_per_group(machine)
    separate = vecs > 0
    vecs = max(1, vecs)
    k0 = machine.cube_k_block(p.dtype)
    d = p.ln.width

    # Vector side: one row block's normalization, per vector core.
    slices = tm // p.q
    subs = math.ceil(slices / vr)
    sub_bytes = vr * d * isz
    x_sub = vr * d * p.x_size  # X's rows in (the handoff is in the Cube's dtype)
    active_vec = groups * vecs if separate else groups
    vec_ops = 0.0
    for step in vector_steps or p.steps:
        for op in step.ops:
            k, b = machine.vector_cost(op, step.dtype)
            vec_ops += k * vr * step.per_row + b
    hand = (
        dma_out(machine, sub_bytes, active_vec)
        if separate
        else machine.l1_to_l0_startup_cycles + sub_bytes / machine.ub_to_l1_bytes_per_cycle
    )
    if p.emit_normalized:
        hand += dma_out(machine, x_sub, active_vec)
    vec_sub = {"MTE2": dma(machine, x_sub, active_vec), "VECTOR": vec_ops, "MTE3": hand}
    subs_per_vec = math.ceil(subs / vecs)
    v_block = Stream()
    v_block.add(vec_sub, subs_per_vec)
    v_all = Stream()
    v_all.add(vec_sub, subs_per_vec * row_blocks)
    db = bool(t.double_buffer)

    # Cube side: one item's matmuls, then the whole share.
    item = Stream()
    if t.a_resident and separate:
        item.add({"MTE2": dma(machine, sub_bytes, groups, True)}, subs / parts)
    for lin in p.linears:
        c0, c1 = part_columns(lin.n, 0, parts)
        cols = max(1, c1 - c0)
        n_tiles = math.ceil(cols / tn)
        width = min(tn, cols)
        for kk, count in _chunks(p.k, tk):
            steps = _chunks(kk, tk0)
            mte1 = sum(
                c * (2 * machine.l1_to_l0_startup_cycles
                     + tm * s * isz / machine.l1_to_l0a_bytes_per_cycle
                     + s * width * isz / machine.l1_to_l0b_bytes_per_cycle)
                for s, c in steps
            )  # fmt: skip
            cube = sum(c * cube_blocks(tm, s, width, k0) for s, c in steps)
            mte2 = dma(machine, kk * width * isz, groups, True)
            if not t.a_resident:
                mte2 += dma(machine, tm * kk * isz, groups, True)
            item.add({"MTE2": mte2, "MTE1": mte1, "CUBE": cube}, count * n_tiles)
        fix = dma_out(machine, tm * width * isz, groups, machine.l0c_to_gm_bytes_per_cycle)
        item.busy["FIXP"] = item.busy.get("FIXP", 0.0) + fix * n_tiles
        if t.l0c_single and db:
            # One L0C slot: the next tile's first multiply waits for this tile's FixPipe.
            item.busy["CUBE"] = item.busy.get("CUBE", 0.0) + fix * n_tiles
        item.drain = fix  # the last tile's FixPipe after its last multiply
    share = Stream()
    for p_, c in item.busy.items():
        share.busy[p_] = c * per_group
    share.first = item.first
    share.drain = item.drain
    one_item = item.time(db)
    first_block = v_block.time(db)
    # Parameters first: LayerNorm's scale and bias into each vector core's UB, the Linears'
    # biases into the cube core's L1 (one copy each, on the copy-in pipes).
    v_params = sum(
        dma(machine, d * p.x_size, active_vec)
        for present in (p.ln.has_scale, p.ln.has_bias)
        if present
    )
    c_params = sum(dma(machine, lin.n * isz, groups, True) for lin in p.linears if lin.has_bias)
    first_block += v_params
    # The cube's copy-in pipe is in order: with the block resident, its workspace copies come
    # first, so the W copies wait for the normalization; streamed, the first W copy (issued
    # before the first A panel) overlaps it.
    if t.a_resident:
        start, ahead = max(first_block, c_params), 0.0
    else:
        first_w = min(tk, p.k) * min(tn, part_columns(p.max_n, 0, parts)[1]) * isz
        ahead = dma(machine, first_w, groups, True)
        start = max(first_block, c_params + ahead)
    group_time = max(start + share.time(db) - ahead, v_params + v_all.time(db) + one_item - ahead)
    if not db:
        # Single-buffered: a row block's normalization waits for the previous block's last
        # matmul to release the L1 block (resident) or its UB slots.
        group_time = max(group_time, row_blocks * first_block + share.time(db))
    n_total = sum(lin.n for lin in p.linears)
    # HBM: X and W on first touch, Y written; X's re-reads by other parts' groups and W's by
    # other row blocks hit the L2 (`l2_spill` when they outgrow it).
    x_bytes, w_bytes = p.x_size * p.ln.rows * d, isz * p.k * n_total
    again = x_bytes * (min(parts, groups) - 1) + w_bytes * (blocks - 1)
    gm = x_bytes + w_bytes + isz * p.m * n_total + l2_spill(machine, x_bytes + w_bytes, again)
    return kernel_cycles(machine, group_time, gm, sub_bytes, active_vec)


def _chunks(total: int, step: int) -> list[tuple[int, int]]:
    full, tail = divmod(total, step)
    out = [(step, full)] if full else []
    if tail:
        out.append((tail, 1))
    return out


def lnmm_space(machine: Machine, p: Problem) -> list[LayerNormMatMulTiling]:
    """Fitting tilings (see the module docstring)."""
    unit = math.lcm(machine.cube_m, p.q)
    top = round_up(max(1, p.m), unit)
    rows_options = sorted({min(top, unit * f) for f in (1, 2, 4, 8, 16)})
    most = n_blocks(p)
    splits = sorted({min(most, s) for s in (1, 2, 3, 4, 6, 8, 12, 16, 24)})
    k0 = machine.cube_k_block(p.dtype)
    tks = aligned_sizes(p.k, k0, (256, 512, 1024))
    tk0s = aligned_sizes(p.k, k0, (64, 128, 256))
    vecs = max(1, vector_cores_per_group(machine))
    seen: set[tuple[int, ...]] = set()
    out: list[LayerNormMatMulTiling] = []
    cores = machine.cube_cores
    for rows, db in itertools.product(rows_options, (1, 0)):
        if rows % p.q:
            continue
        # The UB queues depend on vec_rows only: the most rows per vector step that fit.
        vr = max(1, math.ceil(rows // p.q / vecs))
        probe = LayerNormMatMulTiling(rows, 1, vr, 16, k0, k0, 0, db, cores)
        while vr > 1 and not _ub_fits(machine, p, probe):
            vr //= 2
            probe = dataclasses.replace(probe, vec_rows=vr)
        if not _ub_fits(machine, p, probe):
            continue
        for ns in splits:
            # Each split's exact part width (one W tile per part, as the kernel's default
            # does) and the narrower fixed widths.
            part = min(round_up(math.ceil(p.max_n / ns), machine.cube_n), round_up(p.max_n, 16))
            tns = sorted(
                {w for w in (64, 128, 256) if w < part}
                | ({part} if part <= 512 else set())
                | even_splits(part, machine.cube_n)  # as MatMul's space (fuller last waves)
            )
            for tn, tk, tk0, res in itertools.product(tns, tks, tk0s, (1, 0)):
                if tk0 > tk:
                    continue
                t = LayerNormMatMulTiling(rows, ns, vr, tn, tk, tk0, res, db, cores)
                if db and not fitting(machine, specs(p, t)):
                    # MatMul's per-level choice: L0C single when two blocks do not fit it.
                    t = dataclasses.replace(t, l0c_single=1)
                eff = effective(p, t)
                key = (eff[0], eff[1], min(tn, part), eff[3], eff[4], ns, res, db, t.l0c_single)
                if key in seen:
                    continue
                seen.add(key)
                if fitting(machine, specs(p, t)):
                    out.append(t)
    return out


def _volume(t: LayerNormMatMulTiling) -> int:
    """Product of the tile sizes (as the search's near-tie rule measures a tiling)."""
    return t.rows * t.n_split * t.vec_rows * t.tile_n * t.tile_k * t.tile_k0


def _ub_fits(machine: Machine, p: Problem, t: LayerNormMatMulTiling) -> bool:
    used = sum(s.reserved for s in specs(p, t) if s.level is Level.UB)
    return used <= machine.ub_bytes


class _LnmmModel:
    domain = "fuser"
    op_type = "LayerNormMatMul"

    def __init__(self) -> None:
        self._staged = LastProblem()
        self._last = LastProblem()

    def _problem(self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> Problem:
        return self._last.get(metas, attrs, lambda: problem(metas, attrs))

    def space(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Sequence[Tiling]:
        p = problem(metas, attrs)
        fused = lnmm_space(machine, p)
        space: list[Tiling] = list(fused)
        # The unfused chain's schedule is always a candidate: fused is never priced slower.
        # Its fields are unused; it takes the biggest tiles of the space because the search
        # breaks near ties (within its TIE, below the model's error) towards the biggest tiles:
        # the staged price is the chain's own, exact, so a fused tiling that only ties it must
        # not win on tile size (a BERT layer: fused priced 0.9% above staged ran 5% slower).
        base = max(fused, key=_volume) if fused else default_tiling(p, machine)
        space.append(dataclasses.replace(base, staged=1))
        return space

    def cost(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> float:
        assert isinstance(tiling, LayerNormMatMulTiling)
        p = self._problem(metas, attrs)
        if tiling.staged:  # memo keyed by the machine too: the price is the machine's
            make = lambda: staged_cycles(machine, p, metas, attrs)  # noqa: E731
            return float(self._staged.get([*metas, machine], attrs, make))
        return lnmm_cycles(machine, p, tiling)

    def rule_of_thumb(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Tiling | None:
        """The MatMul rule: 128-row blocks, 128-column W tiles, tile_k 256, L0 steps of 128,
        the block resident in L1, no N split, double-buffered on every core; vec_rows halved
        until UB fits."""
        p = self._problem(metas, attrs)
        unit = math.lcm(machine.cube_m, p.q)
        rows = max(unit, round_up(128, unit))
        vecs = max(1, vector_cores_per_group(machine))
        vr = max(1, math.ceil(rows // p.q / vecs))
        t = LayerNormMatMulTiling(rows, 1, vr, 128, 256, 128, 1, 1, machine.cube_cores)
        while t.vec_rows > 1 and not fitting(machine, specs(p, t)):
            t = LayerNormMatMulTiling(rows, 1, t.vec_rows // 2, 128, 256, 128, 1, 1, t.cores)
        return t if fitting(machine, specs(p, t)) else None


MODELS = (_LnmmModel(),)


# Lower bounds for the exact search (`search.Bounded`): `bounds.lnmm_lower_bounds`.
import numpy as np  # noqa: E402

from .._columns import TilingColumns  # noqa: E402
from .bounds import lnmm_lower_bounds  # noqa: E402
from .space import lnmm_space_fast  # noqa: E402


class _BoundedLnmmModel(_LnmmModel):
    """`_LnmmModel` with a numpy lower bound over its space (`search.best` prunes with it)."""

    def space(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> TilingColumns:
        """`_LnmmModel.space`, the fused tilings built in numpy (`space.lnmm_space_fast`): a
        tiling is made only where read."""
        p = self._problem(metas, attrs)
        fused = lnmm_space_fast(machine, p)
        if fused:  # the staged tiling takes the biggest tiles (see `_LnmmModel.space`)
            c = fused.columns
            volume = c["rows"] * c["n_split"] * c["vec_rows"] * c["tile_n"] * c["tile_k"]
            base = fused[int(np.argmax(volume * c["tile_k0"]))]  # `_volume`, its first biggest
            assert isinstance(base, LayerNormMatMulTiling)
        else:
            base = default_tiling(p, machine)
        return fused.extended([dataclasses.replace(base, staged=1)])

    #: The tiling fields `lower_bounds` understands (`search.Bounded`).
    bound_fields = frozenset(f.name for f in dataclasses.fields(LayerNormMatMulTiling))

    def lower_bounds(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tilings: Sequence[Tiling],
        machine: Machine,
    ) -> np.ndarray:
        """Cycles each tiling's `cost` never goes below (`lnmm_lower_bounds`)."""
        return lnmm_lower_bounds(machine, self._problem(metas, attrs), tilings)


MODELS = (_BoundedLnmmModel(),)
