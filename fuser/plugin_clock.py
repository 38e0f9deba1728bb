"""Where the onnxruntime plugin's time goes: seconds per kind of work, summed over the process.

Validation asks this before and after each step (`fuser.validation`), so a step's time splits
into the fused ops' own work and the rest (onnxruntime, the float64 bridge, gathering inputs):

- `REFERENCE`: numpy `reference` implementations (`--kernel reference`);
- `SEARCH`: run-time tiling search, for nodes without stored `tile_*` attributes (`--kernel npu`);
- `ARITHMETIC`: the NPU programs' tile arithmetic (numpy on the tiles, `kernels.npu.clock`);
- `SIMULATE`: the rest of a kernel run, the simulator scheduling the program's instructions.

Threads (one per rank) add to the same totals: they are measurements, not results.
"""

from __future__ import annotations

from collections.abc import Mapping

REFERENCE = "reference"
SEARCH = "tiling search"
ARITHMETIC = "tile arithmetic"
SIMULATE = "simulate"
KINDS: tuple[str, ...] = (REFERENCE, SEARCH, ARITHMETIC, SIMULATE)

_SPENT: dict[str, float] = dict.fromkeys(KINDS, 0.0)


def add(kind: str, seconds: float) -> None:
    """Count `seconds` of work of `kind` (one of `KINDS`)."""
    _SPENT[kind] += seconds


def snapshot() -> dict[str, float]:
    """The totals so far, per kind."""
    return dict(_SPENT)


def since(before: Mapping[str, float]) -> dict[str, float]:
    """Seconds per kind spent after `before` (a `snapshot`), kinds with none left out."""
    return {k: v - before.get(k, 0.0) for k, v in _SPENT.items() if v > before.get(k, 0.0)}
