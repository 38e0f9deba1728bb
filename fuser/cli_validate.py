"""`fuser validate ORIGINAL FUSED`: both models in onnxruntime on the same inputs, compared."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.text import Text

from .cli_common import (
    command_json,
    fail,
    parse_inputs,
    print_json,
    print_table,
    resolve_input,
    table,
)
from .errors import FuserError


def register(app: typer.Typer) -> None:
    """Add the `validate` command to `app`."""
    app.command()(validate)


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
        source, _ = resolve_input(original)
        result = run_validate(
            source,
            fused,
            runs=runs,
            seed=seed,
            rtol=rtol,
            atol=atol,
            inputs=parse_inputs(input or []),
            dim_size=dim_size,
            kernel=kernel,
            target=target,
        )
    except FuserError as exc:
        raise fail(str(exc)) from None
    except Exception as exc:  # onnxruntime's own errors: keep them to one line
        raise fail(
            f"{fused}: onnxruntime failed: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        ) from None
    if as_json:
        data = command_json("validate", original, target, result.to_dict())
        print_json(data | {"fused": fused})
    else:
        print_validation(result)
    if not result.ok:
        raise typer.Exit(1)


def print_validation(result: Any) -> None:
    """Print a validation result as a table of outputs."""
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
