"""A small, deterministic ONNX graph builder shared by every model builder.

Builders only append to plain Python lists and create protos once, so a 100k-node graph builds in
seconds. Names are derived from a scope and per-prefix counters (never from ids or time), and
weights come from one seeded ``numpy.random.Generator``, so the same call gives byte-identical
models.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DType = Literal["float32", "float16"]
Dim = int | str
Shape = Sequence[Dim]

_ELEM_TYPE: dict[str, int] = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
_NP_DTYPE: dict[str, type[np.generic]] = {"float32": np.float32, "float16": np.float16}

MS_DOMAIN = "com.microsoft"


def elem_type(dtype: DType) -> int:
    """ONNX element type of a float dtype name."""
    if dtype not in _ELEM_TYPE:
        raise ValueError(f"dtype must be one of {sorted(_ELEM_TYPE)}, got {dtype!r}")
    return _ELEM_TYPE[dtype]


class GraphBuilder:
    """Append-only builder of one ONNX graph with unique, stable node and value names."""

    def __init__(
        self,
        name: str,
        *,
        opset: int,
        dtype: DType = "float32",
        seed: int = 0,
        domains: Mapping[str, int] | None = None,
    ) -> None:
        self.name = name
        self.opset = opset
        self.dtype = dtype
        self.elem = elem_type(dtype)
        self.np_dtype = _NP_DTYPE[dtype]
        self.rng = np.random.default_rng(seed)
        self._domains = dict(domains or {})
        self._nodes: list[onnx.NodeProto] = []
        self._inits: list[TensorProto] = []
        self._inputs: list[onnx.ValueInfoProto] = []
        self._outputs: list[onnx.ValueInfoProto] = []
        self._value_infos: list[onnx.ValueInfoProto] = []
        self._counts: dict[str, int] = {}
        self._scope: list[str] = []

    # -- names -------------------------------------------------------------------------------
    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix node and initializer names, like exporters' module paths (``/layer.0/attn``)."""
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def fresh(self, prefix: str) -> str:
        """A name unique in this graph: ``/scope/prefix`` then ``/scope/prefix_1``, ..."""
        base = "/".join(["", *self._scope, prefix]) if self._scope else prefix
        n = self._counts.get(base, 0)
        self._counts[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    # -- graph interface ---------------------------------------------------------------------
    def input(self, name: str, shape: Shape, elem: int | None = None) -> str:
        self._inputs.append(helper.make_tensor_value_info(name, elem or self.elem, list(shape)))
        return name

    def output(self, name: str, shape: Shape, elem: int | None = None) -> None:
        self._outputs.append(helper.make_tensor_value_info(name, elem or self.elem, list(shape)))

    def graph_output(self, value: str, name: str, shape: Shape, elem: int | None = None) -> str:
        """Make ``value`` the graph output ``name`` (renamed, as exporters name outputs)."""
        self.rename(value, name)
        self.output(name, shape, elem)
        return name

    def rename(self, old: str, new: str) -> None:
        """Rename a value everywhere (linear; for the few named values of a model)."""
        for node in self._nodes:
            for i, v in enumerate(node.input):
                if v == old:
                    node.input[i] = new
            for i, v in enumerate(node.output):
                if v == old:
                    node.output[i] = new

    def value_info(self, name: str, shape: Shape, elem: int | None = None) -> None:
        """Declare an intermediate value's type, for ops that shape inference cannot see into."""
        self._value_infos.append(
            helper.make_tensor_value_info(name, elem or self.elem, list(shape))
        )

    # -- constants ---------------------------------------------------------------------------
    def initializer(self, array: np.ndarray, prefix: str) -> str:
        name = self.fresh(prefix)
        self._inits.append(numpy_helper.from_array(np.array(array, order="C"), name))
        return name

    def weight(self, shape: Sequence[int], prefix: str, *, fan_in: int | None = None) -> str:
        """Random normal weight scaled by 1/sqrt(fan_in) so activations stay O(1) in fp16 too."""
        std = 1.0 / np.sqrt(fan_in if fan_in else (shape[0] if shape else 1))
        values = self.rng.standard_normal(tuple(shape), dtype=np.float32) * np.float32(std)
        return self.initializer(values.astype(self.np_dtype), prefix)

    def uniform(self, shape: Sequence[int], prefix: str, low: float, high: float) -> str:
        values = self.rng.uniform(low, high, size=tuple(shape)).astype(np.float32)
        return self.initializer(values.astype(self.np_dtype), prefix)

    def floats(self, values: Any, prefix: str) -> str:
        """Initializer of the model's float dtype."""
        return self.initializer(np.asarray(values, dtype=self.np_dtype), prefix)

    def ints(self, values: Any, prefix: str) -> str:
        """int64 initializer (shapes, axes, k, indices)."""
        return self.initializer(np.asarray(values, dtype=np.int64), prefix)

    def constant(self, array: np.ndarray, prefix: str) -> str:
        """A ``Constant`` node, as the TorchScript exporter writes scalars (eps, exponent 2)."""
        name = self.fresh(prefix)
        out = f"{name}_output_0"
        tensor = numpy_helper.from_array(np.array(array, order="C"), f"{name}_value")
        self._nodes.append(helper.make_node("Constant", [], [out], name=name, value=tensor))
        return out

    def scalar(self, value: float, prefix: str) -> str:
        """A 0-d Constant node of the model's float dtype."""
        return self.constant(np.array(value, dtype=self.np_dtype), prefix)

    # -- nodes -------------------------------------------------------------------------------
    def nodes(
        self,
        op_type: str,
        inputs: Sequence[str],
        *,
        n_out: int = 1,
        prefix: str | None = None,
        domain: str = "",
        **attrs: Any,
    ) -> list[str]:
        """Append a node and return its output names."""
        name = self.fresh(prefix or op_type)
        outs = [f"{name}_output_{i}" for i in range(n_out)]
        node = helper.make_node(op_type, list(inputs), outs, name=name, domain=domain or None)
        if attrs:
            node.attribute.extend(
                helper.make_attribute(k, v) for k, v in sorted(attrs.items()) if v is not None
            )
        self._nodes.append(node)
        return outs

    def op(self, op_type: str, *inputs: str, prefix: str | None = None, **attrs: Any) -> str:
        """Append a single-output node and return its output name."""
        return self.nodes(op_type, inputs, prefix=prefix, **attrs)[0]

    def cast(self, x: str, to: int, prefix: str = "Cast") -> str:
        return self.op("Cast", x, prefix=prefix, to=to)

    # -- model -------------------------------------------------------------------------------
    @property
    def node_count(self) -> int:
        return len(self._nodes)

    def build(self, doc: str = "") -> onnx.ModelProto:
        graph = helper.make_graph(
            self._nodes,
            self.name,
            self._inputs,
            self._outputs,
            initializer=self._inits,
            value_info=self._value_infos,
            doc_string=doc,
        )
        opsets = [helper.make_opsetid("", self.opset)]
        opsets += [helper.make_opsetid(d, v) for d, v in sorted(self._domains.items())]
        # The lowest IR version that carries these opsets keeps models loadable by older runtimes.
        ir_version = max(8, helper.find_min_ir_version_for(opsets, ignore_unknown=True))
        model = helper.make_model(
            graph, opset_imports=opsets, ir_version=ir_version, producer_name="fuser.models"
        )
        model.producer_version = "1"
        return model
