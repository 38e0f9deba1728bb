"""Which core buffer a set of queues overflows: host tiling shrinks what fills that level."""

from __future__ import annotations

from collections.abc import Sequence

from ._budget import QueueSpec, capacity
from .npu.machine import Machine
from .npu.pipes import Level

LEVELS: tuple[Level, ...] = (Level.UB, Level.L1, Level.L0A, Level.L0B, Level.L0C)


def overflow(machine: Machine, specs: Sequence[QueueSpec]) -> Level | None:
    """The first level whose queues exceed its capacity, or None when everything fits (one
    pass over the queues: host tilings shrink in loops of these checks)."""
    used = dict.fromkeys(LEVELS, 0)
    for s in specs:
        if s.level in used:
            used[s.level] += s.reserved
    return next((lv for lv in LEVELS if used[lv] > capacity(machine, lv)), None)
