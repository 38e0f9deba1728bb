"""Buffer budgets: does a tiling's set of queues fit a core's buffers?

Kernels list the queues a tiling reserves (name, bytes per slot, depth) per memory level; the
same list is checked here up front (a `TilingError` naming the level and the queues) and then
reserved on the core (where overrunning raises `CapacityError`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

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
        return int(reserved_bytes(self.slot_bytes, self.depth))


def reserved_bytes(slot_bytes: Any, depth: Any) -> Any:
    """Bytes `depth` slots of `slot_bytes` reserve, aligned as the core aligns them (ints, or
    numpy columns: one entry per tiling of a space)."""
    return align(slot_bytes) * depth


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
    """True when every level's queues fit (for filtering a tiling space): `fits_each` of one
    tiling."""
    return bool(fits_each(machine, [(s.level, s.slot_bytes, s.depth) for s in specs]))


def fits_each(machine: Machine, queues: Iterable[tuple[Level, Any, Any]]) -> Any:
    """Whether every level's queues fit, from (level, slot bytes, depth) per queue: ints for
    one tiling (a bool), or numpy columns for a whole space (a bool column, one pass of numpy
    instead of one Python call per tiling)."""
    used: dict[Level, Any] = {}
    for level, slot, depth in queues:
        used[level] = used.get(level, 0) + reserved_bytes(slot, depth)
    ok: Any = True
    for level, u in used.items():
        if level in _CAPACITY_FIELD:
            ok = ok & (u <= capacity(machine, level))
    return ok


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
