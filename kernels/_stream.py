"""Streamed vector kernels: elementwise ops over a flat output, tile by tile on the Vector unit.

The output is split over vector cores in balanced ranges (in 32-byte blocks); each core walks
its range in tiles: copy in each streamed input (MTE2), compute (Vector), copy out (MTE3).
Inputs with the output's shape are streamed; smaller (broadcast) inputs are loaded into UB
once per core and expanded by the Vector unit per tile. With `double_buffer` the tile queues
have two slots, so copy-in of tile i+1 can run while tile i computes.

A kernel subclasses `StreamKernel` and says, in a `StreamLayout`, which inputs are streamed or
resident and which vector instructions a tile costs; `tile_compute` is its numpy arithmetic.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import numpy as np

from ._budget import QueueSpec, check_flag, check_positive, require_fits
from .api import Kernel, KernelError, KernelRun, TensorMeta, Tiling, TilingError
from .npu.core import Core
from .npu.launch import launch, split_balanced
from .npu.machine import Machine
from .npu.memory import ALIGN_BYTES, align
from .npu.pipes import Level

#: A broadcast input larger than this share of UB is streamed expanded instead of resident.
RESIDENT_SHARE = 8


@dataclass(frozen=True)
class VectorTiling(Tiling):
    """Elements per tile, double buffering (0/1) and vector cores used."""

    elems: int
    double_buffer: int
    cores: int


@dataclass(frozen=True)
class StreamLayout:
    """How a streamed kernel moves its operands (see module docstring)."""

    out: TensorMeta
    compute_dtype: np.dtype
    streamed: tuple[int, ...]
    resident: tuple[int, ...]
    ops: tuple[str, ...]
    # Vector work once per core over the resident elements (e.g. folding BN parameters).
    prologue_ops: tuple[str, ...] = ()
    prologue_n: int = 0
    prologue_bytes: int = 0
    temps: int = 0


class Expanded:
    """A broadcast input seen as a flat array of the output's size (functional mode).

    Past its leading broadcast dims an input repeats with period prod(out_shape[lead:]): that
    one period is expanded once per run and ranges are cut from it.
    """

    def __init__(self, x: np.ndarray, out_shape: tuple[int, ...]) -> None:
        shape = (1,) * (len(out_shape) - x.ndim) + tuple(x.shape)
        lead = 0
        while lead < len(shape) and shape[lead] == 1:
            lead += 1
        self.scalar = x.size == 1
        if self.scalar or shape[lead:] == out_shape[lead:]:
            self.flat = np.ascontiguousarray(x).reshape(-1)
        else:
            period = np.empty(out_shape[lead:], x.dtype)
            period[...] = x.reshape(shape[lead:])
            self.flat = period.reshape(-1)
        self.period = max(1, self.flat.size)

    def take(self, s: int, e: int) -> np.ndarray:
        """Elements s..e of the expanded flat input."""
        if self.scalar:
            return self.flat[:1]
        p = self.period
        off = s % p
        if off + (e - s) <= p:
            return self.flat[off : off + (e - s)]
        reps = (off + (e - s)) // p + 1
        return np.tile(self.flat, reps)[off : off + (e - s)]


def vector_unit(dtypes: Sequence[np.dtype]) -> int:
    """Elements per 32-byte block of the narrowest dtype: the alignment of tiles and splits."""
    return max(1, ALIGN_BYTES // min(np.dtype(d).itemsize for d in dtypes))


class StreamKernel(Kernel):
    """Base of streamed vector kernels (elementwise, BatchNormalization, Relu...)."""

    tiling_type = VectorTiling
    # The layout and the program read shapes; input data is copied only in functional mode.
    value_inputs: ClassVar[frozenset[int] | None] = frozenset()

    @abstractmethod
    def layout(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> StreamLayout:
        """Which inputs are streamed or resident and what a tile costs."""

    @abstractmethod
    def tile_compute(self, attrs: Mapping[str, Any], operands: Sequence[np.ndarray]) -> np.ndarray:
        """Numpy arithmetic of one tile, returning the output tile. `operands` are the tile's
        view of every input in input order (broadcast ones expanded); for a kernel with a
        prologue, the streamed inputs followed by the prologue's result for the tile."""

    def prologue(self, attrs: Mapping[str, Any], resident: Sequence[np.ndarray]) -> np.ndarray:
        """Arithmetic done once per core on the residents (when `prologue_ops`)."""
        raise NotImplementedError(f"{self.op_type} declares no prologue")

    def expand_prologue(
        self, prepared: np.ndarray, out_shape: tuple[int, ...], s: int, e: int
    ) -> Sequence[np.ndarray]:
        """The prologue's result as seen by the tile covering flat output elements s..e."""
        raise NotImplementedError(f"{self.op_type} declares no prologue")

    # -- Kernel API -------------------------------------------------------------------------
    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        return (self.layout(inputs_meta, attrs).out,)

    def _specs(
        self, lay: StreamLayout, metas: Sequence[TensorMeta | None], t: VectorTiling
    ) -> list[QueueSpec]:
        depth = 2 if t.double_buffer else 1
        specs = []
        for i in lay.streamed:
            m = metas[i]
            assert m is not None
            specs.append(QueueSpec(Level.UB, f"in{i}", t.elems * m.dtype.itemsize, depth))
        for i in lay.resident:
            m = metas[i]
            assert m is not None
            specs.append(QueueSpec(Level.UB, f"res{i}", max(1, m.nbytes), 1))
        if lay.prologue_ops:
            specs.append(QueueSpec(Level.UB, "prep", max(1, lay.prologue_bytes), 1))
        if lay.temps:
            tmp_bytes = t.elems * lay.compute_dtype.itemsize
            specs.append(QueueSpec(Level.UB, "tmp", tmp_bytes, lay.temps))
        specs.append(QueueSpec(Level.UB, "out", t.elems * lay.out.dtype.itemsize, depth))
        return specs

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> VectorTiling:
        lay = self.layout(inputs_meta, attrs)
        fixed = sum(align(max(1, _meta(inputs_meta, i).nbytes)) for i in lay.resident)
        if lay.prologue_ops:
            fixed += align(max(1, lay.prologue_bytes))
        per_elem = (
            2
            * (
                sum(_meta(inputs_meta, i).dtype.itemsize for i in lay.streamed)
                + lay.out.dtype.itemsize
            )
            + lay.temps * lay.compute_dtype.itemsize
        )
        unit = vector_unit(self._dtypes(lay, inputs_meta))
        # Leave room for the per-queue alignment padding.
        room = machine.ub_bytes - fixed - ALIGN_BYTES * (len(lay.streamed) + 2) * 2
        if room < per_elem * unit:
            raise TilingError(f"{self.op_type}: resident inputs leave no room in UB for a tile")
        tile_max = (room // per_elem) // unit * unit
        per_core = math.ceil(max(1, lay.out.size) / machine.vector_cores)
        tile = min(tile_max, math.ceil(per_core / unit) * unit)
        return VectorTiling(elems=max(unit, tile), double_buffer=1, cores=machine.vector_cores)

    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, VectorTiling)
        check_positive(self.op_type, elems=tiling.elems, cores=tiling.cores)
        check_flag(self.op_type, double_buffer=tiling.double_buffer)
        if tiling.cores > machine.vector_cores:
            raise TilingError(
                f"{self.op_type}: tiling uses {tiling.cores} cores, {machine.name} has "
                f"{machine.vector_cores} vector cores"
            )
        lay = self.layout(inputs_meta, attrs)
        require_fits(self.op_type, machine, self._specs(lay, inputs_meta, tiling))

    def _dtypes(self, lay: StreamLayout, metas: Sequence[TensorMeta | None]) -> list[np.dtype]:
        return [_meta(metas, i).dtype for i in lay.streamed] + [lay.out.dtype]

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
        assert isinstance(tiling, VectorTiling)
        lay = self.layout(inputs_meta, attrs)
        total = lay.out.size
        unit = vector_unit(self._dtypes(lay, inputs_meta))
        blocks = math.ceil(total / unit)
        n_cores = max(1, min(tiling.cores, blocks))
        ranges = [
            (r.start * unit, min(total, r.stop * unit))
            for r in split_balanced(blocks, n_cores)
            if len(r)
        ]
        out = np.empty(lay.out.shape, lay.out.dtype) if functional else None
        sources: dict[int, Expanded] = {}
        if functional:
            expanded = lay.streamed if lay.prologue_ops else (*lay.streamed, *lay.resident)
            for i in expanded:
                x = inputs[i]
                if x is None:
                    raise KernelError(f"{self.op_type}: input {i} is required")
                sources[i] = Expanded(x, lay.out.shape)
        specs = self._specs(lay, inputs_meta, tiling)
        program = partial(
            self._program,
            lay,
            specs,
            tiling,
            attrs,
            inputs,
            inputs_meta,
            sources,
            None if out is None else out.reshape(-1),
        )
        stats = launch(
            machine,
            self.op_type,
            ranges,
            program,
            max_cores=n_cores,
            functional=functional,
            signature=lambda r: r[1] - r[0],
            timeline=timeline,
        )
        return KernelRun((out,) if out is not None else (), stats)

    def _program(
        self,
        lay: StreamLayout,
        specs: list[QueueSpec],
        t: VectorTiling,
        attrs: Mapping[str, Any],
        inputs: Sequence[np.ndarray | None],
        metas: Sequence[TensorMeta | None],
        sources: dict[int, Expanded],
        out: np.ndarray | None,
        core: Core,
        items: Sequence[tuple[int, int]],
    ) -> None:
        queues = {s.name: core.ub.queue(s.name, s.slot_bytes, s.depth) for s in specs}
        residents = []
        for i in lay.resident:
            slot = queues[f"res{i}"].alloc()
            core.copy_in(slot, _meta(metas, i).nbytes, inputs[i], label=f"in res{i}")
            residents.append(slot)
        prep = None
        if lay.prologue_ops:
            prep = queues["prep"].alloc()
            core.vector(
                lay.prologue_ops,
                lay.compute_dtype,
                lay.prologue_n,
                residents,
                (prep,),
                partial(self._prologue_fn, attrs),
                out_bytes=lay.prologue_bytes,
            )
        osz = lay.out.dtype.itemsize
        # What every tile repeats, made once (a core streams hundreds of tiles): each streamed
        # input's queue, element size and source, and the tile's other reads.
        streamed = [
            (queues[f"in{i}"], _meta(metas, i).dtype.itemsize, sources.get(i)) for i in lay.streamed
        ]
        others = [prep] if prep is not None else residents
        functional = core.functional
        out_queue = queues["out"]
        for start, stop in items:
            for s in range(start, stop, t.elems):
                e = min(s + t.elems, stop)
                n = e - s
                tiles = []
                for queue, isz, source in streamed:
                    slot = queue.alloc()
                    core.copy_in(slot, n * isz, source.take(s, e) if source is not None else None)
                    tiles.append(slot)
                o = out_queue.alloc()
                # The tile's arithmetic, only made where it runs (a functional run).
                fn = partial(self._tile_fn, attrs, lay, sources, s, e) if functional else None
                core.vector(lay.ops, lay.compute_dtype, n, [*tiles, *others], (o,), fn,
                            out_bytes=n * osz)  # fmt: skip
                core.copy_out(o, n * osz, None if out is None else out[s:e])

    def _prologue_fn(self, attrs: Mapping[str, Any], *resident: np.ndarray) -> np.ndarray:
        return self.prologue(attrs, resident)

    def _tile_fn(
        self,
        attrs: Mapping[str, Any],
        lay: StreamLayout,
        sources: dict[int, Expanded],
        s: int,
        e: int,
        *data: np.ndarray,
    ) -> np.ndarray:
        streamed = data[: len(lay.streamed)]
        if lay.prologue_ops:
            prepared = self.expand_prologue(data[len(lay.streamed)], lay.out.shape, s, e)
            return self.tile_compute(attrs, [*streamed, *prepared])
        by_index = dict(zip(lay.streamed, streamed, strict=True))
        for i in lay.resident:
            by_index[i] = sources[i].take(s, e)
        return self.tile_compute(attrs, [by_index[i] for i in sorted(by_index)])


def _meta(metas: Sequence[TensorMeta | None], i: int) -> TensorMeta:
    m = metas[i] if i < len(metas) else None
    if m is None:
        raise KernelError(f"input {i} is required")
    return m
