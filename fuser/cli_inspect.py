"""`fuser inspect INPUT`: every match and every near-miss, with its reason and nodes."""

from __future__ import annotations

from typing import Annotated

import typer

from .cli_common import (
    DimOption,
    command_json,
    fail,
    parse_dims,
    print_items,
    print_json,
    resolve_input,
    split_names,
)
from .errors import FuserError


def register(app: typer.Typer) -> None:
    """Add the `inspect` command to `app`."""
    app.command()(inspect)


def inspect(
    input: Annotated[str, typer.Argument(help="ONNX file, or example:NAME")],
    patterns: Annotated[
        str | None, typer.Option(help="comma-separated patterns (default all)")
    ] = None,
    target: Annotated[str, typer.Option(help="NPU target whose cost model decides")] = "ascend910b",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    dim: DimOption = None,
) -> None:
    """List every match and every near-miss, with its reason and nodes."""
    from .api import inspect as run_inspect

    try:
        source, label = resolve_input(input)
        dims = parse_dims(dim or [])  # the cost model's sizes for named symbolic dims
        found = run_inspect(source, split_names(patterns), target=target, dims=dims)
    except FuserError as exc:
        raise fail(str(exc)) from None
    if as_json:
        print_json(command_json("inspect", label, target, found.to_dict()))
        return
    matches = [
        [("pattern", m.pattern), ("fused op", m.op), ("nodes", list(m.replaced)),
         ("graph", m.graph), ("notes", list(m.notes))]
        for m in found.matches
    ]  # fmt: skip
    print_items(f"matches in {label}", matches, empty=f"no matches in {label}")
    misses = [
        [("pattern", r.pattern), ("nodes", list(r.nodes)), ("graph", r.graph),
         ("reason", r.reason)]
        for r in found.near_misses
    ]  # fmt: skip
    print_items("near-misses", misses, empty="no near-misses")
