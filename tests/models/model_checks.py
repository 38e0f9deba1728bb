"""Shared checks for the model-builder tests: validate, run in onnxruntime, count ops."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort

# Sizes given to symbolic dims when a test runs a model.
SYMBOLIC_SIZES = {"N": 2, "batch": 2, "seq": 6, "L": 19, "tokens": 6}


def check(model: onnx.ModelProto) -> onnx.ModelProto:
    """Full checker + strict shape inference; returns the inferred model."""
    onnx.checker.check_model(model, full_check=True)
    return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)


def random_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input; int64 inputs are token ids (or a 0/1 mask)."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.input:
        t = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else SYMBOLIC_SIZES[d.dim_param]
                 for d in t.shape.dim]  # fmt: skip
        if t.elem_type == onnx.TensorProto.INT64:
            high = 2 if "mask" in value.name else 16
            feeds[value.name] = rng.integers(0, high, size=shape, dtype=np.int64)
            if "mask" in value.name:
                feeds[value.name][..., 0] = 1  # every row attends to something
        else:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # fp16 constant-folding warnings are expected noise
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
    """Run in onnxruntime and check every output is finite with the declared rank and dims."""
    feeds = feeds if feeds is not None else random_inputs(model)
    outputs = session(model).run(None, feeds)
    for value, out in zip(model.graph.output, outputs, strict=True):
        dims = value.type.tensor_type.shape.dim
        assert out.ndim == len(dims), value.name
        for d, size in zip(dims, out.shape, strict=True):
            if d.HasField("dim_value"):
                assert d.dim_value == size, value.name
        assert np.isfinite(out).all(), value.name
    return list(outputs)


def op_counts(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def readers(model: onnx.ModelProto, value: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if value in n.input]


def producer(model: onnx.ModelProto, value: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if value in n.output)


def producer_op(model: onnx.ModelProto, value: str) -> str:
    """Op type of the node producing ``value``; "" for inputs and initializers."""
    return next((n.op_type for n in model.graph.node if value in n.output), "")
