"""The direct reads of `patterns._walk` agree with the general ones they stand in for:
`constant_scalar` with `const` (numpy's reading of the tensor) on every form of one-element
Constant, and refuses every form it does not read; `attrs` with `attr` one name at a time."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuser.patterns._walk import NearMiss, attr, attrs, const, constant_scalar, scalar
from onnx import TensorProto, helper, numpy_helper

from fuser.graph import GraphIndex, TypeTable
from fuser.modelio import load_model


def _index(constants: dict[str, onnx.TensorProto]) -> GraphIndex:
    """A graph of one Constant node per tensor of `constants` (output named by its key)."""
    nodes = [helper.make_node("Constant", [], [name], value=t) for name, t in constants.items()]
    outputs = [
        helper.make_tensor_value_info(name, t.data_type, None) for name, t in constants.items()
    ]
    graph = helper.make_graph(nodes, "g", [], outputs)
    loaded = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    return GraphIndex.build(loaded.model.graph, loaded, {"": 17}, TypeTable())


# One-element values whose float32/float64 bits matter: a tiny epsilon, a double float32
# cannot hold, the largest float32, a negative zero, a subnormal.
_VALUES = [1e-5, 1e-12, 0.1, 2.0, 0.5, -0.0, 3.4028234663852886e38, 1e-45, 1.0000000001]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(), (1,)])
@pytest.mark.parametrize("value", _VALUES)
def test_constant_scalar_reads_what_const_reads(
    dtype: type, shape: tuple[int, ...], value: float
) -> None:
    tensor = numpy_helper.from_array(np.full(shape, value, dtype))
    assert tensor.raw_data  # the form exporters write, and the one read directly
    index = _index({"c": tensor})
    want = const(index, "c")
    assert want is not None
    found = constant_scalar(index, "c")
    assert found is not None
    number, rank = found
    assert rank == want.ndim
    assert type(number) is float
    assert np.array_equal(
        np.asarray([number], dtype).view(np.uint8), want.reshape(-1).view(np.uint8)
    )
    assert scalar(index, "c", "epsilon", 0, None) == float(want.reshape(-1)[0])


def test_constant_scalar_leaves_other_forms_to_const() -> None:
    typed = helper.make_tensor("t", TensorProto.FLOAT, [1], [0.25])  # float_data, not raw
    index = _index(
        {
            "typed": typed,
            "half": numpy_helper.from_array(np.array(0.5, np.float16)),
            "int": numpy_helper.from_array(np.array(2, np.int64)),
            "two": numpy_helper.from_array(np.array([1.0, 2.0], np.float32)),
            "row": numpy_helper.from_array(np.array([[1.0]], np.float32)),
        }
    )
    for name in ("typed", "half", "int", "two", "row"):
        assert constant_scalar(index, name) is None, name
    assert constant_scalar(index, "") is None
    assert constant_scalar(index, "missing") is None
    # `scalar` still reads them through `const`, with the same checks
    assert scalar(index, "typed", "epsilon", 0, None) == 0.25
    assert scalar(index, "half", "epsilon", 0, None) == 0.5
    assert scalar(index, "row", "epsilon", 0, None) == 1.0
    with pytest.raises(NearMiss, match="has rank 2, more than the input's 1"):
        scalar(index, "row", "epsilon", 0, 1)
    with pytest.raises(NearMiss, match="expected a single value"):
        scalar(index, "two", "epsilon", 0, None)


def test_scalar_refuses_a_rank_raising_raw_constant() -> None:
    index = _index({"c": numpy_helper.from_array(np.array([1e-5], np.float32))})
    assert scalar(index, "c", "epsilon", 0, 1) == float(np.float32(1e-5))
    with pytest.raises(NearMiss, match="has rank 1, more than the input's 0"):
        scalar(index, "c", "epsilon", 0, 0)


def test_attrs_reads_each_name_as_attr_does() -> None:
    node = helper.make_node(
        "LayerNormalization", ["x"], ["y"], axis=-2, epsilon=1e-6, name="n", domain=""
    )
    node.attribute.append(helper.make_attribute("axis", 5))  # a second "axis": the first wins
    node.attribute.append(helper.make_attribute("axes", [0, -1]))
    defaults = {"axis": -1, "epsilon": 1e-5, "stash_type": 1, "axes": None, "absent": "d"}
    read = attrs(node, defaults)
    assert list(read) == list(defaults)
    for name, default in defaults.items():
        assert read[name] == attr(node, name, default), name
    assert read == {
        "axis": -2,
        "epsilon": attr(node, "epsilon", 0),
        "stash_type": 1,
        "axes": [0, -1],
        "absent": "d",
    }
