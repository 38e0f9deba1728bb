"""`fuser inspect INPUT`: every match and every near-miss, with its reason and nodes."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from .cli_common import fail, out, print_json, resolve_input, split_names
from .errors import FuserError


def register(app: typer.Typer) -> None:
    """Add the `inspect` command to `app`."""
    app.command()(inspect)


def inspect(
    input: Annotated[str, typer.Argument(help="ONNX file, or example:NAME")],
    patterns: Annotated[
        str | None, typer.Option(help="comma-separated patterns (default all)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """List every match and every near-miss, with its reason and nodes."""
    from .api import inspect as run_inspect

    try:
        source, label = resolve_input(input)
        found = run_inspect(source, split_names(patterns))
    except FuserError as exc:
        raise fail(str(exc)) from None
    if as_json:
        print_json(found.to_dict())
        return
    table = Table(title=f"matches in {label}", title_justify="left")
    table.add_column("pattern")
    table.add_column("fused op")
    table.add_column("nodes")
    table.add_column("notes")
    for m in found.matches:
        table.add_row(m.pattern, m.op, ", ".join(m.replaced), "; ".join(m.notes))
    out.print(table)
    misses = Table(title="near-misses", title_justify="left")
    misses.add_column("pattern")
    misses.add_column("nodes")
    misses.add_column("reason")
    for r in found.near_misses:
        misses.add_row(r.pattern, ", ".join(r.nodes), r.reason)
    out.print(misses)
