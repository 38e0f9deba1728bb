"""Decisions at symbolic shapes hold over a range of sizes, and agree with the simulator there."""

from __future__ import annotations

from pathlib import Path

import pytest
from fuser.models import get_example

from fuser.api import fuse
from fuser.costmodel import CostModelDecider, Priced
from fuser.graph import GraphIndex
from fuser.pattern import Match
from fuser.profile import profile_model

GPT2 = Path(__file__).parents[1] / "data" / "exported" / "gpt2-dynamo18.onnx"
RANGE_NOTE = "symbolic dims decided over sizes 1..4096 (1, 16, 256, 4096)"


def _total(model: object, dims: dict[str, int]) -> float:
    return sum(n.stats.cycles for n in profile_model(model, dims=dims).nodes)  # type: ignore[arg-type]


def test_gpt2_export_fuses_every_layernorm_gemm_and_the_simulator_agrees() -> None:
    result = fuse(GPT2, cache=False)
    # 4 LN -> Reshape -> Gemm, and ln_f -> identity view -> lm_head MatMul
    assert result.report.summary["layernorm_matmul"] == 5, [
        r.reason for r in result.report.rejected
    ]
    for f in result.report.fusions:
        assert any(RANGE_NOTE in n for n in f.notes), f.notes
    for seq in (1, 512):
        dims = {"batch": 1, "seq": seq}
        assert _total(result.model, dims) <= _total(GPT2, dims)


@pytest.mark.parametrize("name", ["tp-mlp", "tp-mlp-negaxis", "sp-mlp", "sp-mlp-bsh"])
def test_tensor_parallel_mlps_are_decided_as_the_simulator_says(name: str) -> None:
    model = get_example(name)
    result = fuse(model, cache=False)
    assert result.report.summary["allgather_matmul"] == 1, [
        r.reason for r in result.report.rejected
    ]
    names = {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim}
    for size in (8, 512):
        dims = {d: (2 if d == "batch" else size) for d in names if d}
        # The fused model's kernels tile at run time; within the model's pick error (3%).
        assert _total(result.model, dims) <= 1.03 * _total(model, dims)


class SlowAtLargeSizes(CostModelDecider):
    """Prices the fused op at twice the unfused chain once a symbolic size reaches 4096."""

    def price_fused(self, graph: GraphIndex, match: Match) -> Priced:
        real = super().price_fused(graph, match)
        if real.symbolic and self.symbolic_size >= 4096:
            return Priced(2 * self.price_unfused(graph, match).cycles, real.tiling, True)
        return real


def test_a_fusion_slower_at_one_size_of_the_range_is_refused_naming_it() -> None:
    decider = SlowAtLargeSizes.for_target("ascend910b", cache=False)
    report = fuse(get_example("tp-mlp"), decider=decider).report
    assert not report.fusions
    (reason,) = [r.reason for r in report.rejected]
    assert " > unfused " in reason
    assert "at symbolic size 4096" in reason
    assert RANGE_NOTE in reason
    # Fixing the dim below the slow sizes (as `--dim` would) lets it through, and says so.
    fixed = SlowAtLargeSizes.for_target("ascend910b", cache=False)
    fixed = type(fixed)(fixed.target, fixed.machine, cache=None, dims={"batch": 2, "seq": 8},
                        symbolic_range=(1, 16, 256))  # fmt: skip
    ok = fuse(get_example("tp-mlp"), decider=fixed).report
    assert len(ok.fusions) == 1
    assert any("batch=2, seq=8" in n for n in ok.fusions[0].notes), ok.fusions[0].notes


class SlowAtSmallSizes(CostModelDecider):
    """Prices the fused op at twice the unfused chain at sizes below 16, and records the
    symbolic sizes it was asked to price."""

    def price_fused(self, graph: GraphIndex, match: Match) -> Priced:
        ASKED.append(self.symbolic_size)
        real = super().price_fused(graph, match)
        if real.symbolic and self.symbolic_size < 16:
            return Priced(2 * self.price_unfused(graph, match).cycles, real.tiling, True)
        return real


ASKED: list[int] = []


@pytest.mark.parametrize("force", [False, True])
def test_the_range_stops_at_the_first_size_it_is_slower_at(force: bool) -> None:
    # The sizes go up from 1: slower there decides (refused, or forced with that reason), and
    # 16 and 4096 are not priced for nothing. The prediction is still the one at 256.
    ASKED.clear()
    decider = SlowAtSmallSizes.for_target("ascend910b", cache=False, force=force)
    report = fuse(get_example("tp-mlp"), decider=decider).report
    assert ASKED == [256, 1], ASKED
    if force:
        (fusion,) = report.fusions
        assert any("forced: predicted slower" in n and RANGE_NOTE in n for n in fusion.notes)
    else:
        assert not report.fusions
        (reason,) = [r.reason for r in report.rejected]
        assert "at symbolic size 1 " in reason and RANGE_NOTE in reason
