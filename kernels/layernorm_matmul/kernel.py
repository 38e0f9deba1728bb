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
- Cube core: with `a_resident=1` the normalized block stays in L1 for every weight; with 0
  (big K, where a whole block cannot fit L1) it stays in the GM/L2 workspace and a
  `rows` x `tile_k` panel of it is copied to L1 at L2 rate per step. Per `tile_n` columns of
  W_i, per `tile_k` of K, W's tile is copied GM -> L1; per `tile_k0` step both operands go to
  L0A/L0B and the Cube accumulates in L0C (float32); FixPipe writes the block with b_i
  added, rounded to T as MatMul then Add round.

GM (HBM) traffic is then npu-model.md's fused `|X| + |W| * row-blocks + |Y|` (plus biases)
with `n_split=1`, and `|X| * n_split + |W| * row-blocks + |Y|` in general (few rows, as in
decoding, are better served by splitting N than by re-reading W); the unfused chain pays
`|X| + 2|N| + |W| + |Y|`. Workspace traffic stays in L2 and is charged in time at L2 rate,
not counted as HBM bytes. With `double_buffer` the X/N queues in UB and the block (or A
panels), W tiles, L0A/L0B and L0C have two slots, so the vector cores normalize block b+1
while the Cube multiplies block b.

The optional `normalized` output is copied out (the workspace write becomes an HBM write)
only with attribute `emit_normalized=1`; the array is returned in functional mode either way,
as the op's contract returns every output.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from .._budget import QueueSpec, check_flag, check_positive, require_fits
from .._groups import Group, from_workspace, launch_groups, to_workspace, ub_to_l1, workspace_tile
from ..api import Kernel, KernelRun, TensorMeta, Tiling, TilingError
from ..layernorm import LayerNormSpec, flat_param, layernorm_rows
from ..matmul.pipeline import L0Queues, k_walk
from ..npu.core import Core
from ..npu.machine import Machine
from ..npu.memory import Buffer, Queue, Tile
from ..npu.pipes import Level, Pipe
from ..search import Searched
from .plan import (
    Item,
    LayerNormMatMulTiling,
    Problem,
    effective,
    n_blocks,
    part_columns,
    problem,
    specs,
)
from .staged import run_staged


class LayerNormMatMulKernel(Searched, Kernel):
    """Fused LayerNorm + n MatMuls (+ bias); see the module docstring."""

    op_type = "LayerNormMatMul"
    domain = "fuser"
    tiling_type = LayerNormMatMulTiling

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        p = problem(inputs_meta, attrs)
        lead = p.ln.shape[:-1]
        outs = [TensorMeta(p.ln.shape, p.ln.dtype)]
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
        check_flag(op, a_resident=t.a_resident, double_buffer=t.double_buffer, staged=t.staged)
        if t.cores > machine.cube_cores:
            raise TilingError(
                f"{op}: tiling uses {t.cores} cores, {machine.name} has {machine.cube_cores} "
                "cube cores"
            )
        p = problem(inputs_meta, attrs)
        if t.rows % p.q:
            raise TilingError(
                f"{op}: rows {t.rows} must be a multiple of {p.q} (matmul rows per normalized "
                "slice)"
            )
        if not t.staged:  # the staged stages check their own tilings
            require_fits(op, machine, specs(p, t))

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> LayerNormMatMulTiling:
        from .space import default_tiling_fast  # plan's, in numpy

        return default_tiling_fast(problem(inputs_meta, attrs), machine)

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
        p = problem(inputs_meta, attrs)
        if tiling.staged:
            metas = self.infer(inputs_meta, attrs)
            return run_staged(machine, p, inputs, inputs_meta, attrs, metas, functional, timeline)
        tm = effective(p, tiling)[0]
        work = [
            Item(m0, min(m0 + tm, p.m), part)
            for m0 in range(0, p.m, tm)
            for part in range(min(tiling.n_split, n_blocks(p)))
        ]
        data = _data(p, inputs) if functional else None
        program = partial(_program, p, tiling, data)
        isz = p.dtype.itemsize
        xsz = p.x_size
        sizes = {"X": p.ln.rows * p.ln.width * xsz, "ln_scale": p.ln.width * xsz}
        sizes["ln_bias"] = p.ln.width * xsz
        for i, lin in enumerate(p.linears):
            sizes[f"W{i}"], sizes[f"b{i}"] = p.k * lin.n * isz, lin.n * isz
        stats = launch_groups(
            machine, self.op_type, work, program, max_groups=tiling.cores,
            functional=functional, timeline=timeline, gm_sizes=sizes,
        )  # fmt: skip
        if data is None:
            return KernelRun((), stats)
        metas = self.infer(inputs_meta, attrs)
        outs = [data.normalized.reshape(metas[0].shape)]
        outs += [y.reshape(m.shape) for y, m in zip(data.ys, metas[1:], strict=True)]
        return KernelRun(tuple(outs), stats)


