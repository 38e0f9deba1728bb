"""`fuse --validate` reads its input once and infers the input's types once: validation reuses
the model fuse loaded and normalized (counted in-process, by wrapping the loader and shape
inference)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import fuser.api
import fuser.modelio
import fuser.ort
from fuser.cli import app


def cnn_file(folder: Path) -> Path:
    """Conv(3->5) -> BN -> Relu -> Conv(5->2) on a [1,3,6,7] input, saved in `folder`."""
    rng = np.random.default_rng(3)

    def init(name: str, values: np.ndarray) -> onnx.TensorProto:
        return numpy_helper.from_array(values.astype(np.float32), name)

    inits = [
        init("W", rng.standard_normal([5, 3, 3, 3])),
        init("s", rng.uniform(0.5, 1.5, [5])),
        init("b", rng.standard_normal([5])),
        init("m", rng.standard_normal([5])),
        init("v", rng.uniform(0.5, 2.0, [5])),
        init("W2", rng.standard_normal([2, 5, 1, 1])),
    ]
    nodes = [
        helper.make_node("Conv", ["X", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "W2"], ["Y"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 3, 6, 7])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 2, 6, 7])],
        inits,
    )
    path = folder / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def has_fused_nodes(model: onnx.ModelProto) -> bool:
    return any(n.domain == "fuser" for n in model.graph.node)


def test_fuse_validate_loads_the_input_once_and_infers_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: Counter[str] = Counter()
    load = fuser.modelio.load_model
    infer = onnx.shape_inference.infer_shapes

    def counting_load(source: Any, **kwargs: Any) -> Any:
        if not isinstance(source, onnx.ModelProto):  # a path or bytes: the input read again
            calls["load"] += 1
        return load(source, **kwargs)

    def counting_infer(model: onnx.ModelProto | bytes, *args: Any, **kwargs: Any) -> Any:
        seen = onnx.load_from_string(model) if isinstance(model, bytes) else model
        calls["infer fused" if has_fused_nodes(seen) else "infer original"] += 1
        return infer(model, *args, **kwargs)

    infer_path = onnx.shape_inference.infer_shapes_path

    def counting_infer_path(path: str, out: str, *args: Any, **kwargs: Any) -> Any:
        # check_infer hands the serialization over as a nameless file: counted the same
        seen = onnx.load_model(path, load_external_data=False)
        calls["infer fused" if has_fused_nodes(seen) else "infer original"] += 1
        return infer_path(path, out, *args, **kwargs)

    for module in (fuser.api, fuser.modelio, fuser.ort):
        monkeypatch.setattr(module, "load_model", counting_load)
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", counting_infer)
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes_path", counting_infer_path)

    source = cnn_file(tmp_path)
    out = tmp_path / "model.fused.onnx"
    result = CliRunner().invoke(
        app, ["fuse", str(source), "-o", str(out), "--validate", "--kernel", "reference"]
    )

    assert result.exit_code == 0, result.output
    assert "ConvBnRelu" in {n.op_type for n in onnx.load(out).graph.node}
    assert calls["load"] == 1
    assert calls["infer original"] == 1
