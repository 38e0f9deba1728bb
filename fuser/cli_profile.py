"""`fuser profile MODEL`: the whole model on the simulated NPU, per node and in total.

    fuser profile model.onnx --dim batch=1 --dim seq=128 --trace trace.json
    fuser profile example:resnet --json

Registered on the main app by `fuser.cli`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .cli_common import fail, out, parse_dims, print_json, resolve_input
from .errors import FuserError


def register(app: typer.Typer) -> None:
    """Add the `profile` command to `app`."""
    app.command("profile")(profile)


def profile(
    model: Annotated[str, typer.Argument(help="ONNX file (original or fused), or example:NAME")],
    target: Annotated[str, typer.Option(help="NPU target name or target JSON file")] = "ascend910b",
    trace: Annotated[
        Path | None, typer.Option(help="write a Chrome trace (Perfetto) of the whole model here")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the profile as JSON")] = False,
    dim: Annotated[
        list[str] | None, typer.Option("--dim", help="NAME=SIZE for a symbolic dim, repeatable")
    ] = None,
    dim_size: Annotated[int, typer.Option(help="size of symbolic dims not given by --dim")] = 1,
    tuned: Annotated[
        bool,
        typer.Option(
            "--tuned", help="unfused ops with a cost model get the tiling search's pick too"
        ),
    ] = False,
) -> None:
    """Run MODEL on the simulated NPU (timing only): cycles, GM bytes and bound per node."""
    from .profile import profile_model

    try:
        source, label = resolve_input(model)
        result = profile_model(
            source,
            target,
            dims=parse_dims(dim or []),
            dim_size=dim_size,
            timeline=bool(trace),
            tuned=tuned,
        )
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
            from .modelio import atomic_write  # onnx only when writing

            atomic_write(trace, json.dumps(result.to_chrome_trace()).encode())
    except FuserError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"{trace}: cannot write the trace ({exc.strerror or exc})") from None
    if as_json:
        print_json(result.to_dict())
        return
    total = result.total_cycles or 1.0
    table = Table(
        title=f"{label} on {result.target} (simulated, timing only)", title_justify="left"
    )
    table.add_column("node", overflow="fold")
    table.add_column("op", no_wrap=True)
    for column in ("cycles", "us", "share", "GM bytes"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("bound", no_wrap=True)
    table.add_column("est.", no_wrap=True)
    for n in result.nodes:
        table.add_row(
            n.name,
            n.op,
            f"{n.cycles:,.0f}",
            f"{n.stats.us:.2f}",
            f"{100 * n.cycles / total:.1f}%",
            f"{n.gm_bytes:,}",
            n.stats.bound,
            "yes" if n.estimated else "",
        )
    out.print(table)
    estimated = 100 * result.estimated_cycles / total
    out.print(
        f"total: {result.total_cycles:,.0f} cycles = {result.total_us:.2f} us on {result.target}; "
        f"GM read {result.gm_read_bytes:,} B, write {result.gm_write_bytes:,} B; "
        f"{result.launches} launches; {estimated:.1f}% of the time estimated (no kernel)"
    )
    if tuned:
        out.print("tilings: the search's pick for every op with a cost model (--tuned)")
    if result.dims:
        out.print("dims: " + ", ".join(f"{k}={v}" for k, v in result.dims.items()))
    if trace is not None:
        out.print(f"wrote {trace}")
