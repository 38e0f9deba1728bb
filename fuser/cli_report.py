"""`fuser report MODEL [-o report.html]`: fuse MODEL and write a self-contained HTML report.

    fuser report model.onnx -o report.html --dim batch=1 --dim seq=128
    fuser report example:resnet

The page shows the summary per pattern, every fusion (the replaced subgraph and the fused node,
drawn), every near-miss with its reason, predicted and simulated speedups, and the simulated
timelines of the original and the fused model side by side. Nothing but the page is written
(`fuser fuse --html` writes the same page next to the fused model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from .cli_common import err, fail, out, parse_dims, resolve_input, same_file, split_names
from .errors import FuserError, UsageError


def register(app: typer.Typer) -> None:
    """Add the `report` command to `app`."""
    app.command("report")(report)


def report(
    model: Annotated[str, typer.Argument(help="ONNX file, or example:NAME")],
    output: Annotated[
        Path, typer.Option("-o", "--output", metavar="FILE", help="where to write the HTML page")
    ] = Path("report.html"),
    patterns: Annotated[
        str | None,
        typer.Option(metavar="NAMES", help="comma-separated patterns to run (default all)"),
    ] = None,
    disable: Annotated[
        str | None, typer.Option(metavar="NAMES", help="comma-separated patterns to skip")
    ] = None,
    target: Annotated[
        str, typer.Option(metavar="TARGET", help="NPU target name or target JSON file")
    ] = "ascend910b",
    force: Annotated[
        bool, typer.Option("--force", help="fuse even where the cost model predicts a slowdown")
    ] = False,
    dim: Annotated[
        list[str] | None,
        typer.Option("--dim", metavar="NAME=SIZE", help="size of a symbolic dim when simulating"),
    ] = None,
    dim_size: Annotated[
        int, typer.Option(metavar="SIZE", help="size of symbolic dims not given by --dim")
    ] = 1,
    simulate: Annotated[
        bool,
        typer.Option(
            "--simulate/--no-simulate", help="profile both models on the target (timelines)"
        ),
    ] = True,
) -> None:
    """Fuse MODEL (nothing is written but the page) and write an HTML report of what was done."""
    from .api import fuse as run_fuse
    from .html_report import write_html

    try:
        source, label = resolve_input(model)
        if isinstance(source, str) and same_file(source, output):
            raise UsageError(f"{output}: the report would overwrite the input; choose another path")
        dims = parse_dims(dim or [])
        with err.status(f"fusing {label}") if err.is_terminal else _nothing():
            result = run_fuse(
                source, split_names(patterns), split_names(disable) or (), target, force=force
            )
        data = page_data(source, result, label, simulate=simulate, dims=dims, dim_size=dim_size)
        written = write_html(output, data)
    except FuserError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"{output}: cannot write the report ({exc.strerror or exc})") from None
    r = result.report
    out.print(
        f"wrote {written} ({len(r.fusions)} fusions, {len(r.rejected)} near-misses)",
        soft_wrap=True,
    )


def page_data(
    source: Any,
    result: Any,
    label: str,
    *,
    simulate: bool = True,
    dims: dict[str, int] | None = None,
    dim_size: int = 1,
) -> dict[str, Any]:
    """The report page's data: both models simulated (unless not `simulate`)."""
    from .report_data import collect

    with err.status(f"simulating {label}") if err.is_terminal and simulate else _nothing():
        return collect(source, result, label=label, simulate=simulate, dims=dims, dim_size=dim_size)


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()
