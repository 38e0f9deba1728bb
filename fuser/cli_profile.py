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
from rich.text import Text

from .cli_common import (
    DimOption,
    DimSizeOption,
    command_json,
    fail,
    out,
    parse_dims,
    print_json,
    print_table,
    resolve_input,
    table,
)
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
    dim: DimOption = None,
    dim_size: DimSizeOption = 1,
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
        print_json(command_json("profile", label, result.target, result.to_dict()))
        return
    total = result.total_cycles or 1.0
    # Below ~110 columns the op goes under the node's name and the per-node time in us (the
    # cycles over the clock) is left to the total, so that names keep room for themselves.
    wide = out.width >= 110
    numeric = ("cycles", "us", "share", "GM bytes") if wide else ("cycles", "share", "GM bytes")
    columns = ("node", "op", *numeric) if wide else ("node", *numeric)
    nodes = table(*columns, "bound", "est.", numeric=numeric)
    for n in result.nodes:
        name = Text(n.name) if wide else Text.assemble(n.name, "\n", (n.op, "dim"))
        cells = [f"{n.cycles:,.0f}", f"{n.stats.us:.2f}", f"{100 * n.cycles / total:.1f}%"]
        nodes.add_row(
            name,
            *([n.op] if wide else []),
            *(cells if wide else [cells[0], cells[2]]),
            f"{n.gm_bytes:,}",
            n.stats.bound,
            "yes" if n.estimated else "",
        )
    print_table(f"{label} on {result.target} (simulated, timing only)", nodes, empty="no nodes")
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
        out.print(f"wrote {trace}", soft_wrap=True)
