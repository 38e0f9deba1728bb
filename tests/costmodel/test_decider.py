"""The cost-model decider in `fuse`: tilings stored, slowdowns refused (unless forced),
symbolic shapes tiled at run time by the same search."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from fuser.kernels import search as kernel_search
from fuser.kernels.api import TensorMeta
from fuser.kernels.npu.machine import load_target
from fuser.kernels.registry import get_kernel
from fuser.models import cnn_edge, get_example

import fuser
from fuser.api import fuse
from fuser.costmodel import CostModelDecider, Priced
from fuser.fusedop import DOMAIN
from fuser.graph import GraphIndex
from fuser.pattern import Match

B910 = load_target("ascend910b")


def fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == DOMAIN]


def attrs_of(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@pytest.fixture
def decider(tmp_path: Path) -> CostModelDecider:
    return CostModelDecider.for_target("ascend910b", cache=tmp_path / "c.sqlite")


def test_static_shapes_get_a_fitting_tiling_and_a_prediction(decider: CostModelDecider) -> None:
    result = fuse(cnn_edge(batch=1), decider=decider)
    nodes = fused_nodes(result.model)
    assert nodes and len(nodes) == len(result.report.fusions)
    kernel = get_kernel(DOMAIN, "ConvBnRelu")
    assert kernel is not None
    for node, record in zip(nodes, result.report.fusions, strict=True):
        attrs = attrs_of(node)
        tiling = kernel.tiling_from_attrs(attrs)
        assert tiling is not None
        assert record.prediction is not None
        p = record.prediction
        assert 0 < p.fused_cycles < p.unfused_cycles
        assert {f"tile_{k}": v for k, v in p.tiling.items()} == kernel.tiling_to_attrs(tiling)
    # The tiled model passes onnx's checker (tile_* attributes are in the schema) and runs.
    onnx.checker.check_model(result.model, full_check=True)
    assert fuser.validate(cnn_edge(batch=1), result, kernel="npu", runs=1).ok


class Pessimist(CostModelDecider):
    """Prices every fused op at ten times the unfused chain."""

    def price_fused(self, graph: GraphIndex, match: Match) -> Priced:
        real = super().price_fused(graph, match)
        unfused = self.price_unfused(graph, match)
        return Priced(10 * unfused.cycles, real.tiling, real.symbolic)


def test_a_predicted_slowdown_is_refused_with_the_reason_and_force_overrides(
    tmp_path: Path,
) -> None:
    model = cnn_edge(batch=1)
    refused = fuse(model, decider=Pessimist.for_target("ascend910b", cache=False)).report
    assert not refused.fusions
    reasons = [r.reason for r in refused.rejected if r.reason.startswith("cost model")]
    assert reasons
    assert all(
        r.startswith("cost model predicts fused ") and " cycles > unfused " in r
        and r.endswith(" cycles on ascend910b")
        for r in reasons
    ), reasons  # fmt: skip
    forced = fuse(model, decider=Pessimist.for_target("ascend910b", force=True, cache=False))
    assert len(forced.report.fusions) == len(reasons)
    for f in forced.report.fusions:
        assert f.prediction is not None and f.prediction.fused_cycles > f.prediction.unfused_cycles


def test_default_fuse_uses_the_cost_model(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    report = fuse(cnn_edge(batch=1)).report
    assert report.fusions and all(f.prediction is not None for f in report.fusions)
    assert (tmp_path / "fuser" / "tuning.sqlite").exists()


def test_symbolic_shapes_store_no_tiling_and_the_kernel_tiles_at_run_time(
    decider: CostModelDecider,
) -> None:
    model = get_example("moe")  # batch and seq are symbolic
    result = fuse(model, decider=decider)
    (node,) = fused_nodes(result.model)
    assert not [a for a in attrs_of(node) if a.startswith("tile_")]
    (record,) = result.report.fusions
    assert record.prediction is not None  # priced with the symbolic dims at a stand-in size
    # At run time: the actual shape, no stored tiling -> the search's pick, which fits.
    kernel = get_kernel(DOMAIN, node.op_type)
    assert kernel is not None
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs_of(node).items()}
    for points in (1, 37, 3000):
        metas = [TensorMeta((points, 4), np.float32)]
        tiling = kernel.host_tiling(metas, attrs, B910)
        kernel.check_tiling(metas, attrs, tiling, B910)
        assert tiling == kernel_search.search(DOMAIN, node.op_type, metas, attrs, B910).best.tiling
        x = np.random.default_rng(points).standard_normal((points, 4)).astype(np.float32)
        run = kernel.run(B910, [x], attrs)  # no tiling given: host tiling
        assert run.outputs[0].shape == (points, attrs["k"])
    # And the whole fused model runs on the NPU kernels with concrete inputs.
    assert fuser.validate(model, result, kernel="npu", runs=1).ok
