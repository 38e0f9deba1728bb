"""`RmsNormMatMul` (domain fuser): RMSNorm on the Vector unit, its Linears on the Cube.

    N = X / sqrt(mean(X^2) + eps) * gamma   (last axis),   Y_i = N @ W_i (+ b_i)

The program is LayerNormMatMul's (`layernorm_matmul.kernel`) with the RMSNorm instructions
(`plan.rms_steps`): M = prod(X.shape[:-1]) rows of K = D; a work item is a row block of `rows`
rows times one of `n_split` parts of every W_i's columns, on a group of one cube core and its
vector cores. Vector cores (sub-blocks of `vec_rows` rows, alternating): copy X in, x*x, its
sum, 1/sqrt(ms + eps), x * that (* gamma), hand the rows to the Cube (through the GM/L2
workspace on 910B, UB -> L1 on a combined core). Cube core: the block resident in L1
(`a_resident`) or `rows` x `tile_k` panels streamed from the workspace; per W tile one GM ->
L1 copy, per `tile_k0` step L0A/L0B loads and a Cube multiply into L0C (float32); FixPipe
writes Y with b_i added, rounded as MatMul then Add round. With `staged=1` the kernel runs the
unfused chain's kernels instead (`staged.py`), so the search can always fall back to them.

GM (HBM) traffic: `|X| * n_split + |W| * row-blocks + |Y|` (plus gamma and biases); the
unfused chain pays `|X|` per elementwise op of the decomposition, `2|N|` and `|W| + |Y|`.
`normalized` is copied out only with attribute `emit_normalized=1`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np
from fuser.patterns.rmsnorm_matmul import WEIGHTS_AT

from .._budget import QueueSpec, check_flag, check_positive, require_fits
from .._groups import Group, from_workspace, launch_groups, to_workspace, ub_to_l1, workspace_tile
from ..api import Kernel, KernelRun, TensorMeta, Tiling, TilingError
from ..layernorm import flat_param
from ..layernorm_matmul.plan import (
    Item,
    LayerNormMatMulTiling,
    Problem,
    default_tiling,
    effective,
    n_blocks,
    part_columns,
    specs,
)
from ..matmul.pipeline import L0Queues, k_walk
from ..npu.core import Core
from ..npu.machine import Machine
from ..npu.memory import Queue, Tile
from ..npu.pipes import Level, Pipe
from ..search import Searched
from .plan import problem, rms_rows, rms_steps, round_before_scale
from .staged import run_staged


class RmsNormMatMulKernel(Searched, Kernel):
    """Fused RMSNorm + n MatMuls (+ bias); see the module docstring. The tiling is the
    norm-then-matmul family's (`LayerNormMatMulTiling`: same buffers, same fields)."""

    op_type = "RmsNormMatMul"
    domain = "fuser"
    tiling_type = LayerNormMatMulTiling

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        p = problem(inputs_meta, attrs)
        lead = p.ln.shape[:-1]
        outs = [TensorMeta(p.ln.shape, p.ln.dtype)]  # N in X's dtype, Y_i in the Cube's
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
        t, op = tiling, self.op_type
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
        if not t.staged:  # the staged stages check their own tilings
            require_fits(op, machine, specs(problem(inputs_meta, attrs), t))

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> LayerNormMatMulTiling:
        return default_tiling(problem(inputs_meta, attrs), machine)

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
            rounded = round_before_scale(attrs)
            return run_staged(machine, p, rounded, inputs, inputs_meta, metas, functional, timeline)
        tm = effective(p, tiling)[0]
        work = [
            Item(m0, min(m0 + tm, p.m), part)
            for m0 in range(0, p.m, tm)
            for part in range(min(tiling.n_split, n_blocks(p)))
        ]
        data = _data(p, inputs) if functional else None
        program = partial(_program, p, round_before_scale(attrs), tiling, data)
        # The GM tensors the program names: their re-reads hit the L2, as LayerNormMatMul's.
        isz, xsz = p.dtype.itemsize, p.x_size
        sizes = {"X": p.ln.rows * p.ln.width * xsz, "scale": p.ln.width * xsz}
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
    x_rows: np.ndarray  # [M, D]
    scale: np.ndarray | None
    weights: tuple[np.ndarray, ...]
    biases: tuple[np.ndarray | None, ...]
    normalized: np.ndarray  # [M, D]
    ys: tuple[np.ndarray, ...]  # [M, N_i]


