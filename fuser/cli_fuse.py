"""`fuser fuse INPUT -o OUTPUT`: fuse a model, print what was fused and why not, write it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from .cli_common import err, fail, out, print_json, resolve_input, same_file, split_names
from .cli_validate import print_validation
from .errors import FuserError, UsageError


def register(app: typer.Typer) -> None:
    """Add the `fuse` command to `app`."""
    app.command()(fuse)


def fuse(
    input: Annotated[str, typer.Argument(help="ONNX file, or example:NAME (see `fuser patterns`)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="where to write the fused model")],
    patterns: Annotated[
        str | None, typer.Option(help="comma-separated patterns to run (default all)")
    ] = None,
    disable: Annotated[str | None, typer.Option(help="comma-separated patterns to skip")] = None,
    target: Annotated[str, typer.Option(help="NPU target name or target JSON file")] = "ascend910b",
    report: Annotated[Path | None, typer.Option(help="write the JSON report here")] = None,
    validate: Annotated[
        bool, typer.Option("--validate", help="check the result in onnxruntime before writing")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="fuse even where the cost model predicts a slowdown")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    cache: Annotated[
        Path | None, typer.Option(help="tuning cache file (default: the user's cache)")
    ] = None,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="neither read nor write the tuning cache")
    ] = False,
    no_functions: Annotated[
        bool,
        typer.Option(
            "--no-functions",
            help="write the bare fused ops, without function bodies (then only fuser's "
            "plugin or an NPU backend runs the model)",
        ),
    ] = False,
) -> None:
    """Fuse a model: prints what was fused, what was not and why, and writes OUTPUT."""
    from .api import fuse as run_fuse
    from .api import validate as run_validate

    try:
        source, label = resolve_input(input)
        if isinstance(source, str) and same_file(source, output):
            raise UsageError(f"{output}: output would overwrite the input; choose another path")
        with (
            err.status(f"fusing {label}", spinner="dots")
            if err.is_terminal
            else contextlib.nullcontext()
        ):
            result = run_fuse(
                source,
                split_names(patterns),
                split_names(disable) or (),
                target,
                force=force,
                cache=False if no_cache else cache,
                functions=not no_functions,
            )
        validation = None
        if validate:
            validation = run_validate(source, result, target=target)
        if validation is not None and not validation.ok:
            print_validation(validation)
            raise fail(f"{label}: the fused model does not match the original; nothing written", 1)
        written = result.save(output)
        data: dict[str, Any] = {}
        if report is not None or as_json:  # only then: thousands of fusions take a while
            data = result.report.to_dict()
            if validation is not None:
                data["validation"] = validation.to_dict()
        if report is not None:
            report.parent.mkdir(parents=True, exist_ok=True)
            from .modelio import atomic_write  # onnx only when writing

            atomic_write(report, json.dumps(data, indent=2).encode())
    except FuserError as exc:
        raise fail(str(exc)) from None
    if as_json:
        print_json(data)
        return
    print_report(result.report, label)
    if validation is not None:
        print_validation(validation)
    out.print(f"wrote {', '.join(str(p) for p in written)}")


def print_report(report: Any, label: str) -> None:
    """Print the fusions per pattern, what was not fused and why, and the node counts."""
    table = Table(title=f"fusions in {label}", title_justify="left")
    table.add_column("pattern")
    table.add_column("fused", justify="right")
    table.add_column("predicted speedup", justify="right")
    for name, count in report.summary.items():
        speedups = [
            f.prediction.speedup for f in report.fusions if f.pattern == name and f.prediction
        ]
        shown = f"{min(speedups):.2f}x – {max(speedups):.2f}x" if speedups else "-"
        table.add_row(name, str(count), shown)
    out.print(table)
    if report.rejected:
        misses = Table(title="not fused", title_justify="left")
        misses.add_column("pattern")
        misses.add_column("nodes")
        misses.add_column("reason")
        for r in report.rejected:
            misses.add_row(
                r.pattern, ", ".join(r.nodes), (f"[{r.graph}] " if r.graph else "") + r.reason
            )
        out.print(misses)
    out.print(f"nodes: {report.nodes_before} -> {report.nodes_after}")