class _Data(NamedTuple):
    x_rows: np.ndarray  # [R, D]
    scale: np.ndarray | None
    bias: np.ndarray | None
    weights: tuple[np.ndarray, ...]
    biases: tuple[np.ndarray | None, ...]
    normalized: np.ndarray  # [R, D]
    ys: tuple[np.ndarray, ...]  # [M, N_i]


def _data(p: Problem, inputs: Sequence[np.ndarray | None]) -> _Data:
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
        normalized=np.empty((p.ln.rows, p.ln.width), p.ln.dtype),
        ys=tuple(np.empty((p.m, lin.n), p.dtype) for lin in p.linears),
    )


def _queues(buf: Buffer, wanted: Sequence[QueueSpec]) -> dict[str, Queue]:
    return {s.name: buf.queue(s.name, s.slot_bytes, s.depth) for s in wanted}


def _program(
    p: Problem,
    t: LayerNormMatMulTiling,
    data: _Data | None,
    group: Group,
    items: Sequence[Item],
) -> None:
    _, vr, tn, tk, tk0 = effective(p, t)
    wanted = specs(p, t)
    cube = group.cube
    bufs = {Level.L1: cube.l1, Level.L0A: cube.l0a, Level.L0B: cube.l0b, Level.L0C: cube.l0c}
    cq = {
        s.name: bufs[s.level].queue(s.name, s.slot_bytes, s.depth)
        for s in wanted
        if s.level in bufs
    }
    ub_specs = [s for s in wanted if s.level is Level.UB]
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
                v.copy_in(tile, d * p.x_size, arr, label=f"in {name}", gm=f"ln_{name}")
                mine.append(tile)
        params.append(mine)
    bias_tiles: dict[int, Tile] = {}
    for i, lin in enumerate(p.linears):
        if lin.has_bias:
            tile = cq[f"b{i}"].alloc()
            cube.copy_in(
                tile,
                lin.n * isz,
                None if data is None else data.biases[i],
                label=f"in b{i}",
                gm=f"b{i}",
            )
            bias_tiles[i] = tile
    steps = p.steps
    parts = min(t.n_split, n_blocks(p))
    a_src: _ASource | None = None
    last: tuple[int, int] | None = None
    for m0, m1, part in items:
        if (m0, m1) != last:
            block = None
            if t.a_resident:
                block = cq["a_block"].alloc()
                if data is not None:
                    block.data = np.empty((m1 - m0, p.k), p.dtype)
            pieces = [
                _normalize(
                    p, group, j, vq, params, steps, data, block, m0, r0, min(r0 + vr, m1 // p.q)
                )
                for j, r0 in enumerate(range(m0 // p.q, m1 // p.q, vr))
            ]
            a_src = _ASource(block, tuple(pieces))
            last = (m0, m1)
        assert a_src is not None
        for i, lin in enumerate(p.linears):
            c0, c1 = part_columns(lin.n, part, parts)
            for n0 in range(c0, c1, tn):
                n1 = min(n0 + tn, c1)
                _block_matmul(
                    p, cube, cq, data, a_src, i, bias_tiles.get(i), m0, m1, n0, n1, tk, tk0
                )


class _ASource(NamedTuple):
    """Where a row block's normalized rows are: in L1 (`block`) or in workspace `pieces`."""

    block: Tile | None
    pieces: tuple[Tile, ...]


def _normalize(
    p: Problem,
    group: Group,
    j: int,
    vq: list[dict[str, Queue]],
    params: list[list[Tile]],
    steps: Sequence[Any],
    data: _Data | None,
    block: Tile | None,
    m0: int,
    r0: int,
    r1: int,
) -> Tile:
    """Sub-block j (normalized rows r0..r1) on one of the group's vector cores, then into the
    L1 `block` (None: it stays in the workspace). Returns where the rows went."""
    v = group.vecs[j % len(group.vecs)]
    q = vq[j % len(group.vecs)]
    n_rows = r1 - r0
    d, isz = p.ln.width, p.dtype.itemsize
    nbytes = n_rows * d * isz  # handed to the Cube, in its dtype
    x_bytes = n_rows * d * p.x_size  # X's rows and the normalized output, in X's dtype
    xin = q["x"].alloc()
    v.copy_in(xin, x_bytes, None if data is None else data.x_rows[r0:r1], gm="X")
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
        out.data = out.data.astype(p.dtype, copy=False)  # the Cast step: the Cube's rows
    lo = (r0 - m0 // p.q) * p.q
    fill = partial(_place, lo, p.k)
    if p.emit_normalized:
        v.copy_out(out, x_bytes, None, label="out normalized")
    if block is not None and not group.separate:
        ub_to_l1(v, out, block, nbytes, fill)
        return block
    if p.emit_normalized:
        # The normalized output in GM doubles as the workspace the cube core reads (L2-hot).
        ws = workspace_tile(f"normalized[{r0}:{r1}]")
        ws.ready = v.pipe_free[Pipe.MTE3]
        ws.data = out.data
        if p.dtype != p.ln.dtype:  # the Cube reads the cast rows: written besides N
            to_workspace(v, out, ws, nbytes)
    else:
        ws = workspace_tile(f"ws[{r0}:{r1}]")
        to_workspace(v, out, ws, nbytes)
    if block is not None:
        from_workspace(group.cube, (ws,), block, nbytes, fill)
    return ws


def _ln_tile(s: LayerNormSpec, x: np.ndarray, *params: np.ndarray) -> np.ndarray:
    it = iter(params)
    scale = next(it) if s.has_scale else None
    bias = next(it) if s.has_bias else None
    return layernorm_rows(s, x, scale, bias)[0]


def _place(lo: int, k: int, dst: Tile, rows: np.ndarray) -> None:
    piece = rows.reshape(-1, k)
    assert dst.data is not None
    dst.data[lo : lo + piece.shape[0]] = piece


def _panel(k: int, k0: int, k1: int, dst: Tile, *pieces: np.ndarray) -> None:
    dst.data = np.concatenate([piece.reshape(-1, k)[:, k0:k1] for piece in pieces])


def _block_matmul(
    p: Problem,
    cube: Core,
    cq: dict[str, Queue],
    data: _Data | None,
    a_src: _ASource,
    i: int,
    bias: Tile | None,
    m0: int,
    m1: int,
    n0: int,
    n1: int,
    tk: int,
    tk0: int,
) -> None:
    """Y_i[m0:m1, n0:n1] = A @ W_i[:, n0:n1] (+ b_i), K in steps of tk; A is the row block in
    L1, or its panels copied from the workspace step by step."""
    rows, cols = m1 - m0, n1 - n0
    isz = p.dtype.itemsize
    W = None if data is None else data.weights[i]

    def w_panel(k0: int, k1: int) -> Tile:
        w = cq["w"].alloc()
        cube.copy_in(w, (k1 - k0) * cols * isz, None if W is None else W[k0:k1, n0:n1], gm=f"W{i}")
        return w

    def a_panel(k0: int, k1: int) -> tuple[Tile, int]:
        if a_src.block is not None:
            return a_src.block, 0
        a_l1 = cq["a_panel"].alloc()
        fill = partial(_panel, p.k, k0, k1)
        from_workspace(cube, a_src.pieces, a_l1, rows * (k1 - k0) * isz, fill)
        return a_l1, k0

    l0 = L0Queues(cq["a"], cq["b"], cq["acc"])
    # W first: its copy runs while the vector cores still normalize the block.
    acc = k_walk(cube, l0, rows, cols, p.k, tk, tk0, p.dtype, a_panel, w_panel, b_first=True)
    dst = None if data is None else data.ys[i][m0:m1, n0:n1]
    reads = (bias,) if bias is not None else ()
    cube.fixpipe(acc, rows * cols * isz, dst, partial(_epilogue, p.dtype, n0, n1), reads=reads)


def _epilogue(dtype: np.dtype, n0: int, n1: int, acc: np.ndarray, *bias: np.ndarray) -> np.ndarray:
    # MatMul rounds to T, then the bias Add rounds again (the op's reference does the same).
    y = acc.astype(dtype)
    if bias:
        y = (y + bias[0][n0:n1]).astype(dtype)
    return y


KERNELS = (LayerNormMatMulKernel(),)
