"""Each distinct problem is searched once: `tune` dedupes identical fused nodes, and a
warm-cache `fuse` searches neither the fused nor the unfused side of a decision."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fuser.kernels import search as kernel_search
from fuser.kernels.npu.machine import load_target
from fuser.models import get_example
from fuser.models.synthetic import cnn_graph

from fuser.api import fuse
from fuser.costmodel import CostModelDecider
from fuser.tune import node_metas, node_signature, tune_model

B910 = load_target("ascend910b")


def counting(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count every search (the full ranking and the fast one), by op type."""
    calls: Counter[str] = Counter()
    full, fast = kernel_search.search, kernel_search.best

    def search(domain: str, op: str, *args: Any, **kw: Any) -> Any:
        calls[op] += 1
        return full(domain, op, *args, **kw)

    def best(domain: str, op: str, *args: Any, **kw: Any) -> Any:
        calls[op] += 1
        return fast(domain, op, *args, **kw)

    monkeypatch.setattr(kernel_search, "search", search)
    monkeypatch.setattr(kernel_search, "best", best)
    kernel_search.clear_memo()
    return calls


def test_tune_searches_each_distinct_node_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CNN repeating its blocks, symbolic batch tuned at 2.
    source = cnn_graph(120, channels=16, image_size=8)
    model = fuse(source, decider=CostModelDecider.for_target("ascend910b", cache=False)).model
    nodes = [n for n in model.graph.node if n.domain == "fuser"]
    distinct = {node_signature(n.op_type, *node_metas(model, n, 2)) for n in nodes}
    assert 1 < len(distinct) < len(nodes)  # the example repeats layers
    calls = counting(monkeypatch)
    tuned = tune_model(model, B910, symbolic_size=2)
    assert sum(calls.values()) == len(distinct)
    assert [t.name for t in tuned] == [n.name for n in nodes]
    by_signature: dict[Any, Any] = {}
    for n, t in zip(nodes, tuned, strict=True):
        key = node_signature(n.op_type, *node_metas(model, n, 2))
        first = by_signature.setdefault(key, t)
        assert (t.chosen, t.candidates, t.shapes) == (first.chosen, first.candidates, first.shapes)


def test_a_warm_cache_fuse_searches_neither_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "c.sqlite"
    model = get_example("resnet")
    calls = counting(monkeypatch)
    cold = fuse(model, decider=CostModelDecider.for_target("ascend910b", cache=cache))
    assert calls["Conv"] > 0 and calls["ConvBnRelu"] > 0
    calls.clear()
    kernel_search.clear_memo()
    warm = fuse(model, decider=CostModelDecider.for_target("ascend910b", cache=cache))
    assert sum(calls.values()) == 0, calls
    assert [f.prediction for f in warm.report.fusions] == [
        f.prediction for f in cold.report.fusions
    ]
    # Without the cache the same run searches again.
    kernel_search.clear_memo()
    fuse(model, decider=CostModelDecider.for_target("ascend910b", cache=False))
    assert calls["Conv"] > 0
