"""Validating a 4-rank tensor-parallel model: ranks as threads of one process vs MPI processes.

For each model size, writes 4 shards of `fuser.models.tp_mlp` (rank r's weights seeded r) and
their fused models, then validates them the same way on both transports of the communicator
(`fuser.validate_ranks`, the code `mpiexec -n 4 fuser validate` runs):
  threads  one process, `validate_local_ranks(Communicator(4), ...)`: the 4 ranks as threads
  mpi      `mpiexec -n 4 fuser validate 'orig{rank}.onnx' 'fused{rank}.onnx' --json`
Wall time is the whole command (interpreter start and imports included); per-rank time is
from loading to the final exchange; peak RSS is per process (so for threads, the one process
holding all 4 ranks), and "total RSS" adds the processes up. Each cell is the median of
--repeat runs. Needs the `mpi` extra (mpiexec beside this Python, or on PATH).

    python benchmarks/validate_ranks.py [--sizes 256x1024,2048x8192] [--runs 3] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx
from fuser.models import tp_mlp
from rich.console import Console
from rich.table import Table

from fuser.api import fuse

RANKS = 4
THREADS_SCRIPT = """
import json, resource, sys
from fuser.collective import Communicator
from fuser.validate_ranks import RankOptions, validate_local_ranks
folder, runs, kernel = sys.argv[1], int(sys.argv[2]), sys.argv[3]
options = RankOptions(f"{folder}/orig{{rank}}.onnx", f"{folder}/fused{{rank}}.onnx", runs=runs,
                      kernel=kernel)
result = validate_local_ranks(Communicator(int(sys.argv[4])), options)
print(json.dumps(result.to_dict()))
"""


def write_shards(folder: Path, hidden: int, intermediate: int) -> int:
    """The 4 shards and their fused models; returns the bytes of one rank's weights."""
    size = 0
    for rank in range(RANKS):
        model = tp_mlp(group_size=RANKS, hidden=hidden, intermediate=intermediate, seed=rank)
        onnx.save(model, folder / f"orig{rank}.onnx")
        fuse(model, force=True, cache=False).save(folder / f"fused{rank}.onnx")
        size = (folder / f"orig{rank}.onnx").stat().st_size
    return size


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise SystemExit("no mpiexec: pip install '.[mpi]'")
    return found


def run_once(transport: str, folder: Path, runs: int, kernel: str) -> tuple[float, Any]:
    """(wall seconds, the result's JSON) of one validation on `transport`."""
    if transport == "threads":
        command = [sys.executable, "-c", THREADS_SCRIPT, str(folder), str(runs), kernel,
                   str(RANKS)]  # fmt: skip
    else:
        fuser = str(Path(sys.executable).parent / "fuser")
        specs = ["orig{rank}.onnx", "fused{rank}.onnx"]
        options = ["--runs", str(runs), "--kernel", kernel, "--json"]
        command = [_mpiexec(), "-n", str(RANKS), fuser, "validate", *specs, *options]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=folder, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{transport} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    report = json.loads(done.stdout)
    if not (report["ok"] and report["transport"] == transport and report["ranks"] == RANKS):
        raise SystemExit(f"{transport}: unexpected result {report}")
    return wall, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="256x1024,2048x8192", help="hidden x intermediate")
    parser.add_argument("--runs", type=int, default=3, help="input sets per validation")
    parser.add_argument("--repeat", type=int, default=3, help="validations per cell (median)")
    parser.add_argument("--kernel", default="reference", help="how fused ops run")
    args = parser.parse_args()
    table = Table(
        title=f"validate, {RANKS}-rank tp_mlp, {args.runs} runs, kernel {args.kernel} "
        f"(median of {args.repeat})",
        title_justify="left",
    )
    for column in ("hidden x inter", "shard MB", "transport", "wall s", "rank s (min-max)",
                   "peak RSS/process MB", "total RSS MB"):  # fmt: skip
        table.add_column(column, justify="left" if column == "transport" else "right")
    for size in args.sizes.split(","):
        hidden, intermediate = (int(v) for v in size.split("x"))
        with tempfile.TemporaryDirectory(prefix="fuser-bench-") as tmp:
            folder = Path(tmp)
            shard = write_shards(folder, hidden, intermediate)
            for transport in ("threads", "mpi"):
                cells = [run_once(transport, folder, args.runs, args.kernel)
                         for _ in range(args.repeat)]  # fmt: skip
                wall = statistics.median(c[0] for c in cells)
                per_rank = [r for _, report in cells for r in report["per_rank"]]
                seconds = [r["seconds"] for r in per_rank]
                # threads: every rank reports the same process; count it once per validation
                rss = [r["peak_rss_mb"] for r in per_rank]
                total = statistics.median(
                    max(r["peak_rss_mb"] for r in report["per_rank"])
                    if transport == "threads"
                    else sum(r["peak_rss_mb"] for r in report["per_rank"])
                    for _, report in cells
                )
                table.add_row(
                    f"{hidden} x {intermediate}",
                    f"{shard / 1e6:.1f}",
                    transport,
                    f"{wall:.2f}",
                    f"{min(seconds):.2f}-{max(seconds):.2f}",
                    f"{min(rss):.0f}-{max(rss):.0f}",
                    f"{total:.0f}",
                )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
