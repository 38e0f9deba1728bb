"""The `fuser` command line: one module per command (`cli_<command>.py`), assembled here.

Errors a user can fix print one line on stderr and exit 2; a failed validation exits 1. The
output file is written only after everything it depends on succeeded (atomically), and never
over the input. What the commands share is in `cli_common`.
"""

from __future__ import annotations

import importlib
import sys

import typer

from .cli_common import err

app = typer.Typer(
    name="fuser",
    help="Fuse ONNX operator chains into NPU kernels, and prove the result computes the same.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# In the order `fuser --help` lists them.
COMMANDS = ("fuse", "unfuse", "inspect", "validate", "patterns", "profile", "tune")
for _command in COMMANDS:
    importlib.import_module(f".cli_{_command}", __package__).register(app)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
