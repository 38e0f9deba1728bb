"""The `fuser` command line: one module per command (`cli_<command>.py`), assembled here.

Errors a user can fix print one line on stderr and exit 2; a failed validation exits 1. The
output file is written only after everything it depends on succeeded (atomically), and never
over the input. What the commands share is in `cli_common`.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Annotated, NoReturn

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
    except SystemExit as done:
        exit_now(done)
    exit_now(SystemExit(0))


def exit_now(done: SystemExit) -> NoReturn:
    """End the process as `done` says, without tearing the interpreter down.

    A command has written all it writes by now (atomically, temporary files removed in its
    own `finally` blocks, the tuning cache committed write by write); what is left is freeing
    every module and object one by one, which costs a fuse about 0.1-0.2 s: more than a
    10k-node model's save. mypy ends the same way, for the same reason. A process that loaded
    mpi4py ends normally (MPI_Finalize runs at exit, and mpirun waits for it), and so does one
    under a profiler or tracer (cProfile, pyinstrument, coverage write their results at exit).
    """
    watched = sys.getprofile() is not None or sys.gettrace() is not None
    if watched or "mpi4py" in sys.modules or "coverage" in sys.modules:
        raise done
    code = done.code
    if code is not None and not isinstance(code, int):
        err.print(str(code), highlight=False, soft_wrap=True)  # as SystemExit("...") prints
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
        pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
