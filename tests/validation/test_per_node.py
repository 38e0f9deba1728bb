"""Per-node proof: a fused model broken at one fused node is caught, and the message names it."""

from __future__ import annotations

import numpy as np
import pytest
from fuser.models import get_example
from onnx import numpy_helper

from fuser.api import validate
from fuser.modelio import load_model
from fuser.mutants import mutants
from fuser.testing import fuse_all

# One example per family, with the families each one's fused nodes admit.
CASES = [
    ("cnn-edge", ("weight", "bias", "attribute")),
    ("bert", ("weight", "bias", "epsilon")),
    ("moe", ("attribute",)),
    ("tp-mlp", ("weight",)),
]


@pytest.mark.parametrize(("example", "families"), CASES)
def test_one_mutated_fused_node_per_family_is_caught_and_named(
    example: str, families: tuple[str, ...]
) -> None:
    original = get_example(example)
    result = fuse_all(original)
    assert validate(original, result, kernel="reference", runs=2).ok
    made: set[str] = set()
    for mutant in mutants(load_model(result.model), families):
        if mutant.family in made:
            continue  # the first applicable node of each family
        made.add(mutant.family)
        checked = validate(original, mutant.model, kernel="reference", runs=2)
        assert not checked.ok, f"{mutant.change} at {mutant.node} passed"
        first = checked.failures[0]
        assert first.where == "node" and first.node == mutant.node, first.message()
        assert f"fused node '{mutant.node}' ({mutant.op}" in first.message()
        assert f"run {first.run}, rank {first.rank}" in first.message()
    assert made == set(families)


def test_the_replaced_nodes_are_named_when_validating_a_fusion_result() -> None:
    original = get_example("cnn-edge")
    result = fuse_all(original)
    node = next(n for n in result.model.graph.node if n.domain == "fuser")
    w = next(t for t in result.model.graph.initializer if t.name == node.input[1])
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * np.float32(1.02), w.name))
    checked = validate(original, result, kernel="reference", runs=1)
    record = next(f for f in result.report.fusions if f.node == node.name)
    message = checked.failures[0].message()
    assert f"replaced {', '.join(record.replaced)}" in message, message
    assert "pattern conv_bn_relu" in message


def test_resnet_first_conv_bn_relu_weights_times_minus_3_is_caught() -> None:
    """Random inputs do not reach the network's output through that node (validate used to say
    ok, max abs 0); the node's own outputs show it."""
    original = get_example("resnet")
    result = fuse_all(original)
    fused = load_model(result.model)
    first = next(n for n in fused.model.graph.node if n.domain == "fuser")
    assert first.op_type == "ConvBnRelu"
    w = next(t for t in fused.model.graph.initializer if t.name == first.input[1])
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * np.float32(-3), w.name))
    for kernel in ("reference", "npu"):
        checked = validate(original, fused.model, kernel=kernel, runs=1)
        assert not checked.ok
        modes = {f.mode for f in checked.failures if f.node == first.name}
        # "stock" too: the function body computes the original chain with the same weights
        assert modes == {"isolated", "model", "stock"}, [f.message() for f in checked.failures]


def test_isolation_catches_a_node_whose_downstream_hides_it() -> None:
    """Two chained fused nodes: the first broken, the second fed the original's values still
    agrees, and only the first is named as run alone."""
    original = get_example("bert")
    result = fuse_all(original)
    fused = load_model(result.model)
    broken = next(m for m in mutants(fused, ("weight",)))
    checked = validate(original, broken.model, kernel="reference", runs=1)
    isolated = [f for f in checked.failures if f.mode == "isolated"]
    assert {f.node for f in isolated} == {broken.node}
    assert any(c.mode == "isolated" and c.ok for c in checked.nodes)
