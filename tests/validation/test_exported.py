"""Real exports (tests/data/exported: BERT, GPT-2, Mixtral/Qwen MoE routers, CNNs; TorchScript
and dynamo; fp32 and fp16) fuse and validate with default flags: NPU kernels, 3 runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from fuser.api import fuse, validate

EXPORTED = sorted((Path(__file__).parent.parent / "data" / "exported").glob("*.onnx"))


@pytest.mark.parametrize("path", EXPORTED, ids=[p.stem for p in EXPORTED])
def test_exported_model_validates_with_default_flags(path: Path) -> None:
    result = fuse(str(path), cache=False)
    checked = validate(str(path), result)
    assert checked.ok, [c.message() for c in checked.failures]
    assert checked.kernel == "npu" and checked.runs == 3
    fused = {n.name for n in result.model.graph.node if n.domain == "fuser"}
    assert {c.node for c in checked.nodes if c.mode == "isolated"} == fused
