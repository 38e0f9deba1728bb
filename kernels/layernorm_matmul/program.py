"""The norm-then-Linears program both `LayerNormMatMul` and `RmsNormMatMul` run on a group of
one cube core and its vector cores (see `layernorm_matmul.kernel` for the schedule): only the
normalization step differs, and it is plugged in as a `NormStep` (its vector instructions, the
numpy of a tile, the parameters each vector core holds).

Per work item (a row block x a part of every W_i's columns): the vector cores normalize the
block in sub-blocks of `vec_rows` normalized rows (copy X in, the step's instructions, the Cast
to the Cube's dtype with `matmul_type`) and hand the rows to the Cube (through the GM/L2
workspace on 910B, UB -> L1 on a combined core); the cube core multiplies them by every W_i
tile by tile (the block resident in L1 or streamed in panels) and FixPipe writes Y_i with b_i
added, rounded as MatMul then Add round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from .._groups import Group, from_workspace, to_workspace, ub_to_l1, workspace_tile
from .._rows import VecStep
from ..matmul.pipeline import L0Queues, k_walk
from ..npu.core import Core
from ..npu.memory import Buffer, Queue, Tile
from ..npu.pipes import Level, Pipe
from .plan import Item, LayerNormMatMulTiling, Problem, effective, n_blocks, part_columns, specs


@dataclass(frozen=True)
class NormStep:
    """The normalization a program runs on its vector cores: `steps` (per row, the handoff
    Cast included), `tile(x_rows, *params)` the normalized rows in X's dtype, and `params`:
    (UB queue, GM tensor name) of each parameter a vector core holds for the whole run (only
    those the problem has a queue for are copied)."""

    steps: tuple[VecStep, ...]
    tile: Callable[..., np.ndarray]
    params: tuple[tuple[str, str], ...]


class NormData(NamedTuple):
    """A functional run's arrays: X's rows, the step's parameters (aligned with
    `NormStep.params`, None where absent), the Linears', and the outputs being filled in."""

    x_rows: np.ndarray  # [R, D]
    params: tuple[np.ndarray | None, ...]
    weights: tuple[np.ndarray, ...]
    biases: tuple[np.ndarray | None, ...]
    normalized: np.ndarray  # [R, D]
    ys: tuple[np.ndarray, ...]  # [M, N_i]


def norm_data(
    p: Problem,
    x: np.ndarray,
    params: tuple[np.ndarray | None, ...],
    inputs: Sequence[np.ndarray | None],
    first: int,
) -> NormData:
    """`NormData` for inputs whose W_0 sits at position `first`."""
    ins = [*inputs, None, None]
    weights, biases = [], []
    pos = first
    for lin in p.linears:
        w = ins[pos]
        assert w is not None
        weights.append(w)
        b = ins[pos + 1] if lin.has_bias else None
        biases.append(None if b is None else b.reshape(-1))
        pos += 1 + lin.has_bias
    return NormData(
        x_rows=x.reshape(p.ln.rows, p.ln.width),
        params=params,
        weights=tuple(weights),
        biases=tuple(biases),
        normalized=np.empty((p.ln.rows, p.ln.width), p.ln.dtype),
        ys=tuple(np.empty((p.m, lin.n), p.dtype) for lin in p.linears),
    )


def _queues(buf: Buffer, wanted: Sequence[Any]) -> dict[str, Queue]:
    return {s.name: buf.queue(s.name, s.slot_bytes, s.depth) for s in wanted}


def norm_matmul_program(
    p: Problem,
    t: LayerNormMatMulTiling,
    norm: NormStep,
    data: NormData | None,
    group: Group,
    items: Sequence[Item],
) -> None:
    """One group's share of the work items (see the module docstring)."""
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
    # Parameters copied once: the step's into every vector core's UB, biases into L1.
    params: list[list[Tile]] = []
    for v, q in zip(group.vecs, vq, strict=True):
        mine = []
        for i, (name, gm) in enumerate(norm.params):
            if name in q:
                tile = q[name].alloc()
                arr = None if data is None else data.params[i]
                v.copy_in(tile, d * p.x_size, arr, label=f"in {name}", gm=gm)
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
                    p, norm, group, j, vq, params, data, block, m0, r0, min(r0 + vr, m1 // p.q)
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
    norm: NormStep,
    group: Group,
    j: int,
    vq: list[dict[str, Queue]],
    params: list[list[Tile]],
    data: NormData | None,
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
    for s_i, step in enumerate(norm.steps):
        if s_i == 0:
            fn = None if data is None else norm.tile
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
    data: NormData | None,
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
