"""What every `fuser` command shares: consoles, input resolution, errors, JSON and argument parsing.

Commands live in their own modules (`cli_<command>.py`) and use only the public names here, so
a command is read in one file and the rules it follows (one-line errors, exit 2) in this one.
"""

from __future__ import annotations

import copy
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from .errors import UsageError
from .report import envelope

# rich takes the width from COLUMNS, else the terminal's, else 80 when piped; piped output is
# plain text (no colour, no markup codes) unless FORCE_COLOR asks for it.
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

EXAMPLE_PREFIX = "example:"


def resolve_input(spec: str) -> tuple[Any, str]:
    """A path, or `example:NAME` for a built-in model from fuser.models; and its label."""
    if spec.startswith(EXAMPLE_PREFIX):
        models = importlib.import_module("fuser.models")
        return models.get_example(spec[len(EXAMPLE_PREFIX) :]), spec  # UsageError if unknown
    return spec, spec


def split_names(names: str | None) -> list[str] | None:
    """`a,b , c` as a list of names; None stays None (meaning: the default set)."""
    if names is None:
        return None
    return [n.strip() for n in names.split(",") if n.strip()]


def command_json(command: str, input: str, target: str | None, data: dict[str, Any]) -> dict:
    """`data` under the envelope every command's JSON starts with (docs/json.md)."""
    return envelope(command, input, target) | data


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


# The shape flags, one definition for every command that needs sizes for symbolic dims.
DimOption = Annotated[
    list[str] | None,
    typer.Option("--dim", help="NAME=SIZE for a symbolic dim (its dim_param), repeatable"),
]
DimSizeOption = Annotated[
    int, typer.Option("--dim-size", help="size of the symbolic dims not given by --dim")
]


class PlainTable(Table):
    """A rich Table whose string cells are plain text: a node named `[b]` is not markup."""

    def add_row(self, *cells: Any, **kwargs: Any) -> None:
        super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **kwargs)


def table(*columns: str, numeric: tuple[str, ...] = ()) -> PlainTable:
    """A table that fits the console: text columns fold (a node name too long for its cell goes
    on over the next lines, whole), `numeric` columns are right-aligned and never wrap."""
    t = PlainTable(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in columns:
        if name in numeric:
            t.add_column(name, justify="right", no_wrap=True)
        else:
            t.add_column(name, overflow="fold")
    return t


def print_table(title: str, t: Table, *, empty: str | None = None) -> None:
    """Print `title` on its own line (never split: the terminal wraps it, if anything) and `t`;
    a table without rows is not printed: `empty` (if given) says so instead."""
    if not t.row_count:
        if empty is not None:
            out.print(empty, soft_wrap=True)
        return
    out.print(f"[bold]{escape(title)}[/bold]", soft_wrap=True)
    out.print(t)


def print_items(
    title: str, items: Sequence[Sequence[tuple[str, str | Sequence[str]]]], empty: str
) -> None:
    """Print `title` and each item as labelled lines (a list value one entry per line), or the
    `empty` line. For records whose text is long (node lists, reasons): in a table, at 80
    columns each such column would get a sliver and cut every name."""
    if not items:
        out.print(empty, soft_wrap=True)
        return
    out.print(f"[bold]{escape(title)}[/bold]", soft_wrap=True)
    for item in items:
        grid = PlainTable.grid(padding=(0, 2))
        grid.add_column(justify="right", no_wrap=True, style="dim")
        grid.add_column(overflow="fold")
        for label, value in item:
            if value:
                grid.add_row(label, value if isinstance(value, str) else "\n".join(value))
        out.print(grid)
        out.print()


def escape(text: str) -> str:
    """`text` safe to print through rich (a node named `[b]` stays `[b]`)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


class ReadableGroup(TyperGroup):
    """The app's command group, with `--help` metavars a user reads (`--target TARGET`, a bare
    `--json`), not typer's type names (`<str>`, `<bool>`, `<list[str]>`)."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        for command in (self, *self.commands.values()):
            help_option = command.get_help_option(typer.Context(command))
            for param in [*command.params, *([help_option] if help_option else [])]:
                if getattr(param, "metavar", None) is None:
                    param.metavar = _metavar(param)
                if param.param_type_name == "argument":
                    # typer prints an argument's Python type (`<str>`) beside its name, and
                    # has no setting for it: the help text says what the argument is. typer
                    # 0.29 asks the argument (`display_type_rich`), 0.28 its click type's
                    # metavar: a copy of the type, as click's types are shared singletons.
                    setattr(param, "display_type_rich", _no_type)  # noqa: B010 (a method: mypy)
                    if getattr(param, "type", None) is not None:
                        param.type = copy.copy(param.type)
                        setattr(param.type, "get_metavar", _no_metavar)  # noqa: B010


def _no_type(ctx: Any) -> None:
    return None


def _no_metavar(param: Any, ctx: Any = None) -> str:
    return ""


def _metavar(param: Any) -> str:
    if getattr(param, "is_flag", False):
        return ""
    # typer 0.29 knows a path parameter by its annotation, 0.28 by its click type
    if getattr(getattr(param, "type_descriptor", None), "is_path", False):
        return "FILE"
    if getattr(getattr(param, "type", None), "name", None) == "path":
        return "FILE"
    return str(param.name or "value").upper()
