"""The vector epilogue of ConvBnRelu: an activation other than Relu, on the Vector unit.

FixPipe writes each output block (BN or bias applied, cast to the output dtype) to a GM/L2
workspace instead of the output; one of the group's vector cores (`_groups`: on 910B the two
AIVs beside the AIC, taking the blocks in turn) copies it into UB in chunks of
`CHUNK_BYTES`, runs the activation's vector instructions (`conv_activation.VECTOR_OPS`, each
priced by its row of the target's `vector_ops`) and copies the result to the output (MTE3).
UB in and out queues are double-buffered, so chunk i+1's copy-in runs under chunk i's
compute. The workspace stays in the L2: it costs L2 port time, not HBM traffic. On a combined
core (910, 310P) the same schedule runs on the one core.

`epilogue_cycles` prices the same steps for the cost model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from fuser.patterns.conv_activation import VECTOR_OPS, Activation, apply

from .._groups import workspace_tile
from ..npu.core import Core
from ..npu.machine import Machine
from ..npu.memory import Queue, Tile
from ..npu.pipes import Pipe

#: UB chunk of one vector step: in and out queues of two slots each fit UB with room to spare.
CHUNK_BYTES = 32 * 1024
#: The GM name of the workspace (its reads hit the L2: it was just written there).
WORKSPACE = "WS"


def chunk_elements(dtype: np.dtype) -> int:
    """Elements per vector chunk."""
    return CHUNK_BYTES // np.dtype(dtype).itemsize


@dataclass
class VectorEpilogue:
    """The vector cores of one group and their UB queues; blocks go to them in turn."""

    vecs: Sequence[Core]
    activation: Activation
    dtype: np.dtype
    _queues: dict[int, tuple[Queue, Queue]] = field(default_factory=dict)
    _count: int = 0

    def _queues_of(self, vec: Core) -> tuple[Queue, Queue]:
        if vec.index not in self._queues:
            self._queues[vec.index] = (
                vec.ub.queue("act_in", CHUNK_BYTES, 2),
                vec.ub.queue("act_out", CHUNK_BYTES, 2),
            )
        return self._queues[vec.index]

    def run(
        self,
        cube: Core,
        acc: Tile,
        reads: Sequence[Tile],
        elements: int,
        dst: np.ndarray | None,
        pre_activation: Callable[..., np.ndarray],
    ) -> None:
        """FixPipe `acc` (through `pre_activation(acc, *reads)`, the block in GM layout) to a
        workspace, then the activation on a vector core into `dst` (functional mode)."""
        isz = np.dtype(self.dtype).itemsize
        ws = workspace_tile(f"{WORKSPACE}{self._count}")
        cycles = cube.dma_out_cycles(
            Pipe.FIXP, elements * isz, cube.machine.l0c_to_gm_bytes_per_cycle
        )
        cube.issue(Pipe.FIXP, cycles, (acc, *reads), (ws,), "fixpipe -> workspace")
        block: np.ndarray | None = None
        out: np.ndarray | None = None
        if cube.functional and dst is not None:
            block = pre_activation(acc.data, *(t.data for t in reads)).reshape(-1)
            out = np.empty_like(block)
        vec = self.vecs[self._count % len(self.vecs)]
        self._count += 1
        q_in, q_out = self._queues_of(vec)
        ops = VECTOR_OPS[self.activation.name]
        step = chunk_elements(self.dtype)
        for e0 in range(0, elements, step):
            n = min(step, elements - e0)
            t_in = q_in.alloc()
            vec.issue(
                Pipe.MTE2, vec.dma_in_cycles(n * isz, to_l1=False), (ws,), (t_in,),
                "in workspace",
            )  # fmt: skip
            vec.moved["gm_read"] += n * isz
            vec.moved["ub"] += n * isz
            vec.gm_reads[WORKSPACE] = vec.gm_reads.get(WORKSPACE, 0) + n * isz
            if block is not None:
                t_in.data = block[e0 : e0 + n]
            t_out = q_out.alloc()
            vec.vector(ops, self.dtype, n, (t_in,), (t_out,), self._activate)
            vec.copy_out(t_out, n * isz, None if out is None else out[e0 : e0 + n], label="out y")
        if dst is not None and out is not None:
            dst[...] = out.reshape(dst.shape)

    def _activate(self, x: np.ndarray) -> np.ndarray:
        return apply(self.activation, x.astype(np.float32)).astype(self.dtype)


def _chunks(elements: int, step: int) -> list[tuple[int, int]]:
    """(size, count) of a block's chunks."""
    full, tail = divmod(elements, step)
    return [(step, full), (tail, 1 if tail else 0)]


def block_cycles(
    machine: Machine, activation: Activation, dtype: np.dtype, elements: int
) -> tuple[float, float]:
    """(one block's vector-core time with its chunks pipelined, its slowest chunk stage)."""
    isz = np.dtype(dtype).itemsize
    ops = VECTOR_OPS[activation.name]
    stages: list[tuple[float, float, float, int]] = []
    for n, count in _chunks(elements, chunk_elements(dtype)):
        if count == 0:
            continue
        t_in = machine.copy_in_transfer(False) + n * isz / machine.read_bytes_per_cycle
        t_vec = sum(k * n + b for k, b in (machine.vector_cost(op, dtype) for op in ops))
        t_out = machine.copy_out_transfer_cycles + n * isz / machine.write_bytes_per_cycle
        stages.append((t_in, t_vec, t_out, count))
    first = stages[0]
    slowest = max(max(s[:3]) for s in stages)
    total = sum(first[:3]) + sum(max(s[:3]) * s[3] for s in stages) - max(first[:3])
    return total, slowest


def epilogue_cycles(
    machine: Machine,
    activation: Activation,
    dtype: np.dtype,
    elements: int,
    blocks: int,
    vec_cores: int,
    vec_active: int,
    cube_heads: float,
    cube_stream: float,
) -> float:
    """When the last vector core finishes, given the cube core's DMA heads and its stream of
    `blocks` blocks of `elements` each (`cube_stream` cycles), handed in turn to its
    `vec_cores` vector cores (`vec_active` vector cores in the whole launch share the DMA
    head)."""
    vb, _ = block_cycles(machine, activation, dtype, elements)
    isz = np.dtype(dtype).itemsize
    heads = (
        machine.copy_in_head(min(elements, chunk_elements(dtype)) * isz, vec_active)
        + machine.copy_out_head_cycles
    )
    per_vec = math.ceil(blocks / max(1, vec_cores))
    cube_end = cube_heads + cube_stream
    first = cube_heads + cube_stream / max(1, blocks)
    # Either the vector cores keep up (the last block's epilogue trails the cube) or they set
    # the pace (the first block's arrival, then their own blocks back to back).
    trailing = cube_end + vb + (heads if per_vec <= 1 else 0.0)
    paced = first + heads + per_vec * vb
    return max(trailing, paced)
