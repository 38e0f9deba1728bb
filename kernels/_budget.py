"""Buffer budgets: does a tiling's set of queues fit a core's buffers?

Kernels list the queues a tiling reserves (name, bytes per slot, depth) per memory level; the
same list is checked here up front (a `TilingError` naming the level and the queues) and then
reserved on the core (where overrunning raises `CapacityError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .api import TilingError
from .npu.machine import Machine
from .npu.memory import align
from .npu.pipes import Level


@dataclass(frozen=True)
class QueueSpec:
    """One queue a tiling needs: `depth` slots of `slot_bytes` in `level`."""

    level: Level
    name: str
    slot_bytes: int
    depth: int = 1

    @property
    def reserved(self) -> int:
        """Bytes the queue reserves, aligned as the core aligns them."""
        return align(self.slot_bytes) * self.depth


#: The machine's field holding each buffer level's bytes per core.
_CAPACITY_FIELD = {
    Level.UB: "ub_bytes",
    Level.L1: "l1_bytes",
    Level.L0A: "l0a_bytes",
    Level.L0B: "l0b_bytes",
    Level.L0C: "l0c_bytes",
}


def capacity(machine: Machine, level: Level) -> int:
    """Bytes of `level` on one core of `machine`."""
    return int(getattr(machine, _CAPACITY_FIELD[level]))


def require_fits(op: str, machine: Machine, specs: Sequence[QueueSpec]) -> None:
    """Raise `TilingError` if the queues of some level exceed its capacity."""
    for level in (Level.UB, Level.L1, Level.L0A, Level.L0B, Level.L0C):
        mine = [s for s in specs if s.level is level]
        used = sum(s.reserved for s in mine)
        cap = capacity(machine, level)
        if used > cap:
            parts = ", ".join(f"{s.name} {s.depth}x{align(s.slot_bytes)}" for s in mine)
            raise TilingError(
                f"{op}: tiling needs {used} bytes of {level.value.upper()} but a core has {cap} "
                f"({parts})"
            )


def fits(machine: Machine, specs: Sequence[QueueSpec]) -> bool:
    """True when every level's queues fit (for filtering a tiling space). One pass over the
    queues: spaces check hundreds of thousands of tilings per model."""
    used: dict[Level, int] = {}
    for s in specs:
        used[s.level] = used.get(s.level, 0) + s.reserved
    return all(u <= capacity(machine, lv) for lv, u in used.items() if lv in _CAPACITY_FIELD)


def check_positive(op: str, **fields: int) -> None:
    """Raise `TilingError` for a tiling field that is not a positive int."""
    for name, value in fields.items():
        if value <= 0:
            raise TilingError(f"{op}: tiling field '{name}' must be positive, got {value}")


def check_flag(op: str, **fields: int) -> None:
    """Raise `TilingError` for a 0/1 tiling field with another value."""
    for name, value in fields.items():
        if value not in (0, 1):
            raise TilingError(f"{op}: tiling field '{name}' must be 0 or 1, got {value}")
