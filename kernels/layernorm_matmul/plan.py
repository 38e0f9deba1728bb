"""LayerNormMatMul's problem, buffers and host-side tiling (the kernel is `layernorm_matmul`).

`problem` checks the op's inputs and attributes and says what the kernel computes: M matmul
rows of K, q = D / K matmul rows per normalized slice, the Linears. `specs` lists the queues a
tiling reserves on the vector cores (UB) and the cube core (L1, L0A, L0B, L0C), double buffering
counted. `default_tiling` tries a few row-block x N-split shapes, with the normalized block in L1 or
streamed from the workspace, gives each the biggest tiles that fit, and keeps the one a rough
estimate (`estimate`) prices lowest.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .._budget import QueueSpec
from .._columns import TilingColumns, greater, lesser, pick
from .._cost_base import ceil_div
from .._groups import vector_cores_per_group
from .._levels import overflow
from .._rows import VecStep
from ..api import KernelError, TensorMeta, Tiling, TilingError
from ..layernorm import LayerNormSpec, layernorm_spec, layernorm_steps
from ..npu.launch import split_balanced
from ..npu.machine import Machine
from ..npu.pipes import Level

OP = "LayerNormMatMul"


@dataclass(frozen=True)
class LayerNormMatMulTiling(Tiling):
    """Row block of `rows` matmul rows (a multiple of D / K); each W_i's columns split in
    `n_split` parts (a work item is a row block x a part); `vec_rows` normalized rows per
    vector step; W tiles of `tile_k` x `tile_n` in L1, fed to L0 in steps of `tile_k0`;
    `a_resident` 1: the normalized block stays in L1 for all its matmuls, 0: it stays in the
    GM/L2 workspace and `rows` x `tile_k` panels of it are copied to L1 per step (big K);
    double buffering (0/1); cube cores (groups); `staged` 1: the unfused chain's schedule
    instead (`staged.py`: LayerNorm writes N once, MatMul reads it back), the other fields
    then unused; `l0c_single` 1: L0C single-buffered even when double-buffering (MatMul's
    per-level choice, CATLASS's 128 x 256 blocks: one float32 block fills L0C, its FixPipe
    then runs between this block's last multiply and the next block's first)."""

    rows: int
    n_split: int
    vec_rows: int
    tile_n: int
    tile_k: int
    tile_k0: int
    a_resident: int
    double_buffer: int
    cores: int
    staged: int = 0
    l0c_single: int = 0


class Item(NamedTuple):
    """A work item: matmul rows m0..m1 times part `part` of every W_i's columns."""

    m0: int
    m1: int
    part: int


class Linear(NamedTuple):
    """One MatMul of the op: N columns, with a bias or not, output flattened to 2-D or not."""

    n: int
    has_bias: bool
    flatten: bool


@dataclass(frozen=True)
class Problem:
    """What one LayerNormMatMul computes (see the module docstring)."""

    ln: LayerNormSpec
    m: int  # matmul rows
    k: int
    q: int  # matmul rows per normalized slice
    linears: tuple[Linear, ...]
    emit_normalized: bool
    # The Linears' dtype when N is cast to it first (`matmul_type`, autocast), else None.
    mm_dtype: np.dtype | None = None

    @property
    def dtype(self) -> np.dtype:
        """The Cube's dtype: the normalized rows handed to it, W_i, b_i and Y_i (X's dtype
        unless `matmul_type` casts N)."""
        return self.ln.dtype if self.mm_dtype is None else self.mm_dtype

    @property
    def x_size(self) -> int:
        """Bytes per element of X, gamma, beta and the normalized output (X's dtype)."""
        return int(self.ln.dtype.itemsize)

    @property
    def steps(self) -> list[VecStep]:
        """The vector instructions per row: the LayerNorm's, then `handoff`."""
        return self.handoff(layernorm_steps(self.ln))

    def handoff(self, norm_steps: list[VecStep]) -> list[VecStep]:
        """A norm's vector instructions per row, then the Cast to the Cube's dtype when
        `matmul_type` asks for one (the rows are handed to the Cube in its dtype)."""
        if self.dtype != self.ln.dtype:
            return [*norm_steps, VecStep(("Cast",), self.ln.width, self.ln.dtype)]
        return norm_steps

    @property
    def max_n(self) -> int:
        """Columns of the widest W_i."""
        return max((lin.n for lin in self.linears), default=1)


