"""`fuser tune`: JSON per fused node, simulated candidates, the direct form."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from fuser.cli import app

runner = CliRunner()


def test_tune_a_model_with_simulation_prints_the_json_nodes(tmp_path: Path) -> None:
    cache = tmp_path / "c.sqlite"
    done = runner.invoke(
        app, ["tune", "example:moe", "--simulate", "--top", "4", "--json", "--cache", str(cache)]
    )
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    (node,) = data["nodes"]
    assert node["op"] == "SoftmaxTopK" and node["name"]
    assert set(node["chosen"]) == {"rows", "double_buffer", "cores", "staged"}
    assert len(node["candidates"]) == 4
    for c in node["candidates"]:
        assert c["predicted_cycles"] > 0 and c["simulated_cycles"] > 0 and "rows" in c["tiling"]
    assert node["spearman"] is None or -1 <= node["spearman"] <= 1
    assert node["regret"] is not None and node["regret"] >= 0


def test_tune_direct_form_ranks_candidates_without_simulating() -> None:
    done = runner.invoke(
        app,
        ["tune", "SoftmaxTopK", "--input", "1024x64:float16", "--attr", "k=4", "--json",
         "--no-cache", "--top", "0"],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    (node,) = json.loads(done.stdout)["nodes"]
    predicted = [c["predicted_cycles"] for c in node["candidates"]]
    assert len(predicted) == node["space_size"] > 10
    assert all(c["simulated_cycles"] is None for c in node["candidates"])
    assert node["spearman"] is None and node["regret"] is None


def test_tune_unknown_op_fails_with_one_line() -> None:
    done = runner.invoke(app, ["tune", "NoSuchOp", "--input", "4x4", "--no-cache"])
    assert done.exit_code == 2
    assert "error:" in done.output
