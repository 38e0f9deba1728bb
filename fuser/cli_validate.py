"""`fuser validate ORIGINAL FUSED`: both models in onnxruntime on the same inputs, compared.

Exit 0 when every graph output and every fused node matches, 1 when something differs (each
failure printed as one line naming the node, its pattern, the run and the worst element), 2 on
an error a user can fix (one line: inputs the model does not accept, a file that does not load).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.text import Text

from .cli_common import (
    DimOption,
    DimSizeOption,
    command_json,
    err,
    fail,
    out,
    parse_dims,
    parse_inputs,
    print_json,
    print_table,
    resolve_input,
    table,
)
from .errors import FuserError

SHOWN_FAILURES = 10  # failure lines printed; --json has all
SHOWN_FALLBACKS = 20  # rows of fused nodes run on their reference instead; --json has all
PROGRESS_AFTER_S = 1.0  # a progress bar appears only on validations that take longer


def register(app: typer.Typer) -> None:
    """Add the `validate` command to `app`."""
    app.command()(validate)


RunsOption = Annotated[int, typer.Option(help="input sets to try")]
KernelOption = Annotated[str, typer.Option(help="how fused ops run: reference or npu")]
InputOption = Annotated[list[str] | None, typer.Option("--input", help="name=file.npy, repeatable")]


def validate(
    original: Annotated[str, typer.Argument(help="the original ONNX file (or example:NAME)")],
    fused: Annotated[str, typer.Argument(help="the fused ONNX file")],
    runs: RunsOption = 3,
    seed: Annotated[int, typer.Option(help="seed of the random inputs")] = 0,
    rtol: Annotated[
        float | None, typer.Option(help="relative tolerance (overrides the dtype default)")
    ] = None,
    atol: Annotated[float | None, typer.Option(help="absolute tolerance")] = None,
    input: InputOption = None,
    dim: DimOption = None,
    dim_size: DimSizeOption = 3,
    kernel: KernelOption = "npu",
    target: Annotated[str, typer.Option(help="NPU target for --kernel npu")] = "ascend910b",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Run both models in onnxruntime on the same inputs; exit 0 only if everything matches.

    Under `mpiexec -n P` (P > 1) every process validates one rank (`{rank}` in ORIGINAL,
    FUSED or an --input file names that rank's own), with collectives over MPI.
    """
    from .api import validate as run_validate
    from .mpi import launched_world_size

    if launched_world_size() > 1:
        from .cli_validate_ranks import run
        from .validate_ranks import RankOptions

        try:
            dims = tuple(parse_dims(dim or []).items())
        except FuserError as exc:
            raise fail(str(exc)) from None
        options = (runs, seed, rtol, atol, tuple(input or ()), dim_size, kernel, target, dims)
        run(RankOptions(original, fused, *options), as_json=as_json)

    try:
        source, _ = resolve_input(original)
        with progress_bar("validating") as progress:
            result = run_validate(
                source,
                fused,
                runs=runs,
                seed=seed,
                rtol=rtol,
                atol=atol,
                inputs=parse_inputs(input or []),
                dims=parse_dims(dim or []),
                dim_size=dim_size,
                kernel=kernel,
                target=target,
                progress=progress,
            )
    except FuserError as exc:
        raise fail(str(exc)) from None
    if as_json:
        data = command_json("validate", original, target, result.to_dict())
        print_json(data | {"fused": fused, "transport": "threads"})
    else:
        print_validation(result)
    if not result.ok:
        raise typer.Exit(1)


@contextmanager
def progress_bar(label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback drawing a bar on stderr once the work has taken over a second
    (terminals only: nothing in pipes, files and CI logs)."""
    if not err.is_terminal:
        yield None
        return
    from rich.progress import Progress

    start = time.monotonic()
    bar: Progress | None = None
    task: Any = None

    def update(done: int, total: int) -> None:
        nonlocal bar, task
        if bar is None:
            if time.monotonic() - start < PROGRESS_AFTER_S:
                return
            bar = Progress(console=err, transient=True)
            bar.start()
            task = bar.add_task(label, total=total)
        bar.update(task, completed=done, total=total)

    try:
        yield update
    finally:
        if bar is not None:
            bar.stop()


def print_validation(result: Any) -> None:
    """Print a validation result: graph outputs, a line per fused-node check, the failures."""
    numeric = ("max abs", "max rel", "tolerance")
    outputs = table("output", "dtype", *numeric, "ok", numeric=numeric)
    for o in result.outputs:
        ok = Text("yes", style="green") if o.ok else Text("NO", style="red")
        outputs.add_row(
            o.name,
            o.dtype,
            f"{o.max_abs:.3g}",
            f"{o.max_rel:.3g}",
            f"{o.tolerance:.0e}",
            ok + (f" ({o.detail})" if o.detail else ""),
        )
    title = (
        f"validation ({result.runs} runs x {result.ranks} rank(s), seed {result.seed}, "
        f"kernel {result.kernel})"
    )
    print_table(title, outputs, empty=f"{title}: no outputs compared")
    nodes = {c.node for c in result.nodes}
    bad_nodes = {c.node for c in result.nodes if not c.ok}
    out.print(
        f"fused nodes: {len(nodes) - len(bad_nodes)} of {len(nodes)} match, in the model and "
        f"run alone on the original's values",
        highlight=False,
    )
    print_kernels(result)
    out.print(f"stock onnxruntime (function bodies): {result.stock}", highlight=False)
    failures = result.failures
    for c in failures[:SHOWN_FAILURES]:
        out.print(f"[red]mismatch:[/] {c.message()}", highlight=False, soft_wrap=True)
    if len(failures) > SHOWN_FAILURES:
        out.print(f"... and {len(failures) - SHOWN_FAILURES} more (--json lists all)")


def print_kernels(result: Any) -> None:
    """How many fused nodes ran on which kernel, and a row per node that did not run on the
    kernel asked for (the NPU has no unit for it: its reference ran, compared like the rest)."""
    counts = result.kernel_counts
    if not counts:
        return
    shown = ", ".join(f"{n} on {label}" for label, n in counts.items())
    out.print(f"fused nodes by kernel: {shown}", highlight=False)
    moved = [(n, k) for n, k in result.node_kernels.items() if k != result.kernel]
    if not moved:
        return
    ops = {c.node: c.op for c in result.nodes}
    bad = {c.node for c in result.nodes if not c.ok}
    rows = table("fused node", "op", "kernel", "ok")
    for name, label in moved[:SHOWN_FALLBACKS]:
        ok = Text("NO", style="red") if name in bad else Text("yes", style="green")
        rows.add_row(name, ops.get(name, ""), label, ok)
    print_table(f"fused nodes not run on kernel {result.kernel}", rows)
    if len(moved) > SHOWN_FALLBACKS:
        out.print(f"... and {len(moved) - SHOWN_FALLBACKS} more (--json lists all)")
