"""The `fuser` command line: one module per command (`cli_<command>.py`), assembled here.

Errors a user can fix print one line on stderr and exit 2; a failed validation exits 1. The
output file is written only after everything it depends on succeeded (atomically), and never
over the input. What the commands share is in `cli_common`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Annotated

import typer

from .cli_common import ReadableGroup, err, out

app = typer.Typer(
    name="fuser",
    help="Fuse ONNX operator chains into NPU kernels, and prove the result computes the same.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=ReadableGroup,
)


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        out.print(f"fuser {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    """Fuse ONNX operator chains into NPU kernels, and prove the result computes the same."""


# In the order `fuser --help` lists them.
COMMANDS = ("fuse", "unfuse", "inspect", "validate", "report", "patterns", "profile", "tune")
for _command in COMMANDS:
    importlib.import_module(f".cli_{_command}", __package__).register(app)


def main() -> None:
    """Console-script entry point."""
    from .cli_patterns import run_fast

    try:
        if run_fast(sys.argv[1:]):
            return
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
