"""Seconds the simulator spends on tile arithmetic, apart from scheduling instructions.

In functional mode every instruction also computes on its tiles' numpy arrays (a halo copy, an
img2col, the Cube's matmul, an epilogue). `ARITHMETIC.seconds` sums the time of that numpy work
over the process, so a benchmark can tell the cost of the numbers (what any kernel computing the
op pays) from the cost of simulating the program around them (`benchmarks/validate_bench.py`).
Threads running kernels at once (one per rank) share it: it is a measurement, not a result.
"""

from __future__ import annotations


class Stopwatch:
    """Accumulated seconds; `seconds` only grows."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0


#: Tile arithmetic of functional runs, every core and kernel of the process.
ARITHMETIC = Stopwatch()
