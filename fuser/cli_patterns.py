"""`fuser patterns`: the registered fusion patterns, their fused ops and the built-in examples.

Listed from the static manifest (`fuser.pattern_manifest`, checked against the real registry
by a test), so the command starts without importing onnx, numpy or any kernel.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .cli_common import out, print_json


def register(app: typer.Typer) -> None:
    """Add the `patterns` command to `app`."""
    app.command("patterns")(list_patterns)


def run_fast(args: list[str]) -> bool:
    """Run `patterns [--json]` without typer's argument parsing, if that is what `args` asks;
    whether it did. typer (0.29) coerces every option through a pydantic TypeAdapter, and
    importing pydantic costs more than the whole listing; anything else (`--help`, a typo)
    goes through typer as usual."""
    if not args or args[0] != "patterns" or not set(args[1:]) <= {"--json"}:
        return False
    list_patterns(as_json="--json" in args[1:])
    return True


def list_patterns(
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """The registered fusion patterns and the fused ops they emit."""
    from .pattern_manifest import EXAMPLES, PATTERNS

    if as_json:
        print_json(PATTERNS)
        return
    from rich.table import Table

    table = Table(title="patterns", title_justify="left")
    table.add_column("pattern")
    table.add_column("fused ops")
    table.add_column("matches")
    for row in PATTERNS:
        table.add_row(str(row["name"]), ", ".join(row["ops"]), str(row["description"]))
    out.print(table)
    out.print("examples: " + ", ".join(f"example:{n}" for n in EXAMPLES))
