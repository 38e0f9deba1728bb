"""Run `fuser` on one MPI rank and record that rank's exit status in DIR/rc.<rank>.

    mpiexec -n 4 python rank_exit.py DIR validate ORIGINAL FUSED ...

mpiexec folds the ranks' statuses into one; the tests need every rank's own.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mpi4py import MPI

from fuser.cli import main


def run() -> None:
    folder = Path(sys.argv[1])
    sys.argv = ["fuser", *sys.argv[2:]]
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    # Written under another name, then renamed: a rank that the job's abort kills while it
    # writes leaves no file (None: killed), never an empty one.
    rank = MPI.COMM_WORLD.Get_rank()
    partial = folder / f".rc.{rank}.part"
    partial.write_text(str(code))
    partial.replace(folder / f"rc.{rank}")
    sys.exit(code)


if __name__ == "__main__":
    run()
