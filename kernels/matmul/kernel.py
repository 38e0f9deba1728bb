"""MatMul (batched, broadcasting) and Gemm on the Cube.

A work item is one output block (batch index, `tile_m` rows, `tile_n` columns); items are
split over the cube cores in balanced ranges. For each block the core walks K: per chunk of
`tile_k` it copies the A and B panels into L1 (MTE2), then per `tile_k0` step loads L0A and
L0B (MTE1) and accumulates on the Cube in L0C (float32). FixPipe writes the block out, with
Gemm's alpha and beta * C in its epilogue (the C block is copied into L1 beside the panels).

Double buffering is chosen per level, as CATLASS does on 910B (L1 and L0A/B double, L0C single
for 128 x 256 tiles): `db_l1` overlaps the next chunk's copy-in with this chunk's loads and
multiplies, `db_l0` the next L0 load with this multiply, `db_l0c` the block's FixPipe with the
next block's multiplies. A and B are named GM tensors: their panels re-read by other blocks hit
the L2.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from .._budget import QueueSpec, check_flag, check_positive, fits, require_fits
from .._columns import TilingColumns, lesser, pick
from ..api import Kernel, KernelError, KernelRun, TensorMeta, Tiling, TilingError
from ..npu.core import Core
from ..npu.launch import launch
from ..npu.machine import Machine
from ..npu.memory import Queue, Tile
from ..npu.pipes import Level
from ..npu.stats import RunStats, sequence
from .pipeline import L0Queues, k_walk
from .splitk import (
    Block,
    ReduceData,
    Split,
    core_work,
    reduce_elems,
    reduce_items,
    run_reduce,
    split_of,
)


@dataclass(frozen=True)
class MatMulTiling(Tiling):
    """Output block `tile_m` x `tile_n`; K in L1 chunks of `tile_k`, L0 steps of `tile_k0`;
    double buffering (0/1) of L1, of L0A/L0B and of L0C; cube cores used; `split_k`: the
    blocks past the last full wave cut into that many K slices (`splitk.py`; 1: none)."""

    tile_m: int
    tile_n: int
    tile_k: int
    tile_k0: int
    db_l1: int
    db_l0: int
    db_l0c: int
    cores: int
    split_k: int = 1


@dataclass(frozen=True)
class GemmProblem:
    """Y[batch..., M, N] = alpha * A[batch..., M, K] @ B[batch..., K, N] (+ beta * C)."""

    batch: tuple[int, ...]
    m: int
    k: int
    n: int
    dtype: np.dtype
    out_shape: tuple[int, ...]
    has_c: bool = False

    @property
    def batch_size(self) -> int:
        """Number of matrices in the batch."""
        return math.prod(self.batch)


class _Item(NamedTuple):
    b: int
    m0: int
    m1: int
    n0: int
    n1: int
    k0: int = 0  # K range of a split-K slice (k1 -1: all of K)
    k1: int = -1
    s: int = -1  # the slice's workspace plane; -1: a whole block written to Y


class _CubeGemm(Kernel):
    """Shared tiling and program of MatMul and Gemm."""

    tiling_type = MatMulTiling

    def problem(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> GemmProblem:
        """The GEMM this op computes; `KernelError` for shapes or dtypes it cannot take."""
        raise NotImplementedError

    def operands(
        self, inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any], p: GemmProblem
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """A [batch..., M, K] and B [batch..., K, N] views (broadcast), and C as [M, N]."""
        raise NotImplementedError

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        p = self.problem(inputs_meta, attrs)
        return (TensorMeta(p.out_shape, p.dtype),)

    def _specs(self, p: GemmProblem, t: MatMulTiling) -> list[QueueSpec]:
        return [QueueSpec(*q) for q in gemm_queues(p, t)]

    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, MatMulTiling)
        t = tiling
        check_positive(
            self.op_type, tile_m=t.tile_m, tile_n=t.tile_n, tile_k=t.tile_k, tile_k0=t.tile_k0,
            cores=t.cores, split_k=t.split_k,
        )  # fmt: skip
        check_flag(self.op_type, db_l1=t.db_l1, db_l0=t.db_l0, db_l0c=t.db_l0c)
        if t.tile_k0 > t.tile_k:
            raise TilingError(f"{self.op_type}: tile_k0 {t.tile_k0} exceeds tile_k {t.tile_k}")
        if t.cores > machine.cube_cores:
            raise TilingError(
                f"{self.op_type}: tiling uses {t.cores} cores, {machine.name} has "
                f"{machine.cube_cores} cube cores"
            )
        require_fits(self.op_type, machine, self._specs(self.problem(inputs_meta, attrs), t))

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> MatMulTiling:
        p = self.problem(inputs_meta, attrs)
        k0 = machine.cube_k_block(p.dtype)
        cm, cn = machine.cube_m, machine.cube_n
        # CATLASS's 910B shape: 128 x 256 blocks, K chunks of 256 and L0 steps of 64 (fp16),
        # L1 and L0A/B double-buffered, L0C single (a 128 x 256 float32 block fills it).
        t = MatMulTiling(
            tile_m=min(_round_up(p.m, cm), 128),
            tile_n=min(_round_up(p.n, cn), 256),
            tile_k=min(_round_up(p.k, k0), 512 // p.dtype.itemsize),
            tile_k0=min(_round_up(p.k, k0), 128 // p.dtype.itemsize),
            db_l1=1,
            db_l0=1,
            db_l0c=0,
            cores=machine.cube_cores,
        )
        if fits(machine, self._specs(p, dataclasses.replace(t, db_l0c=1))):
            t = dataclasses.replace(t, db_l0c=1)
        while not fits(machine, self._specs(p, t)):
            if t.tile_k > 2 * t.tile_k0:
                t = dataclasses.replace(t, tile_k=t.tile_k // 2)
            elif t.tile_n > 128 and t.tile_n >= t.tile_m:
                t = dataclasses.replace(t, tile_n=_round_up(t.tile_n // 2, cn))
            elif t.tile_k0 > k0:
                t = dataclasses.replace(t, tile_k0=max(k0, t.tile_k0 // 2), tile_k=t.tile_k0)
            elif t.tile_n > cn:
                t = dataclasses.replace(t, tile_n=_round_up(t.tile_n // 2, cn))
            elif t.tile_m > cm:
                t = dataclasses.replace(t, tile_m=_round_up(t.tile_m // 2, cm))
            else:
                raise TilingError(f"{self.op_type}: no tiling fits {machine.name}")
        while _items(p, t) < machine.cube_cores:
            if t.tile_m > 2 * cm and t.tile_m >= t.tile_n:
                t = dataclasses.replace(t, tile_m=_round_up(t.tile_m // 2, cm))
            elif t.tile_n > 2 * cn:
                t = dataclasses.replace(t, tile_n=_round_up(t.tile_n // 2, cn))
            elif t.tile_m > 2 * cm:
                t = dataclasses.replace(t, tile_m=_round_up(t.tile_m // 2, cm))
            else:
                break
        balanced = _balanced(p, t, machine, self._specs)
        return _split_or_balanced(p, t, balanced, attrs, machine, self._specs)

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
        assert isinstance(tiling, MatMulTiling)
        p = self.problem(inputs_meta, attrs)
        tm, tn = min(tiling.tile_m, p.m), min(tiling.tile_n, p.n)
        work = [
            _Item(b, m0, min(m0 + tm, p.m), n0, min(n0 + tn, p.n))
            for b in range(p.batch_size)
            for m0 in range(0, p.m, tm)
            for n0 in range(0, p.n, tn)
        ]
        data = None
        y = None
        if functional:
            a, b, c = self.operands(inputs, attrs, p)
            y = np.empty(p.out_shape, p.dtype)
            data = _RunData(a, b, c, y.reshape(p.batch_size, p.m, p.n), p.batch)
        alpha = float(attrs.get("alpha", 1.0))
        beta = float(attrs.get("beta", 1.0))
        program = partial(_program, p, self._specs(p, tiling), tiling, alpha, beta, data)
        sizes = {
            name: m.nbytes
            for name, m in zip(("A", "B", "C"), inputs_meta, strict=False)
            if m is not None
        }
        cores = min(tiling.cores, machine.cube_cores)
        split = split_of(len(work), p.k, tiling.split_k, cores, machine.cube_k_block(p.dtype))
        if split.slices > 1:
            stats = self._simulate_split(
                machine, p, tiling, split, work, sizes, data, alpha, beta, functional, timeline
            )
            return KernelRun((y,) if y is not None else (), stats)
        stats = launch(
            machine,
            self.op_type,
            work,
            program,
            max_cores=tiling.cores,
            functional=functional,
            signature=_signature,
            timeline=timeline,
            gm_sizes=sizes,
        )
        return KernelRun((y,) if y is not None else (), stats)

    def _simulate_split(
        self,
        machine: Machine,
        p: GemmProblem,
        t: MatMulTiling,
        split: Split,
        blocks: list[_Item],
        sizes: dict[str, int],
        data: _RunData | None,
        alpha: float,
        beta: float,
        functional: bool,
        timeline: bool,
    ) -> RunStats:
        """Split-K (`splitk.py`): the cube phase (whole blocks, and the cut blocks' slices
        into the fp32 workspace), a barrier, the reduce phase on the vector cores."""
        cores = min(t.cores, machine.cube_cores)
        per_core = [
            [blocks[i] if s < 0 else blocks[i]._replace(k0=k0, k1=k1, s=s)
             for i, s in items for k0, k1 in [split.k_range(max(s, 0), p.k)]]
            for items in core_work(split, len(blocks), cores)
        ]  # fmt: skip
        ws = None
        if data is not None:
            ws = np.zeros((split.slices, p.batch_size, p.m, p.n), np.float32)
            data = data._replace(ws=ws)
        program = partial(_program, p, self._specs(p, t), t, alpha, beta, data)
        cube = launch(
            machine, self.op_type, per_core, partial(_flat, program), max_cores=len(per_core),
            functional=functional, signature=_core_signature, timeline=timeline, gm_sizes=sizes,
        )  # fmt: skip
        cut = [Block(*b[:5]) for b in blocks[split.full :]]
        items = reduce_items(cut, reduce_elems(machine, p.dtype.itemsize))
        rdata = None
        if data is not None and ws is not None:
            rdata = ReduceData(ws, data.c, data.y)
        red = run_reduce(
            machine, f"{self.op_type} split-K reduce", items, split.slices, p.dtype, alpha, beta,
            p.has_c, rdata, functional, timeline,
        )  # fmt: skip
        # One kernel: the reduce waits at a barrier across the cores (charged as a launch head).
        return dataclasses.replace(sequence([cube, red]), launches=1)


def gemm_queues(
    p: GemmProblem, t: MatMulTiling | TilingColumns
) -> list[tuple[Level, str, Any, Any]]:
    """(level, name, slot bytes, depth) of the queues a tiling reserves: ints for one tiling
    (`check_tiling`, the program), numpy columns for a whole space (its fit filter), one rule."""
    tm, tn = lesser(t.tile_m, p.m), lesser(t.tile_n, p.n)
    tk, tk0 = lesser(t.tile_k, p.k), lesser(t.tile_k0, t.tile_k, p.k)
    isz = p.dtype.itemsize
    l1, l0, l0c = (pick(f, 2, 1) for f in (t.db_l1, t.db_l0, t.db_l0c))
    queues = [
        (Level.L1, "a_panel", tm * tk * isz, l1),
        (Level.L1, "b_panel", tk * tn * isz, l1),
        (Level.L0A, "a", tm * tk0 * isz, l0),
        (Level.L0B, "b", tk0 * tn * isz, l0),
        (Level.L0C, "acc", tm * tn * 4, l0c),
    ]
    if p.has_c:
        queues.append((Level.L1, "c", tm * tn * isz, l0c))
    return queues


def _flat(
    program: Callable[[Core, Sequence[_Item]], None], core: Core, lists: Sequence[list[_Item]]
) -> None:
    program(core, [it for items in lists for it in items])


def _core_signature(items: list[_Item]) -> tuple[tuple[int, ...], ...]:
    return tuple((it.m1 - it.m0, it.n1 - it.n0, it.k1 - it.k0, it.s >= 0) for it in items)


class _RunData(NamedTuple):
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray | None
    y: np.ndarray
    batch: tuple[int, ...]
    ws: np.ndarray | None = None  # split-K workspace [slices, batch, M, N], float32

    def _index(self, b: int) -> tuple[int, ...]:
        # Plain ints: basic indexing returns a view (index arrays would copy the matrix).
        return tuple(int(i) for i in np.unravel_index(b, self.batch))

    def panel_a(self, b: int) -> np.ndarray:
        return self.a[self._index(b)] if self.batch else self.a

    def panel_b(self, b: int) -> np.ndarray:
        return self.b[self._index(b)] if self.batch else self.b


def _program(
    p: GemmProblem,
    specs: list[QueueSpec],
    t: MatMulTiling,
    alpha: float,
    beta: float,
    data: _RunData | None,
    core: Core,
    items: Sequence[_Item],
) -> None:
    bufs = {Level.L1: core.l1, Level.L0A: core.l0a, Level.L0B: core.l0b, Level.L0C: core.l0c}
    q = {s.name: bufs[s.level].queue(s.name, s.slot_bytes, s.depth) for s in specs}
    isz = p.dtype.itemsize
    tk = min(t.tile_k, p.k)
    tk0 = min(t.tile_k0, tk)
    l0 = L0Queues(q["a"], q["b"], q["acc"])
    for it in items:
        mm, nn = it.m1 - it.m0, it.n1 - it.n0
        A = None if data is None else data.panel_a(it.b)
        B = None if data is None else data.panel_b(it.b)
        k = p.k if it.k1 < 0 else it.k1 - it.k0
        acc = k_walk(
            core, l0, mm, nn, k, min(tk, k), min(tk0, k), p.dtype,
            partial(_a_panel, core, q["a_panel"], A, it, isz),
            partial(_b_panel, core, q["b_panel"], B, it, isz),
        )  # fmt: skip
        if it.s >= 0:
            # A split-K slice: its fp32 partial sum to the workspace plane, unrounded.
            ws = None if data is None or data.ws is None else data.ws[it.s, it.b]
            dst = None if ws is None else ws[it.m0 : it.m1, it.n0 : it.n1]
            core.fixpipe(acc, mm * nn * 4, dst, _partial_sum)
            continue
        reads: tuple[Tile, ...] = ()
        if p.has_c:
            ct = q["c"].alloc()
            core.copy_in(
                ct, mm * nn * isz,
                None if data is None or data.c is None else data.c[it.m0 : it.m1, it.n0 : it.n1],
                label="in C", gm="C",
            )  # fmt: skip
            reads = (ct,)
        core.fixpipe(
            acc,
            mm * nn * isz,
            None if data is None else data.y[it.b, it.m0 : it.m1, it.n0 : it.n1],
            partial(_epilogue, p.dtype, alpha, beta),
            reads=reads,
        )


def _a_panel(
    core: Core, q: Queue, A: np.ndarray | None, it: _Item, isz: int, k0: int, k1: int
) -> tuple[Tile, int]:
    ap = q.alloc()
    src = None if A is None else A[it.m0 : it.m1, it.k0 + k0 : it.k0 + k1]
    core.copy_in(ap, (it.m1 - it.m0) * (k1 - k0) * isz, src, gm="A")
    return ap, k0


def _b_panel(
    core: Core, q: Queue, B: np.ndarray | None, it: _Item, isz: int, k0: int, k1: int
) -> Tile:
    bp = q.alloc()
    src = None if B is None else B[it.k0 + k0 : it.k0 + k1, it.n0 : it.n1]
    core.copy_in(bp, (k1 - k0) * (it.n1 - it.n0) * isz, src, gm="B")
    return bp


def _epilogue(
    dtype: np.dtype, alpha: float, beta: float, acc: np.ndarray, *c: np.ndarray
) -> np.ndarray:
    y = acc if alpha == 1.0 else acc * np.float32(alpha)
    if c:
        y = y + np.float32(beta) * c[0].astype(np.float32)
    return y.astype(dtype)


def _partial_sum(acc: np.ndarray) -> np.ndarray:
    return acc.astype(np.float32, copy=False)


def _signature(it: _Item) -> tuple[int, int]:
    return (it.m1 - it.m0, it.n1 - it.n0)


def _items(p: GemmProblem, t: MatMulTiling) -> int:
    return p.batch_size * math.ceil(p.m / min(t.tile_m, p.m)) * math.ceil(p.n / min(t.tile_n, p.n))


def _balanced(
    p: GemmProblem,
    t: MatMulTiling,
    machine: Machine,
    specs: Callable[[GemmProblem, MatMulTiling], list[QueueSpec]],
) -> MatMulTiling:
    """When the last wave of blocks leaves more than an eighth of the cores' time idle (1024 x
    1024 in 128 x 256 blocks: 32 blocks on 24 cores), the block of an even split of M or N
    (between 128 and 256, `cost.even_splits`' sizes) that leaves the least work per core."""

    def per_core(x: MatMulTiling) -> int:
        return math.ceil(_items(p, x) / machine.cube_cores) * x.tile_m * x.tile_n

    waves = math.ceil(_items(p, t) / machine.cube_cores)
    if _items(p, t) >= waves * machine.cube_cores * 7 / 8:
        return t
    cands = [t]
    for j in range(2, 17):
        bn = _round_up(-(-p.n // j), machine.cube_n)
        if 128 < bn < t.tile_n:
            cands.append(dataclasses.replace(t, tile_n=bn))
        bm = _round_up(-(-p.m // j), machine.cube_m)
        if 128 < bm < t.tile_m:
            cands.append(dataclasses.replace(t, tile_m=bm))
    fitting = [c for c in cands if fits(machine, specs(p, c))]
    return min(fitting, key=lambda c: (per_core(c), -c.tile_m * c.tile_n))


def _split_or_balanced(
    p: GemmProblem,
    t: MatMulTiling,
    balanced: MatMulTiling,
    attrs: Mapping[str, Any],
    machine: Machine,
    specs: Callable[[GemmProblem, MatMulTiling], list[QueueSpec]],
) -> MatMulTiling:
    """The other fix for a partly filled last wave: keep CATLASS's block and cut the last
    wave's blocks along K (`splitk.py`), where the cost model prices that below the evened-out
    block (large K: 1024 x 4096 x 1024, 512 x 8192 x 512); else `balanced`."""
    from .cost import SPLIT_K, SPLIT_K_MIN, gemm_cycles  # cost.py imports this module

    if p.k < SPLIT_K_MIN:
        return balanced
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    cands = [balanced, *(dataclasses.replace(t, split_k=s) for s in SPLIT_K)]
    fitting = [c for c in cands if fits(machine, specs(p, c))]
    return min(fitting, key=lambda c: gemm_cycles(machine, p, c, alpha=alpha, beta=beta))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _cube_dtype(op: str, *metas: TensorMeta) -> np.dtype:
    dtype = metas[0].dtype
    if dtype not in (np.float16, np.float32):
        raise KernelError(f"{op}: the Cube takes float16 or float32, got {dtype}")
    for m in metas[1:]:
        if m.dtype != dtype:
            raise KernelError(f"{op}: input dtypes differ ({dtype} and {m.dtype})")
    return dtype


class MatMul(_CubeGemm):
    """ONNX MatMul: numpy matmul semantics (1-D operands promoted, batch dims broadcast)."""

    op_type = "MatMul"
    domain = ""

    def problem(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> GemmProblem:
        if len(inputs_meta) < 2 or inputs_meta[0] is None or inputs_meta[1] is None:
            raise KernelError("MatMul: needs A and B")
        a, b = inputs_meta[0], inputs_meta[1]
        dtype = _cube_dtype(self.op_type, a, b)
        if not a.shape or not b.shape:
            raise KernelError("MatMul: operands must have at least one dimension")
        sa = (1, *a.shape) if len(a.shape) == 1 else a.shape
        sb = (*b.shape, 1) if len(b.shape) == 1 else b.shape
        if sa[-1] != sb[-2]:
            raise KernelError(f"MatMul: inner dimensions differ: A {a.shape}, B {b.shape}")
        try:
            batch = tuple(np.broadcast_shapes(sa[:-2], sb[:-2]))
        except ValueError:
            raise KernelError(f"MatMul: batch dims of {a.shape} and {b.shape} differ") from None
        out = (
            *batch,
            *([sa[-2]] if len(a.shape) > 1 else []),
            *([sb[-1]] if len(b.shape) > 1 else []),
        )
        return GemmProblem(batch, sa[-2], sa[-1], sb[-1], dtype, out)

    def operands(
        self, inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any], p: GemmProblem
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        a, b = inputs[0], inputs[1]
        assert a is not None
        assert b is not None
        a2 = a.reshape(1, -1) if a.ndim == 1 else a
        b2 = b.reshape(-1, 1) if b.ndim == 1 else b
        return (
            np.broadcast_to(a2, (*p.batch, p.m, p.k)),
            np.broadcast_to(b2, (*p.batch, p.k, p.n)),
            None,
        )


class Gemm(_CubeGemm):
    """ONNX Gemm: Y = alpha * A' @ B' + beta * C, A' and B' optionally transposed."""

    op_type = "Gemm"
    domain = ""

    def problem(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> GemmProblem:
        if len(inputs_meta) < 2 or inputs_meta[0] is None or inputs_meta[1] is None:
            raise KernelError("Gemm: needs A and B")
        a, b = inputs_meta[0], inputs_meta[1]
        c = inputs_meta[2] if len(inputs_meta) > 2 else None
        dtype = _cube_dtype(self.op_type, a, b, *([c] if c is not None else []))
        if len(a.shape) != 2 or len(b.shape) != 2:
            raise KernelError(f"Gemm: A and B must be 2-D, got {a.shape} and {b.shape}")
        m, k = a.shape[::-1] if int(attrs.get("transA", 0)) else a.shape
        kb, n = b.shape[::-1] if int(attrs.get("transB", 0)) else b.shape
        if k != kb:
            raise KernelError(f"Gemm: inner dimensions differ: A' has {k}, B' has {kb}")
        if c is not None:
            try:
                if np.broadcast_shapes(c.shape, (m, n)) != (m, n):
                    raise ValueError
            except ValueError:
                raise KernelError(f"Gemm: C {c.shape} does not broadcast to {(m, n)}") from None
        return GemmProblem((), m, k, n, dtype, (m, n), has_c=c is not None)

    def operands(
        self, inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any], p: GemmProblem
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        a, b = inputs[0], inputs[1]
        assert a is not None
        assert b is not None
        c = inputs[2] if len(inputs) > 2 else None
        # The DMA converts layout on the way in (ND -> fractal), so a transpose costs nothing.
        a = a.T if int(attrs.get("transA", 0)) else a
        b = b.T if int(attrs.get("transB", 0)) else b
        return a, b, None if c is None else np.broadcast_to(c, (p.m, p.n))


KERNELS = (MatMul(), Gemm())
