"""One AI core: its buffers and pipes, and the instructions a kernel issues on them.

Each instruction names the tiles it reads and writes. It starts when its pipe is free, every
tile it reads is ready, and every tile it writes has been released by its previous readers;
it then occupies its pipe for its cost in cycles (`npu-model.md`):

- DMA (MTE2 / MTE3 / FixPipe): head + bytes / bandwidth, the GM side shared by active cores;
- MTE1 (L1 -> L0A/L0B): start-up + bytes / bandwidth;
- Cube: ceil(m/16) * ceil(k/k0) * ceil(n/16) cycles, k0 = 32 bytes of the input dtype;
- Vector: k * N + b per instruction; Scalar: ops * scalar_op_cycles.

In functional mode each instruction also does its arithmetic on the tiles' numpy arrays (the
Cube accumulates in float32), so a tiling bug gives a wrong answer. In timing-only mode the
same schedule runs without data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from .machine import Machine
from .memory import Buffer, Tile
from .pipes import Level, Pipe

Load = Callable[[], np.ndarray]
Store = Callable[[np.ndarray], None]


class Core:
    """The state of one core during one kernel run."""

    def __init__(self, machine: Machine, index: int, active_cores: int, functional: bool) -> None:
        self.machine = machine
        self.index = index
        self.active_cores = active_cores
        self.functional = functional
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
        self._gm_bw = machine.dma_bytes_per_cycle(active_cores)

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
        self.intervals.append((pipe, start, end, label))
        return end

    @property
    def makespan(self) -> float:
        """Cycles until the last pipe of this core goes idle."""
        return max(self.pipe_free.values())

    # -- data movement ----------------------------------------------------------------------
    def copy_in(self, dst: Tile, nbytes: int, load: Load | None = None, label: str = "") -> None:
        """MTE2: GM -> `dst` (UB or L1). `load` returns the data (called in functional mode)."""
        dst.check_fits(nbytes)
        m = self.machine
        cycles = m.copy_in_head(nbytes, self.active_cores) + nbytes / self._gm_bw
        self.issue(Pipe.MTE2, cycles, (), (dst,), label or f"in {dst.name}")
        self.moved["gm_read"] += nbytes
        self.moved[dst.level.value] += nbytes
        if self.functional and load is not None:
            dst.data = load()

    def copy_out(self, src: Tile, nbytes: int, store: Store | None = None, label: str = "") -> None:
        """MTE3: `src` (UB) -> GM. `store` receives the data (called in functional mode)."""
        cycles = self.machine.copy_out_head_cycles + nbytes / self._gm_bw
        self.issue(Pipe.MTE3, cycles, (src,), (), label or f"out {src.name}")
        self.moved["gm_write"] += nbytes
        if self.functional and store is not None:
            assert src.data is not None, f"{src.name} read before written"
            store(src.data)

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
        self.moved[dst.level.value] += nbytes
        if self.functional:
            assert src.data is not None, f"{src.name} read before written"
            dst.data = transform(src.data) if transform is not None else src.data

    def fixpipe(
        self,
        src: Tile,
        nbytes: int,
        store: Store | None = None,
        reads: Sequence[Tile] = (),
        label: str = "",
    ) -> None:
        """FixPipe: L0C `src` -> GM; `store` applies the epilogue and writes (functional)."""
        m = self.machine
        bw = min(m.l0c_to_gm_bytes_per_cycle, self._gm_bw)
        cycles = m.copy_out_head_cycles + nbytes / bw
        self.issue(Pipe.FIXP, cycles, (src, *reads), (), label or f"fixpipe {src.name}")
        self.moved["gm_write"] += nbytes
        if self.functional and store is not None:
            assert src.data is not None, f"{src.name} read before written"
            store(src.data)

    # -- compute ----------------------------------------------------------------------------
    def mmad(
        self, l0c: Tile, l0a: Tile, l0b: Tile, m: int, k: int, n: int, dtype: np.dtype, init: bool
    ) -> None:
        """Cube: L0C (+)= L0A[m, k] @ L0B[k, n], accumulated in float32."""
        mc = self.machine
        l0c.check_fits(m * n * 4)
        k0 = mc.cube_k_block(dtype)
        blocks = math.ceil(m / mc.cube_m) * math.ceil(k / k0) * math.ceil(n / mc.cube_n)
        reads = (l0a, l0b) if init else (l0a, l0b, l0c)
        self.issue(Pipe.CUBE, float(blocks), reads, (l0c,), f"mmad {m}x{k}x{n}")
        self.moved["l0c"] += m * n * 4
        if self.functional:
            a, b = l0a.data, l0b.data
            assert a is not None, f"{l0a.name} read before written"
            assert b is not None, f"{l0b.name} read before written"
            prod = np.matmul(a.astype(np.float32, copy=False), b.astype(np.float32, copy=False))
            if init or l0c.data is None:
                l0c.data = prod
            else:
                l0c.data = l0c.data + prod

    def vector(
        self,
        ops: str | Sequence[str],
        dtype: np.dtype,
        n: int,
        reads: Sequence[Tile],
        writes: Sequence[Tile],
        compute: Callable[[], None] | None = None,
        out_bytes: int | None = None,
    ) -> None:
        """Vector: one instruction per op in `ops`, each on `n` elements, k * n + b cycles.

        `compute` sets the written tiles' data (functional mode only).
        """
        names = (ops,) if isinstance(ops, str) else tuple(ops)
        cycles = 0.0
        for op in names:
            k, b = self.machine.vector_cost(op, dtype)
            cycles += k * n + b
        written = n * np.dtype(dtype).itemsize if out_bytes is None else out_bytes
        for t in writes:
            t.check_fits(written)
        self.issue(Pipe.VECTOR, cycles, reads, writes, "+".join(names) + f" {n}")
        self.moved["ub"] += written * len(writes)
        if self.functional and compute is not None:
            compute()

    def scalar(
        self,
        n_ops: int,
        reads: Sequence[Tile],
        writes: Sequence[Tile],
        compute: Callable[[], None] | None = None,
        label: str = "scalar",
    ) -> None:
        """Scalar unit: `n_ops` arithmetic operations (e.g. folding per-channel parameters)."""
        self.issue(Pipe.SCALAR, n_ops * self.machine.scalar_op_cycles, reads, writes, label)
        if self.functional and compute is not None:
            compute()
