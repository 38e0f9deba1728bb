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
    (folder / f"rc.{MPI.COMM_WORLD.Get_rank()}").write_text(str(code))
    sys.exit(code)


if __name__ == "__main__":
    run()
