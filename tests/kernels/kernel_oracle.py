"""The oracle for kernel tests: onnxruntime running one ONNX node (or a short chain).

float16 inputs are upcast to float32 before onnxruntime sees them: the NPU kernels compute
fp16 with fp32 accumulation, so the fp32 result of the same fp16 values is the reference,
compared with fp16 tolerances.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort
from fuser.kernels.npu.machine import load_target
from onnx import TensorProto, helper

MACHINE = load_target("ascend910b")

_ELEM = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.bool_): TensorProto.BOOL,
    np.dtype(np.float16): TensorProto.FLOAT16,
}


def _upcast(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype == np.float16 else x


def run_chain(
    nodes: Sequence[tuple[str, Sequence[str], Mapping[str, Any]]],
    feeds: Mapping[str, np.ndarray],
    opset: int = 17,
) -> np.ndarray:
    """Run nodes (op_type, input names, attrs) in order; node i writes `t{i}`, the last `y`.

    An input name may be "" for an absent optional input.
    """
    feeds = {k: _upcast(v) for k, v in feeds.items()}
    onnx_nodes = []
    for i, (op, ins, attrs) in enumerate(nodes):
        out = "y" if i == len(nodes) - 1 else f"t{i}"
        onnx_nodes.append(helper.make_node(op, list(ins), [out], **dict(attrs)))
    graph = helper.make_graph(
        onnx_nodes,
        "oracle",
        [helper.make_tensor_value_info(k, _ELEM[v.dtype], v.shape) for k, v in feeds.items()],
        [helper.make_empty_tensor_value_info("y")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # tiny graphs: thread pools only add start-up time
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, dict(feeds))[0]


def run_node(
    op: str, inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any], opset: int = 17
) -> np.ndarray:
    """Run one ONNX node on `inputs` (None = absent optional input)."""
    names = ["" if x is None else f"i{k}" for k, x in enumerate(inputs)]
    while names and names[-1] == "":
        names.pop()
    feeds = {f"i{k}": x for k, x in enumerate(inputs) if x is not None}
    return run_chain([(op, names, attrs)], feeds, opset)


def assert_close(got: np.ndarray, want: np.ndarray, dtype: np.dtype, scale: float = 1.0) -> None:
    """Compare a kernel output with the oracle using dtype tolerances.

    `scale` is the magnitude of the terms summed into one output (e.g. sqrt(K) for a dot
    product of unit normals), so fp16 rounding of the output is judged against it.
    """
    assert got.shape == want.shape, (got.shape, want.shape)
    if np.dtype(dtype) == np.float16:
        tol = 2e-3 * max(1.0, scale)
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=tol)
    elif np.issubdtype(dtype, np.floating):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, scale))
    else:
        np.testing.assert_array_equal(got, want)
