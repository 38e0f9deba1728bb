"""`mpiexec -n P fuser validate ...`: one rank per process; rank 0 prints for every rank.

`fuser validate` comes here when the launcher started more than one process (see
`fuser.mpi.launched_world_size`). Every rank exits with the same status; only rank 0 prints
(the per-rank table, or the JSON, and the one-line error of the rank that failed).
"""

from __future__ import annotations

import socket
import sys

import typer
from rich.table import Table

from .cli_common import err, fail, out, parse_inputs, print_json, resolve_input
from .cli_validate import print_validation
from .errors import FuserError
from .validate_ranks import EXIT_ERROR, RankOptions, RanksResult, one_line, validate_local_ranks


def run(options: RankOptions, *, as_json: bool) -> None:
    """Validate this process's rank over MPI; raise typer.Exit with the job-wide status."""
    from . import mpi

    try:
        communicator = mpi.communicator()
    except FuserError as exc:
        raise fail(str(exc)) from None
    try:
        result = validate_local_ranks(
            communicator,
            options,
            resolve=lambda spec: resolve_input(spec)[0],
            load_inputs=parse_inputs,
        )
    except Exception as exc:  # an exchange timed out: some rank hangs, nobody knows the result
        why = one_line(exc)
        if not why.startswith("rank "):
            why = f"rank {communicator.local_ranks[0]} ({socket.gethostname()}): {why}"
        fail(why)
        sys.stderr.flush()
        mpi.abort_job(EXIT_ERROR)
        raise typer.Exit(EXIT_ERROR) from None  # if the launcher has not ended us yet
    if communicator.local_ranks[0] == 0:
        if as_json:
            print_json(result.to_dict())
        else:
            if result.merged is not None:
                print_validation(result.merged)
            print_ranks(result)
        if result.error:
            err.print(f"[bold red]error:[/] {result.error}", highlight=False, soft_wrap=True)
    raise typer.Exit(result.exit_code)


def print_ranks(result: RanksResult) -> None:
    """One row per rank: where it ran, how long, its peak memory, and its verdict."""
    table = Table(title=f"ranks ({result.transport})", title_justify="left")
    for column in ("rank", "host", "seconds", "peak RSS MB", "ok"):
        table.add_column(column, justify="left" if column in ("host", "ok") else "right")
    for o in result.per_rank:
        failed = sum(1 for c in o.comparisons if not c.ok)
        verdict = (
            "[green]yes[/]"
            if o.ok
            else f"[red]NO[/] ({failed} mismatches)"
            if not o.error
            else "[red]stopped[/] (another rank failed)"
            if o.stopped_by
            else f"[red]failed[/]: {o.error}"
        )
        table.add_row(str(o.rank), o.host, f"{o.seconds:.2f}", f"{o.peak_rss_mb:.0f}", verdict)
    out.print(table)
