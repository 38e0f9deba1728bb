"""`fuser patterns`: the registered fusion patterns, their fused ops and the built-in examples."""

from __future__ import annotations

import importlib
from typing import Annotated

import typer
from rich.table import Table

from .cli_common import out, print_json


def register(app: typer.Typer) -> None:
    """Add the `patterns` command to `app`."""
    app.command("patterns")(list_patterns)


def list_patterns(
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """The registered fusion patterns and the fused ops they emit."""
    from .registry import all_patterns

    rows: list[dict[str, str | list[str]]] = [
        {"name": p.name, "ops": [op.name for op in p.ops], "description": p.description}
        for p in all_patterns()
    ]
    if as_json:
        print_json(rows)
        return
    table = Table(title="patterns", title_justify="left")
    table.add_column("pattern")
    table.add_column("fused ops")
    table.add_column("matches")
    for row in rows:
        table.add_row(str(row["name"]), ", ".join(row["ops"]), str(row["description"]))
    out.print(table)
    try:
        models = importlib.import_module("fuser.models")
        out.print("examples: " + ", ".join(f"example:{n}" for n in models.EXAMPLES))
    except (ImportError, AttributeError):
        pass
