"""`mpiexec -n P fuser validate`: one rank per process, one result, the same status everywhere.

Every rank gets its own shard (`{rank}` in the paths; weights seeded by rank), so a rank that
compared the wrong shard, or gathered in the wrong order, shows up as a mismatch.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("mpi4py", reason="the 'mpi' extra is not installed: pip install '.[mpi]'")

from fuser.models import sp_mlp, tp_attention, tp_linear, tp_mlp
from mpi_launch import launch, write_shards

from fuser.collective import Communicator
from fuser.validate_ranks import RankOptions, validate_local_ranks

# Quick on 2 cores: one run per input set kind would miss the zero-variance run; keep 2.
RUNS = "2"


@pytest.mark.parametrize(
    ("build", "ranks", "dtype", "extra"),
    [
        (tp_mlp, 2, "float32", {}),
        (tp_mlp, 4, "float16", {}),
        (sp_mlp, 2, "float16", {}),
        (sp_mlp, 4, "float32", {"seq": 12, "layout": "bsh"}),
        (tp_mlp, 3, "float16", {"hidden": 24, "intermediate": 48, "all_reduce": True}),
        # One gather for Q, K and V (no value_info on it); nn.Linear as Gemm(transB) on 2-D.
        (tp_attention, 2, "float16", {}),
        (tp_linear, 2, "float32", {}),
    ],
    ids=[
        "tp-fp32-2",
        "tp-fp16-4",
        "sp-fp16-2",
        "sp-bsh-fp32-4",
        "tp-allreduce-fp16-3",
        "qkv-fp16-2",
        "gemm-fp32-2",
    ],
)
def test_every_rank_validates_its_own_shard_and_rank_0_reports_all(
    tmp_path: Path, build: object, ranks: int, dtype: str, extra: dict[str, object]
) -> None:
    original, fused = write_shards(tmp_path, build, ranks, dtype=dtype, **extra)  # type: ignore[arg-type]
    done = launch(ranks, tmp_path, "validate", original, fused, "--runs", RUNS, "--json")
    assert done.rank_codes == (0,) * ranks, done.stderr
    report = done.json()
    assert report["ok"] is True and report["transport"] == "mpi" and report["ranks"] == ranks
    assert [r["rank"] for r in report["per_rank"]] == list(range(ranks))
    for rank in report["per_rank"]:
        (out,) = rank["outputs"]
        assert rank["ok"] and rank["host"] and out["dtype"] == dtype and out["ok"]
        assert rank["peak_rss_mb"] > 0
    # The same shards, the same inputs, the same steps on the threads transport: same numbers.
    threads = validate_local_ranks(
        Communicator(ranks),
        RankOptions(str(tmp_path / original), str(tmp_path / fused), runs=int(RUNS)),
    )
    assert threads.transport == "threads" and threads.ok
    by_threads = [
        [c.max_abs for c in o.comparisons if c.where == "output" and c.mode != "stock"]
        for o in threads.per_rank
    ]
    assert by_threads == [[c["max_abs"] for c in r["outputs"]] for r in report["per_rank"]]
    # and the fused node was checked on every rank, in the model and alone; the model also ran
    # through its function bodies in stock onnxruntime (the plugin serving the AllGather alone)
    assert {(n["mode"], n["ok"]) for n in report["nodes"]} == {("model", True), ("isolated", True)}
    assert report["stock"] == "ok" and all(r["stock_outputs"] for r in report["per_rank"])


def test_a_mismatch_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    original, fused = write_shards(tmp_path, tp_mlp, 3, hidden=24, intermediate=48)
    broken = onnx.load(tmp_path / "fused1.onnx")
    for init in broken.graph.initializer:
        if init.name.endswith("bias"):
            values = onnx.numpy_helper.to_array(init).copy()
            values[0] += 0.5  # rank 1's fused model now computes something else
            init.CopyFrom(onnx.numpy_helper.from_array(values, init.name))
    onnx.save(broken, tmp_path / "fused1.onnx")
    done = launch(3, tmp_path, "validate", original, fused, "--runs", "1", "--json")
    assert done.rank_codes == (1, 1, 1) and done.returncode == 1
    report = done.json()
    assert report["ok"] is False and report["error"] == ""
    assert [r["ok"] for r in report["per_rank"]] == [True, False, True]
    assert report["outputs"][0]["ok"] is False  # the summary is the worst rank's
    assert report["failures"] and all(", rank 1" in line for line in report["failures"])


def test_a_kernel_that_raises_on_one_rank_fails_every_rank_at_once(tmp_path: Path) -> None:
    original, fused = write_shards(tmp_path, tp_mlp, 3, hidden=24, intermediate=48)
    broken = onnx.load(tmp_path / "fused1.onnx")
    (node,) = [n for n in broken.graph.node if n.op_type == "AllGatherMatMul"]
    node.attribute.append(onnx.helper.make_attribute("tile_tile_m", 8))  # a partial tiling
    onnx.save(broken, tmp_path / "fused1.onnx")
    # The collective timeout is far beyond the launch timeout: only the notice can end it.
    env = {"FUSER_COLLECTIVE_TIMEOUT": "3600"}
    done = launch(3, tmp_path, "validate", original, fused, "--runs", "3", env=env)
    assert done.rank_codes == (2, 2, 2), done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith("error: rank 1 (") and "tiling attributes missing" in line
    assert "AllGatherMatMul" in line


def test_a_missing_input_file_or_a_session_that_cannot_be_built_fails_every_rank(
    tmp_path: Path,
) -> None:
    original, fused = write_shards(tmp_path, tp_mlp, 3, hidden=24, intermediate=48)
    rng = np.random.default_rng(0)
    for rank in (0, 2):  # no x1.npy: rank 1's input is missing
        np.save(tmp_path / f"x{rank}.npy", rng.standard_normal((2, 3, 8)).astype(np.float32))
    unbuildable = onnx.load(tmp_path / "fused2.onnx")
    (relu,) = [n for n in unbuildable.graph.node if n.op_type == "Relu"]
    relu.op_type = "NoSuchOp"  # rank 2's fused model: onnxruntime cannot make a session
    onnx.save(unbuildable, tmp_path / "fused2.onnx")
    spec = "x_shard=x{rank}.npy"
    done = launch(3, tmp_path, "validate", original, fused, "--input", spec, "--json")
    assert done.rank_codes == (2, 2, 2)
    report = done.json()
    assert report["ok"] is False
    assert report["error"].startswith("rank 1 (") and "x1.npy" in report["error"]
    zero, one, two = report["per_rank"]
    assert zero["stopped_by"].startswith("rank 1: ") and not one["stopped_by"]
    assert "cannot load the fused model" in two["error"] and "NoSuchOp" in two["error"]


def test_a_world_size_other_than_the_group_size_is_an_error_naming_both(tmp_path: Path) -> None:
    original, fused = write_shards(tmp_path, tp_mlp, 4)
    done = launch(2, tmp_path, "validate", original, fused)
    assert done.rank_codes == (2, 2)
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert "group_size=4" in line and "world size is 2" in line and "orig0.onnx" in line


def test_a_rank_that_hangs_ends_the_job_after_the_timeout_with_the_reason(tmp_path: Path) -> None:
    original, fused = write_shards(tmp_path, tp_mlp, 2)
    (tmp_path / "fused1.onnx").unlink()
    os.mkfifo(tmp_path / "fused1.onnx")  # rank 1 blocks reading it, as on a stuck file system
    done = launch(2, tmp_path, "validate", original, fused, env={"FUSER_COLLECTIVE_TIMEOUT": "2"})
    assert done.returncode == 2 and done.rank_codes[1] is None  # rank 1 was ended by the abort
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, f"stderr: {done.stderr!r}"  # the reason reached the launcher's stderr
    (line,) = lines
    assert line.startswith("error: rank 0 (") and "waited 2 s for the other ranks" in line
