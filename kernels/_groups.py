"""Mixed launch: each work share runs on a group of one cube core and its vector cores.

On 910B the cube and vector cores are separate (1 cube : 2 vector, Ascend C's mixed mode), so a
kernel that normalizes on the Vector unit and multiplies on the Cube runs as groups of one AIC
and two AIVs: separate `Core`s with their own pipes and buffers, synchronized through tiles
(a vector result reaches the cube core through a GM/L2 workspace: `to_workspace` then
`from_workspace`). On a combined core (910, 310P; `machine.vector_to_cube_via_gm` false) the
group is that one core, and the result goes UB -> L1 directly (`ub_to_l1`).

`launch_groups` mirrors `npu.launch.launch` (balanced split, launch head plus the slowest
core's makespan) and gathers the stats of every core of every group.

GM bandwidth: the simulator gives each core a static share of HBM, `1 / active cores`. Here
the cube cores share it among themselves and the vector cores among themselves: the two kinds
stream different tensors (weights on the cube side, activations on the vector side), and
counting all of them would cap a cube core at a third of what a plain MatMul gets although
the vector side's traffic is small. The cost of that choice: when both kinds stream at full
rate at the same time, the chip's HBM bandwidth is over-counted (at most 2x).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from .npu.core import Core
from .npu.launch import gather, split_balanced
from .npu.machine import Machine
from .npu.memory import Tile
from .npu.pipes import Level, Pipe
from .npu.stats import RunStats

W = TypeVar("W")


@dataclass(frozen=True)
class Group:
    """One cube core and the vector cores that feed it (the cube core itself when combined)."""

    cube: Core
    vecs: tuple[Core, ...]

    @property
    def separate(self) -> bool:
        """True when the vector cores are not the cube core (results cross a workspace)."""
        return self.vecs[0] is not self.cube


def vector_cores_per_group(machine: Machine) -> int:
    """Vector cores beside each cube core (0 on a combined core: the cube core does it)."""
    if not machine.vector_to_cube_via_gm:
        return 0
    return max(1, machine.vector_cores // max(1, machine.cube_cores))


def launch_groups(
    machine: Machine,
    name: str,
    work: Sequence[W],
    body: Callable[[Group, Sequence[W]], None],
    *,
    max_groups: int,
    functional: bool,
    timeline: bool = True,
    gm_sizes: Mapping[str, int] | None = None,
) -> RunStats:
    """Run `body(group, items)` for each group's balanced share of `work` (`gm_sizes`: bytes
    of the GM tensors the program names, as for `npu.launch.launch`)."""
    n = max(1, min(max_groups, machine.cube_cores, len(work)))
    per = vector_cores_per_group(machine)
    cores: list[Core] = []
    for share in split_balanced(len(work), n):
        cube = Core(machine, len(cores), n, functional)
        cores.append(cube)
        vecs = tuple(Core(machine, len(cores) + i, n * per, functional) for i in range(per))
        cores.extend(vecs)
        items = [work[i] for i in share]
        if items:
            body(Group(cube, vecs or (cube,)), items)
    return gather(machine, name, cores, timeline, gm_sizes)


def workspace_tile(name: str) -> Tile:
    """A fresh GM workspace buffer (GM is not a core buffer: no capacity, never reused)."""
    return Tile(name, Level.GM, 1 << 62)


def to_workspace(vec: Core, src: Tile, ws: Tile, nbytes: int) -> None:
    """MTE3 of a vector core: UB -> GM/L2 workspace, at L2 rate (the data stays in L2, so it
    is not counted as HBM traffic)."""
    cycles = vec.dma_out_cycles(Pipe.MTE3, nbytes)
    vec.issue(Pipe.MTE3, cycles, (src,), (ws,), f"out {src.name} -> workspace")
    if vec.functional:
        ws.data = src.data


def from_workspace(
    cube: Core,
    sources: Sequence[Tile],
    dst: Tile,
    nbytes: int,
    fill: Callable[..., None],
) -> None:
    """MTE2 of the cube core: GM/L2 workspace -> L1, at L2 rate, once every piece in `sources`
    has been written; `fill(dst, *pieces' data)` sets what lands in `dst` (functional mode)."""
    cycles = cube.dma_in_cycles(nbytes, to_l1=True)
    cube.issue(Pipe.MTE2, cycles, tuple(sources), (dst,), f"in workspace -> {dst.name}")
    cube.moved["l1"] += nbytes
    if cube.functional:
        pieces = [t.data for t in sources]
        if all(d is not None for d in pieces):
            fill(dst, *pieces)


def ub_to_l1(
    core: Core,
    src: Tile,
    dst: Tile,
    nbytes: int,
    fill: Callable[[Tile, np.ndarray], None],
) -> None:
    """A combined core's direct UB -> L1 move (MTE3), with the on-chip start-up of an L1 move
    rather than a GM head; `fill(dst, data)` sets what lands in `dst` (functional mode)."""
    m = core.machine
    cycles = m.l1_to_l0_startup_cycles + nbytes / m.ub_to_l1_bytes_per_cycle
    core.issue(Pipe.MTE3, cycles, (src,), (dst,), f"{src.name} -> {dst.name}")
    core.moved["l1"] += nbytes
    if core.functional and src.data is not None:
        fill(dst, src.data)
