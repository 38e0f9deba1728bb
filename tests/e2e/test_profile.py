"""`fuser profile` end to end: the JSON report, the gain of fusion, the Chrome trace, bad input.

The command runs as a user runs it (`python -m fuser.cli`, outside the repository); the Python
API (`fuser.profile.profile_model`) is checked where a subprocess adds nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fuser.models import get_example

from fuser.api import fuse
from fuser.profile import profile_model

NODE_FIELDS = ("name", "op", "cycles", "gm_bytes", "bound", "estimated")
TOP_FIELDS = ("target", "total_cycles", "total_us", "gm_read_bytes", "gm_write_bytes", "launches")


def fuser(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fuser.cli", *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).anchor,
        timeout=300,
    )


def profile_json(*args: str) -> dict[str, Any]:
    done = fuser("profile", *args, "--json")
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


@pytest.fixture(scope="module")
def resnet_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("resnet")
    fused = folder / "resnet.fused.onnx"
    done = fuser("fuse", "example:resnet", "-o", str(fused))
    assert done.returncode == 0, done.stderr
    return Path("example:resnet"), fused


def test_json_fields_and_totals_are_the_sum_of_nodes(resnet_files: tuple[Path, Path]) -> None:
    data = profile_json(str(resnet_files[0]), "--dim", "N=2")
    assert all(k in data for k in TOP_FIELDS) and data["nodes"]
    assert data["target"] == "ascend910b" and data["dims"] == {"N": 2}
    for node in data["nodes"]:
        assert all(k in node for k in NODE_FIELDS), node
        assert node["bound"] in ("compute", "memory", "none")
        assert node["gm_bytes"] == node["gm_read_bytes"] + node["gm_write_bytes"]
    nodes = data["nodes"]
    assert data["total_cycles"] == pytest.approx(sum(n["cycles"] for n in nodes))
    assert data["total_us"] == pytest.approx(sum(n["us"] for n in nodes))
    assert data["gm_read_bytes"] == sum(n["gm_read_bytes"] for n in nodes)
    assert data["gm_write_bytes"] == sum(n["gm_write_bytes"] for n in nodes)
    assert data["launches"] == sum(n["launches"] for n in nodes)
    assert data["total_us"] == pytest.approx(data["total_cycles"] / 1.8e3)  # 1.8 GHz
    by_op = {n["op"]: n["estimated"] for n in nodes}
    assert by_op["Conv"] is False and by_op["MaxPool"] is True  # MaxPool has no kernel
    starts = [n["start_cycles"] for n in nodes]
    assert starts == sorted(starts) and starts[0] == 0


def test_fused_resnet_has_fewer_launches_bytes_and_cycles(resnet_files: tuple[Path, Path]) -> None:
    original = profile_json(str(resnet_files[0]))
    fused = profile_json(str(resnet_files[1]))
    assert fused["launches"] < original["launches"]
    gm = "gm_read_bytes", "gm_write_bytes"
    assert sum(fused[k] for k in gm) < sum(original[k] for k in gm)
    assert fused["total_cycles"] < original["total_cycles"]
    assert any(n["op"] == "ConvBnRelu" and not n["estimated"] for n in fused["nodes"])


def test_trace_has_one_track_per_core_and_pipe(tmp_path: Path) -> None:
    trace = tmp_path / "out" / "trace.json"
    done = fuser("profile", "example:sp-mlp", "--trace", str(trace))
    assert done.returncode == 0, done.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    threads = [(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"]
    assert len(threads) == len(set(threads))
    names = [(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"]
    assert len(names) == len(set(names)), "a pipe appears twice on one core"
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    work = [e for e in events if e["ph"] == "X" and e["pid"] != 0]
    assert work and all((e["pid"], e["tid"]) in set(threads) for e in work)
    assert {processes[e["pid"]] for e in work} >= {"core 0"}
    pipes = {name for _, name in names}
    assert {"MTE2", "CUBE", "VECTOR"} <= pipes


def test_trace_lays_nodes_end_to_end() -> None:
    result = profile_model(get_example("moe"), dims={"seq": 4}, timeline=True)
    events = result.to_chrome_trace()["traceEvents"]
    launches = [e for e in events if e["ph"] == "X" and e["pid"] == 0]
    run = [n for n in result.nodes if n.cycles > 0]
    assert len(launches) >= len(run)
    us = 1e6 / result.clock_hz
    for node in run:
        mine = [e for e in launches if e["name"].startswith(node.name)]
        assert mine, node.name
        assert min(e["ts"] for e in mine) == pytest.approx(node.start_cycles * us)
    end = max(e["ts"] + e["dur"] for e in events if e["ph"] == "X")
    assert end == pytest.approx(result.total_us, rel=1e-6)


def test_symbolic_dims_resolve_through_shape_arithmetic() -> None:
    for name in ("bert", "gpt2"):
        result = profile_model(get_example(name), dims={"batch": 2, "seq": 16})
        unresolved = [n.name for n in result.nodes if "no static shape" in n.note]
        assert not unresolved, f"{name}: {unresolved[:5]}"
        assert result.estimated_cycles < 0.25 * result.total_cycles
        matmuls = [n for n in result.nodes if n.op == "MatMul"]
        assert matmuls and not any(n.estimated for n in matmuls)


def test_collectives_run_their_kernels() -> None:
    for name in ("tp-mlp", "tp-mlp-negaxis"):
        model = get_example(name)
        original = profile_model(model, dims={"batch": 2, "seq": 8})
        fused = profile_model(fuse(model).model, dims={"batch": 2, "seq": 8})
        gather = next(n for n in original.nodes if n.op == "AllGather")
        assert not gather.estimated, gather.note
        agmm = next(n for n in fused.nodes if n.op == "AllGatherMatMul")
        assert not agmm.estimated, agmm.note


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("/no/such/model.onnx",), "no such file"),
        (("example:nope",), "unknown example"),
        (("example:bert", "--dim", "seqq=4"), "no such symbolic dim"),
        (("example:bert", "--dim", "seq"), "expected NAME=SIZE"),
        (("example:bert", "--dim-size", "0"), "at least 1"),
        (("example:bert", "--target", "tpu9000"), "no such target"),
    ],
)
def test_bad_input_one_line_exit_2(args: tuple[str, ...], message: str) -> None:
    done = fuser("profile", *args)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert not done.stdout.strip()


def test_ops_with_value_inputs_run_their_kernels() -> None:
    """TopK's K and ReduceSum's axes come from constants; the unfused router runs on kernels."""
    result = profile_model(get_example("qwen-router"), dims={"batch": 2, "seq": 8})
    for op in ("Softmax", "TopK", "ReduceSum"):
        nodes = [n for n in result.nodes if n.op == op]
        assert nodes and not any(n.estimated for n in nodes), [(n.name, n.note) for n in nodes]


def test_tuned_profile_gives_unfused_ops_the_searched_tiling() -> None:
    """`tuned` changes the time of unfused ops that have a cost model only; the nodes and the
    launches stay."""
    model = get_example("moe")
    plain = profile_model(model, dims={"batch": 8, "seq": 32})
    tuned = profile_model(model, dims={"batch": 8, "seq": 32}, tuned=True)
    assert tuned.tuned and not plain.tuned and tuned.to_dict()["tuned"] is True
    assert [n.name for n in tuned.nodes] == [n.name for n in plain.nodes]
    assert tuned.launches == plain.launches
    changed = [a.op for a, b in zip(plain.nodes, tuned.nodes, strict=True) if a.cycles != b.cycles]
    assert changed and all(
        op in ("MatMul", "Gemm", "Softmax", "TopK", "ReduceSum") for op in changed
    )
