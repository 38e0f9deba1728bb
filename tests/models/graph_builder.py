"""A small ONNX graph builder the pattern tests share: nodes, initializers, outputs, and one
line per constant or op. Test files subclass it with the chain they build."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper


class GraphBuilder:
    """Collects nodes, initializers and graph output names; names are made unique by count."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.outputs: list[str] = []

    def const(self, value: Any, dtype: Any = np.float32) -> str:
        """An initializer holding `value` as `dtype`; its name."""
        name = f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, name: str = "", **attrs: Any) -> str:
        """A one-output node reading `inputs`; its output's name (the node's name)."""
        name = name or f"{op_type}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=name, **attrs))
        return name
