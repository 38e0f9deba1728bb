"""The HTML report's data: subgraphs read from the original, speedups from two profiles."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from report_models import TRICKY, chain_in_branch, two_chains

import fuser
from fuser.html_report import render_html, write_html
from fuser.profile import profile_model
from fuser.report_data import FUSED, PLAIN, REPLACED, collect


@pytest.fixture(scope="module")
def data() -> dict:
    model = two_chains()
    return collect(model, fuser.fuse(model), label="two_chains.onnx", dims={"N": 2})


def test_envelope_and_vocabulary(data: dict) -> None:
    assert data["schema_version"] == 1 and data["fuser_version"] == fuser.__version__
    assert (data["command"], data["input"], data["target"]) == (
        "report",
        "two_chains.onnx",
        "ascend910b",
    )
    (fusion,) = data["fusions"]
    assert fusion["nodes"] == [TRICKY, "bn1", "relu1"] and fusion["pattern"] == "conv_bn_relu"
    (miss,) = data["near_misses"]
    assert miss["nodes"] == ["conv2", "bn2", "relu2"] and miss["value"] == "c2"
    assert "'c2' is a graph output" in miss["reason"]
    (row,) = [r for r in data["summary"] if r["pattern"] == "conv_bn_relu"]
    assert (row["fusions"], row["near_misses"]) == (1, 1)


def test_subgraph_is_the_replaced_nodes_with_their_edges_and_border(data: dict) -> None:
    sub = data["fusions"][0]["subgraph"]
    assert [n["op"] for n in sub["nodes"]] == ["Conv", "BatchNormalization", "Relu"]
    assert sub["edges"] == [[0, 1, "c1"], [1, 2, "n1"]]
    assert sub["inputs"] == [{"value": "x", "to": [0]}]
    assert sub["outputs"] == [{"value": "r1", "from": 2}]
    assert sub["weights"] == 5  # W1 and the four BN tensors: counted, not drawn
    fused = data["fusions"][0]["fused"]
    assert fused["op"] == "ConvBnRelu" and fused["inputs"] == ["x"] and fused["outputs"] == ["r1"]


def test_unnamed_nodes_are_found_in_the_original_graph() -> None:
    model = two_chains(named=False)
    result = fuser.fuse(model)
    data = collect(model, result, label="m", simulate=False)
    sub = data["fusions"][0]["subgraph"]
    assert [n["name"] for n in sub["nodes"]] == ["Conv#0", "BatchNormalization#1", "Relu#2"]
    assert [n["op"] for n in sub["nodes"]] == ["Conv", "BatchNormalization", "Relu"]
    assert sub["edges"] == [[0, 1, "c1"], [1, 2, "n1"]]
    assert data["timelines"] is None and data["fusions"][0]["simulated"] is None


def test_simulated_speedup_is_replaced_cycles_over_fused_cycles(data: dict) -> None:
    model = two_chains()
    result = fuser.fuse(model)
    before = profile_model(model, dims={"N": 2}, tuned=True)
    after = profile_model(result.model, dims={"N": 2}, tuned=True)
    unfused = sum(n.cycles for n in before.nodes if n.name in (TRICKY, "bn1", "relu1"))
    (fused,) = [n.cycles for n in after.nodes if n.op == "ConvBnRelu"]
    sim = data["fusions"][0]["simulated"]
    assert sim["unfused_cycles"] == pytest.approx(unfused)
    assert sim["fused_cycles"] == pytest.approx(fused)
    assert sim["speedup"] == pytest.approx(unfused / fused)
    t = data["timelines"]
    assert t["dims"] == {"N": 2}
    assert t["original"]["total_cycles"] == pytest.approx(before.total_cycles)
    kinds = {name: kind for _, _, name, _, kind in t["original"]["nodes"]}
    assert kinds == {TRICKY: REPLACED, "bn1": REPLACED, "relu1": REPLACED, "conv2": PLAIN,
                     "bn2": PLAIN, "relu2": PLAIN}  # fmt: skip
    fused_kinds = [kind for _, _, _, op, kind in t["fused"]["nodes"] if op == "ConvBnRelu"]
    assert fused_kinds == [FUSED]


def test_page_is_self_contained_and_carries_the_data_intact(data: dict) -> None:
    page = render_html(data)
    # The only URL is SVG's namespace name, which is never fetched.
    assert set(re.findall(r"https?://[^\s\"'`]+", page)) == {"http://www.w3.org/2000/svg"}
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=", page)
    # The tricky node name did not end the data script: the JSON reads back whole.
    embedded = re.search(
        r'<script id="fuser-data" type="application/json">(.*?)</script>', page, re.S
    )
    assert embedded is not None and json.loads(embedded.group(1)) == data


def test_write_is_atomic_and_leaves_only_the_page(tmp_path: Path, data: dict) -> None:
    target = tmp_path / "out" / "r.html"
    write_html(target, data)
    target.write_text("old")
    write_html(target, data)
    assert target.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in target.parent.iterdir()] == ["r.html"]


def test_a_zero_cycle_prediction_is_valid_json() -> None:
    from fuser.report import FusionRecord, Prediction, fusion_dict

    record = FusionRecord("p", "n", "Op", ("a",), {}, prediction=Prediction(0.0, 10.0))
    assert record.prediction is not None and record.prediction.speedup == float("inf")
    text = json.dumps(fusion_dict(record), allow_nan=False)  # raised before: inf is not JSON
    assert json.loads(text)["prediction"]["speedup"] is None


def test_a_fusion_inside_a_branch_is_listed_but_not_drawn() -> None:
    model = chain_in_branch()
    data = collect(model, fuser.fuse(model), label="m")
    main, branch = data["fusions"]
    assert main["graph"] == "" and main["subgraph"] and main["simulated"]
    assert branch["graph"] == "if.then_branch" and branch["nodes"] == ["conv2", "bn2", "relu2"]
    # Its nodes are not in the main graph (a main-graph node of the same name would be another
    # node), and profile does not look inside an If: nothing drawn, no simulated speedup.
    assert (branch["subgraph"], branch["fused"], branch["simulated"]) == (None, None, None)
