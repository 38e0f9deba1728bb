"""Per-core buffers with capacities, and the tiles (slots) and queues carved out of them.

A `Buffer` is one memory level of a core (UB, L1, L0A, L0B, L0C). Kernels reserve `Queue`s in
it up front, as Ascend C's `pipe.InitBuffer(queue, depth, bytes)` does; reserving past the
capacity raises `CapacityError`. A queue of depth 2 is double buffering: its producer writes
slot i+1 while the consumer still reads slot i, and a producer that comes back to a slot waits
until that slot's last reader has finished, so the overlap comes out of the schedule.
"""

from __future__ import annotations

import numpy as np

from .errors import CapacityError
from .pipes import Level

#: Buffers are allocated in 32-byte units (one UB block) on Ascend cores.
ALIGN_BYTES = 32


def align(nbytes: int) -> int:
    """Round `nbytes` up to the allocation unit."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class Tile:
    """One slot of a queue: capacity, current data (functional mode) and its timing state.

    `ready` is when the last write into the slot finished; `released` is when the last access
    of its current content finished (a new write must not start before).
    """

    __slots__ = ("data", "level", "name", "nbytes", "ready", "released")

    def __init__(self, name: str, level: Level, nbytes: int) -> None:
        self.name = name
        self.level = level
        self.nbytes = nbytes
        self.data: np.ndarray | None = None
        self.ready = 0.0
        self.released = 0.0

    def check_fits(self, nbytes: int) -> None:
        """Refuse to place `nbytes` in this slot when it is smaller (a tiling bug)."""
        if nbytes > self.nbytes:
            level = self.level.value.upper()
            raise CapacityError(level, self.name, nbytes, self.nbytes, self.nbytes)


class Queue:
    """`depth` equal slots used round robin; depth 2 is double buffering."""

    __slots__ = ("_next", "depth", "name", "slots")

    def __init__(self, name: str, level: Level, slot_bytes: int, depth: int) -> None:
        self.name = name
        self.depth = depth
        self.slots = tuple(Tile(f"{name}[{i}]", level, slot_bytes) for i in range(depth))
        self._next = 0

    def alloc(self) -> Tile:
        """The next slot; writing into it waits for its previous content to be released."""
        tile = self.slots[self._next]
        self._next = (self._next + 1) % self.depth
        return tile


class Buffer:
    """A memory level of one core with a fixed capacity in bytes."""

    __slots__ = ("capacity", "level", "queues", "used")

    def __init__(self, level: Level, capacity: int) -> None:
        self.level = level
        self.capacity = capacity
        self.used = 0
        self.queues: list[Queue] = []

    @property
    def free(self) -> int:
        """Bytes not yet reserved."""
        return self.capacity - self.used

    def queue(self, name: str, slot_bytes: int, depth: int = 1) -> Queue:
        """Reserve `depth` slots of `slot_bytes` (aligned); raises `CapacityError` if too big."""
        if slot_bytes <= 0 or depth <= 0:
            raise ValueError(f"queue '{name}' needs positive slot bytes and depth")
        asked = align(slot_bytes) * depth
        if asked > self.free:
            raise CapacityError(self.level.value.upper(), name, asked, self.free, self.capacity)
        self.used += asked
        q = Queue(name, self.level, align(slot_bytes), depth)
        self.queues.append(q)
        return q
