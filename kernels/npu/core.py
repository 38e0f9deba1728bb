"""One AI core: its buffers and pipes, and the instructions a kernel issues on them.

Each instruction names the tiles it reads and writes. It starts when its pipe is free, every
tile it reads is ready, and every tile it writes has been released by its previous readers;
it then occupies its pipe for its cost in cycles (`npu-model.md`):

- DMA (MTE2 / MTE3 / FixPipe): the pipe's start-up head at its first instruction of the kernel,
  then per copy a transfer cost + bytes / the core's L2 port rate (HBM, shared by the whole chip,
  is charged by `npu.launch` over all cores: first touches and writes);
- MTE1 (L1 -> L0A/L0B): start-up + bytes / bandwidth;
- Cube: ceil(m/16) * ceil(k/k0) * ceil(n/16) cycles, k0 = 32 bytes of the input dtype;
- Vector: k * N + b per instruction; Scalar: ops * scalar_op_cycles.

In functional mode each instruction also does its arithmetic on the tiles' numpy arrays (the
Cube accumulates in float32), so a tiling bug gives a wrong answer. In timing-only mode the
same schedule runs without data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

import numpy as np

from .clock import ARITHMETIC
from .machine import Machine
from .memory import Buffer, Tile
from .pipes import Level, Pipe

Source = np.ndarray | Callable[[], np.ndarray] | None


class Core:
    """The state of one core during one kernel run."""

    def __init__(
        self, machine: Machine, index: int, active_cores: int, functional: bool, record: bool = True
    ) -> None:
        self.machine = machine
        self.index = index
        self.active_cores = active_cores
        self.functional = functional
        # Whether `intervals` keeps every instruction (for the run's timeline); without it the
        # schedule, cycles and bytes are the same, only the per-instruction list is not built.
        self.record = record
        self.ub = Buffer(Level.UB, machine.ub_bytes)
        self.l1 = Buffer(Level.L1, machine.l1_bytes)
        self.l0a = Buffer(Level.L0A, machine.l0a_bytes)
        self.l0b = Buffer(Level.L0B, machine.l0b_bytes)
        self.l0c = Buffer(Level.L0C, machine.l0c_bytes)
        self.pipe_free: dict[Pipe, float] = dict.fromkeys(Pipe, 0.0)
        self.busy: dict[Pipe, float] = dict.fromkeys(Pipe, 0.0)
        self.moved: dict[str, int] = dict.fromkeys(
            ("gm_read", "gm_write", "ub", "l1", "l0a", "l0b", "l0c"), 0
        )
        self.intervals: list[tuple[Pipe, float, float, str]] = []
        # GM bytes read per named tensor (`copy_in(gm=...)`): repeated reads of a tensor hit the
        # L2, so the chip's HBM serves each named tensor once (`npu.launch.hbm_bytes`).
        self.gm_reads: dict[str, int] = {}
        self._started: set[Pipe] = set()
        self._vector_costs: dict[
            tuple[tuple[str, ...], np.dtype], tuple[tuple[float, float], ...]
        ] = {}
        self._k0: dict[np.dtype, int] = {}
        # MTE1 cost per destination level: (start-up cycles, bytes per cycle).
        self._mte1 = {
            Level.L0A: (machine.l1_to_l0_startup_cycles, machine.l1_to_l0a_bytes_per_cycle),
            Level.L0B: (machine.l1_to_l0_startup_cycles, machine.l1_to_l0b_bytes_per_cycle),
        }

    # -- scheduling -------------------------------------------------------------------------
    def issue(
        self, pipe: Pipe, cycles: float, reads: Sequence[Tile], writes: Sequence[Tile], label: str
    ) -> float:
        """Schedule one instruction; returns its end cycle."""
        start = self.pipe_free[pipe]
        for t in reads:
            if t.ready > start:
                start = t.ready
        for t in writes:
            if t.released > start:
                start = t.released
        end = start + cycles
        self.pipe_free[pipe] = end
        self.busy[pipe] += cycles
        for t in reads:
            if end > t.released:
                t.released = end
        for t in writes:
            t.ready = end
            t.released = end
        if self.record:
            self.intervals.append((pipe, start, end, label))
        return end

    @property
    def makespan(self) -> float:
        """Cycles until the last pipe of this core goes idle."""
        return max(self.pipe_free.values())

    # -- data movement ----------------------------------------------------------------------
    def dma_in_cycles(self, nbytes: int, to_l1: bool) -> float:
        """Cycles of one MTE2 copy: the pipe's head if it has not started yet, the per-transfer
        cost, and the bytes at the core's L2 read port."""
        m = self.machine
        head = 0.0
        if Pipe.MTE2 not in self._started:
            self._started.add(Pipe.MTE2)
            head = m.copy_in_head(nbytes, self.active_cores)
        return head + m.copy_in_transfer(to_l1) + nbytes / m.read_bytes_per_cycle

    def dma_out_cycles(self, pipe: Pipe, nbytes: int, cap: float | None = None) -> float:
        """Cycles of one copy-out on `pipe` (MTE3 or FixPipe, whose own bandwidth is `cap`):
        the pipe's head if it has not started yet, the per-transfer cost, the bytes."""
        m = self.machine
        head = 0.0
        if pipe not in self._started:
            self._started.add(pipe)
            head = m.copy_out_head_cycles
        bw = m.write_bytes_per_cycle if cap is None else min(cap, m.write_bytes_per_cycle)
        return head + m.copy_out_transfer_cycles + nbytes / bw

    def copy_in(
        self, dst: Tile, nbytes: int, src: Source = None, label: str = "", gm: str | None = None
    ) -> None:
        """MTE2: GM -> `dst` (UB or L1). `src` is the data (array or a function making it,
        e.g. a halo tile with padding); it is only used in functional mode. `gm` names the GM
        tensor read when the kernel reads it more than once (its L2 hits cost no HBM time);
        unnamed reads are first touches."""
        dst.check_fits(nbytes)
        cycles = self.dma_in_cycles(nbytes, dst.level is Level.L1)
        self.issue(Pipe.MTE2, cycles, (), (dst,), label or f"in {dst.name}")
        self.moved["gm_read"] += nbytes
        self.moved[dst.level._value_] += nbytes
        if gm is not None:
            self.gm_reads[gm] = self.gm_reads.get(gm, 0) + nbytes
        if self.functional and src is not None:
            t = perf_counter()
            dst.data = src() if callable(src) else src
            ARITHMETIC.seconds += perf_counter() - t

    def copy_out(
        self, src: Tile, nbytes: int, dst: np.ndarray | None = None, label: str = ""
    ) -> None:
        """MTE3: `src` (UB) -> GM view `dst` (written in functional mode)."""
        cycles = self.dma_out_cycles(Pipe.MTE3, nbytes)
        self.issue(Pipe.MTE3, cycles, (src,), (), label or f"out {src.name}")
        self.moved["gm_write"] += nbytes
        if self.functional and dst is not None:
            t = perf_counter()
            data = _data(src)
            dst[...] = data.reshape(dst.shape)
            ARITHMETIC.seconds += perf_counter() - t

    def load_l0(
        self,
        dst: Tile,
        src: Tile,
        nbytes: int,
        transform: Callable[[np.ndarray], np.ndarray] | None = None,
        label: str = "",
    ) -> None:
        """MTE1: L1 `src` -> L0A/L0B `dst`; `transform` (e.g. img2col) maps src data to dst data."""
        dst.check_fits(nbytes)
        m = self.machine
        bw = m.l1_to_l0a_bytes_per_cycle if dst.level is Level.L0A else m.l1_to_l0b_bytes_per_cycle
        cycles = m.l1_to_l0_startup_cycles + nbytes / bw
        self.issue(Pipe.MTE1, cycles, (src,), (dst,), label or f"load {dst.name}")
        self.moved[dst.level._value_] += nbytes
        if self.functional:
            t = perf_counter()
            data = _data(src)
            dst.data = transform(data) if transform is not None else data
            ARITHMETIC.seconds += perf_counter() - t

    def fixpipe(
        self,
        src: Tile,
        nbytes: int,
        dst: np.ndarray | None = None,
        epilogue: Callable[..., np.ndarray] | None = None,
        reads: Sequence[Tile] = (),
        label: str = "",
    ) -> None:
        """FixPipe: L0C `src` -> GM view `dst`, through `epilogue(acc, *reads' data)`
        (per-channel scale and bias, relu, cast) in functional mode."""
        cycles = self.dma_out_cycles(Pipe.FIXP, nbytes, self.machine.l0c_to_gm_bytes_per_cycle)
        self.issue(Pipe.FIXP, cycles, (src, *reads), (), label or f"fixpipe {src.name}")
        self.moved["gm_write"] += nbytes
        if self.functional and dst is not None:
            t0 = perf_counter()
            acc = _data(src)
            out = epilogue(acc, *(_data(t) for t in reads)) if epilogue is not None else acc
            dst[...] = out.reshape(dst.shape)
            ARITHMETIC.seconds += perf_counter() - t0

    # -- compute ----------------------------------------------------------------------------
    def mmad(
        self, l0c: Tile, l0a: Tile, l0b: Tile, m: int, k: int, n: int, dtype: np.dtype, init: bool
    ) -> None:
        """Cube: L0C (+)= L0A[m, k] @ L0B[k, n], accumulated in float32."""
        mc = self.machine
        l0c.check_fits(m * n * 4)
        k0 = self._k0.get(dtype)
        if k0 is None:
            k0 = self._k0[dtype] = mc.cube_k_block(dtype)
        # Integer ceilings: blocks of the Cube's m x k0 x n shape.
        blocks = (-(-m // mc.cube_m)) * (-(-k // k0)) * (-(-n // mc.cube_n))
        reads = (l0a, l0b) if init else (l0a, l0b, l0c)
        self.issue(
            Pipe.CUBE, float(blocks), reads, (l0c,), f"mmad {m}x{k}x{n}" if self.record else ""
        )
        self.moved["l0c"] += m * n * 4
        if self.functional:
            t = perf_counter()
            a = _data(l0a).astype(np.float32, copy=False)
            b = _data(l0b).astype(np.float32, copy=False)
            prod = np.matmul(a, b)
            l0c.data = prod if init else _data(l0c) + prod
            ARITHMETIC.seconds += perf_counter() - t

    def vector(
        self,
        ops: str | Sequence[str],
        dtype: np.dtype,
        n: int,
        reads: Sequence[Tile],
        writes: Sequence[Tile],
        fn: Callable[..., Any] | None = None,
        out_bytes: int | None = None,
    ) -> None:
        """Vector: one instruction per op in `ops`, each on `n` elements, k * n + b cycles.

        In functional mode `fn(*reads' data)` returns the data of the written tile (a tuple
        when several are written).
        """
        names = (ops,) if isinstance(ops, str) else tuple(ops)
        # The (k, b) of each op, looked up once per core for the whole instruction list.
        costs = self._vector_costs.get((names, dtype))
        if costs is None:
            costs = tuple(self.machine.vector_cost(op, dtype) for op in names)
            self._vector_costs[(names, dtype)] = costs
        cycles = 0.0
        for k, b in costs:
            cycles += k * n + b
        written = n * np.dtype(dtype).itemsize if out_bytes is None else out_bytes
        for t in writes:
            t.check_fits(written)
        label = "+".join(names) + f" {n}" if self.record else ""
        self.issue(Pipe.VECTOR, cycles, reads, writes, label)
        self.moved["ub"] += written * len(writes)
        if self.functional and fn is not None:
            t0 = perf_counter()
            _assign(writes, fn(*(_data(t) for t in reads)))
            ARITHMETIC.seconds += perf_counter() - t0

    def scalar(
        self,
        n_ops: int,
        reads: Sequence[Tile],
        writes: Sequence[Tile],
        fn: Callable[..., Any] | None = None,
        label: str = "scalar",
    ) -> None:
        """Scalar unit: `n_ops` arithmetic operations (e.g. folding per-channel parameters)."""
        self.issue(Pipe.SCALAR, n_ops * self.machine.scalar_op_cycles, reads, writes, label)
        if self.functional and fn is not None:
            t0 = perf_counter()
            _assign(writes, fn(*(_data(t) for t in reads)))
            ARITHMETIC.seconds += perf_counter() - t0


def _data(tile: Tile) -> np.ndarray:
    if tile.data is None:
        raise RuntimeError(f"{tile.name} is read before anything was written to it")
    return tile.data


def _assign(writes: Sequence[Tile], result: Any) -> None:
    if len(writes) == 1:
        writes[0].data = result
        return
    for t, r in zip(writes, result, strict=True):
        t.data = r
