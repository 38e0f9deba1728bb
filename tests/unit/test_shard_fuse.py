"""Sharded models, per rank, without MPI: `fuser fuse` of a shard gives the same bytes in any
process (so every host can fuse its own shard), and threads `validate --json` names its transport.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
from fuser.models import tp_mlp

from fuser.mpi import WORLD_SIZE_VARIABLES

FUSER = [sys.executable, "-m", "fuser.cli"]


def _fuser(*args: str, hash_seed: str = "0") -> subprocess.CompletedProcess[str]:
    # Outside the repository, so the installed package (patterns/ mapped in) is the one imported.
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    for name in WORLD_SIZE_VARIABLES:  # a plain run, even when the tests run under mpiexec
        env.pop(name, None)
    return subprocess.run(
        [*FUSER, *args], capture_output=True, text=True, cwd="/", env=env, timeout=300
    )


def test_fusing_a_shard_gives_the_same_bytes_in_every_process(tmp_path: Path) -> None:
    outputs = []
    for rank in (1, 1, 2):
        shard = tmp_path / f"shard{rank}.onnx"
        onnx.save(tp_mlp(group_size=4, seed=rank), shard)
        fused = tmp_path / f"shard{rank}.fused.{len(outputs)}.onnx"
        # different hash seeds: set/dict iteration order must not leak into the output
        done = _fuser("fuse", str(shard), "-o", str(fused), "--force", "--no-cache",
                      hash_seed=str(len(outputs) * 7919))  # fmt: skip
        assert done.returncode == 0, done.stderr
        outputs.append(fused.read_bytes())
    model = onnx.load_from_string(outputs[0])
    assert [n.op_type for n in model.graph.node].count("AllGatherMatMul") == 1
    assert outputs[0] == outputs[1]  # the same shard: the same bytes
    assert outputs[0] != outputs[2]  # another shard's weights: another model


def test_threads_validate_json_names_its_transport_and_ranks(tmp_path: Path) -> None:
    original, fused = tmp_path / "tp.onnx", tmp_path / "tp.fused.onnx"
    onnx.save(tp_mlp(group_size=2, seed=3), original)
    done = _fuser("fuse", str(original), "-o", str(fused), "--force", "--no-cache")
    assert done.returncode == 0, done.stderr
    done = _fuser("validate", str(original), str(fused), "--runs", "1", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["transport"] == "threads" and report["ranks"] == 2 and report["ok"] is True
