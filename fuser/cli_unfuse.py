"""`fuser unfuse FUSED -o OUTPUT`: replace every fused node by its function body (plain ONNX)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .cli_common import command_json, fail, out, print_json, resolve_input, same_file
from .errors import FuserError, UsageError


def register(app: typer.Typer) -> None:
    """Add the `unfuse` command to `app`."""
    app.command()(unfuse)


def unfuse(
    input: Annotated[str, typer.Argument(help="fused ONNX file (or example:NAME)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="where to write the plain model")],
    as_json: Annotated[bool, typer.Option("--json", help="print what was inlined as JSON")] = False,
) -> None:
    """Write FUSED as plain ONNX: each fused node replaced by the original ops (its body)."""
    from .unfused import unfuse as run_unfuse

    try:
        source, label = resolve_input(input)
        if isinstance(source, str) and same_file(source, output):
            raise UsageError(f"{output}: output would overwrite the input; choose another path")
        result = run_unfuse(source)
        written = result.save(output)
    except FuserError as exc:
        raise fail(str(exc)) from None
    if as_json:
        data = {"inlined": result.inlined, "written": [str(p) for p in written]}
        print_json(command_json("unfuse", label, None, data) | {"output": str(output)})
        return
    total = sum(result.inlined.values())
    detail = ", ".join(f"{op} x{n}" for op, n in result.inlined.items()) or "nothing to inline"
    out.print(f"{label}: unfused {total} fused nodes ({detail})", highlight=False, soft_wrap=True)
    out.print(f"wrote {', '.join(str(p) for p in written)}", highlight=False, soft_wrap=True)