def problem(inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> Problem:
    """Check the op's inputs and attributes (`KernelError` says what is wrong)."""
    op = OP
    """Check the op's inputs and attributes (`KernelError` says what is wrong)."""
    op = OP
    metas = [*inputs_meta, None, None, None]
    ln = layernorm_spec(op, metas[0], metas[1], metas[2], attrs)
    has_bias = [int(v) for v in attrs.get("has_bias") or []]
    flatten = [int(v) for v in attrs.get("flatten") or []] or [0] * len(has_bias)
    if not has_bias or len(flatten) != len(has_bias):
        raise KernelError(
            f"{op}: has_bias and flatten need one entry per MatMul, got {has_bias}, {flatten}"
        )
    k = ln.shape[-1]
    to = int(attrs.get("matmul_type") or 0)
    mm = _MATMUL_TYPES.get(to) if to else None
    if to and mm is None:
        raise KernelError(f"{op}: matmul_type {to} is not float16 or float32")
    if mm == ln.dtype:
        mm = None
    linears = []
    pos = 3
    for i, (hb, fl) in enumerate(zip(has_bias, flatten, strict=True)):
        w = metas[pos] if pos < len(inputs_meta) else None
        if w is None or len(w.shape) != 2 or w.shape[0] != k:
            got = None if w is None else w.shape
            raise KernelError(f"{op}: W_{i} must be [{k}, N], got {got}")
        if w.dtype != (mm or ln.dtype):
            want = f"matmul_type {mm}" if mm else f"X {ln.dtype}"
            raise KernelError(f"{op}: W_{i} is {w.dtype}, {want}")
        if hb:
            b = metas[pos + 1] if pos + 1 < len(inputs_meta) else None
            if b is None or b.size != w.shape[1] or (b.shape and b.shape[-1] != w.shape[1]):
                got = None if b is None else b.shape
                raise KernelError(
                    f"{op}: b_{i} must hold {w.shape[1]} values along its last axis, got {got}"
                )
        linears.append(Linear(w.shape[1], bool(hb), bool(fl)))
        pos += 1 + hb
    d = ln.width
    return Problem(
        ln=ln,
        m=ln.rows * (d // k) if k else 0,
        k=k,
        q=d // k if k else 1,
        linears=tuple(linears),
        emit_normalized=bool(int(attrs.get("emit_normalized", 0))),
        mm_dtype=mm,
    )


# TensorProto FLOAT and FLOAT16: the Cube's dtypes a normalized value can be cast to.
_MATMUL_TYPES: dict[int, np.dtype] = {1: np.dtype(np.float32), 10: np.dtype(np.float16)}


def effective(p: Problem, t: LayerNormMatMulTiling | TilingColumns) -> tuple[Any, ...]:
    """(rows, vec_rows, tile_n, tile_k, tile_k0) clipped to the problem (ints of one tiling,
    or columns of a space's)."""
    rows = lesser(t.rows, max(p.q, p.m))
    tk = lesser(t.tile_k, p.k)
    return (
        rows, lesser(t.vec_rows, greater(1, rows // p.q)), lesser(t.tile_n, p.max_n), tk,
        lesser(t.tile_k0, tk),
    )  # fmt: skip


def specs(p: Problem, t: LayerNormMatMulTiling) -> list[QueueSpec]:
    """Queues per vector core (UB) and on the cube core (L1, L0A/L0B/L0C) for tiling `t`."""
    tm, vr, tn, tk, tk0 = effective(p, t)
    isz = p.dtype.itemsize
    depth = 2 if t.double_buffer else 1
    d = p.ln.width
    xsz = p.x_size
    specs = [
        QueueSpec(Level.UB, "x", vr * d * xsz, depth),
        # N in X's dtype, cast in place to the Cube's when it is narrower.
        QueueSpec(Level.UB, "n", vr * d * max(xsz, isz), depth),
        QueueSpec(Level.UB, "tmp", vr * d * p.ln.work.itemsize, 1),
        QueueSpec(Level.L1, "a_block", tm * p.k * isz, depth)
        if t.a_resident
        else QueueSpec(Level.L1, "a_panel", tm * tk * isz, depth),
        QueueSpec(Level.L1, "w", tk * tn * isz, depth),
        QueueSpec(Level.L0A, "a", tm * tk0 * isz, depth),
        QueueSpec(Level.L0B, "b", tk0 * tn * isz, depth),
        QueueSpec(Level.L0C, "acc", tm * tn * 4, 1 if t.l0c_single else depth),
    ]
    for name, present in (("scale", p.ln.has_scale), ("bias", p.ln.has_bias)):
        if present:
            specs.append(QueueSpec(Level.UB, name, d * xsz, 1))
    for i, lin in enumerate(p.linears):
        if lin.has_bias:
            specs.append(QueueSpec(Level.L1, f"b{i}", lin.n * isz, 1))
    return specs


def n_blocks(p: Problem) -> int:
    """16-column blocks of the widest W_i: the most parts N can be split into."""
    return max(1, math.ceil(p.max_n / 16))


def part_columns(n: int, part: int, parts: int) -> tuple[int, int]:
    """Columns of part `part` of `parts` of an N of n, in balanced 16-column blocks."""
    r = split_balanced(math.ceil(n / 16), parts)[part]
    return min(n, r.start * 16), min(n, r.stop * 16)


def round_up(x: int, m: int) -> int:
    """x rounded up to a multiple of m."""
    return -(-x // m) * m


def fit(
    p: Problem, machine: Machine, rows: int, n_split: int, a_resident: int
) -> LayerNormMatMulTiling | None:
    """Big W tiles (few DMA heads) shrunk until the queues fit, or None."""
    k0 = machine.cube_k_block(p.dtype)
    cn = machine.cube_n
    vecs = max(1, vector_cores_per_group(machine))
    part_n = math.ceil(p.max_n / n_split)
    t = LayerNormMatMulTiling(
        rows=rows,
        n_split=n_split,
        vec_rows=max(1, math.ceil(rows // p.q / vecs)),
        tile_n=min(round_up(part_n, cn), 256),
        tile_k=min(round_up(max(1, p.k), k0), 1024),
        # Wide L0 steps: fewer, bigger Cube instructions (and numpy calls in functional runs).
        tile_k0=min(round_up(max(1, p.k), k0), 512 // p.dtype.itemsize),
        a_resident=a_resident,
        double_buffer=1,
        cores=machine.cube_cores,
    )
    rep = dataclasses.replace
    while (level := overflow(machine, specs(p, t))) is not None:
        # Shrink what fills the level that overflows; give up when only `rows` would help
        # (the caller tries smaller row blocks itself).
        if level is Level.UB and t.vec_rows > 1:
            t = rep(t, vec_rows=t.vec_rows // 2)
        elif level is Level.L1 and t.tile_k > t.tile_k0:
            t = rep(t, tile_k=max(t.tile_k0, round_up(t.tile_k // 2, t.tile_k0)))
        elif level in (Level.L0A, Level.L0B) and t.tile_k0 > 2 * k0:
            t = rep(t, tile_k0=t.tile_k0 // 2, tile_k=round_up(t.tile_k, t.tile_k0 // 2))
        elif level in (Level.L0B, Level.L0C, Level.L1) and t.tile_n > 2 * cn:
            t = rep(t, tile_n=round_up(t.tile_n // 2, cn))
        elif t.double_buffer:
            t = rep(t, double_buffer=0)
        else:
            return None
    return t


def estimate(p: Problem, t: LayerNormMatMulTiling | TilingColumns, machine: Machine) -> Any:
    """Rough cycles of a tiling: waves of items, each bounded by its slowest pipe (W copies
    with their DMA heads, Cube blocks, vector work), or by HBM traffic. Of one tiling, or of
    every row of a space at once (a column; the same arithmetic in the same order)."""
    tm, vr, tn, tk, _ = effective(p, t)
    blocks = ceil_div(p.m, tm)
    parts = lesser(t.n_split, n_blocks(p))
    items = blocks * parts
    groups = lesser(t.cores, machine.cube_cores, items)
    isz = p.dtype.itemsize
    bw = machine.read_bytes_per_cycle
    k0 = machine.cube_k_block(p.dtype)
    head = machine.copy_in_transfer(True)
    mte2: Any = 0.0
    cube: Any = 0.0
    for lin in p.linears:
        cols = ceil_div(lin.n, parts)
        tiles = ceil_div(cols, tn) * ceil_div(p.k, tk)
        mte2 = mte2 + (tiles * head + p.k * cols * isz / bw)
        cube = cube + ceil_div(tm, 16) * ceil_div(p.k, k0) * ceil_div(cols, 16)
    subs = ceil_div(tm // p.q, vr)
    sub_bytes = vr * p.ln.width * isz
    streamed = t.a_resident == 0
    # Streamed: A panels from the L2 workspace, once per W tile.
    for lin in p.linears:
        tiles = ceil_div(ceil_div(lin.n, parts), tn) * ceil_div(p.k, tk)
        mte2 = mte2 + pick(streamed, tiles * (head + tm * tk * isz / bw), 0.0)
    if vector_cores_per_group(machine):
        # Resident: the normalized block reaches L1 in sub-blocks, each with its own copy.
        mte2 = mte2 + pick(streamed, 0.0, subs * (head + sub_bytes / bw))
    vecs = max(1, vector_cores_per_group(machine))
    vec = subs / vecs * (machine.copy_in_transfer(False) + sub_bytes / bw)
    slices = tm // p.q
    for step in p.steps:
        for op in step.ops:
            k, b = machine.vector_cost(op, step.dtype)
            vec = vec + (k * slices * step.per_row + b * subs)
    vec = vec / max(1, vector_cores_per_group(machine))
    waves = ceil_div(items, groups)
    gm = (
        p.ln.rows * p.ln.width * p.x_size * lesser(parts, groups)
        + blocks * p.k * sum(lin.n for lin in p.linears) * isz
        + p.m * sum(lin.n for lin in p.linears) * isz
    )
    return greater(waves * greater(mte2, cube, vec), gm / machine.hbm_bytes_per_cycle)


def default_tiling(p: Problem, machine: Machine) -> LayerNormMatMulTiling:
    """The best of a few row-block x N-split x A-placement shapes by `estimate`, each with the
    biggest tiles that fit; the cost model of the tiling search refines it."""
    unit = math.lcm(machine.cube_m, p.q)
    top = round_up(max(1, p.m), p.q)
    rows_options = sorted({min(top, unit * 2**i) for i in range(5)})
    most = min(machine.cube_cores, n_blocks(p))
    splits = [s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if s <= most]
    best: tuple[float, LayerNormMatMulTiling] | None = None
    for rows, ns, resident in itertools.product(rows_options, splits, (1, 0)):
        t = fit(p, machine, rows, ns, resident)
        if t is None:
            continue
        est = estimate(p, t, machine)
        if best is None or est < best[0]:
            best = (est, t)
    if best is None:
        raise TilingError(f"{OP}: no tiling fits {machine.name}")
    return best[1]
