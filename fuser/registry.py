"""The fusion families fuser knows: discovered from the `fuser.patterns` package.

Adding a family is adding one module there that defines `PATTERN` (and optionally `PRIORITY`,
lower runs first). The engine knows no pattern by name; this module only collects them.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path

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


# -- the static manifest (`fuser/pattern_manifest.py`) ------------------------------------------

MANIFEST_PATH = Path(__file__).with_name("pattern_manifest.py")
LINE_LENGTH = 100  # ruff's, in pyproject.toml


def manifest_rows() -> list[dict[str, str | list[str]]]:
    """What `fuser patterns` lists, from the live registry: name, fused ops, what it matches."""
    return [
        {"name": p.name, "ops": [op.name for op in p.ops], "description": p.description}
        for p in all_patterns()
    ]


def example_names() -> list[str]:
    """The built-in examples `fuse example:NAME` accepts, from fuser.models."""
    models = importlib.import_module("fuser.models")
    return list(models.EXAMPLES)


def render_manifest() -> str:
    """The source of `fuser/pattern_manifest.py` for the live registry and examples (laid out
    as `ruff format` would, so the generated file passes the format check as it is)."""
    lines = [
        '"""What `fuser patterns` prints, as data: listing the patterns imports neither onnx nor',
        "numpy nor the kernels (importing the real registry takes most of a second).",
        "",
        "Generated from the registry by `python -m fuser.registry --write-manifest`;",
        "tests/unit/test_pattern_manifest.py fails when it no longer equals the registry.",
        '"""',
        "",
        "PATTERNS: list[dict[str, str | list[str]]] = [",
    ]
    for row in manifest_rows():
        ops = ", ".join(json.dumps(op) for op in row["ops"])
        lines += [
            "    {",
            f'        "name": {json.dumps(row["name"])},',
            f'        "ops": [{ops}],',
        ]
        text = json.dumps(row["description"])
        if len(f'        "description": {text},') <= LINE_LENGTH:
            lines.append(f'        "description": {text},')
        elif len(f"            {text}") <= LINE_LENGTH:
            lines += ['        "description": (', f"            {text}", "        ),"]
        else:
            chunks = _chunks(str(row["description"]), 80)
            lines.append('        "description": (')
            lines += [f"            {json.dumps(c)}" for c in chunks]
            lines.append("        ),")
        lines.append("    },")
    lines += ["]", "", "EXAMPLES: list[str] = ["]
    lines += [f"    {json.dumps(name)}," for name in example_names()]
    lines.append("]")
    return "\n".join(lines) + "\n"


def _chunks(text: str, width: int) -> list[str]:
    """`text` cut after spaces into pieces of at most about `width` characters."""
    chunks: list[str] = []
    current = ""
    for word in text.split(" "):
        piece = word if not current else " " + word
        if current and len(current) + len(piece) > width:
            chunks.append(current + " ")
            current = word
        else:
            current += piece
    return [*chunks, current]


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write-manifest"]:
        sys.exit("usage: python -m fuser.registry --write-manifest")
    MANIFEST_PATH.write_text(render_manifest())
    print(f"wrote {MANIFEST_PATH}")
