"""`TypeTable.add_initializers` then `add_tensors` of the same tensors (the inferred table, then
the graph's index): the index gets what a fresh `add_tensors` would give, whatever changed
in between."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from fuser.graph import TypeTable, ValueType


def _graph(seed: int) -> onnx.GraphProto:
    """Initializers of random shapes, one name repeated (the first is the table's, the last
    the index's)."""
    rng = np.random.default_rng(seed)
    graph = onnx.GraphProto()
    for i in range(int(rng.integers(3, 9))):
        shape = [int(d) for d in rng.integers(1, 4, size=int(rng.integers(0, 4)))]
        graph.initializer.append(numpy_helper.from_array(np.zeros(shape, np.float32), f"w{i}"))
    graph.initializer.append(numpy_helper.from_array(np.zeros([5], np.int64), "w0"))
    return graph


def _fresh(graph: onnx.GraphProto, before: TypeTable) -> tuple[dict, dict]:
    """What `add_tensors` gives a table holding what `before` holds, and its types after."""
    table = TypeTable()
    for name in before:
        table[name] = before[name]
    by_name = table.add_tensors(graph.initializer)
    return by_name, {name: table[name] for name in table}


def _change(graph: onnx.GraphProto, table: TypeTable, how: str) -> None:
    if how == "renamed":
        graph.initializer[1].name = "renamed"
    elif how == "removed":
        del graph.initializer[2]
    elif how == "added":
        graph.initializer.append(numpy_helper.from_array(np.zeros([7], np.float32), "late"))
    elif how == "replaced":
        graph.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros([9], np.float32), "w0"))
    elif how == "reordered":
        first = onnx.TensorProto()
        first.CopyFrom(graph.initializer[0])
        del graph.initializer[0]
        graph.initializer.append(first)
    elif how == "forgotten":
        del table["w1"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "how", ["unchanged", "renamed", "removed", "added", "replaced", "reordered", "forgotten"]
)
def test_the_index_gets_what_a_fresh_add_would_give(seed, how):
    graph = _graph(seed)
    table = TypeTable()
    table.add_initializers(graph.initializer)
    _change(graph, table, how)
    expected, expected_types = _fresh(graph, table)
    by_name = table.add_tensors(graph.initializer)
    assert list(by_name) == list(expected)
    assert all(by_name[n] is expected[n] for n in expected)  # the graph's own tensors
    assert {name: table[name] for name in table} == expected_types
    assert table["w0"] == ValueType(onnx.TensorProto.FLOAT, table["w0"].shape)


def test_the_dict_is_handed_out_once():
    graph = _graph(0)
    table = TypeTable()
    table.add_initializers(graph.initializer)
    first = table.add_tensors(graph.initializer)
    first.pop("w1")  # the index changes its own dict
    second = table.add_tensors(graph.initializer)
    assert second is not first and "w1" in second
