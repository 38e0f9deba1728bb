"""`fuser fuse INPUT -o OUTPUT`: fuse a model, print what was fused and why not, write it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from .cli_common import (
    DimOption,
    DimSizeOption,
    command_json,
    err,
    fail,
    out,
    parse_dims,
    parse_inputs,
    print_items,
    print_json,
    print_table,
    resolve_input,
    same_file,
    split_names,
    table,
)
from .cli_progress import StageBar
from .cli_report import page_data
from .cli_validate import InputOption, KernelOption, RunsOption, print_validation
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
    html: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="write an HTML report here (see `fuser report`)"),
    ] = None,
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
    input_: InputOption = None,
    kernel: KernelOption = "npu",
    runs: RunsOption = 3,
    dim: DimOption = None,
    dim_size: DimSizeOption = 3,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet", "-q", help="print only errors and warnings: no report, no progress bar"
        ),
    ] = False,
) -> None:
    """Fuse a model: prints what was fused, what was not and why, and writes OUTPUT."""
    from .api import fuse as run_fuse
    from .api import validate as run_validate

    bar = StageBar(quiet=quiet)
    try:
        source, label = resolve_input(input)
        for path in (output, report, html):
            if path is not None and isinstance(source, str) and same_file(source, path):
                raise UsageError(f"{path}: output would overwrite the input; choose another path")
            if path is not None and path.is_dir():  # fail before fusing, not after
                raise UsageError(f"{path}: is a directory; give a file path")
        result = run_fuse(
            source,
            split_names(patterns),
            split_names(disable) or (),
            target,
            force=force,
            cache=False if no_cache else cache,
            functions=not no_functions,
            dims=parse_dims(dim or []),  # the cost model prices named dims at these sizes
            keep_original=validate,  # validation reuses the input as read: loaded once
            progress=bar,
        )
        validation = None
        if validate:  # --input, --kernel, --runs, --dim, --dim-size: as `fuser validate`
            bar("validate", 0, runs)
            validation = run_validate(
                result.original or source,
                result,
                target=target,
                kernel=kernel,
                runs=runs,
                inputs=parse_inputs(input_ or []),
                dims=parse_dims(dim or []),
                dim_size=dim_size,
                progress=bar.validation(),
            )
        if validation is not None and not validation.ok:
            bar.close()
            print_validation(validation)
            raise fail(f"{label}: the fused model does not match the original; nothing written", 1)
        # The page is made before anything is written: a failure leaves no output at all.
        page = page_data(source, result, label) if html is not None else None
        data: dict[str, Any] = {}
        if report is not None or as_json:  # only then: thousands of fusions take a while
            data = command_json("fuse", label, target, result.report.to_dict())
            data["output"] = str(output)
            if validation is not None:
                data["validation"] = validation.to_dict()
        # The model and the report are written as one step: both appear, or neither.
        extra = {report: json.dumps(data, indent=2).encode()} if report is not None else None
        bar("save", 0, 1)
        written = result.save(output, extra=extra)
        if html is not None and page is not None:
            from .html_report import write_html

            written.append(write_html(html, page))
    except FuserError as exc:
        bar.close()
        raise fail(str(exc)) from None
    except OSError as exc:
        bar.close()
        raise fail(f"{exc.filename or output}: cannot write ({exc.strerror or exc})") from None
    finally:
        bar.close()
    for warning in result.warnings:
        err.print(f"[bold yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    if as_json:
        print_json(data)
        return
    if quiet:  # errors, warnings and a failed validation still print
        return
    print_report(result.report, label)
    if validation is not None:
        print_validation(validation)
    out.print(f"wrote {', '.join(str(p) for p in written)}", soft_wrap=True)


def print_report(report: Any, label: str) -> None:
    """Print the fusions per pattern, what was not fused and why, and the node counts."""
    summary = table("pattern", "fused", "predicted speedup", numeric=("fused", "predicted speedup"))
    for name, count in report.summary.items():
        speedups = [
            f.prediction.speedup for f in report.fusions if f.pattern == name and f.prediction
        ]
        shown = f"{min(speedups):.2f}x – {max(speedups):.2f}x" if speedups else "-"
        summary.add_row(name, str(count), shown)
    print_table(f"fusions in {label}", summary, empty="no patterns enabled")
    misses = [
        [("pattern", r.pattern), ("nodes", list(r.nodes)), ("graph", r.graph),
         ("reason", r.reason)]
        for r in report.rejected
    ]  # fmt: skip
    if misses:
        print_items("not fused", misses, empty="")
    for note in report.normalized:
        out.print(f"normalized: {note}", highlight=False, soft_wrap=True)
    out.print(f"nodes: {report.nodes_before} -> {report.nodes_after}")
