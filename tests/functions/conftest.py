"""Shared by the function-body tests: a tiny graph builder (onnx.helper with seeded weights)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

Dim = int | str


class Graph:
    """Nodes, initializers and typed inputs of one test graph, in one dtype."""

    def __init__(
        self, dtype: str, opset: int, seed: int = 0, domains: dict[str, int] | None = None
    ):
        self.dtype = np.dtype(dtype)
        self.elem = helper.np_dtype_to_tensor_dtype(self.dtype)
        self.opset = opset
        self.domains = domains or {}
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[str] = []

    def input(self, name: str, shape: Sequence[Dim], elem: int | None = None) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem or self.elem, list(shape)))
        return name

    def const(self, value: Any, name: str, dtype: Any = None) -> str:
        array = np.asarray(value, dtype=dtype or self.dtype)
        self.inits.append(numpy_helper.from_array(array, f"{name}_{len(self.inits)}"))
        return self.inits[-1].name

    def random(self, shape: Sequence[int], name: str, scale: float = 0.3) -> str:
        return self.const(self.rng.standard_normal(shape) * scale, name)

    def op(self, op_type: str, *inputs: str, n_out: int = 1, domain: str = "", **attrs: Any) -> Any:
        name = f"{op_type}_{len(self.nodes)}"
        outs = [f"{name}_out{i}" for i in range(n_out)]
        node = helper.make_node(op_type, list(inputs), outs, name=name, domain=domain, **attrs)
        self.nodes.append(node)
        return outs[0] if n_out == 1 else outs

    def model(self) -> onnx.ModelProto:
        """The model, graph outputs typed by shape inference (symbolic dims kept)."""
        untyped = [
            helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in self.outputs
        ]
        graph = helper.make_graph(self.nodes, "test", self.inputs, untyped, self.inits)
        imports = [helper.make_opsetid("", self.opset)]
        imports += [helper.make_opsetid(d, v) for d, v in self.domains.items()]
        model = helper.make_model(graph, opset_imports=imports)
        model.ir_version = 8
        inferred = onnx.shape_inference.infer_shapes(model)
        del model.graph.output[:]
        model.graph.output.extend(inferred.graph.output)
        return model


@pytest.fixture
def graph() -> type[Graph]:
    return Graph
