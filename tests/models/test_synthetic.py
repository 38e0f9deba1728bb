"""Synthetic benchmark graphs: node counts, speed, validity, chain density, distinct weights."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.models.inventory import count_chains
from fuser.models.synthetic import cnn_graph, transformer_graph
from model_checks import check, run

BUILDERS = [cnn_graph, transformer_graph]


def _layers(model: onnx.ModelProto, scope: str) -> list[str]:
    """Distinct block ids in node names ``/scope.<id>/...``, in graph order."""
    ids = dict.fromkeys(
        n.name.split("/")[1] for n in model.graph.node if n.name.startswith(f"/{scope}.")
    )
    return list(ids)


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("n_nodes", [1000, 10_000, 100_000])
def test_node_count_within_10_percent(builder, n_nodes: int) -> None:  # type: ignore[no-untyped-def]
    # Build speed is measured by benchmarks/fuse_speed.py, not asserted on wall time here
    # (a loaded machine made this flaky).
    model = builder(n_nodes)
    assert abs(len(model.graph.node) - n_nodes) <= 0.1 * n_nodes
    assert model.ByteSize() < 400 * n_nodes  # tiny tensors: the file stays small


@pytest.mark.parametrize("builder", BUILDERS)
def test_small_graph_is_valid_and_runs(builder) -> None:  # type: ignore[no-untyped-def]
    model = builder(1000)
    check(model)
    run(model)
    assert builder(1000).SerializeToString() == model.SerializeToString()


@pytest.mark.parametrize("builder", BUILDERS)
def test_float16(builder) -> None:  # type: ignore[no-untyped-def]
    model = builder(500, dtype="float16")
    check(model)
    assert run(model)[0].dtype == np.float16


def test_ten_thousand_nodes_pass_the_checker() -> None:
    check(cnn_graph(10_000))
    check(transformer_graph(10_000))


def test_cnn_chain_density() -> None:
    model = cnn_graph(10_000)
    blocks = _layers(model, "block")
    kinds = [i % 3 for i in range(len(blocks))]
    counts = count_chains(model)
    # stem + one per residual + one per depthwise block have a Relu after the BN
    assert counts["conv_bn_relu"] == 1 + kinds.count(0) + kinds.count(1)
    assert counts["conv_bn"] == kinds.count(0) + kinds.count(2)
    depthwise = [
        n for n in model.graph.node
        if n.op_type == "Conv" and any(a.name == "group" and a.i == 4 for a in n.attribute)
    ]  # fmt: skip
    assert len(depthwise) == kinds.count(1)


def test_transformer_chain_density() -> None:
    model = transformer_graph(10_000)
    layers = len(_layers(model, "layers"))
    kinds = [i % 4 for i in range(layers)]
    moe = kinds.count(3)
    counts = count_chains(model)
    assert counts["layernorm"] == 2 * layers + 1
    assert counts["layernorm_matmul"] == 2 * layers - moe + 1
    assert counts["layernorm_matmuls"] == 3 * layers + 2 * (layers - moe) + 1
    assert counts["softmax_topk"] == moe
    ops = {n.op_type for n in model.graph.node}
    assert {"LayerNormalization", "Pow", "Reciprocal", "Cast", "TopK", "OneHot"} <= ops


def test_every_copy_has_its_own_weights() -> None:
    model = cnn_graph(1000)
    inits = model.graph.initializer
    assert len({t.name for t in inits}) == len(inits)
    weights = [t.raw_data for t in inits if len(t.dims) == 4 and t.dims[1] == 4]
    assert len(weights) > 100
    assert len(set(weights)) == len(weights)
    variances = [t for t in inits if t.name.endswith("running_var")]
    assert all((onnx.numpy_helper.to_array(t) >= 0.5).all() for t in variances)


def test_transformer_needs_opset_17() -> None:
    with pytest.raises(ValueError, match="opset >= 17"):
        transformer_graph(1000, opset=13)
