"""`fuser.ort.session(model, communicator=fuser.mpi.communicator())` in a user's mpi4py program:
AllGather (a fused op's gather included) and AllReduce run over MPI, fp32 and fp16."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

pytest.importorskip("mpi4py", reason="the 'mpi' extra is not installed: pip install '.[mpi]'")

from fuser.models import tp_mlp
from mpi_launch import HERE, LAUNCH_TIMEOUT_S, mpiexec, with_all_reduce

from fuser.api import fuse


def _user_program(
    ranks: int, template: Path, mode: str = "run", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [mpiexec(), "-n", str(ranks), sys.executable, str(HERE / "user_program.py"),
         str(template), mode],
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def _shards(folder: Path, ranks: int, dtype: str = "float32") -> None:
    for rank in range(ranks):
        model = tp_mlp(group_size=ranks, hidden=12 * ranks, intermediate=8 * ranks, seed=rank,
                       dtype=dtype)  # fmt: skip
        model = with_all_reduce(model, ranks)
        onnx.save(model, folder / f"orig{rank}.onnx")
        result = fuse(model, force=True, cache=False)
        assert result.report.summary["allgather_matmul"] == 1
        result.save(folder / f"fused{rank}.onnx")


@pytest.mark.parametrize(("ranks", "dtype"), [(2, "float32"), (3, "float16")])
def test_a_users_mpi_program_runs_original_and_fused_shards(
    tmp_path: Path, ranks: int, dtype: str
) -> None:
    _shards(tmp_path, ranks, dtype)
    for kind in ("orig", "fused"):
        done = _user_program(ranks, tmp_path / f"{kind}{{rank}}.onnx")
        assert done.returncode == 0, done.stderr
        lines = [ln.split() for ln in done.stdout.splitlines() if ln.startswith("rank ")]
        assert [(ln[1], ln[2], ln[4]) for ln in lines] == [
            (str(r), "ok", dtype) for r in range(ranks)
        ], done.stdout


def test_a_rank_that_dies_ends_the_whole_job(tmp_path: Path) -> None:
    _shards(tmp_path, 3)
    done = _user_program(3, tmp_path / "fused{rank}.onnx", "die")
    assert done.returncode == 9  # the launcher tore the job down with the dead rank's status
    assert "rank 0 ok" not in done.stdout


def test_a_late_rank_makes_the_others_time_out_with_a_reason(tmp_path: Path) -> None:
    _shards(tmp_path, 3)
    env = {"FUSER_COLLECTIVE_TIMEOUT": "1"}
    done = _user_program(3, tmp_path / "fused{rank}.onnx", "sleep", env)
    assert done.returncode == 3
    lines = sorted(ln for ln in done.stdout.splitlines() if ln.startswith("rank "))
    assert len(lines) == 3 and all(" raised: " in ln for ln in lines), done.stdout
    for line in (lines[0], lines[2]):  # ranks 0 and 2 waited for rank 1
        assert "waited 1 s for the other ranks" in line
