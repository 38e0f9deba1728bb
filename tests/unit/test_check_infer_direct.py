"""An input fuser has not changed is checked and inferred from its own file (no serialization of
it is made): the types and the messages are those of the serialized route, a file changed since
it was read is never trusted, and one walk over the nodes finds what the views rename."""

from __future__ import annotations

import os

import onnx
import pytest
from fuser.models.synthetic import cnn_graph, transformer_graph
from onnx import TensorProto, defs, helper

from fuser import api, check_infer
from fuser.checkview import LEGACY_LAYERNORM, checker_view, scan_nodes
from fuser.errors import ModelLoadError, UnsafeExternalDataError
from fuser.fusedop import DOMAIN
from fuser.modelio import TENSOR_ATTRIBUTE_OPS, load_model, unchanged_on_disk
from fuser.registry import ensure_fused_ops_registered

pytestmark = pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="Linux's O_TMPFILE")


def _serializations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the serializations `check_and_infer` hands to the tools."""
    made: list[int] = []
    real = check_infer.serialized

    def counting(model: onnx.ModelProto):  # type: ignore[no-untyped-def]
        made.append(1)
        return real(model)

    monkeypatch.setattr(check_infer, "serialized", counting)
    return made


def _table(checked) -> dict[str, object]:  # type: ignore[no-untyped-def]
    assert checked is not None
    table = checked[0][""]
    return {name: table[name] for name in table}


@pytest.mark.parametrize(
    "model",
    [cnn_graph(90, batch=1, channels=3), transformer_graph(70, batch="b", seq=5)],
    ids=["cnn", "transformer-symbolic"],
)
def test_an_unchanged_file_is_read_as_is_with_the_same_types(model, tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    made = _serializations(monkeypatch)
    direct = _table(check_infer.check_and_infer(load_model(path), as_read=True))
    assert made == []  # the tools read m.onnx itself
    serialized = _table(check_infer.check_and_infer(load_model(path)))
    assert made == [1]
    assert direct == serialized
    assert len(direct) > 100


def _two_values(name: str, dims: list[int]) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], [name])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_file_replaced_after_it_was_read_is_not_trusted(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    onnx.save(_two_values("y", [2, 3]), path)
    loaded = load_model(path)
    assert unchanged_on_disk(loaded)
    other = tmp_path / "other.onnx"
    onnx.save(_two_values("z", [5]), other)
    other.replace(path)  # a new file of that name: not what was read
    assert not unchanged_on_disk(loaded)
    made = _serializations(monkeypatch)
    types = _table(check_infer.check_and_infer(loaded, as_read=True))
    assert made == [1]
    assert "y" in types and "z" not in types
    assert types["y"].shape == (2, 3)


def test_a_file_name_that_is_not_utf8_is_serialized_instead(tmp_path, monkeypatch):
    path = tmp_path / os.fsdecode(b"m\xff.onnx")  # onnx's bindings take UTF-8 paths only
    onnx.save(_two_values("y", [3]), path)
    made = _serializations(monkeypatch)
    assert _table(check_infer.check_and_infer(load_model(path), as_read=True))["y"].shape == (3,)
    assert made == [1]


def test_a_model_given_in_memory_is_never_read_from_a_file(monkeypatch):
    made = _serializations(monkeypatch)
    loaded = load_model(_two_values("y", [4]))
    assert not unchanged_on_disk(loaded)
    assert _table(check_infer.check_and_infer(loaded, as_read=True))["y"].shape == (4,)
    assert made == [1]


def _with_external_constant(location: str, domain: str = "") -> onnx.ModelProto:
    """`_two_values` plus a node (a Constant, or a custom op of `domain`) whose tensor attribute
    is external data at `location`."""
    model = _two_values("y", [2])
    value = helper.make_tensor("c", TensorProto.FLOAT, [2], [1.0, 2.0])
    op = "Custom" if domain else "Constant"
    model.graph.node.insert(0, helper.make_node(op, [], ["k"], value=value, domain=domain))
    if domain:
        model.opset_import.append(helper.make_opsetid(domain, 1))
    tensor = next(a.t for a in model.graph.node[0].attribute if a.name == "value")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", location
    return model


def test_external_data_is_never_checked_from_the_inputs_folder(tmp_path, monkeypatch):
    # The checker resolves external data against the folder of the file it reads: a Constant
    # node's external tensor would be found next to the input, not next to a serialization.
    (tmp_path / "k.bin").write_bytes(bytes(8))  # two float zeros
    model = _with_external_constant("k.bin")
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    loaded = load_model(path)
    assert loaded.external and unchanged_on_disk(loaded)
    made = _serializations(monkeypatch)
    outcomes = []
    for as_read in (True, False):
        try:
            table = _table(check_infer.check_and_infer(loaded, as_read=as_read))
            outcomes.append(sorted((name, table[name].shape) for name in table if name != "x"))
        except ModelLoadError as exc:
            outcomes.append([str(exc)])
    assert made == [1, 1]  # serialized both times
    assert outcomes[0] == outcomes[1] == [("k", (2,)), ("y", (2,))]


def test_an_invalid_file_gets_the_same_message_either_way(tmp_path):
    bad = _two_values("y", [2])
    bad.graph.node[0].op_type = "NoSuchOp"
    path = tmp_path / "bad.onnx"
    onnx.save(bad, path)
    messages = []
    for as_read in (True, False):
        with pytest.raises(ModelLoadError) as caught:
            check_infer.check_and_infer(load_model(path), as_read=as_read)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"{path}: invalid ONNX model: ")
    assert "NoSuchOp" in messages[0]


def test_fuse_reads_the_file_only_when_normalize_changed_nothing(tmp_path, monkeypatch):
    seen: list[bool] = []
    real = api.engine.check_and_infer

    def spy(loaded, *, as_read=False, scan=None):  # type: ignore[no-untyped-def]
        seen.append(as_read)
        return real(loaded, as_read=as_read, scan=scan)

    monkeypatch.setattr(api.engine, "check_and_infer", spy)
    model = _two_values("y", [2, 3])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    api.fuse(path, cache=False)
    unsorted = _two_values("y", [2, 3])
    unsorted.graph.node[0].output[0] = "y0"
    unsorted.graph.node.insert(0, helper.make_node("Relu", ["y0"], ["y"]))  # reads y0 too early
    model = unsorted
    onnx.save(model, path)
    result = api.fuse(path, cache=False)
    assert any("sorted topologically" in n for n in result.report.normalized)
    # Unsorted: the file as read (the checker refuses it: only then are the nodes sorted and
    # their order checked), then the sorted model's own serialization.
    assert seen == [True, True, False]


def _legacy_in_a_branch() -> onnx.ModelProto:
    """Opset 16 LayerNormalization nodes (onnxruntime's contrib op) in the main graph and in an
    If branch, behind a node of another domain."""

    def layernorm(x: str, y: str) -> onnx.NodeProto:
        return helper.make_node("LayerNormalization", [x, "scale"], [y], name=f"ln_{y}")

    def branch(name: str, nodes: list[onnx.NodeProto], out: str) -> onnx.GraphProto:
        return helper.make_graph(
            nodes, name, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2, 4])]
        )

    then = branch("then", [layernorm("a", "t")], "t")
    other = branch("else", [helper.make_node("Identity", ["a"], ["e"])], "e")
    graph = helper.make_graph(
        [
            layernorm("x", "a"),
            helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor("scale", TensorProto.FLOAT, [4], [1.0] * 4)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])


def test_one_walk_finds_legacy_nodes_in_subgraphs_in_graph_order():
    model = _legacy_in_a_branch()
    scan = scan_nodes(model)
    assert [n.name for n in scan.layernorms] == ["ln_a", "ln_t"]
    assert scan.simplified == [] and scan.nested and scan.legacy
    view = checker_view(model).model
    branch = next(a.g for a in view.graph.node[1].attribute if a.name == "then_branch")
    assert [view.graph.node[0].op_type, branch.node[0].op_type] == [LEGACY_LAYERNORM] * 2
    assert model.graph.node[0].op_type == "LayerNormalization"  # the model is not changed
    onnx.checker.check_model(view)  # the view is what the checker accepts


def test_a_graph_of_standard_ops_holds_no_subgraph_and_renames_nothing():
    scan = scan_nodes(cnn_graph(30, batch=1, channels=3))
    assert (scan.layernorms, scan.simplified, scan.nested, scan.legacy) == ([], [], False, False)
    custom = _two_values("y", [2])
    custom.graph.node[0].domain = "com.example"  # another domain's node may carry graphs
    assert scan_nodes(custom).nested and not scan_nodes(custom).legacy


def test_the_ops_whose_attributes_are_read_at_load_are_those_onnx_declares():
    kinds = {
        defs.OpSchema.AttrType.TENSOR,
        defs.OpSchema.AttrType.TENSORS,
        defs.OpSchema.AttrType.GRAPH,
        defs.OpSchema.AttrType.GRAPHS,
        defs.OpSchema.AttrType.SPARSE_TENSOR,
        defs.OpSchema.AttrType.SPARSE_TENSORS,
    }
    declared = {
        schema.name
        for schema in defs.get_all_schemas_with_history()
        if schema.domain in ("", "ai.onnx")
        and any(a.type in kinds for a in schema.attributes.values())
    }
    assert declared == TENSOR_ATTRIBUTE_OPS


@pytest.mark.parametrize("domain", ["", "com.example"])
def test_an_escaping_location_on_a_node_is_refused_at_load(tmp_path, domain):
    model = _with_external_constant("../outside.bin", domain)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(UnsafeExternalDataError, match=r"'\.\./outside\.bin' outside the model's"):
        load_model(path)


def test_nodes_of_a_schema_without_graph_attributes_are_not_walked_into():
    ensure_fused_ops_registered()
    model = _two_values("y", [2])
    node = model.graph.node[0]
    node.op_type, node.domain = "ConvBnRelu", DOMAIN  # a fused op: its schema has no graph
    assert not scan_nodes(model).nested
    node.op_type = "NoSuchFusedOp"  # no schema: it may carry graphs
    assert scan_nodes(model).nested
