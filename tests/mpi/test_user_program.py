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
from mpi_launch import HERE, LAUNCH_TIMEOUT_S, mpiexec

from fuser.api import fuse


def _with_all_reduce(model: onnx.ModelProto, group_size: int) -> onnx.ModelProto:
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


@pytest.mark.parametrize(("ranks", "dtype"), [(2, "float32"), (3, "float16")])
def test_a_users_mpi_program_runs_original_and_fused_shards(
    tmp_path: Path, ranks: int, dtype: str
) -> None:
    for rank in range(ranks):
        model = tp_mlp(group_size=ranks, hidden=12 * ranks, intermediate=8 * ranks, seed=rank,
                       dtype=dtype)  # fmt: skip
        model = _with_all_reduce(model, ranks)
        onnx.save(model, tmp_path / f"orig{rank}.onnx")
        result = fuse(model, force=True, cache=False)
        assert result.report.summary["allgather_matmul"] == 1
        result.save(tmp_path / f"fused{rank}.onnx")
    for kind in ("orig", "fused"):
        done = subprocess.run(
            [mpiexec(), "-n", str(ranks), sys.executable, str(HERE / "user_program.py"),
             str(tmp_path / f"{kind}{{rank}}.onnx")],
            capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False,
            env={**os.environ},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        lines = [ln.split() for ln in done.stdout.splitlines() if ln.startswith("rank ")]
        assert [(ln[1], ln[2], ln[4]) for ln in lines] == [
            (str(r), "ok", dtype) for r in range(ranks)
        ], done.stdout
