"""MatMul / Gemm split-K: the blocks of the last, partly filled wave cut along K.

When the output blocks do not fill the cube cores evenly (1024 x 1024 in 128 x 256 blocks: 32
blocks on 24 cores, the second wave a third full; 16 x 4096 at decode: 16 blocks, 8 cores
idle), the blocks past the last full wave are cut into `split_k` K slices, so every core gets
the same share of the Cube and copy-in work. As CATLASS's split-K matmul does, a slice's
float32 partial sum goes to a GM workspace (one plane per slice, FixPipe writing 4 bytes an
element, no rounding), and after a barrier across the cores the vector cores reduce the
planes: copy each in (MTE2), add them in float32 (Vector), apply Gemm's alpha and beta * C,
round once to T and copy out (MTE3). Blocks of the full waves run as without split-K.

The barrier between the cube phase and the reduce phase is charged as a launch head, as the
staged schedules charge theirs [G]; the workspace's bytes are HBM traffic both ways (every
write is, in the machine model). So split-K is priced honestly: it wins only where the even
share of the Cube outweighs the workspace and the reduce pass.

Numbers: fp32 accumulation either way; only the order of the fp32 additions differs (slice
sums added together instead of one running sum), and the result is rounded once to T.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from .._columns import pick
from .._cost_base import dma, dma_out, kernel_cycles, round_up
from ..npu.core import Core
from ..npu.launch import launch, split_balanced
from ..npu.machine import Machine
from ..npu.memory import Tile
from ..npu.stats import RunStats

F32 = np.dtype(np.float32)


class Block(NamedTuple):
    """One output block (batch index, rows, columns)."""

    b: int
    m0: int
    m1: int
    n0: int
    n1: int


@dataclass(frozen=True)
class Split:
    """Which blocks are cut, into how many K slices of `slice_k`."""

    full: int  # blocks of the full waves (not cut): blocks[:full]
    slices: int  # K slices per cut block (1: no split-K)
    slice_k: int

    def k_range(self, s: int, k: int) -> tuple[int, int]:
        """K range of slice s."""
        return s * self.slice_k, min(k, (s + 1) * self.slice_k)


def split_of(blocks: int, k: int, split_k: int, cores: int, k_block: int) -> Split:
    """The split of `blocks` output blocks on `cores` cube cores (see the module docstring):
    none when split_k is 1, K is a single slice or every wave is full."""
    if split_k <= 1:
        return Split(blocks, 1, k)
    slices = cut_slices(blocks, k, split_k, cores, k_block)
    if slices == 1:
        return Split(blocks, 1, k)
    return Split((blocks // cores) * cores, slices, slice_k_of(k, split_k, k_block))


def slice_k_of(k: Any, split_k: Any, k_block: int) -> Any:
    """K of each slice: K over `split_k`, rounded up to the Cube's K block."""
    return round_up(-(-k // split_k), k_block)


def cut_slices(blocks: Any, k: Any, split_k: Any, cores: Any, k_block: int) -> Any:
    """K slices per cut block, 1 when nothing is cut (`split_of`'s rule; ints, or numpy
    columns over a tiling space with every `split_k` >= 1)."""
    full = (blocks // cores) * cores
    slices = -(-k // slice_k_of(k, split_k, k_block))
    return pick((split_k <= 1) | (full == blocks) | (slices <= 1), 1, slices)


def core_work(split: Split, n_blocks: int, cores: int) -> list[list[tuple[int, int]]]:
    """Per cube core: its (block index, slice) items; slice -1 is a whole (uncut) block.

    Full-wave blocks go round robin (one per core per wave); the cut blocks' slices are shared
    out in balanced contiguous ranges."""
    work: list[list[tuple[int, int]]] = [[] for _ in range(cores)]
    for i in range(split.full):
        work[i % cores].append((i, -1))
    cut = [(j, s) for j in range(split.full, n_blocks) for s in range(split.slices)]
    for c, share in enumerate(split_balanced(len(cut), cores)):
        work[c] += [cut[i] for i in share]
    return [w for w in work if w]


# -- the reduce pass on the vector cores ---------------------------------------------------------


def reduce_elems(machine: Machine, itemsize: int) -> int:
    """Elements per reduce tile: double-buffered fp32 accumulator and plane, C and output in UB."""
    per = 2 * (4 + 4 + 2 * itemsize)
    return max(256, (machine.ub_bytes // per) // 256 * 256)


def reduce_items(blocks: Sequence[Block], elems: int) -> list[Block]:
    """The cut blocks in row chunks of at most `elems` elements."""
    out = []
    for blk in blocks:
        cols = blk.n1 - blk.n0
        rows = max(1, elems // cols)
        out += [blk._replace(m0=r, m1=min(r + rows, blk.m1)) for r in range(blk.m0, blk.m1, rows)]
    return out


def reduce_ops(alpha: float, beta: float, has_c: bool, dtype: np.dtype) -> tuple[str, ...]:
    """Vector instructions of one tile's epilogue after the plane adds."""
    ops = ["Muls"] if alpha != 1.0 else []
    if has_c:
        ops += ["Cast", *(["Muls"] if beta != 1.0 else []), "Add"]
    if dtype != F32:
        ops.append("Cast")
    return tuple(ops)


@dataclass(frozen=True)
class ReduceData:
    """Functional-mode arrays: workspace [slices, batch, M, N], C [M, N] or None, Y view."""

    ws: np.ndarray
    c: np.ndarray | None
    y: np.ndarray  # [batch, M, N]


def run_reduce(
    machine: Machine,
    name: str,
    items: Sequence[Block],
    slices: int,
    dtype: np.dtype,
    alpha: float,
    beta: float,
    has_c: bool,
    data: ReduceData | None,
    functional: bool,
    timeline: bool,
) -> RunStats:
    """Simulate the reduce pass over `items` on the vector cores."""
    elems = max((it.m1 - it.m0) * (it.n1 - it.n0) for it in items)
    isz = dtype.itemsize
    ops = reduce_ops(alpha, beta, has_c, dtype)

    def program(core: Core, mine: Sequence[Block]) -> None:
        q_acc = core.ub.queue("acc", elems * 4, 2)
        q_in = core.ub.queue("plane", elems * 4, 2)
        q_c = core.ub.queue("c", elems * isz, 2) if has_c else None
        q_out = core.ub.queue("out", elems * isz, 2)
        for it in mine:
            e = (it.m1 - it.m0) * (it.n1 - it.n0)
            rows, cols = slice(it.m0, it.m1), slice(it.n0, it.n1)
            acc = q_acc.alloc()
            src = None if data is None else data.ws[0, it.b, rows, cols]
            core.copy_in(acc, e * 4, src, label="in partial 0", gm="WS")
            for s in range(1, slices):
                plane = q_in.alloc()
                src = None if data is None else data.ws[s, it.b, rows, cols]
                core.copy_in(plane, e * 4, src, label=f"in partial {s}", gm="WS")
                core.vector("Add", F32, e, (acc, plane), (acc,), fn=np.add)
            reads: tuple[Tile, ...] = (acc,)
            if q_c is not None:
                ct = q_c.alloc()
                src = None if data is None or data.c is None else data.c[rows, cols]
                core.copy_in(ct, e * isz, src, label="in C", gm="C")
                reads = (acc, ct)
            out = q_out.alloc()
            if ops:
                fn = partial(_epilogue, dtype, alpha, beta)
                core.vector(ops, F32, e, reads, (out,), fn=fn, out_bytes=e * isz)
            else:  # fp32 without alpha or C: the sum is the output
                core.vector("Adds", F32, e, reads, (out,), fn=lambda a: a)
            dst = None if data is None else data.y[it.b, rows, cols]
            core.copy_out(out, e * isz, dst, label="out Y")

    sizes = {"WS": slices * sum((it.m1 - it.m0) * (it.n1 - it.n0) for it in items) * 4}
    if has_c:
        sizes["C"] = sum((it.m1 - it.m0) * (it.n1 - it.n0) for it in items) * isz
    return launch(
        machine, name, list(items), program, max_cores=machine.vector_cores,
        functional=functional, signature=_shape, timeline=timeline, gm_sizes=sizes,
    )  # fmt: skip


def _shape(it: Block) -> tuple[int, int]:
    return (it.m1 - it.m0, it.n1 - it.n0)


def _epilogue(
    dtype: np.dtype, alpha: float, beta: float, acc: np.ndarray, *c: np.ndarray
) -> np.ndarray:
    # As the unsplit kernel's FixPipe epilogue: alpha * acc + beta * C in fp32, rounded once.
    y = acc if alpha == 1.0 else acc * np.float32(alpha)
    if c:
        y = y + np.float32(beta) * c[0].astype(np.float32)
    return y.astype(dtype)


def reduce_cycles(
    machine: Machine,
    items: Sequence[Block],
    slices: int,
    dtype: np.dtype,
    alpha: float,
    beta: float,
    has_c: bool,
) -> float:
    """Predicted cycles of `run_reduce` (its own launch head included: the barrier)."""
    isz = dtype.itemsize
    vcores = max(1, min(machine.vector_cores, len(items)))
    ops = reduce_ops(alpha, beta, has_c, dtype) or ("Adds",)
    per_item: list[tuple[float, float, float]] = []
    for it in items:
        e = (it.m1 - it.m0) * (it.n1 - it.n0)
        mte2 = slices * dma(machine, e * 4, vcores) + (
            dma(machine, e * isz, vcores) if has_c else 0
        )
        vec = (slices - 1) * _vec(machine, "Add", e) + sum(_vec(machine, op, e) for op in ops)
        mte3 = dma_out(machine, e * isz, vcores)
        per_item.append((mte2, vec, mte3))
    # The slowest vector core: the largest balanced share, pipes overlapped (double buffers).
    worst = 0.0
    for share in split_balanced(len(items), vcores):
        mine = [per_item[i] for i in share]
        if mine:
            busy = max(sum(x[j] for x in mine) for j in range(3))
            worst = max(worst, busy + sum(mine[0]) - max(mine[0]))  # + one tile's fill
    elems = max((it.m1 - it.m0) * (it.n1 - it.n0) for it in items)
    total = sum((it.m1 - it.m0) * (it.n1 - it.n0) for it in items)
    gm = total * (slices * 4 + isz + (isz if has_c else 0))
    return kernel_cycles(machine, worst, gm, elems * 4, vcores)


def _vec(machine: Machine, op: str, n: int) -> float:
    k, b = machine.vector_cost(op, F32)
    return k * n + b
