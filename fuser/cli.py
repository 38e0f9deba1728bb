"""The `fuser` command line: fuse, inspect, validate, patterns (profile and tune join later).

Errors a user can fix print one line on stderr and exit 2; a failed validation exits 1. The
output file is written only after everything it depends on succeeded (atomically), and never
over the input.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from .errors import FuserError, UsageError

app = typer.Typer(
    name="fuser",
    help="Fuse ONNX operator chains into NPU kernels, and prove the result computes the same.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped or redirected output is read in files and CI logs, not an 80-column terminal: give rich
# room so tables of long node names do not wrap into unreadable columns.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

EXAMPLE_PREFIX = "example:"


def _resolve_input(spec: str) -> tuple[Any, str]:
    """A path, or `example:NAME` for a built-in model from fuser.models."""
    if spec.startswith(EXAMPLE_PREFIX):
        models = importlib.import_module("fuser.models")
        name = spec[len(EXAMPLE_PREFIX) :]
        try:
            return models.get_example(name), spec
        except KeyError as exc:
            raise UsageError(str(exc.args[0]) if exc.args else f"unknown example '{name}'") from exc
    return spec, spec


def _split(names: str | None) -> list[str] | None:
    if names is None:
        return None
    return [n.strip() for n in names.split(",") if n.strip()]


def _print_json(data: Any) -> None:
    # Plain json: reports of large models have thousands of entries, and rich's highlighter
    # takes longer to print them than fuser takes to make them.
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _same_file(a: str, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


@app.command()
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
) -> None:
    """Fuse a model: prints what was fused, what was not and why, and writes OUTPUT."""
    from .api import fuse as run_fuse
    from .api import validate as run_validate

    try:
        source, label = _resolve_input(input)
        if isinstance(source, str) and _same_file(source, output):
            raise UsageError(f"{output}: output would overwrite the input; choose another path")
        with (
            err.status(f"fusing {label}", spinner="dots")
            if err.is_terminal
            else contextlib.nullcontext()
        ):
            result = run_fuse(
                source,
                _split(patterns),
                _split(disable) or (),
                target,
                force=force,
                cache=False if no_cache else cache,
            )
        validation = None
        if validate:
            validation = run_validate(source, result, target=target)
        if validation is not None and not validation.ok:
            _print_validation(validation)
            raise _fail(f"{label}: the fused model does not match the original; nothing written", 1)
        written = result.save(output)
        data: dict[str, Any] = {}
        if report is not None or as_json:  # only then: thousands of fusions take a while
            data = result.report.to_dict()
            if validation is not None:
                data["validation"] = validation.to_dict()
        if report is not None:
            from .modelio import _atomic_write

            report.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(report, json.dumps(data, indent=2).encode())
    except FuserError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        _print_json(data)
        return
    _print_report(result.report, label)
    if validation is not None:
        _print_validation(validation)
    out.print(f"wrote {', '.join(str(p) for p in written)}")


def _print_report(report: Any, label: str) -> None:
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


def _print_validation(result: Any) -> None:
    table = Table(
        title=f"validation ({result.runs} runs x {result.ranks} rank(s), seed {result.seed}, "
        f"kernel {result.kernel})",
        title_justify="left",
    )
    for column in ("output", "dtype", "max abs", "max rel", "tolerance", "ok"):
        table.add_column(column, justify="right" if column.startswith(("max", "tol")) else "left")
    for o in result.outputs:
        table.add_row(
            o.name,
            o.dtype,
            f"{o.max_abs:.3g}",
            f"{o.max_rel:.3g}",
            f"{o.tolerance:.0e}",
            ("[green]yes[/]" if o.ok else "[red]NO[/]") + (f" ({o.detail})" if o.detail else ""),
        )
    out.print(table)


@app.command()
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
        source, label = _resolve_input(input)
        found = run_inspect(source, _split(patterns))
    except FuserError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        _print_json(found.to_dict())
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


def _parse_inputs(specs: list[str]) -> dict[str, Any]:
    import numpy as np

    feeds: dict[str, Any] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--input '{spec}': expected name=file.npy")
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--input {name}: cannot read '{path}' as .npy ({exc})") from exc
    return feeds


@app.command()
def validate(
    original: Annotated[str, typer.Argument(help="the original ONNX file (or example:NAME)")],
    fused: Annotated[str, typer.Argument(help="the fused ONNX file")],
    runs: Annotated[int, typer.Option(help="input sets to try")] = 3,
    seed: Annotated[int, typer.Option(help="seed of the random inputs")] = 0,
    rtol: Annotated[
        float | None, typer.Option(help="relative tolerance (overrides the dtype default)")
    ] = None,
    atol: Annotated[float | None, typer.Option(help="absolute tolerance")] = None,
    input: Annotated[
        list[str] | None, typer.Option("--input", help="name=file.npy, repeatable")
    ] = None,
    dim_size: Annotated[int, typer.Option(help="size given to symbolic dims")] = 3,
    kernel: Annotated[str, typer.Option(help="how fused ops run: reference or npu")] = "npu",
    target: Annotated[str, typer.Option(help="NPU target for --kernel npu")] = "ascend910b",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Run both models in onnxruntime on the same inputs; exit 0 only if every output matches."""
    from .api import validate as run_validate

    try:
        source, _ = _resolve_input(original)
        result = run_validate(
            source,
            fused,
            runs=runs,
            seed=seed,
            rtol=rtol,
            atol=atol,
            inputs=_parse_inputs(input or []),
            dim_size=dim_size,
            kernel=kernel,
            target=target,
        )
    except FuserError as exc:
        raise _fail(str(exc)) from None
    except Exception as exc:  # onnxruntime's own errors: keep them to one line
        raise _fail(
            f"{fused}: onnxruntime failed: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        ) from None
    if as_json:
        _print_json(result.to_dict())
    else:
        _print_validation(result)
    if not result.ok:
        raise typer.Exit(1)


@app.command("patterns")
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
        _print_json(rows)
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


importlib.import_module(".cli_profile", __package__).register(app)  # fuser profile
importlib.import_module(".cli_tune", __package__).register(app)  # fuser tune


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
