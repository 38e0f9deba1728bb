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
does); FixPipe adds B and rounds to T, as MatMul then Add round. The optional `gathered`
output is the buffer the links fill anyway (returned in functional mode, no extra cost).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from .._budget import QueueSpec, check_flag, check_positive, require_fits
from .._levels import overflow
from .._link import arrival_order, ring_arrivals, with_link
from ..allgather import Gather, concat_shards, gather_spec
from ..api import Kernel, KernelError, KernelRun, TensorMeta, Tiling, TilingError
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
class _Problem:
    g: Gather
    m: int  # rows of one shard's matmul
    ks: int  # K of one shard (the whole K for a leading-axis gather)
    n: int
    has_bias: bool

    @property
    def k_gather(self) -> bool:
        return self.g.axis == len(self.g.shard) - 1

    @property
    def dtype(self) -> np.dtype:
        return self.g.dtype

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (*self.g.gathered[:-1], self.n)


class _Tile(NamedTuple):
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
    metas = [*inputs_meta, None, None]
    g = gather_spec(op, metas[0], attrs, machine)
    w, b = metas[1], metas[2]
    k = g.gathered[-1]
    if w is None or len(w.shape) != 2 or w.shape[0] != k:
        raise KernelError(
            f"{op}: W must be [{k}, N] (K of the gathered input), "
            f"got {None if w is None else w.shape}"
        )
    if g.dtype not in (np.float16, np.float32) or w.dtype != g.dtype:
        raise KernelError(
            f"{op}: the Cube takes float16 or float32 X and W alike, got {g.dtype}, {w.dtype}"
        )
    n = w.shape[1]
    if b is not None and b.size != n:
        raise KernelError(f"{op}: B must hold {n} values, got shape {b.shape}")
    shard = g.shard if len(g.shard) > 1 else (1, *g.shard)
    return _Problem(g, m=math.prod(shard[:-1]), ks=shard[-1], n=n, has_bias=b is not None)


def _effective(p: _Problem, t: AllGatherMatMulTiling) -> tuple[int, int, int, int]:
    tk = min(t.tile_k, p.ks)
    return min(t.tile_m, p.m), min(t.tile_n, p.n), tk, min(t.tile_k0, tk)


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
    if p.has_bias:
        specs.append(QueueSpec(Level.L1, "bias", p.n * isz, 1))
    return specs


