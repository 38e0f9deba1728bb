"""The fusion families fuser knows: discovered from the `fuser.patterns` package.

Adding a family is adding one module there that defines `PATTERN` (and optionally `PRIORITY`,
lower runs first). The engine knows no pattern by name; this module only collects them.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable, Sequence
from functools import cache

from . import fusedop
from .errors import UsageError
from .pattern import Pattern


@cache
def _discover() -> tuple[tuple[int, str, Pattern], ...]:
    package = importlib.import_module("fuser.patterns")
    found: list[tuple[int, str, Pattern]] = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"fuser.patterns.{info.name}")
        pattern = getattr(module, "PATTERN", None)
        if pattern is None:
            continue
        for op in pattern.ops:
            fusedop.register(op)
        found.append((getattr(module, "PRIORITY", 100), pattern.name, pattern))
    return tuple(sorted(found, key=lambda item: (item[0], item[1])))


def all_patterns() -> list[Pattern]:
    """Every registered pattern, in the order the engine applies them."""
    return [pattern for _, _, pattern in _discover()]


def ensure_fused_ops_registered() -> None:
    """Register every fused op's schema with onnx.defs (idempotent)."""
    _discover()


def select(patterns: Sequence[str] | None = None, disable: Iterable[str] = ()) -> list[Pattern]:
    """The patterns to run: `patterns` (all if None) minus `disable`; unknown names are errors."""
    known = {p.name: p for p in all_patterns()}
    wanted = list(known) if patterns is None else list(patterns)
    disabled = list(disable)
    for name in [*wanted, *disabled]:
        if name not in known:
            raise UsageError(f"unknown pattern '{name}'; known patterns: {', '.join(known)}")
    return [known[name] for name in known if name in wanted and name not in disabled]
