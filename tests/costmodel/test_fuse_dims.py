"""`fuse --dim NAME=SIZE` reaches the cost model: named dims are priced at their size, the
others over the default range, and the decision's note says which."""

from __future__ import annotations

import json
import subprocess
import sys

from fuser.models import get_example

import fuser


def _cost_notes(result: fuser.FusionResult) -> list[str]:
    return [n for f in result.report.fusions for n in f.notes if n.startswith("cost model")]


def test_named_dim_is_priced_at_its_size_and_said() -> None:
    given = _cost_notes(fuser.fuse(get_example("bert"), cache=False, dims={"seq": 64}))
    default = _cost_notes(fuser.fuse(get_example("bert"), cache=False))
    assert given and all("seq=64" in n for n in given)
    assert default and not any("seq=" in n for n in default)
    assert all("1..4096" in n for n in default)


def test_cli_fuse_dim_reaches_the_decision(tmp_path: object) -> None:
    out = f"{tmp_path}/bert.fused.onnx"
    done = subprocess.run(
        [sys.executable, "-m", "fuser.cli", "fuse", "example:bert", "-o", out, "--dim",
         "seq=32", "--no-cache", "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    notes = [n for f in json.loads(done.stdout)["fusions"] for n in f["notes"]]
    assert any("seq=32" in n for n in notes if n.startswith("cost model"))


def test_inspect_and_tune_take_the_same_dim_flag() -> None:
    inspected = subprocess.run(
        [sys.executable, "-m", "fuser.cli", "inspect", "example:gpt", "--dim", "seq=48",
         "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert inspected.returncode == 0, inspected.stderr
    notes = [n for f in json.loads(inspected.stdout)["fusions"] for n in f["notes"]]
    assert any("seq=48" in n for n in notes)
    tuned = {}
    for seq in ("8", "512"):
        done = subprocess.run(
            [sys.executable, "-m", "fuser.cli", "tune", "example:gpt", "--dim", f"seq={seq}",
             "--dim", "batch=1", "--no-cache", "--json", "--top", "1"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        tuned[seq] = json.loads(done.stdout)["nodes"]
    # the sizes reach the priced shapes: a longer sequence costs more cycles
    shapes = {seq: nodes[0]["shapes"][0] for seq, nodes in tuned.items()}
    assert shapes == {"8": [1, 8, 32], "512": [1, 512, 32]}
    best = {seq: nodes[0]["candidates"][0]["predicted_cycles"] for seq, nodes in tuned.items()}
    assert best["512"] > best["8"], best
