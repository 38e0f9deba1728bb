"""Shared by the MPI tests: launching `mpiexec`, and per-rank shards of the parallel examples."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import pytest

HERE = Path(__file__).parent
# Generous: a hang shows as this timeout, and no passing test comes near it.
LAUNCH_TIMEOUT_S = 180


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"  # the mpich wheel's, in this venv
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpi4py is installed but no mpiexec was found (install the 'mpi' extra)")
    return found


@dataclass(frozen=True)
class Launch:
    """One `mpiexec` run: the job's status, every rank's own status (None: it was killed)."""

    returncode: int
    rank_codes: tuple[int | None, ...]
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


def launch(ranks: int, folder: Path, *args: str, env: dict[str, str] | None = None) -> Launch:
    """`mpiexec -n ranks fuser ARGS...`, recording each rank's exit status."""
    codes = folder / f"codes-{len(list(folder.glob('codes-*')))}"
    codes.mkdir()
    command = [mpiexec(), "-n", str(ranks), sys.executable, str(HERE / "rank_exit.py")]
    done = subprocess.run(
        [*command, str(codes), *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
        env={**os.environ, **(env or {})},
        check=False,
    )
    files = [codes / f"rc.{r}" for r in range(ranks)]
    rank_codes = tuple(int(f.read_text()) if f.exists() else None for f in files)
    return Launch(done.returncode, rank_codes, done.stdout, done.stderr)


def write_shards(
    folder: Path, build: Callable[..., onnx.ModelProto], ranks: int, **kwargs: Any
) -> tuple[str, str]:
    """Rank r's original (seed r: its own weight shard) and its fused model, as `{rank}` specs;
    `all_reduce=True` appends a com.microsoft AllReduce of the partial sums."""
    from fuser.api import fuse

    all_reduce = bool(kwargs.pop("all_reduce", False))
    for rank in range(ranks):
        model = build(group_size=ranks, seed=rank, **kwargs)
        if all_reduce:
            model = with_all_reduce(model, ranks)
        onnx.save(model, folder / f"orig{rank}.onnx")
        result = fuse(model, force=True, cache=False)
        assert result.report.summary["allgather_matmul"] == 1  # the gather is inside a fused op
        result.save(folder / f"fused{rank}.onnx")
    return "orig{rank}.onnx", "fused{rank}.onnx"


def with_all_reduce(model: onnx.ModelProto, group_size: int) -> onnx.ModelProto:
    """The row-parallel partial sums all-reduced, as a real tensor-parallel MLP does."""
    (out,) = model.graph.output
    partial = out.name + "_partial"
    for node in model.graph.node:
        node.output[:] = [partial if o == out.name else o for o in node.output]
    model.graph.node.append(
        onnx.helper.make_node(
            "AllReduce", [partial], [out.name], domain="com.microsoft", group_size=group_size
        )
    )
    return model
