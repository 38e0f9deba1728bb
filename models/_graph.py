"""A small, deterministic ONNX graph builder shared by every model builder.

Nodes and initializers are created once, in place in the final model's graph, with cached
attributes and pooled random draws, so builders stay cheap (for 100k-node graphs, ``_repeat``
copies serialized blocks instead). Names are derived from a scope and per-prefix counters (never
from ids or time), and weights come from one seeded ``numpy.random.Generator``, so the same call
gives byte-identical models.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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

_RAW_DTYPES: dict[np.dtype, int] = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
}
_POOL_SIZE = 1 << 16
_LITTLE_ENDIAN = sys.byteorder == "little"


def _attribute(key: str, value: Any) -> onnx.AttributeProto:
    """``helper.make_attribute`` for the common scalar and list cases, without its type sniffing
    (a measurable share of 100k-node builds); anything else goes through the helper."""
    if isinstance(value, bool) or not isinstance(value, int | float | str | list):
        return helper.make_attribute(key, value)
    if isinstance(value, int):
        return onnx.AttributeProto(name=key, type=onnx.AttributeProto.INT, i=value)
    if isinstance(value, float):
        return onnx.AttributeProto(name=key, type=onnx.AttributeProto.FLOAT, f=value)
    if isinstance(value, str):
        return onnx.AttributeProto(name=key, type=onnx.AttributeProto.STRING, s=value.encode())
    if value and all(type(v) is int for v in value):
        return onnx.AttributeProto(name=key, type=onnx.AttributeProto.INTS, ints=value)
    return helper.make_attribute(key, value)


@dataclass(frozen=True)
class RandomSpec:
    """The distribution a random initializer was drawn from: normal(a, b) or uniform[a, b)."""

    kind: Literal["normal", "uniform"]
    a: float
    b: float

    def draw(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        if self.kind == "normal":
            return rng.standard_normal(shape, dtype=np.float32) * np.float32(self.b)
        values = rng.random(shape, dtype=np.float32) * np.float32(self.b - self.a)
        return values + np.float32(self.a)


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
        # Nodes and initializers are created in place in the final model's graph: collecting
        # them in lists and copying them into a GraphProto doubles the time of huge builds.
        self._model = onnx.ModelProto()
        self._graph = self._model.graph
        self._built = False
        self._attr_cache: dict[tuple[str, Any], onnx.AttributeProto] = {}
        # How each random initializer was drawn, so synthetic graphs can redraw copies of it.
        self.random_specs: dict[str, RandomSpec] = {}
        self._counts: dict[str, int] = {}
        self._scope: list[str] = []
        self._pools: dict[str, np.ndarray] = {}
        self._pool_pos: dict[str, int] = defaultdict(int)

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
        self._graph.input.append(
            helper.make_tensor_value_info(name, elem or self.elem, list(shape))
        )
        return name

    def output(self, name: str, shape: Shape, elem: int | None = None) -> None:
        self._graph.output.append(
            helper.make_tensor_value_info(name, elem or self.elem, list(shape))
        )

    def graph_output(self, value: str, name: str, shape: Shape, elem: int | None = None) -> str:
        """Make ``value`` the graph output ``name`` (renamed, as exporters name outputs)."""
        self.rename(value, name)
        self.output(name, shape, elem)
        return name

    def rename(self, old: str, new: str) -> None:
        """Rename a value everywhere (linear; for the few named values of a model)."""
        for node in self._graph.node:
            for i, v in enumerate(node.input):
                if v == old:
                    node.input[i] = new
            for i, v in enumerate(node.output):
                if v == old:
                    node.output[i] = new

    def value_info(self, name: str, shape: Shape, elem: int | None = None) -> None:
        """Declare an intermediate value's type, for ops that shape inference cannot see into."""
        info = helper.make_tensor_value_info(name, elem or self.elem, list(shape))
        self._graph.value_info.append(info)

    # -- constants ---------------------------------------------------------------------------
    def initializer(self, array: np.ndarray, prefix: str) -> str:
        name = self.fresh(prefix)
        array = np.asarray(array)
        if array.dtype in _RAW_DTYPES:
            # Direct raw_data construction: numpy_helper.from_array's generality costs ~10x,
            # which dominates 100k-node builds. Little-endian bytes, as from_array writes.
            if not _LITTLE_ENDIAN:
                array = array.astype(array.dtype.newbyteorder("<"))
            self._graph.initializer.add(
                name=name,
                data_type=_RAW_DTYPES[array.dtype],
                dims=array.shape,
                raw_data=array.tobytes(),
            )
        else:
            self._graph.initializer.append(
                numpy_helper.from_array(np.array(array, order="C"), name)
            )
        return name

    def _random(self, shape: Sequence[int], draw: str) -> np.ndarray:
        """Float32 draws from a seeded pool: per-call Generator calls dominate huge builds."""
        size = math.prod(shape)
        pool = self._pools.setdefault(draw, np.empty(0, dtype=np.float32))
        if self._pool_pos[draw] + size > pool.size:
            fresh = max(size, _POOL_SIZE)
            if draw == "normal":
                pool = self.rng.standard_normal(fresh, dtype=np.float32)
            else:
                pool = self.rng.random(fresh, dtype=np.float32)
            self._pools[draw] = pool
            self._pool_pos[draw] = 0
        start = self._pool_pos[draw]
        self._pool_pos[draw] = start + size
        return pool[start : start + size].reshape(tuple(shape))

    def weight(self, shape: Sequence[int], prefix: str, *, fan_in: int | None = None) -> str:
        """Random normal weight scaled by 1/sqrt(fan_in) so activations stay O(1) in fp16 too."""
        std = float(1.0 / np.sqrt(fan_in if fan_in else (shape[0] if shape else 1)))
        values = self._random(shape, "normal") * np.float32(std)
        name = self.initializer(values.astype(self.np_dtype), prefix)
        self.random_specs[name] = RandomSpec("normal", 0.0, std)
        return name

    def uniform(self, shape: Sequence[int], prefix: str, low: float, high: float) -> str:
        values = self._random(shape, "uniform") * np.float32(high - low) + np.float32(low)
        name = self.initializer(values.astype(self.np_dtype), prefix)
        self.random_specs[name] = RandomSpec("uniform", low, high)
        return name

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
        self._graph.node.append(helper.make_node("Constant", [], [out], name=name, value=tensor))
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
        node = self._graph.node.add(op_type=op_type, name=name, input=inputs, output=outs)
        if domain:
            node.domain = domain
        if attrs:
            node.attribute.extend(
                self._attribute(k, v) for k, v in sorted(attrs.items()) if v is not None
            )
        return outs

    def _attribute(self, key: str, value: Any) -> onnx.AttributeProto:
        """Attributes are cached by value: building them is a real share of 100k-node builds."""
        try:
            cache_key = (key, tuple(value) if isinstance(value, list) else value)
            hash(cache_key)
        except TypeError:
            return _attribute(key, value)
        if (attr := self._attr_cache.get(cache_key)) is None:
            attr = self._attr_cache[cache_key] = _attribute(key, value)
        return attr

    def op(self, op_type: str, *inputs: str, prefix: str | None = None, **attrs: Any) -> str:
        """Append a single-output node and return its output name."""
        return self.nodes(op_type, inputs, prefix=prefix, **attrs)[0]

    def cast(self, x: str, to: int, prefix: str = "Cast") -> str:
        return self.op("Cast", x, prefix=prefix, to=to)

    # -- model -------------------------------------------------------------------------------
    @property
    def node_count(self) -> int:
        return len(self._graph.node)

    @property
    def graph(self) -> onnx.GraphProto:
        """The graph being built (read it; add to it only through the builder)."""
        return self._graph

    def extend_serialized(self, blob: bytes, node_count: int) -> None:
        """Append nodes/initializers given as serialized ``GraphProto`` fields (fast bulk path)."""
        before = len(self._graph.node)
        self._graph.MergeFromString(blob)
        if len(self._graph.node) != before + node_count:
            raise AssertionError("serialized block did not hold the expected nodes")

    def build(self, doc: str = "") -> onnx.ModelProto:
        """Finish and return the model; the builder cannot be used afterwards."""
        if self._built:
            raise RuntimeError("GraphBuilder.build() may only be called once")
        self._built = True
        self._graph.name = self.name
        self._graph.doc_string = doc
        opsets = [helper.make_opsetid("", self.opset)]
        opsets += [helper.make_opsetid(d, v) for d, v in sorted(self._domains.items())]
        model = self._model
        model.opset_import.extend(opsets)
        # The lowest IR version that carries these opsets keeps models loadable by older runtimes.
        model.ir_version = max(8, helper.find_min_ir_version_for(opsets, ignore_unknown=True))
        model.producer_name = "fuser.models"
        model.producer_version = "1"
        return model
