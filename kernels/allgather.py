"""com.microsoft `AllGather`: this rank's shard exchanged with the group, concatenated.

Input convention (as the onnxruntime plugin passes gathering ops): input 0 holds ALL ranks'
shards stacked on a new leading axis, `[group_size, *shard]`, and attribute `rank` says which
one is this rank's. Output: the shards concatenated along `axis` (ONNX Runtime's default 0) in
rank order.

Time: the ring of `_link` (p - 1 steps of `alpha + S / beta`) after the launch head; no AI core
works. GM traffic of this rank: the gathered output written (p * S, the local shard copied in),
and p * S read (its own shard, and each received shard forwarded to the next rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from ._budget import check_positive
from ._link import LINK_PIPE, arrival_order, check_group, ring_arrivals
from .api import Kernel, KernelError, KernelRun, TensorMeta, Tiling
from .npu.machine import Machine
from .npu.stats import RunStats
from .npu.timeline import Interval, Timeline


@dataclass(frozen=True)
class AllGatherTiling(Tiling):
    """Each shard crosses its link in `chunks` transfers, each paying the link latency.

    Nothing is staged on a core (the links move GM to GM), so no buffer limits the tiling;
    alone, more chunks only add latency (a consumer that starts on the first chunk is what
    would gain from them).
    """

    chunks: int


@dataclass(frozen=True)
class Gather:
    """A gather of `group_size` shards of `shard` shape along `axis` (in the shard's dims)."""

    group_size: int
    rank: int
    axis: int
    shard: tuple[int, ...]
    dtype: np.dtype

    @property
    def shard_bytes(self) -> int:
        """Bytes of one shard."""
        return int(np.prod(self.shard, dtype=np.int64)) * self.dtype.itemsize

    @property
    def gathered(self) -> tuple[int, ...]:
        """Shape of the concatenation."""
        g = list(self.shard)
        g[self.axis] *= self.group_size
        return tuple(g)


def gather_spec(
    op: str, x: TensorMeta | None, attrs: Mapping[str, Any], machine: Machine | None = None
) -> Gather:
    """Check a stacked-shards input against `group_size`, `rank` and `axis`."""
    if x is None or len(x.shape) < 2:
        raise KernelError(
            f"{op}: input 0 must hold all shards stacked on a leading axis [group_size, *shard]"
        )
    p = int(attrs.get("group_size", x.shape[0]))
    if x.shape[0] != p:
        raise KernelError(f"{op}: {x.shape[0]} shards stacked but group_size is {p}")
    rank = int(attrs.get("rank", 0))
    if not 0 <= rank < p:
        raise KernelError(f"{op}: rank {rank} outside the group of {p}")
    shard = x.shape[1:]
    axis = int(attrs.get("axis", 0))
    if not 0 <= axis < len(shard):
        raise KernelError(
            f"{op}: axis {axis} must be in [0, {len(shard)}) (normalized at fuse time)"
        )
    if machine is not None:
        check_group(op, machine, p)
    return Gather(p, rank, axis, shard, x.dtype)


def concat_shards(x: np.ndarray, axis: int) -> np.ndarray:
    """The stacked shards [p, *shard] concatenated along `axis` of the shard."""
    return np.concatenate(list(x), axis=axis)


class AllGatherKernel(Kernel):
    """com.microsoft AllGather over the stacked shards (see the module docstring)."""

    op_type = "AllGather"
    domain = "com.microsoft"
    tiling_type = AllGatherTiling

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        g = gather_spec(self.op_type, inputs_meta[0] if inputs_meta else None, attrs)
        return (TensorMeta(g.gathered, g.dtype),)

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> AllGatherTiling:
        return AllGatherTiling(chunks=1)

    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, AllGatherTiling)
        check_positive(self.op_type, chunks=tiling.chunks)
        gather_spec(self.op_type, inputs_meta[0] if inputs_meta else None, attrs, machine)

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
        assert isinstance(tiling, AllGatherTiling)
        g = gather_spec(self.op_type, inputs_meta[0], attrs, machine)
        steps = ring_arrivals(machine, g.group_size, g.shard_bytes, tiling.chunks)
        order = arrival_order(g.rank, g.group_size)
        stats = _link_only_stats(
            machine, self.op_type, steps, [f"shard {r}" for r in order[1:]],
            g.shard_bytes * g.group_size, timeline,
        )  # fmt: skip
        x = inputs[0]
        if not functional or x is None:
            return KernelRun((), stats)
        return KernelRun((concat_shards(x, g.axis),), stats)


def _link_only_stats(
    machine: Machine,
    name: str,
    steps: Sequence[tuple[float, float]],
    labels: Sequence[str],
    gm_bytes: int,
    timeline: bool,
) -> RunStats:
    head = machine.kernel_launch_cycles
    core_cycles = max((e for _, e in steps), default=0.0)
    cycles = head + core_cycles
    busy = sum(e - s for s, e in steps)
    tl = None
    if timeline:
        intervals = tuple(
            Interval(0, LINK_PIPE, s + head, e + head, label)
            for (s, e), label in zip(steps, labels, strict=True)
        )
        tl = Timeline(machine.clock_hz, intervals, ((0.0, cycles, name),))
    return RunStats(
        cycles=cycles,
        us=machine.cycles_to_us(cycles),
        core_cycles=core_cycles,
        pipe_busy=MappingProxyType({LINK_PIPE: busy}),
        pipe_utilization=MappingProxyType({LINK_PIPE: busy / core_cycles if core_cycles else 0.0}),
        gm_read=gm_bytes,
        gm_write=gm_bytes,
        ub=0,
        l1=0,
        l0a=0,
        l0b=0,
        l0c=0,
        launches=1,
        cores=1,
        # Not compute: the run waits on data movement (over the links).
        bound="memory",
        estimated=False,
        timeline=tl,
        hbm_bytes=2 * gm_bytes,
    )


KERNELS = (AllGatherKernel(),)
