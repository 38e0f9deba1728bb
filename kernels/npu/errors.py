"""Errors raised by the simulated NPU.

Each carries a one-line message a user can act on: what was asked, what was available, and
where (file and key for a target file, buffer name for a capacity error).
"""

from __future__ import annotations


class NpuError(Exception):
    """Base class of every error the simulated NPU raises."""


class TargetError(NpuError):
    """A target file is missing, unreadable or malformed (the message names file and key)."""


class CapacityError(NpuError):
    """An allocation asked for more bytes than a core buffer has free, as on hardware."""

    def __init__(self, level: str, name: str, asked: int, free: int, capacity: int) -> None:
        self.level = level
        self.name = name
        self.asked = asked
        self.free = free
        self.capacity = capacity
        super().__init__(
            f"{level}: '{name}' asks {asked} bytes but only {free} of {capacity} are free"
        )