def _data(p: Problem, inputs: Sequence[np.ndarray | None]) -> _Data:
    ins = [*inputs, None, None]
    x = ins[0]
    assert x is not None
    weights, biases = [], []
    pos = WEIGHTS_AT
    for lin in p.linears:
        w = ins[pos]
        assert w is not None
        weights.append(w)
        b = ins[pos + 1] if lin.has_bias else None
        biases.append(None if b is None else b.reshape(-1))
        pos += 1 + lin.has_bias
    return _Data(
        x_rows=x.reshape(p.m, p.k),
        scale=flat_param(ins[1], p.ln),
        weights=tuple(weights),
        biases=tuple(biases),
        normalized=np.empty((p.m, p.k), p.ln.dtype),
        ys=tuple(np.empty((p.m, lin.n), p.dtype) for lin in p.linears),
    )


def _queues(
    cores: Sequence[Core], level: Level, wanted: Sequence[QueueSpec]
) -> list[dict[str, Queue]]:
    """Each core's queues of `wanted` that live at `level`."""
    out = []
    for c in cores:
        buf = {Level.UB: c.ub, Level.L1: c.l1, Level.L0A: c.l0a, Level.L0B: c.l0b, Level.L0C: c.l0c}
        out.append(
            {
                s.name: buf[level].queue(s.name, s.slot_bytes, s.depth)
                for s in wanted
                if s.level is level
            }
        )
    return out


class _Block(NamedTuple):
    """Where a row block's normalized rows are: in L1 (`l1`) or in workspace `pieces`."""

    l1: Tile | None
    pieces: tuple[Tile, ...]


def _program(
    p: Problem,
    rounded: bool,
    t: LayerNormMatMulTiling,
    data: _Data | None,
    group: Group,
    items: Sequence[Item],
) -> None:
    _, vr, tn, tk, tk0 = effective(p, t)
    wanted = specs(p, t)
    cube = group.cube
    cq: dict[str, Queue] = {}
    for level in (Level.L1, Level.L0A, Level.L0B, Level.L0C):
        cq.update(_queues([cube], level, wanted)[0])
    vq = _queues(group.vecs, Level.UB, wanted)
    isz = p.dtype.itemsize
    gammas: list[tuple[Tile, ...]] = []
    for v, q in zip(group.vecs, vq, strict=True):
        if "scale" in q:
            tile = q["scale"].alloc()
            v.copy_in(
                tile,
                p.k * p.x_size,
                None if data is None else data.scale,
                label="in scale",
                gm="scale",
            )
            gammas.append((tile,))
        else:
            gammas.append(())
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
    steps = p.handoff(rms_steps(p.ln, rounded))
    parts = min(t.n_split, n_blocks(p))
    block: _Block | None = None
    last: tuple[int, int] | None = None
    for m0, m1, part in items:
        if (m0, m1) != last:
            l1 = cq["a_block"].alloc() if t.a_resident else None
            if l1 is not None and data is not None:
                l1.data = np.empty((m1 - m0, p.k), p.dtype)
            pieces = tuple(
                _normalize(
                    p, rounded, steps, group, j, vq, gammas, data, l1, m0, r0, min(r0 + vr, m1)
                )
                for j, r0 in enumerate(range(m0, m1, vr))
            )
            block, last = _Block(l1, pieces), (m0, m1)
        assert block is not None
        for i, lin in enumerate(p.linears):
            c0, c1 = part_columns(lin.n, part, parts)
            for n0 in range(c0, c1, tn):
                _block_matmul(
                    p,
                    cube,
                    cq,
                    data,
                    block,
                    i,
                    bias_tiles.get(i),
                    (m0, m1),
                    (n0, min(n0 + tn, c1)),
                    tk,
                    tk0,
                )