def _tiles(m: int, n: int, tm: int, tn: int) -> list[_Tile]:
    return [
        _Tile(m0, min(m0 + tm, m), n0, min(n0 + tn, n))
        for m0 in range(0, m, tm)
        for n0 in range(0, n, tn)
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
        return TensorMeta(p.out_shape, p.dtype), TensorMeta(p.g.gathered, p.dtype)

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
            tile_n=min(_round_up(p.n, cn), 256),
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
        while shards * len(_tiles(p.m, p.n, t.tile_m, t.tile_n)) < machine.cube_cores:
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
            per_core = math.ceil(len(_tiles(p.m, p.n, tm, tn)) / machine.cube_cores)
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
        # Named GM tensors (re-read panels hit the L2): each shard as it lands, W and B.
        w = inputs_meta[1]
        sizes = {f"X{r}": g.shard_bytes for r in range(g.group_size)}
        sizes["W"] = 0 if w is None else w.nbytes
        sizes["B"] = p.n * p.dtype.itemsize
        stats = launch(
            machine, self.op_type, list(range(n_cores)), program, max_cores=n_cores,
            functional=functional, timeline=timeline, gm_sizes=sizes,
        )  # fmt: skip
        labels = [f"shard {r}" for r in order[1:]]
        stats = with_link(stats, machine, steps, labels, link_core=n_cores)
        if data is None:
            return KernelRun((), stats)
        return KernelRun((data.result(p), concat_shards(data.x, g.axis)), stats)


class _Data(NamedTuple):
    x: np.ndarray  # [p, *shard]
    shards: tuple[np.ndarray, ...]  # each [m, ks]
    w: np.ndarray
    b: np.ndarray | None
    outs: tuple[np.ndarray, ...]  # per shard [m, n] (M gather) or one [m, n] (K gather)

    def result(self, p: _Problem) -> np.ndarray:
        if p.k_gather:
            return self.outs[0].reshape(p.out_shape)
        lead = p.g.shard[:-1]
        parts = [o.reshape((*lead, p.n)) for o in self.outs]
        return np.concatenate(parts, axis=p.g.axis)


def _data(p: _Problem, inputs: Sequence[np.ndarray | None]) -> _Data:
    x, w = inputs[0], inputs[1]
    assert x is not None
    assert w is not None
    b = inputs[2] if len(inputs) > 2 else None
    shards = tuple(s.reshape(p.m, p.ks) for s in x)
    n_out = 1 if p.k_gather else p.g.group_size
    return _Data(
        x=x,
        shards=shards,
        w=w,
        b=None if b is None else b.reshape(-1),
        outs=tuple(np.empty((p.m, p.n), p.dtype) for _ in range(n_out)),
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
    bias = None
    if p.has_bias:
        bias = q["bias"].alloc()
        core.copy_in(bias, p.n * isz, None if data is None else data.b, label="in B", gm="B")
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

    run = _Run(p, core, q, data, bias, tk, tk0, isz)
    if not p.k_gather:
        tiles = _tiles(p.m, p.n, tm, tn)
        shares = split_balanced(len(tiles), n_cores)
        extra = len(tiles) % n_cores
        for j, r in enumerate(order):
            # Rotate which cores take the extra tiles, so the per-shard tails even out.
            mine = [tiles[i] for i in shares[(c - j * extra) % n_cores]]
            for tile in mine:
                wait(j)
                acc = q["acc"].alloc()
                run.accumulate(acc, tile, r, 0, first=True)
                run.write(acc, tile, None if data is None else data.outs[r])
        return
    tiles = _tiles(p.m, p.n, tm, tn)
    mine = [tiles[i] for i in split_balanced(len(tiles), n_cores)[c]]
    for s in range(0, len(mine), t.acc_tiles):
        batch = mine[s : s + t.acc_tiles]
        accs = [q["acc"].alloc() for _ in batch]
        for j, r in enumerate(order):
            wait(j)
            for tile, acc in zip(batch, accs, strict=True):
                run.accumulate(acc, tile, r, r * p.ks, first=j == 0)
        for tile, acc in zip(batch, accs, strict=True):
            run.write(acc, tile, None if data is None else data.outs[0])


@dataclass
class _Run:
    """One core's operands and queues: the per-tile copy, load, multiply and write steps."""

    p: _Problem
    core: Core
    q: dict[str, Queue]
    data: _Data | None
    bias: Tile | None
    tk: int
    tk0: int
    isz: int

    def accumulate(self, acc: Tile, tile: _Tile, r: int, w_row0: int, first: bool) -> None:
        """acc (+)= shard r's rows tile.m0:m1 @ W[w_row0 + its K, tile.n0:n1]."""
        core, q, p, isz = self.core, self.q, self.p, self.isz
        rows, cols = tile.m1 - tile.m0, tile.n1 - tile.n0
        X = None if self.data is None else self.data.shards[r]
        W = None if self.data is None else self.data.w

        def a_panel(k0: int, k1: int) -> tuple[Tile, int]:
            ap = q["a_panel"].alloc()
            asrc = None if X is None else X[tile.m0 : tile.m1, k0:k1]
            core.copy_in(ap, rows * (k1 - k0) * isz, asrc, gm=f"X{r}")
            return ap, k0

        def w_panel(k0: int, k1: int) -> Tile:
            wp = q["w_panel"].alloc()
            wsrc = None if W is None else W[w_row0 + k0 : w_row0 + k1, tile.n0 : tile.n1]
            core.copy_in(wp, (k1 - k0) * cols * isz, wsrc, gm="W")
            return wp

        l0 = L0Queues(q["a"], q["b"], q["acc"])
        k_walk(core, l0, rows, cols, p.ks, self.tk, self.tk0, p.dtype, a_panel, w_panel,
               acc=acc, init=first)  # fmt: skip

    def write(self, acc: Tile, tile: _Tile, out: np.ndarray | None) -> None:
        """FixPipe the tile to GM with B added, rounded to T."""
        rows, cols = tile.m1 - tile.m0, tile.n1 - tile.n0
        dst = None if out is None else out[tile.m0 : tile.m1, tile.n0 : tile.n1]
        reads = (self.bias,) if self.bias is not None else ()
        self.core.fixpipe(
            acc, rows * cols * self.isz, dst, partial(_epilogue, self.p.dtype, tile.n0, tile.n1),
            reads=reads,
        )  # fmt: skip


def _epilogue(dtype: np.dtype, n0: int, n1: int, acc: np.ndarray, *bias: np.ndarray) -> np.ndarray:
    # MatMul rounds to T, then the bias Add rounds again.
    y = acc.astype(dtype)
    if bias:
        y = (y + bias[0][n0:n1]).astype(dtype)
    return y


KERNELS = (AllGatherMatMulKernel(),)
