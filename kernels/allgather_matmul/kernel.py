"""`AllGatherMatMul` (domain fuser): the matmul of a gathered input, overlapped with the gather.

    Y = concat(shards of the group_size ranks, axis) @ W (+ B)

Input convention (as the onnxruntime plugin passes gathering ops): input 0 holds ALL ranks'
shards stacked, `[group_size, *shard]`, attribute `rank` says which is this rank's; then W
`[K, N]` and optional B `[N]`. `axis` is the gather axis in the shard's own dims.

Timeline: the ring AllGather of `_link` starts with the kernel; the cores multiply the local
shard first, then each remote shard as its ring step lands (a zero-length wait on the copy-in
pipe stands for the arrival flag, so the copy-ins of a shard cannot start earlier). Link
transfers and the Cube overlap; per npu-model.md the run takes about
`T_mm(m/p) + sum over p-1 steps of max(T_mm(m/p), alpha + S/beta)`, never less than
max(T_allgather, T_matmul).

- Gather along a leading (sequence, M) axis: each shard is a block of output rows,
  `Y_r = X_r @ W (+ B)`; its output tiles are split over the cube cores as it lands.
- Gather along the last (hidden, K) axis: each shard is a slice of K and contributes a partial
  sum `X_r @ W[K_r]`. Each core owns output tiles and keeps up to `acc_tiles` of them in L0C
  across all shards (a pass), accumulating every shard's part there in float32; FixPipe writes
  a tile once, after the last shard. More output than L0C holds takes several passes (later
  passes find every shard already landed).

Per output tile and `tile_k` panel: A's and W's panels are copied GM -> L1; per `tile_k0`
step they are loaded into L0A/L0B and the Cube accumulates in L0C (as the MatMul kernel
does); FixPipe adds B and rounds to T, as MatMul then Add round (a Gemm Linear: alpha * acc +
beta * B, rounded once, as one Gemm rounds). The optional `gathered` output is the buffer the
links fill anyway (returned in functional mode, no extra cost).

Several Linears on one gathered value (QKV, gate/up; `linears.py`): their output tiles are one
work list, so each landed shard is multiplied by every W_i before the next one is waited for:
the gather happens once and its steps hide under all the matmuls.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np
from fuser.patterns.allgather_linears import Linear, linears

from .._budget import QueueSpec, check_flag, check_positive, require_fits
from .._levels import overflow
from .._link import arrival_order, ring_arrivals, with_link
from ..allgather import Gather, concat_shards, gather_spec
from ..api import (
    Kernel,
    KernelError,
    KernelRun,
    MachineLimitError,
    TensorMeta,
    Tiling,
    TilingError,
)
from ..matmul.pipeline import L0Queues, k_walk
from ..npu.core import Core
from ..npu.launch import launch, split_balanced
from ..npu.machine import Machine
from ..npu.memory import Queue, Tile
from ..npu.pipes import Level, Pipe
from ..search import Searched


@dataclass(frozen=True)
class AllGatherMatMulTiling(Tiling):
    """Output tiles `tile_m` x `tile_n`; K in L1 panels of `tile_k`, L0 steps of `tile_k0`;
    `acc_tiles` L0C accumulators (output tiles kept across shards for a K gather); double
    buffering (0/1); cube cores; `staged` 1: one chunk, the unfused chain's schedule
    (`staged.py`: gather, then multiply), the other fields then unused."""

    tile_m: int
    tile_n: int
    tile_k: int
    tile_k0: int
    acc_tiles: int
    double_buffer: int
    cores: int
    staged: int = 0


@dataclass(frozen=True)
class _Lin:
    """One Linear of the problem: its spec and its N."""

    spec: Linear
    n: int

    @property
    def has_bias(self) -> bool:
        return self.spec.b is not None


@dataclass(frozen=True)
class _Problem:
    g: Gather
    m: int  # rows of one shard's matmul
    ks: int  # K of one shard (the whole K for a leading-axis gather)
    lins: tuple[_Lin, ...]

    @property
    def n(self) -> int:
        """N of all Linears together (the output columns the cores share out)."""
        return sum(lin.n for lin in self.lins)

    @property
    def has_bias(self) -> bool:
        return any(lin.has_bias for lin in self.lins)

    @property
    def k_gather(self) -> bool:
        return self.g.axis == len(self.g.shard) - 1

    @property
    def dtype(self) -> np.dtype:
        return self.g.dtype

    def out_shape(self, i: int) -> tuple[int, ...]:
        """Shape of Y_i."""
        lead = self.g.gathered[:-1]
        if self.lins[i].spec.flatten:
            lead = (math.prod(lead),)
        return (*lead, self.lins[i].n)


class _Tile(NamedTuple):
    lin: int
    m0: int
    m1: int
    n0: int
    n1: int


def _problem(
    op: str,
    inputs_meta: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    machine: Machine | None = None,
) -> _Problem:
    g = gather_spec(op, inputs_meta[0] if inputs_meta else None, attrs, machine)
    try:
        specs = linears(attrs, inputs_meta)
    except ValueError as e:
        raise KernelError(f"{op}: {e}") from None
    k = g.gathered[-1]
    lins = []
    for i, spec in enumerate(specs):
        metas = [*inputs_meta, None, None]
        w = metas[spec.w]
        b = None if spec.b is None else metas[spec.b]
        want = f"[N_{i}, {k}]" if spec.trans_b else f"[{k}, N_{i}]"
        shape = None if w is None else (w.shape[::-1] if spec.trans_b else w.shape)
        if shape is None or len(shape) != 2 or shape[0] != k:
            raise KernelError(
                f"{op}: W must be {want} (K of the gathered input), "
                f"got {None if w is None else w.shape}"
            )
        assert w is not None
        if g.dtype not in (np.float16, np.float32) or w.dtype != g.dtype:
            error = MachineLimitError if g.dtype == w.dtype == np.float64 else KernelError
            raise error(
                f"{op}: the Cube takes float16 or float32 X and W alike, got {g.dtype}, {w.dtype}"
            )
        n = shape[1]
        if spec.b is not None and (b is None or b.size != n):
            raise KernelError(
                f"{op}: B_{i} must hold {n} values, got {None if b is None else b.shape}"
            )
        if spec.flatten and len(g.shard) < 2:
            raise KernelError(f"{op}: flatten[{i}] on a 1-D shard")
        lins.append(_Lin(spec, n))
    shard = g.shard if len(g.shard) > 1 else (1, *g.shard)
    return _Problem(g, m=math.prod(shard[:-1]), ks=shard[-1], lins=tuple(lins))


def _effective(p: _Problem, t: AllGatherMatMulTiling) -> tuple[int, int, int, int]:
    tk = min(t.tile_k, p.ks)
    widest = max(lin.n for lin in p.lins)
    return min(t.tile_m, p.m), min(t.tile_n, widest), tk, min(t.tile_k0, tk)


def _specs(p: _Problem, t: AllGatherMatMulTiling) -> list[QueueSpec]:
    tm, tn, tk, tk0 = _effective(p, t)
    isz = p.dtype.itemsize
    depth = 2 if t.double_buffer else 1
    specs = [
        QueueSpec(Level.L1, "a_panel", tm * tk * isz, depth),
        QueueSpec(Level.L1, "w_panel", tk * tn * isz, depth),
        QueueSpec(Level.L0A, "a", tm * tk0 * isz, depth),
        QueueSpec(Level.L0B, "b", tk0 * tn * isz, depth),
        QueueSpec(Level.L0C, "acc", tm * tn * 4, t.acc_tiles),
    ]
    specs += [
        QueueSpec(Level.L1, f"bias{i}", lin.n * isz, 1)
        for i, lin in enumerate(p.lins)
        if lin.has_bias
    ]
    return specs


def _tiles(p: _Problem, tm: int, tn: int) -> list[_Tile]:
    """Every Linear's output tiles of one shard's rows, Linear by Linear."""
    return [
        _Tile(i, m0, min(m0 + tm, p.m), n0, min(n0 + tn, lin.n))
        for i, lin in enumerate(p.lins)
        for m0 in range(0, p.m, tm)
        for n0 in range(0, lin.n, tn)
    ]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class AllGatherMatMulKernel(Searched, Kernel):
    """Fused AllGather + MatMul (+ bias); see the module docstring."""

    op_type = "AllGatherMatMul"
    domain = "fuser"
    tiling_type = AllGatherMatMulTiling

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        p = _problem(self.op_type, inputs_meta, attrs)
        ys = [TensorMeta(p.out_shape(i), p.dtype) for i in range(len(p.lins))]
        return ys[0], TensorMeta(p.g.gathered, p.dtype), *ys[1:]

    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, AllGatherMatMulTiling)
        t = tiling
        op = self.op_type
        check_positive(
            op, tile_m=t.tile_m, tile_n=t.tile_n, tile_k=t.tile_k, tile_k0=t.tile_k0,
            acc_tiles=t.acc_tiles, cores=t.cores,
        )  # fmt: skip
        check_flag(op, double_buffer=t.double_buffer, staged=t.staged)
        if t.tile_k0 > t.tile_k:
            raise TilingError(f"{op}: tile_k0 {t.tile_k0} exceeds tile_k {t.tile_k}")
        if t.cores > machine.cube_cores:
            raise TilingError(
                f"{op}: tiling uses {t.cores} cores, {machine.name} has {machine.cube_cores} "
                "cube cores"
            )
        if not t.staged:  # the staged stages check their own tilings
            require_fits(op, machine, _specs(_problem(op, inputs_meta, attrs, machine), t))

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> AllGatherMatMulTiling:
        p = _problem(self.op_type, inputs_meta, attrs, machine)
        k0 = machine.cube_k_block(p.dtype)
        cm, cn = machine.cube_m, machine.cube_n
        t = AllGatherMatMulTiling(
            tile_m=min(_round_up(p.m, cm), 128),
            tile_n=min(_round_up(max(lin.n for lin in p.lins), cn), 256),
            tile_k=min(_round_up(p.ks, k0), 512),
            tile_k0=min(_round_up(p.ks, k0), 256 // p.dtype.itemsize),
            acc_tiles=2,
            double_buffer=1,
            cores=machine.cube_cores,
        )
        rep = dataclasses.replace
        while (level := overflow(machine, _specs(p, t))) is not None:
            # Shrink what fills the level that overflows.
            if level is Level.L1 and t.tile_k > t.tile_k0:
                t = rep(t, tile_k=max(t.tile_k0, t.tile_k // 2))
            elif level in (Level.L0A, Level.L0B) and t.tile_k0 > k0:
                t = rep(t, tile_k0=max(k0, t.tile_k0 // 2))
            elif level in (Level.L1, Level.L0B, Level.L0C) and t.tile_n > cn:
                t = rep(t, tile_n=_round_up(t.tile_n // 2, cn))
            elif t.tile_m > cm:
                t = rep(t, tile_m=_round_up(t.tile_m // 2, cm))
            elif t.double_buffer:
                t = rep(t, double_buffer=0, acc_tiles=1)
            else:
                raise TilingError(f"{self.op_type}: no tiling fits {machine.name}")
        # Enough output tiles over the whole output to keep every core busy, as MatMul does:
        # more per shard would cut tiles small and pay a DMA head per tiny copy.
        shards = 1 if p.k_gather else p.g.group_size
        while shards * len(_tiles(p, t.tile_m, t.tile_n)) < machine.cube_cores:
            if t.tile_m > 2 * cm and t.tile_m >= t.tile_n:
                t = rep(t, tile_m=_round_up(t.tile_m // 2, cm))
            elif t.tile_n > 2 * cn:
                t = rep(t, tile_n=_round_up(t.tile_n // 2, cn))
            elif t.tile_m > 2 * cm:
                t = rep(t, tile_m=_round_up(t.tile_m // 2, cm))
            else:
                break
        if p.k_gather:
            # As many output tiles resident in L0C as fit (fewer passes over the shards).
            tm, tn, _, _ = _effective(p, t)
            per_core = math.ceil(len(_tiles(p, tm, tn)) / machine.cube_cores)
            room = machine.l0c_bytes // (tm * tn * 4)
            t = rep(t, acc_tiles=max(1, min(per_core, room)))
        return t

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
        assert isinstance(tiling, AllGatherMatMulTiling)
        p = _problem(self.op_type, inputs_meta, attrs, machine)
        if tiling.staged:
            from .staged import run_staged

            return run_staged(machine, p, inputs, inputs_meta, functional, timeline)
        g = p.g
        steps = ring_arrivals(machine, g.group_size, g.shard_bytes)
        order = arrival_order(g.rank, g.group_size)
        data = _data(p, inputs) if functional else None
        n_cores = min(tiling.cores, machine.cube_cores)
        program = partial(_program, p, tiling, data, steps, order, n_cores)
        # Named GM tensors (re-read panels hit the L2): each shard as it lands, W_i and B_i.
        sizes = {f"X{r}": g.shard_bytes for r in range(g.group_size)}
        for i, lin in enumerate(p.lins):
            sizes[f"W{i}"] = g.gathered[-1] * lin.n * p.dtype.itemsize
            sizes[f"B{i}"] = lin.n * p.dtype.itemsize
        stats = launch(
            machine, self.op_type, list(range(n_cores)), program, max_cores=n_cores,
            functional=functional, timeline=timeline, gm_sizes=sizes,
        )  # fmt: skip
        labels = [f"shard {r}" for r in order[1:]]
        stats = with_link(stats, machine, steps, labels, link_core=n_cores)
        if data is None:
            return KernelRun((), stats)
        ys = [data.result(p, i) for i in range(len(p.lins))]
        return KernelRun((ys[0], concat_shards(data.x, g.axis), *ys[1:]), stats)


class _Data(NamedTuple):
    x: np.ndarray  # [p, *shard]
    shards: tuple[np.ndarray, ...]  # each [m, ks]
    w: tuple[np.ndarray, ...]  # per Linear, [K, N_i] (a transposed view for trans_b)
    b: tuple[np.ndarray | None, ...]
    # per Linear: per shard [m, N_i] (M gather) or one [m, N_i] (K gather)
    outs: tuple[tuple[np.ndarray, ...], ...]

    def result(self, p: _Problem, i: int) -> np.ndarray:
        n = p.lins[i].n
        if p.k_gather:
            return self.outs[i][0].reshape(p.out_shape(i))
        lead = p.g.shard[:-1]
        parts = [o.reshape((*lead, n)) for o in self.outs[i]]
        return np.concatenate(parts, axis=p.g.axis).reshape(p.out_shape(i))


def _data(p: _Problem, inputs: Sequence[np.ndarray | None]) -> _Data:
    x = inputs[0]
    assert x is not None
    shards = tuple(s.reshape(p.m, p.ks) for s in x)
    n_out = 1 if p.k_gather else p.g.group_size
    ws, bs = [], []
    for lin in p.lins:
        w = inputs[lin.spec.w]
        assert w is not None
        ws.append(w.T if lin.spec.trans_b else w)
        b = None if lin.spec.b is None else inputs[lin.spec.b]
        bs.append(None if b is None else b.reshape(-1))
    return _Data(
        x=x,
        shards=shards,
        w=tuple(ws),
        b=tuple(bs),
        outs=tuple(tuple(np.empty((p.m, lin.n), p.dtype) for _ in range(n_out)) for lin in p.lins),
    )


def _program(
    p: _Problem,
    t: AllGatherMatMulTiling,
    data: _Data | None,
    steps: Sequence[tuple[float, float]],
    order: Sequence[int],
    n_cores: int,
    core: Core,
    items: Sequence[int],
) -> None:
    c = items[0]
    bufs = {Level.L1: core.l1, Level.L0A: core.l0a, Level.L0B: core.l0b, Level.L0C: core.l0c}
    q = {s.name: bufs[s.level].queue(s.name, s.slot_bytes, s.depth) for s in _specs(p, t)}
    tm, tn, tk, tk0 = _effective(p, t)
    isz = p.dtype.itemsize
    biases: dict[int, Tile] = {}
    for i, lin in enumerate(p.lins):
        if lin.has_bias:
            biases[i] = q[f"bias{i}"].alloc()
            src = None if data is None else data.b[i]
            core.copy_in(biases[i], lin.n * isz, src, label=f"in B{i}", gm=f"B{i}")
    arrived = []
    for j, (_, end) in enumerate(steps):
        flag = Tile(f"shard {order[j + 1]} landed", Level.GM, 0)
        flag.ready = flag.released = end
        arrived.append(flag)
    waited: set[int] = set()

    def wait(j: int) -> None:
        # The arrival flag: a zero-length instruction on the copy-in pipe (in order), so no
        # copy of shard j's data starts before its ring step has landed.
        if j and j not in waited:
            core.issue(Pipe.MTE2, 0.0, (arrived[j - 1],), (), f"wait shard {order[j]}")
            waited.add(j)

    run = _Run(p, core, q, data, biases, tk, tk0, isz)
    if not p.k_gather:
        tiles = _tiles(p, tm, tn)
        shares = split_balanced(len(tiles), n_cores)
        extra = len(tiles) % n_cores
        for j, r in enumerate(order):
            # Rotate which cores take the extra tiles, so the per-shard tails even out.
            mine = [tiles[i] for i in shares[(c - j * extra) % n_cores]]
            for tile in mine:
                wait(j)
                acc = q["acc"].alloc()
                run.accumulate(acc, tile, r, 0, first=True)
                run.write(acc, tile, None if data is None else data.outs[tile.lin][r])
        return
    tiles = _tiles(p, tm, tn)
    mine = [tiles[i] for i in split_balanced(len(tiles), n_cores)[c]]
    for s in range(0, len(mine), t.acc_tiles):
        batch = mine[s : s + t.acc_tiles]
        accs = [q["acc"].alloc() for _ in batch]
        for j, r in enumerate(order):
            wait(j)
            for tile, acc in zip(batch, accs, strict=True):
                run.accumulate(acc, tile, r, r * p.ks, first=j == 0)
        for tile, acc in zip(batch, accs, strict=True):
            run.write(acc, tile, None if data is None else data.outs[tile.lin][0])


@dataclass
class _Run:
    """One core's operands and queues: the per-tile copy, load, multiply and write steps."""

    p: _Problem
    core: Core
    q: dict[str, Queue]
    data: _Data | None
    biases: Mapping[int, Tile]
    tk: int
    tk0: int
    isz: int

    def accumulate(self, acc: Tile, tile: _Tile, r: int, w_row0: int, first: bool) -> None:
        """acc (+)= shard r's rows tile.m0:m1 @ W[w_row0 + its K, tile.n0:n1]."""
        core, q, p, isz = self.core, self.q, self.p, self.isz
        rows, cols = tile.m1 - tile.m0, tile.n1 - tile.n0
        X = None if self.data is None else self.data.shards[r]
        W = None if self.data is None else self.data.w[tile.lin]

        def a_panel(k0: int, k1: int) -> tuple[Tile, int]:
            ap = q["a_panel"].alloc()
            asrc = None if X is None else X[tile.m0 : tile.m1, k0:k1]
            core.copy_in(ap, rows * (k1 - k0) * isz, asrc, gm=f"X{r}")
            return ap, k0

        def w_panel(k0: int, k1: int) -> Tile:
            wp = q["w_panel"].alloc()
            wsrc = None if W is None else W[w_row0 + k0 : w_row0 + k1, tile.n0 : tile.n1]
            # A transposed W (Gemm transB) is converted by the DMA on the way in (ND -> fractal).
            core.copy_in(wp, (k1 - k0) * cols * isz, wsrc, gm=f"W{tile.lin}")
            return wp

        l0 = L0Queues(q["a"], q["b"], q["acc"])
        k_walk(core, l0, rows, cols, p.ks, self.tk, self.tk0, p.dtype, a_panel, w_panel,
               acc=acc, init=first)  # fmt: skip

    def write(self, acc: Tile, tile: _Tile, out: np.ndarray | None) -> None:
        """FixPipe the tile to GM with B added, rounded to T."""
        rows, cols = tile.m1 - tile.m0, tile.n1 - tile.n0
        dst = None if out is None else out[tile.m0 : tile.m1, tile.n0 : tile.n1]
        bias = self.biases.get(tile.lin)
        reads = (bias,) if bias is not None else ()
        spec = self.p.lins[tile.lin].spec
        self.core.fixpipe(
            acc, rows * cols * self.isz, dst,
            partial(_epilogue, self.p.dtype, spec, tile.n0, tile.n1), reads=reads,
        )  # fmt: skip


def _epilogue(
    dtype: np.dtype, spec: Linear, n0: int, n1: int, acc: np.ndarray, *bias: np.ndarray
) -> np.ndarray:
    if spec.gemm:
        # One Gemm: alpha * A @ B + beta * C in float32, rounded once.
        y = acc if spec.alpha == 1.0 else acc * np.float32(spec.alpha)
        if bias:
            y = y + np.float32(spec.beta) * bias[0][n0:n1].astype(np.float32)
        return y.astype(dtype)
    # MatMul rounds to T, then the bias Add rounds again.
    y = acc.astype(dtype)
    if bias:
        y = (y + bias[0][n0:n1]).astype(dtype)
    return y


KERNELS = (AllGatherMatMulKernel(),)
