"""One JSON vocabulary: every command's JSON starts with the same envelope, and fusions and
near-misses have the same keys wherever they appear (docs/json.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import fuser
from fuser.cli import app
from fuser.report import SCHEMA_VERSION

runner = CliRunner()
FUSION_KEYS = {"pattern", "node", "op", "nodes", "attributes", "graph", "notes", "prediction"}
NEAR_MISS_KEYS = {"pattern", "nodes", "reason", "value", "graph"}


def run_json(*args: str) -> dict[str, Any]:
    done = runner.invoke(app, list(args))
    assert done.exit_code == 0, done.output
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def assert_envelope(data: dict[str, Any], command: str, input: str, target: str) -> None:
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["fuser_version"] == fuser.__version__
    assert (data["command"], data["input"], data["target"]) == (command, input, target)


@pytest.fixture(scope="module")
def fused(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vocab") / "edge.fused.onnx"
    run_json("fuse", "example:cnn-edge", "-o", str(out), "--no-cache", "--json")
    return out


def test_fuse_and_inspect_name_fusions_and_near_misses_alike(tmp_path: Path) -> None:
    out, report = tmp_path / "f.onnx", tmp_path / "r.json"
    printed = run_json(
        "fuse", "example:cnn-edge", "-o", str(out), "--no-cache", "--json", "--report", str(report)
    )
    assert json.loads(report.read_text()) == printed
    inspected = run_json("inspect", "example:cnn-edge", "--json")
    assert_envelope(printed, "fuse", "example:cnn-edge", "ascend910b")
    assert_envelope(inspected, "inspect", "example:cnn-edge", "ascend910b")
    assert printed["output"] == str(out)
    for data in (printed, inspected):
        assert data["fusions"] and data["near_misses"]
        assert all(set(f) == FUSION_KEYS for f in data["fusions"])
        assert all(set(r) == NEAR_MISS_KEYS for r in data["near_misses"])
        assert not {"replaced", "rejected", "matches"} & set(data)
    assert [f["nodes"] for f in inspected["fusions"]] == [f["nodes"] for f in printed["fusions"]]
    (miss,) = printed["near_misses"]
    assert miss["nodes"] == ["/conv1/Conv", "/conv1/BatchNormalization", "/conv1/Relu"]
    assert miss["value"] == "conv1" and "graph output" in miss["reason"]


def test_validate_profile_and_tune_carry_the_envelope(fused: Path) -> None:
    validated = run_json("validate", "example:cnn-edge", str(fused), "--runs", "1", "--json")
    assert_envelope(validated, "validate", "example:cnn-edge", "ascend910b")
    assert validated["fused"] == str(fused) and validated["ok"] is True
    profiled = run_json("profile", str(fused), "--json", "--target", "ascend910b")
    assert_envelope(profiled, "profile", str(fused), "ascend910b")
    assert profiled["nodes"] and profiled["total_cycles"] > 0
    tuned = run_json("tune", str(fused), "--json", "--no-cache", "--top", "1")
    assert_envelope(tuned, "tune", str(fused), "ascend910b")
    assert {n["op"] for n in tuned["nodes"]} == {"ConvBnRelu"}


def test_version_and_readable_help() -> None:
    done = runner.invoke(app, ["--version"])
    assert done.exit_code == 0 and done.stdout.strip() == f"fuser {fuser.__version__}"
    for command in ("fuse", "inspect", "validate", "report", "profile", "tune", "patterns"):
        shown = runner.invoke(app, [command, "--help"], env={"COLUMNS": "120"}).stdout
        assert not re.search(r"<(bool|str|int|path|list)", shown), command
    fuse_help = runner.invoke(app, ["fuse", "--help"], env={"COLUMNS": "120"}).stdout
    assert "--target" in fuse_help and "TARGET" in fuse_help and "FILE" in fuse_help
