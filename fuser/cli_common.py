"""What every `fuser` command shares: consoles, input resolution, errors, JSON and argument parsing.

Commands live in their own modules (`cli_<command>.py`) and use only the public names here, so
a command is read in one file and the rules it follows (one-line errors, exit 2) in this one.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from .errors import UsageError

# Piped or redirected output is read in files and CI logs, not an 80-column terminal: give rich
# room so tables of long node names do not wrap into unreadable columns.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

EXAMPLE_PREFIX = "example:"


def resolve_input(spec: str) -> tuple[Any, str]:
    """A path, or `example:NAME` for a built-in model from fuser.models; and its label."""
    if spec.startswith(EXAMPLE_PREFIX):
        models = importlib.import_module("fuser.models")
        name = spec[len(EXAMPLE_PREFIX) :]
        try:
            return models.get_example(name), spec
        except KeyError as exc:
            raise UsageError(str(exc.args[0]) if exc.args else f"unknown example '{name}'") from exc
    return spec, spec


def split_names(names: str | None) -> list[str] | None:
    """`a,b , c` as a list of names; None stays None (meaning: the default set)."""
    if names is None:
        return None
    return [n.strip() for n in names.split(",") if n.strip()]


def print_json(data: Any) -> None:
    """Write `data` as indented JSON on stdout."""
    # Plain json: reports of large models have thousands of entries, and rich's highlighter
    # takes longer to print them than fuser takes to make them.
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one error line on stderr; the caller raises the returned Exit."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def same_file(a: str, b: Path) -> bool:
    """Whether path `a` and `b` name the same file (False if either cannot be resolved)."""
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


def parse_inputs(specs: list[str]) -> dict[str, Any]:
    """`--input name=file.npy` options as a feed dict."""
    import numpy as np

    feeds: dict[str, Any] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--input '{spec}': expected name=file.npy")
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--input {name}: cannot read '{path}' as .npy ({exc})") from exc
    return feeds


def parse_dims(specs: list[str]) -> dict[str, int]:
    """`--dim NAME=SIZE` options as a mapping of symbolic dim names to sizes."""
    dims: dict[str, int] = {}
    for spec in specs:
        name, sep, size = spec.partition("=")
        if not sep or not name or not size.strip().lstrip("-").isdigit():
            raise UsageError(f"--dim '{spec}': expected NAME=SIZE with an integer size")
        dims[name.strip()] = int(size)
    return dims
