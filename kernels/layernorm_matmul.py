"""`LayerNormMatMul` (domain fuser): LayerNorm on the Vector unit, its Linears on the Cube.

    N = LayerNorm(X; scale, bias, axis, epsilon, stash_type),   Y_i = N @ W_i (+ b_i)

The matmul view: M = prod(X.shape[:-1]) rows of K = X.shape[-1]; a normalized slice (axis ..
last) spans q = D / K matmul rows. A work item is a row block of `rows` matmul rows times one
of `n_split` parts of every W_i's columns; items are split over groups of one cube core and its
vector cores (`_groups`), and a group whose next item has the same row block reuses it. Per
item:

- Vector cores (sub-blocks of `vec_rows` normalized rows, alternating between the group's
  vector cores): copy X in, statistics and normalization (`layernorm`), then hand the rows to
  the Cube. On 910B (separate cores) that hop crosses a GM/L2 workspace (MTE3 out of UB, MTE2
  into L1, both at L2 rate); on a combined core it is a direct UB -> L1 move.
- Cube core: the normalized block stays in L1 for every weight: per `tile_n` columns of W_i,
  per `tile_k` of K, W's tile is copied GM -> L1; per `tile_k0` step both operands go to
  L0A/L0B and the Cube accumulates in L0C (float32); FixPipe writes the block with b_i
  added, rounded to T as MatMul then Add round.

GM (HBM) traffic is then npu-model.md's fused `|X| + |W| * row-blocks + |Y|` (plus biases)
with `n_split=1`, and `|X| * n_split + |W| * row-blocks + |Y|` in general (few rows, as in
decoding, are better served by splitting N than by re-reading W); the unfused chain pays
`|X| + 2|N| + |W| + |Y|`. With `double_buffer` the X/N queues in UB and
the block, W tiles, L0A/L0B and L0C have two slots, so the vector cores normalize block b+1
while the Cube multiplies block b.

The optional `normalized` output is copied out (the workspace write becomes an HBM write)
only with attribute `emit_normalized=1`; the array is returned in functional mode either way,
as the op's contract returns every output.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from ._budget import QueueSpec, capacity, check_flag, check_positive, require_fits
from ._groups import (
    Group,
    from_workspace,
    launch_groups,
    to_workspace,
    ub_to_l1,
    vector_cores_per_group,
    workspace_tile,
)
from .api import Kernel, KernelError, KernelRun, TensorMeta, Tiling, TilingError
from .layernorm import LayerNormSpec, flat_param, layernorm_rows, layernorm_spec, layernorm_steps
from .npu.launch import split_balanced
from .npu.machine import Machine
from .npu.memory import Queue, Tile
from .npu.pipes import Level, Pipe


@dataclass(frozen=True)
class LayerNormMatMulTiling(Tiling):
    """Row block of `rows` matmul rows (a multiple of D / K); each W_i's columns split in
    `n_split` parts (a work item is a row block x a part); `vec_rows` normalized rows per
    vector step; W tiles of `tile_k` x `tile_n` in L1, fed to L0 in steps of `tile_k0`; double
    buffering (0/1); cube cores (groups)."""

    rows: int
    n_split: int
    vec_rows: int
    tile_n: int
    tile_k: int
    tile_k0: int
    double_buffer: int
    cores: int


class _Item(NamedTuple):
    m0: int
    m1: int
    part: int


class _Linear(NamedTuple):
    n: int
    has_bias: bool
    flatten: bool


@dataclass(frozen=True)
class _Problem:
    ln: LayerNormSpec
    m: int  # matmul rows
    k: int
    q: int  # matmul rows per normalized slice
    linears: tuple[_Linear, ...]
    emit_normalized: bool

    @property
    def dtype(self) -> np.dtype:
        return self.ln.dtype

    @property
    def max_n(self) -> int:
        return max((lin.n for lin in self.linears), default=1)


def _problem(
    op: str, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
) -> _Problem:
    metas = [*inputs_meta, None, None, None]
    ln = layernorm_spec(op, metas[0], metas[1], metas[2], attrs)
    has_bias = [int(v) for v in attrs.get("has_bias") or []]
    flatten = [int(v) for v in attrs.get("flatten") or []] or [0] * len(has_bias)
    if not has_bias or len(flatten) != len(has_bias):
        raise KernelError(
            f"{op}: has_bias and flatten need one entry per MatMul, got {has_bias}, {flatten}"
        )
    k = ln.shape[-1]
    linears = []
    pos = 3
    for i, (hb, fl) in enumerate(zip(has_bias, flatten, strict=True)):
        w = metas[pos] if pos < len(inputs_meta) else None
        if w is None or len(w.shape) != 2 or w.shape[0] != k:
            got = None if w is None else w.shape
            raise KernelError(f"{op}: W_{i} must be [{k}, N], got {got}")
        if w.dtype != ln.dtype:
            raise KernelError(f"{op}: W_{i} is {w.dtype}, X is {ln.dtype}")
        if hb:
            b = metas[pos + 1] if pos + 1 < len(inputs_meta) else None
            if b is None or b.size != w.shape[1] or (b.shape and b.shape[-1] != w.shape[1]):
                got = None if b is None else b.shape
                raise KernelError(
                    f"{op}: b_{i} must hold {w.shape[1]} values along its last axis, got {got}"
                )
        linears.append(_Linear(w.shape[1], bool(hb), bool(fl)))
        pos += 1 + hb
    d = ln.width
    return _Problem(
        ln=ln,
        m=ln.rows * (d // k) if k else 0,
        k=k,
        q=d // k if k else 1,
        linears=tuple(linears),
        emit_normalized=bool(int(attrs.get("emit_normalized", 0))),
    )


def _effective(p: _Problem, t: LayerNormMatMulTiling) -> tuple[int, int, int, int, int]:
    """(rows, vec_rows, tile_n, tile_k, tile_k0) clipped to the problem."""
    rows = min(t.rows, max(p.q, p.m))
    tk = min(t.tile_k, p.k)
    return (
        rows, min(t.vec_rows, max(1, rows // p.q)), min(t.tile_n, p.max_n), tk,
        min(t.tile_k0, tk),
    )  # fmt: skip


def _specs(p: _Problem, t: LayerNormMatMulTiling) -> list[QueueSpec]:
    tm, vr, tn, tk, tk0 = _effective(p, t)
    isz = p.dtype.itemsize
    depth = 2 if t.double_buffer else 1
    d = p.ln.width
    specs = [
        QueueSpec(Level.UB, "x", vr * d * isz, depth),
        QueueSpec(Level.UB, "n", vr * d * isz, depth),
        QueueSpec(Level.UB, "tmp", vr * d * p.ln.stats.itemsize, 1),
        QueueSpec(Level.L1, "a_block", tm * p.k * isz, depth),
        QueueSpec(Level.L1, "w", tk * tn * isz, depth),
        QueueSpec(Level.L0A, "a", tm * tk0 * isz, depth),
        QueueSpec(Level.L0B, "b", tk0 * tn * isz, depth),
        QueueSpec(Level.L0C, "acc", tm * tn * 4, depth),
    ]
    for name, present in (("scale", p.ln.has_scale), ("bias", p.ln.has_bias)):
        if present:
            specs.append(QueueSpec(Level.UB, name, d * isz, 1))
    for i, lin in enumerate(p.linears):
        if lin.has_bias:
            specs.append(QueueSpec(Level.L1, f"b{i}", lin.n * isz, 1))
    return specs


def _n_blocks(p: _Problem) -> int:
    """16-column blocks of the widest W_i: the most parts N can be split into."""
    return max(1, math.ceil(p.max_n / 16))


def _part(n: int, part: int, parts: int) -> tuple[int, int]:
    """Columns of part `part` of `parts` of an N of n, in balanced 16-column blocks."""
    r = split_balanced(math.ceil(n / 16), parts)[part]
    return min(n, r.start * 16), min(n, r.stop * 16)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class LayerNormMatMulKernel(Kernel):
    """Fused LayerNorm + n MatMuls (+ bias); see the module docstring."""

    op_type = "LayerNormMatMul"
    domain = "fuser"
    tiling_type = LayerNormMatMulTiling

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        p = _problem(self.op_type, inputs_meta, attrs)
        lead = p.ln.shape[:-1]
        outs = [TensorMeta(p.ln.shape, p.dtype)]
        for lin in p.linears:
            shape = (math.prod(lead), lin.n) if lin.flatten else (*lead, lin.n)
            outs.append(TensorMeta(shape, p.dtype))
        return tuple(outs)

    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, LayerNormMatMulTiling)
        t = tiling
        op = self.op_type
        check_positive(
            op, rows=t.rows, n_split=t.n_split, vec_rows=t.vec_rows, tile_n=t.tile_n,
            tile_k=t.tile_k, tile_k0=t.tile_k0, cores=t.cores,
        )  # fmt: skip
        if t.tile_k0 > t.tile_k:
            raise TilingError(f"{op}: tile_k0 {t.tile_k0} exceeds tile_k {t.tile_k}")
        check_flag(op, double_buffer=t.double_buffer)
        if t.cores > machine.cube_cores:
            raise TilingError(
                f"{op}: tiling uses {t.cores} cores, {machine.name} has {machine.cube_cores} "
                "cube cores"
            )
        p = _problem(op, inputs_meta, attrs)
        if t.rows % p.q:
            raise TilingError(
                f"{op}: rows {t.rows} must be a multiple of {p.q} (matmul rows per normalized "
                "slice)"
            )
        require_fits(op, machine, _specs(p, t))

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> LayerNormMatMulTiling:
        """The best of a few row-block x N-split shapes by a rough estimate (`_estimate`), each
        with the biggest W tiles that fit; the cost model of the tiling search refines it."""
        p = _problem(self.op_type, inputs_meta, attrs)
        unit = math.lcm(machine.cube_m, p.q)
        top = _round_up(max(1, p.m), p.q)
        rows_options = sorted({min(top, unit * 2**i) for i in range(5)})
        splits = [
            s
            for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
            if s <= min(machine.cube_cores, _n_blocks(p))
        ]
        best: tuple[float, LayerNormMatMulTiling] | None = None
        for rows in rows_options:
            for ns in splits:
                t = _fit(p, machine, rows, ns)
                if t is None:
                    continue
                est = _estimate(p, t, machine)
                if best is None or est < best[0]:
                    best = (est, t)
        if best is None:
            raise TilingError(f"{self.op_type}: no tiling fits {machine.name}")
        return best[1]

    def simulate(
        self,
        machine: Machine,
        inputs: Sequence[np.ndarray | None],
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        functional: bool,
        timeline: bool,
    ) -> KernelRun:
        assert isinstance(tiling, LayerNormMatMulTiling)
        p = _problem(self.op_type, inputs_meta, attrs)
        tm = _effective(p, tiling)[0]
        work = [
            _Item(m0, min(m0 + tm, p.m), part)
            for m0 in range(0, p.m, tm)
            for part in range(min(tiling.n_split, _n_blocks(p)))
        ]
        data = _data(p, inputs) if functional else None
        program = partial(_program, p, tiling, data)
        stats = launch_groups(
            machine, self.op_type, work, program, max_groups=tiling.cores,
            functional=functional, timeline=timeline,
        )  # fmt: skip
        if data is None:
            return KernelRun((), stats)
        metas = self.infer(inputs_meta, attrs)
        outs = [data.normalized.reshape(metas[0].shape)]
        outs += [y.reshape(m.shape) for y, m in zip(data.ys, metas[1:], strict=True)]
        return KernelRun(tuple(outs), stats)


def _fit(p: _Problem, machine: Machine, rows: int, n_split: int) -> LayerNormMatMulTiling | None:
    """Big W tiles (few DMA heads) shrunk until the queues fit, or None."""
    k0 = machine.cube_k_block(p.dtype)
    cn = machine.cube_n
    vecs = max(1, vector_cores_per_group(machine))
    part_n = math.ceil(p.max_n / n_split)
    t = LayerNormMatMulTiling(
        rows=rows,
        n_split=n_split,
        vec_rows=max(1, math.ceil(rows // p.q / vecs)),
        tile_n=min(_round_up(part_n, cn), 256),
        tile_k=min(_round_up(max(1, p.k), k0), 1024),
        # Wide L0 steps: fewer, bigger Cube instructions (and numpy calls in functional runs).
        tile_k0=min(_round_up(max(1, p.k), k0), 512 // p.dtype.itemsize),
        double_buffer=1,
        cores=machine.cube_cores,
    )
    rep = dataclasses.replace
    while (level := _overflow(machine, _specs(p, t))) is not None:
        # Shrink what fills the level that overflows; give up when only `rows` would help
        # (the caller tries smaller row blocks itself).
        if level is Level.UB and t.vec_rows > 1:
            t = rep(t, vec_rows=t.vec_rows // 2)
        elif level is Level.L1 and t.tile_k > t.tile_k0:
            t = rep(t, tile_k=max(t.tile_k0, _round_up(t.tile_k // 2, t.tile_k0)))
        elif level in (Level.L0A, Level.L0B) and t.tile_k0 > 2 * k0:
            t = rep(t, tile_k0=t.tile_k0 // 2, tile_k=_round_up(t.tile_k, t.tile_k0 // 2))
        elif level in (Level.L0B, Level.L0C, Level.L1) and t.tile_n > 2 * cn:
            t = rep(t, tile_n=_round_up(t.tile_n // 2, cn))
        elif t.double_buffer:
            t = rep(t, double_buffer=0)
        else:
            return None
    return t


def _overflow(machine: Machine, specs: Sequence[QueueSpec]) -> Level | None:
    """The first level whose queues exceed its capacity, or None when everything fits."""
    for level in (Level.UB, Level.L1, Level.L0A, Level.L0B, Level.L0C):
        if sum(s.reserved for s in specs if s.level is level) > capacity(machine, level):
            return level
    return None


def _estimate(p: _Problem, t: LayerNormMatMulTiling, machine: Machine) -> float:
    """Rough cycles of a tiling: waves of items, each bounded by its slowest pipe (W copies
    with their DMA heads, Cube blocks, vector work), or by HBM traffic."""
    tm, vr, tn, tk, _ = _effective(p, t)
    blocks = math.ceil(p.m / tm)
    parts = min(t.n_split, _n_blocks(p))
    items = blocks * parts
    groups = min(t.cores, machine.cube_cores, items)
    active = groups  # cube cores share HBM among themselves (see `_groups`)
    isz = p.dtype.itemsize
    bw = machine.dma_bytes_per_cycle(active)
    k0 = machine.cube_k_block(p.dtype)
    mte2 = cube = 0.0
    for lin in p.linears:
        cols = math.ceil(lin.n / parts)
        tiles = math.ceil(cols / tn) * math.ceil(p.k / tk)
        mte2 += tiles * machine.copy_in_head(tk * tn * isz, active) + p.k * cols * isz / bw
        cube += math.ceil(tm / 16) * math.ceil(p.k / k0) * math.ceil(cols / 16)
    # The normalized block reaches L1 in sub-blocks, each with its own copy (and head).
    subs = math.ceil(tm // p.q / vr)
    sub_bytes = vr * p.ln.width * isz
    if vector_cores_per_group(machine):
        mte2 += subs * (machine.copy_in_head(sub_bytes, active) + sub_bytes / bw)
    vecs = max(1, vector_cores_per_group(machine))
    vec = subs / vecs * (machine.copy_in_head(sub_bytes, active) + sub_bytes / bw)
    for step in layernorm_steps(p.ln):
        for op in step.ops:
            k, b = machine.vector_cost(op, step.dtype)
            vec += k * (tm // p.q) * step.per_row + b * math.ceil(tm // p.q / vr)
    vec /= max(1, vector_cores_per_group(machine))
    waves = math.ceil(items / groups)
    gm = (
        p.ln.rows * p.ln.width * isz * min(parts, groups)
        + blocks * p.k * sum(lin.n for lin in p.linears) * isz
        + p.m * sum(lin.n for lin in p.linears) * isz
    )
    return max(waves * max(mte2, cube, vec), gm / machine.hbm_bytes_per_cycle)


class _Data(NamedTuple):
    x_rows: np.ndarray  # [R, D]
    scale: np.ndarray | None
    bias: np.ndarray | None
    weights: tuple[np.ndarray, ...]
    biases: tuple[np.ndarray | None, ...]
    normalized: np.ndarray  # [R, D]
    ys: tuple[np.ndarray, ...]  # [M, N_i]


def _data(p: _Problem, inputs: Sequence[np.ndarray | None]) -> _Data:
    ins = [*inputs, None, None, None]
    x = ins[0]
    assert x is not None
    weights, biases = [], []
    pos = 3
    for lin in p.linears:
        w = ins[pos]
        assert w is not None
        weights.append(w)
        b = ins[pos + 1] if lin.has_bias else None
        biases.append(None if b is None else b.reshape(-1))
        pos += 1 + lin.has_bias
    return _Data(
        x_rows=x.reshape(p.ln.rows, p.ln.width),
        scale=flat_param(ins[1], p.ln),
        bias=flat_param(ins[2], p.ln),
        weights=tuple(weights),
        biases=tuple(biases),
        normalized=np.empty((p.ln.rows, p.ln.width), p.dtype),
        ys=tuple(np.empty((p.m, lin.n), p.dtype) for lin in p.linears),
    )


def _queues(core_buf: Any, specs: Sequence[QueueSpec]) -> dict[str, Queue]:
    return {s.name: core_buf.queue(s.name, s.slot_bytes, s.depth) for s in specs}


def _program(
    p: _Problem,
    t: LayerNormMatMulTiling,
    data: _Data | None,
    group: Group,
    items: Sequence[_Item],
) -> None:
    _, vr, tn, tk, tk0 = _effective(p, t)
    specs = _specs(p, t)
    cube = group.cube
    bufs = {Level.L1: cube.l1, Level.L0A: cube.l0a, Level.L0B: cube.l0b, Level.L0C: cube.l0c}
    cq = {
        s.name: bufs[s.level].queue(s.name, s.slot_bytes, s.depth) for s in specs if s.level in bufs
    }
    ub_specs = [s for s in specs if s.level is Level.UB]
    vq = [_queues(v.ub, ub_specs) for v in group.vecs]
    isz = p.dtype.itemsize
    d = p.ln.width
    # Parameters copied once: scale/bias into every vector core's UB, biases into L1.
    params: list[list[Tile]] = []
    for v, q in zip(group.vecs, vq, strict=True):
        mine = []
        for name, arr in (("scale", None if data is None else data.scale),
                          ("bias", None if data is None else data.bias)):  # fmt: skip
            if name in q:
                tile = q[name].alloc()
                v.copy_in(tile, d * isz, arr, label=f"in {name}")
                mine.append(tile)
        params.append(mine)
    bias_tiles: dict[int, Tile] = {}
    for i, lin in enumerate(p.linears):
        if lin.has_bias:
            tile = cq[f"b{i}"].alloc()
            cube.copy_in(
                tile, lin.n * isz, None if data is None else data.biases[i], label=f"in b{i}"
            )
            bias_tiles[i] = tile
    steps = layernorm_steps(p.ln)
    parts = min(t.n_split, _n_blocks(p))
    block: Tile | None = None
    last: tuple[int, int] | None = None
    for m0, m1, part in items:
        if (m0, m1) != last:
            block = cq["a_block"].alloc()
            if data is not None:
                block.data = np.empty((m1 - m0, p.k), p.dtype)
            for j, r0 in enumerate(range(m0 // p.q, m1 // p.q, vr)):
                r1 = min(r0 + vr, m1 // p.q)
                _normalize(p, group, j, vq, params, steps, data, block, m0, r0, r1)
            last = (m0, m1)
        assert block is not None
        for i, lin in enumerate(p.linears):
            c0, c1 = _part(lin.n, part, parts)
            for n0 in range(c0, c1, tn):
                n1 = min(n0 + tn, c1)
                _block_matmul(
                    p, cube, cq, data, block, i, bias_tiles.get(i), m0, m1, n0, n1, tk, tk0
                )


def _normalize(
    p: _Problem,
    group: Group,
    j: int,
    vq: list[dict[str, Queue]],
    params: list[list[Tile]],
    steps: Sequence[Any],
    data: _Data | None,
    block: Tile,
    m0: int,
    r0: int,
    r1: int,
) -> None:
    """Sub-block j (normalized rows r0..r1) on one of the group's vector cores, then to L1."""
    v = group.vecs[j % len(group.vecs)]
    q = vq[j % len(group.vecs)]
    n_rows = r1 - r0
    d, isz = p.ln.width, p.dtype.itemsize
    nbytes = n_rows * d * isz
    xin = q["x"].alloc()
    v.copy_in(xin, nbytes, None if data is None else data.x_rows[r0:r1])
    out = q["n"].alloc()
    mine = params[j % len(group.vecs)]
    for s_i, step in enumerate(steps):
        if s_i == 0:
            fn = None if data is None else partial(_ln_tile, p.ln)
            v.vector(step.ops, step.dtype, n_rows * step.per_row, (xin, *mine), (out,), fn,
                     out_bytes=nbytes)  # fmt: skip
        else:
            # Later steps charge their instructions on the same pipe (the tile is done).
            v.vector(step.ops, step.dtype, n_rows * step.per_row, (out,), (out,), None,
                     out_bytes=nbytes)  # fmt: skip
    if data is not None and out.data is not None:
        data.normalized[r0:r1] = out.data
    lo = (r0 - m0 // p.q) * p.q
    place = partial(_place, lo, p.k)
    if p.emit_normalized:
        v.copy_out(out, nbytes, None, label="out normalized")
    if not group.separate:
        ub_to_l1(v, out, block, nbytes, place)
        return
    if p.emit_normalized:
        # The normalized output in GM doubles as the workspace the cube core reads (L2-hot).
        ws = workspace_tile(f"normalized[{r0}:{r1}]")
        ws.ready = v.pipe_free[Pipe.MTE3]
        ws.data = out.data
    else:
        ws = workspace_tile(f"ws[{r0}:{r1}]")
        to_workspace(v, out, ws, nbytes)
    from_workspace(group.cube, ws, block, nbytes, place)


def _ln_tile(s: LayerNormSpec, x: np.ndarray, *params: np.ndarray) -> np.ndarray:
    it = iter(params)
    scale = next(it) if s.has_scale else None
    bias = next(it) if s.has_bias else None
    return layernorm_rows(s, x, scale, bias)[0]


def _place(lo: int, k: int, dst: np.ndarray, rows: np.ndarray) -> None:
    piece = rows.reshape(-1, k)
    dst[lo : lo + piece.shape[0]] = piece


def _block_matmul(
    p: _Problem,
    cube: Any,
    cq: dict[str, Queue],
    data: _Data | None,
    block: Tile,
    i: int,
    bias: Tile | None,
    m0: int,
    m1: int,
    n0: int,
    n1: int,
    tk: int,
    tk0: int,
) -> None:
    """Y_i[m0:m1, n0:n1] = block @ W_i[:, n0:n1] (+ b_i), K in steps of tk."""
    rows, cols = m1 - m0, n1 - n0
    isz = p.dtype.itemsize
    acc = cq["acc"].alloc()
    W = None if data is None else data.weights[i]
    for k0 in range(0, p.k, tk):
        k1 = min(k0 + tk, p.k)
        w = cq["w"].alloc()
        cube.copy_in(w, (k1 - k0) * cols * isz, None if W is None else W[k0:k1, n0:n1])
        for s0 in range(k0, k1, tk0):
            s1 = min(s0 + tk0, k1)
            a = cq["a"].alloc()
            cube.load_l0(a, block, rows * (s1 - s0) * isz, partial(_cols, s0, s1))
            b = cq["b"].alloc()
            cube.load_l0(b, w, (s1 - s0) * cols * isz, partial(_rows, s0 - k0, s1 - k0))
            cube.mmad(acc, a, b, rows, s1 - s0, cols, p.dtype, init=s0 == 0)
    dst = None if data is None else data.ys[i][m0:m1, n0:n1]
    reads = (bias,) if bias is not None else ()
    cube.fixpipe(acc, rows * cols * isz, dst, partial(_epilogue, p.dtype, n0, n1), reads=reads)


def _cols(k0: int, k1: int, a: np.ndarray) -> np.ndarray:
    return a[:, k0:k1]


def _rows(k0: int, k1: int, w: np.ndarray) -> np.ndarray:
    return w[k0:k1]


def _epilogue(dtype: np.dtype, n0: int, n1: int, acc: np.ndarray, *bias: np.ndarray) -> np.ndarray:
    # MatMul rounds to T, then the bias Add rounds again (the op's reference does the same).
    y = acc.astype(dtype)
    if bias:
        y = (y + bias[0][n0:n1]).astype(dtype)
    return y


KERNELS = (LayerNormMatMulKernel(),)
