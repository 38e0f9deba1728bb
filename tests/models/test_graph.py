"""The shared GraphBuilder and block repetition underneath every builder."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.models._graph import GraphBuilder, RandomSpec
from fuser.models._repeat import block_value, make_template, repeat_blocks
from model_checks import check, run


def test_names_are_scoped_and_unique() -> None:
    b = GraphBuilder("g", opset=13)
    x = b.input("x", [2, 3])
    with b.scope("layer.0"):
        y = b.op("Relu", x)
        z = b.op("Relu", y)
    assert (y, z) == ("/layer.0/Relu_output_0", "/layer.0/Relu_1_output_0")
    b.graph_output(z, "out", [2, 3])
    model = b.build()
    check(model)
    assert [n.name for n in model.graph.node] == ["/layer.0/Relu", "/layer.0/Relu_1"]
    assert model.graph.node[1].output == ["out"]


def test_build_once_and_dtype_checked() -> None:
    b = GraphBuilder("g", opset=13)
    b.build()
    with pytest.raises(RuntimeError, match="once"):
        b.build()
    with pytest.raises(ValueError, match="dtype"):
        GraphBuilder("g", opset=13, dtype="int8")  # type: ignore[arg-type]


def test_random_specs_redraw_the_same_distribution() -> None:
    rng = np.random.default_rng(0)
    uniform = RandomSpec("uniform", 0.5, 1.5).draw(rng, (10_000,))
    assert uniform.min() >= 0.5 and uniform.max() < 1.5
    normal = RandomSpec("normal", 0.0, 0.25).draw(rng, (10_000,))
    assert abs(float(normal.std()) - 0.25) < 0.01


def test_repeated_blocks_chain_and_compute() -> None:
    """Three copies of x -> x * w + 1 (w drawn per copy) equal the numpy composition."""

    def block(b: GraphBuilder, x: str) -> str:
        return b.op("Add", b.op("Mul", x, b.uniform([4], "w", 1.0, 2.0)), b.floats(1.0, "one"))

    template = make_template(block, scope="blk", opset=13, dtype="float32", seed=0)
    b = GraphBuilder("g", opset=13, seed=1)
    b.input(block_value(0, "blk"), [4])
    last = repeat_blocks(b, [template], [0, 0, 0])
    assert last == 3
    b.graph_output(block_value(3, "blk"), "y", [4])
    model = b.build()
    check(model)
    x = np.arange(4, dtype=np.float32)
    (y,) = run(model, {block_value(0, "blk"): x})
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    expected = x
    for i in (1, 2, 3):
        w = weights[f"/blk.{i:08d}/w"]
        assert w.min() >= 1.0 and w.max() < 2.0
        expected = expected * w + 1
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    assert len({weights[f"/blk.{i:08d}/w"].tobytes() for i in (1, 2, 3)}) == 3
