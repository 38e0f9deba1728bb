"""The decider prices an unfused chain at one consistent size, views included."""

from __future__ import annotations

from fuser.models import get_example

from fuser.api import fuse


def test_layernorm_reshape_gemm_is_priced_at_the_layernorm_rows() -> None:
    """GPT-2's LN -> Reshape([-1, D]) -> Gemm: shape inference loses the Reshape's leading dim.
    Pricing it as a symbolic size made the unfused Gemm 256x too cheap and refused every
    fusion; the simulator shows them ~2.6x faster fused."""
    result = fuse(get_example("gpt2-ln"), cache=False)
    assert result.report.summary["layernorm_matmul"] == 5, [
        r.reason for r in result.report.rejected
    ]
    for fusion in result.report.fusions:
        assert fusion.prediction is not None
        assert fusion.prediction.unfused_cycles > 1.2 * fusion.prediction.fused_cycles
