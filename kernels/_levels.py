"""Which core buffer a set of queues overflows: host tiling shrinks what fills that level."""

from __future__ import annotations

from collections.abc import Sequence

from ._budget import QueueSpec, capacity
from .npu.machine import Machine
from .npu.pipes import Level

LEVELS: tuple[Level, ...] = (Level.UB, Level.L1, Level.L0A, Level.L0B, Level.L0C)


def overflow(machine: Machine, specs: Sequence[QueueSpec]) -> Level | None:
    """The first level whose queues exceed its capacity, or None when everything fits."""
    for level in LEVELS:
        if sum(s.reserved for s in specs if s.level is level) > capacity(machine, level):
            return level
    return None
