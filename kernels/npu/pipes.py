"""The pipes of an AI core and the memory levels they move data between.

Pipes run in parallel; each executes its own instructions in program order.
"""

from __future__ import annotations

from enum import StrEnum


class Pipe(StrEnum):
    """An in-order instruction queue of a core (names as in Ascend C)."""

    MTE2 = "MTE2"  # copy-in: GM -> UB / L1
    MTE1 = "MTE1"  # L1 -> L0A / L0B (img2col on the way for convolutions)
    CUBE = "CUBE"  # matrix multiply L0A x L0B -> L0C
    FIXP = "FIXP"  # FixPipe: L0C -> GM with a per-channel epilogue (scale, bias, relu, cast)
    VECTOR = "VECTOR"  # elementwise and reductions on UB
    MTE3 = "MTE3"  # copy-out: UB -> GM
    SCALAR = "SCALAR"  # scalar unit: address and parameter arithmetic


class Level(StrEnum):
    """A memory level; every level except GM belongs to one core."""

    GM = "gm"
    UB = "ub"
    L1 = "l1"
    L0A = "l0a"
    L0B = "l0b"
    L0C = "l0c"


#: Pipes whose busy time counts as GM traffic when deciding memory- vs compute-bound.
GM_PIPES: tuple[Pipe, ...] = (Pipe.MTE2, Pipe.MTE3, Pipe.FIXP)
#: Pipes that do arithmetic.
COMPUTE_PIPES: tuple[Pipe, ...] = (Pipe.CUBE, Pipe.VECTOR, Pipe.SCALAR)