def _normalize(
    p: Problem,
    rounded: bool,
    steps: Sequence[Any],
    group: Group,
    j: int,
    vq: list[dict[str, Queue]],
    gammas: list[tuple[Tile, ...]],
    data: _Data | None,
    l1: Tile | None,
    m0: int,
    r0: int,
    r1: int,
) -> Tile:
    """Rows r0..r1 on vector core j % n (copy in, RMSNorm, hand over to the Cube); returns
    where the rows went (the L1 block, or their workspace tile)."""
    v = group.vecs[j % len(group.vecs)]
    q = vq[j % len(group.vecs)]
    n_rows, isz = r1 - r0, p.dtype.itemsize
    nbytes = n_rows * p.k * isz  # handed to the Cube, in its dtype
    x_bytes = n_rows * p.k * p.x_size  # X's rows and the normalized output, in X's dtype
    xin = q["x"].alloc()
    v.copy_in(xin, x_bytes, None if data is None else data.x_rows[r0:r1], gm="X")
    out = q["n"].alloc()
    gamma = gammas[j % len(group.vecs)]
    for s_i, step in enumerate(steps):
        fn = partial(_rms_tile, p, rounded) if s_i == 0 and data is not None else None
        ins = (xin, *gamma) if s_i == 0 else (out,)
        # Later steps charge their instructions on the same pipe (the tile is done).
        v.vector(step.ops, step.dtype, n_rows * step.per_row, ins, (out,), fn, out_bytes=nbytes)
    if data is not None and out.data is not None:
        data.normalized[r0:r1] = out.data
        out.data = out.data.astype(p.dtype, copy=False)  # the Cast step: the Cube's rows
    fill = partial(_place, r0 - m0)
    if p.emit_normalized:
        v.copy_out(out, x_bytes, None, label="out normalized")
    if l1 is not None and not group.separate:
        ub_to_l1(v, out, l1, nbytes, fill)
        return l1
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
    if l1 is not None:
        from_workspace(group.cube, (ws,), l1, nbytes, fill)
    return ws


def _rms_tile(p: Problem, rounded: bool, x: np.ndarray, *gamma: np.ndarray) -> np.ndarray:
    return rms_rows(p.ln, rounded, x, gamma[0] if gamma else None)


def _place(lo: int, dst: Tile, rows: np.ndarray) -> None:
    assert dst.data is not None
    dst.data[lo : lo + rows.shape[0]] = rows


def _panel(k0: int, k1: int, dst: Tile, *pieces: np.ndarray) -> None:
    dst.data = np.concatenate([piece[:, k0:k1] for piece in pieces])


def _block_matmul(
    p: Problem,
    cube: Core,
    cq: dict[str, Queue],
    data: _Data | None,
    block: _Block,
    i: int,
    bias: Tile | None,
    rows_: tuple[int, int],
    cols_: tuple[int, int],
    tk: int,
    tk0: int,
) -> None:
    """Y_i[m0:m1, n0:n1] = N @ W_i[:, n0:n1] (+ b_i), K in steps of tk, on MatMul's Cube
    pipeline (as LayerNormMatMul's): N is the L1 block, or its panels copied from the
    workspace step by step."""
    (m0, m1), (n0, n1) = rows_, cols_
    rows, cols, isz = m1 - m0, n1 - n0, p.dtype.itemsize
    W = None if data is None else data.weights[i]

    def w_panel(k0: int, k1: int) -> Tile:
        w = cq["w"].alloc()
        cube.copy_in(w, (k1 - k0) * cols * isz, None if W is None else W[k0:k1, n0:n1], gm=f"W{i}")
        return w

    def a_panel(k0: int, k1: int) -> tuple[Tile, int]:
        if block.l1 is not None:
            return block.l1, 0
        a_l1 = cq["a_panel"].alloc()
        from_workspace(cube, block.pieces, a_l1, rows * (k1 - k0) * isz, partial(_panel, k0, k1))
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


KERNELS = (RmsNormMatMulKernel(),)
