"""A Llama written by onnxruntime's own transformer optimizer (tests/data/ort_optimized, made by
scripts/ort_optimized_fixtures.py from exported llama-ts14): RMSNorm as ONNX-domain
SimplifiedLayerNormalization, a model onnxruntime runs and onnx's checker alone refuses. It
fuses, validates on both kernels, matches PyTorch's outputs and loads in stock onnxruntime; the
optimizer's com.microsoft SkipSimplifiedLayerNormalization (a residual Add folded in) is left
as it was."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from fuser.api import fuse, validate
from fuser.fusedop import DOMAIN
from fuser.ort import session
from fuser.testing import assert_runs_stock

DATA = Path(__file__).parent.parent / "data"
SLN = ("", "SimplifiedLayerNormalization")
SKIP = ("com.microsoft", "SkipSimplifiedLayerNormalization")

# name: (ONNX-domain SLNs, SkipSLNs in the optimized model, RmsNormMatMuls, their Linears)
EXPECTED = {
    "llama-ortopt-ts14": (1, 4, 1, 3),  # the first norm -> q, k, v; the Skip forms stay
    "llama-ortopt-noskip-ts14": (5, 0, 5, 11),  # as llama-ts14's decomposed RMSNorms fuse
}


def ops(model: onnx.ModelProto, kind: tuple[str, str]) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if (n.domain, n.op_type) == kind]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ort_optimized_llama_fuses_and_validates(name: str) -> None:
    path = DATA / "ort_optimized" / f"{name}.onnx"
    assert path.stat().st_size < 300_000
    original = onnx.load(path)
    slns, skips, fused_count, linears = EXPECTED[name]
    assert (len(ops(original, SLN)), len(ops(original, SKIP))) == (slns, skips)

    result = fuse(str(path), cache=False)
    model = result.model
    fused = [n for n in model.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in fused] == ["RmsNormMatMul"] * fused_count
    assert sum(len(n.output) - 1 for n in fused) == linears  # one Y per Linear, after N
    assert ops(model, SLN) == []
    assert [n.SerializeToString() for n in ops(model, SKIP)] == [
        n.SerializeToString() for n in ops(original, SKIP)
    ]

    for kernel in ("npu", "reference"):
        checked = validate(str(path), result, kernel=kernel)
        assert checked.ok, [c.message() for c in checked.failures]
        assert checked.kernel == kernel and checked.runs == 3
        assert {c.node for c in checked.nodes if c.mode == "isolated"} == {n.name for n in fused}

    torch_run = np.load(DATA / "exported" / "llama-ts14.npz")
    feeds = {k.removeprefix("in_"): torch_run[k] for k in torch_run.files if k.startswith("in_")}
    (got,) = session(model, kernel="npu").run(None, feeds)
    np.testing.assert_allclose(got, torch_run["out_0"], rtol=1e-4, atol=1e-4)

    assert assert_runs_stock(original, model) == ["RmsNormMatMul"]
