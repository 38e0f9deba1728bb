"""One output block's K walk on the Cube: the pipeline MatMul, Gemm and the fused Cube kernels
(LayerNormMatMul, RmsNormMatMul) share.

Per `tile_k` chunk of K the caller's `a_panel` and `b_panel` put the chunk's operands in L1
(from GM, from a GM/L2 workspace, or a block already resident in L1), then per `tile_k0` step
MTE1 loads L0A and L0B and the Cube accumulates in L0C (float32). How much of that overlaps is
set by the depths of the queues the caller passes (one depth per level: L1 panels, L0A/B, L0C),
so a fused kernel gets the per-level double buffering of MatMul by asking for the same queues.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import numpy as np

from ..npu.core import Core
from ..npu.memory import Queue, Tile

#: `a_panel(k0, k1)`: the L1 tile holding A[:, k0:k1] and the K index its column 0 stands for
#: (k0 for a panel, 0 for a whole resident block).
APanel = Callable[[int, int], tuple[Tile, int]]
#: `b_panel(k0, k1)`: the L1 tile holding B[k0:k1, :].
BPanel = Callable[[int, int], Tile]


class L0Queues(NamedTuple):
    """The L0 queues of a block: L0A and L0B steps, the L0C accumulator."""

    a: Queue
    b: Queue
    acc: Queue


def k_walk(
    core: Core,
    q: L0Queues,
    rows: int,
    cols: int,
    k: int,
    tk: int,
    tk0: int,
    dtype: np.dtype,
    a_panel: APanel,
    b_panel: BPanel,
    b_first: bool = False,
    acc: Tile | None = None,
    init: bool = True,
) -> Tile:
    """Accumulate A[rows, k] @ B[k, cols] into L0C and return the accumulator (the caller's
    FixPipe writes it out): a fresh tile, or `acc` (a K split over several walks: `init`
    False adds to what it holds). `b_first` issues each chunk's B copy before A's (a fused
    kernel whose A waits on the vector cores lets its first W copy run meanwhile)."""
    isz = dtype.itemsize
    if acc is None:
        acc = q.acc.alloc()
    for k0 in range(0, k, tk):
        k1 = min(k0 + tk, k)
        if b_first:
            bp = b_panel(k0, k1)
            ap, base = a_panel(k0, k1)
        else:
            ap, base = a_panel(k0, k1)
            bp = b_panel(k0, k1)
        for s0 in range(k0, k1, tk0):
            s1 = min(s0 + tk0, k1)
            a = q.a.alloc()
            core.load_l0(a, ap, rows * (s1 - s0) * isz, partial(cols_of, s0 - base, s1 - base))
            b = q.b.alloc()
            core.load_l0(b, bp, (s1 - s0) * cols * isz, partial(rows_of, s0 - k0, s1 - k0))
            core.mmad(acc, a, b, rows, s1 - s0, cols, dtype, init=init and s0 == 0)
    return acc


def cols_of(s0: int, s1: int, panel: np.ndarray) -> np.ndarray:
    """Columns s0..s1 of an A panel (the L0A step)."""
    return panel[:, s0:s1]


def rows_of(s0: int, s1: int, panel: np.ndarray) -> np.ndarray:
    """Rows s0..s1 of a B panel (the L0B step)."""
    return panel[s0:s1]
