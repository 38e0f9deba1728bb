"""Profile a whole model on the simulated NPU: every node through its kernel, end to end.

The model's inputs get concrete shapes (symbolic dims sized by name, or a default size), shape
inference types every value, and each node of the main graph, in topological order, runs its
kernel from `fuser.kernels.registry` in timing-only mode (the same schedule, no arithmetic).
A node without a kernel, or whose kernel refuses the inputs, gets the registry's roofline
`estimate` and is marked `estimated`. Nodes run one after another, so the model's time, GM
bytes and launches are the sums over its nodes, and their timelines are laid end to end.

Kernels that need an input's values get them from the graph index's constants (TopK's `K`,
ReduceMean's `axes`): integer constants are passed as arrays, every other input as its shape
and dtype. Gathering ops (com.microsoft AllGather, fused ops with `collective_input`) take all
shards stacked, `[group_size, *shard]`, as the plugin passes them; every rank runs the same
program, so rank 0 stands for the group. `Constant` nodes are data, not kernels: not listed.

    >>> p = profile_model("model.onnx", dims={"batch": 1, "seq": 128})   # doctest: +SKIP
    >>> p.total_us, p.launches                                          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from . import fusedop
from .engine import infer_types, opset_map
from .errors import UsageError
from .graph import GraphIndex
from .modelio import LoadedModel, ModelSource, load_model
from .npu_run import kernel_attrs, machine

if TYPE_CHECKING:
    from .kernels.api import Input, Kernel, TensorMeta, Tiling
    from .kernels.npu.machine import Machine
    from .kernels.npu.stats import RunStats
    from .kernels.npu.timeline import Timeline

#: Integer constants up to this many elements are passed to kernels as values (K, axes, ...).
_MAX_VALUE_INPUT = 4096
_SKIPPED = frozenset({"Constant"})


@dataclass(frozen=True)
class NodeProfile:
    """One node's simulated run: where it starts on the model's timeline and what it cost."""

    name: str
    op: str
    domain: str
    start_cycles: float
    stats: RunStats
    note: str = ""

    @property
    def cycles(self) -> float:
        return self.stats.cycles

    @property
    def gm_bytes(self) -> int:
        return self.stats.gm_bytes

    @property
    def estimated(self) -> bool:
        return self.stats.estimated

    def to_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "name": self.name,
            "op": self.op,
            "domain": self.domain,
            "start_cycles": self.start_cycles,
            "cycles": s.cycles,
            "us": s.us,
            "gm_read_bytes": s.gm_read,
            "gm_write_bytes": s.gm_write,
            "gm_bytes": s.gm_bytes,
            "launches": s.launches,
            "cores": s.cores,
            "bound": s.bound,
            "estimated": s.estimated,
            "pipe_utilization": dict(s.pipe_utilization),
            "note": self.note,
        }


@dataclass(frozen=True)
class ModelProfile:
    """A model's nodes on one target, run one after another."""

    target: str
    clock_hz: float
    dims: Mapping[str, int]
    nodes: tuple[NodeProfile, ...]
    tuned: bool = False
    timeline: Timeline | None = field(default=None, compare=False, repr=False)

    @property
    def total_cycles(self) -> float:
        return sum(n.cycles for n in self.nodes)

    @property
    def total_us(self) -> float:
        return sum(n.stats.us for n in self.nodes)

    @property
    def gm_read_bytes(self) -> int:
        return sum(n.stats.gm_read for n in self.nodes)

    @property
    def gm_write_bytes(self) -> int:
        return sum(n.stats.gm_write for n in self.nodes)

    @property
    def gm_bytes(self) -> int:
        return self.gm_read_bytes + self.gm_write_bytes

    @property
    def launches(self) -> int:
        return sum(n.stats.launches for n in self.nodes)

    @property
    def estimated_cycles(self) -> float:
        return sum(n.cycles for n in self.nodes if n.estimated)

    def by_op(self) -> dict[str, tuple[int, float]]:
        """Per op type: (nodes, cycles), most expensive first."""
        acc: dict[str, tuple[int, float]] = {}
        for n in self.nodes:
            count, cycles = acc.get(n.op, (0, 0.0))
            acc[n.op] = (count + 1, cycles + n.cycles)
        return dict(sorted(acc.items(), key=lambda kv: -kv[1][1]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "dims": dict(self.dims),
            "tuned": self.tuned,
            "total_cycles": self.total_cycles,
            "total_us": self.total_us,
            "gm_read_bytes": self.gm_read_bytes,
            "gm_write_bytes": self.gm_write_bytes,
            "gm_bytes": self.gm_bytes,
            "launches": self.launches,
            "estimated_cycles": self.estimated_cycles,
            "nodes": [n.to_dict() for n in self.nodes],
        }

    def to_chrome_trace(self) -> dict[str, Any]:
        """One Chrome trace for the whole model: one track per core and pipe, the nodes end to
        end on the `kernels` track (estimated ones included, marked)."""
        if self.timeline is None:
            raise ValueError("profile was run without a timeline (timeline=True)")
        return self.timeline.to_chrome_trace()


def profile_model(
    model: ModelSource | LoadedModel,
    target: str = "ascend910b",
    *,
    dims: Mapping[str, int] | None = None,
    dim_size: int = 1,
    timeline: bool = False,
    tuned: bool = False,
) -> ModelProfile:
    """Run every node of `model`'s main graph on `target`'s simulator, timing only.

    `dims` sizes symbolic input dims by name; the others take `dim_size`. With `timeline`, the
    result can export a Chrome trace of the whole model. Fused ops without stored tiling get
    the tiling search's pick at run time; with `tuned`, so do the other ops that have a cost
    model (MatMul, Conv, Softmax...), instead of their kernel's rule-of-thumb default, so that
    an original and its fused model are compared at their best tilings. Raises `UsageError`
    for a bad target, an unknown dim name or a non-positive size.
    """
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    npu = machine(target)
    sized, used = _with_concrete_inputs(loaded.model, dict(dims or {}), dim_size)
    index = _index(dataclasses.replace(loaded, model=sized))
    values = _Values(index)
    nodes: list[NodeProfile] = []
    timelines: list[tuple[Timeline, float, str]] = []
    clock = 0.0
    for node_id in index.live_nodes():
        node = index.node(node_id)
        if node.op_type in _SKIPPED:
            continue
        if values.fold(node):
            stats, note = _folded(npu), "folded: constant once the input shapes are fixed"
        else:
            values.infer(node)
            stats, note = _run_node(node, values, npu, timeline, tuned)
        name = node.name or f"{node.op_type}_{node_id}"
        nodes.append(NodeProfile(name, node.op_type, node.domain, clock, stats, note))
        if timeline:
            label = f"{name} ({node.op_type}{', estimated' if stats.estimated else ''})"
            timelines.append((_node_timeline(stats, npu, label), clock, name))
        clock += stats.cycles
    trace = _model_timeline(timelines, npu) if timeline else None
    return ModelProfile(npu.name, npu.clock_hz, used, tuple(nodes), tuned, trace)


# -- inputs and types ------------------------------------------------------------------------


def _with_concrete_inputs(
    model: onnx.ModelProto, dims: dict[str, int], dim_size: int
) -> tuple[onnx.ModelProto, dict[str, int]]:
    """A copy of `model` whose graph inputs have concrete shapes; the sizes used by name."""
    for name, size in {**dims, "--dim-size": dim_size}.items():
        if size < 1:
            raise UsageError(f"{name}: a dim size must be at least 1, got {size}")
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    inits = {t.name for t in copy.graph.initializer}
    used: dict[str, int] = {}
    names: set[str] = set()
    for value in copy.graph.input:
        if value.name in inits or not value.type.HasField("tensor_type"):
            continue
        for i, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_value"):
                continue
            label = dim.dim_param or f"{value.name}[{i}]"
            names.add(label)
            size = dims.get(label, dim_size)
            used[label] = size
            dim.Clear()
            dim.dim_value = size
    unknown = sorted(set(dims) - names)
    if unknown:
        known = ", ".join(sorted(names)) or "none"
        raise UsageError(
            f"--dim {unknown[0]}: the model has no such symbolic dim (it has: {known})"
        )
    # Shapes computed from shapes (Shape -> Gather -> Concat -> Reshape) need data propagation.
    del copy.graph.value_info[:]
    with contextlib.suppress(Exception):  # best effort: infer_types below does what it can
        copy = onnx.shape_inference.infer_shapes(copy, check_type=False, data_prop=True)
    return copy, used


def _index(loaded: LoadedModel) -> GraphIndex:
    types = infer_types(loaded.model)
    return GraphIndex.build(loaded.model.graph, loaded, opset_map(loaded.model), types[""])


@dataclass
class _Values:
    """What is known of each value while walking the graph: static metas and small values.

    Shape inference over the whole graph misses shapes computed from shapes (Shape -> Slice ->
    Reshape, Range); with every input shape fixed those are compile-time constants, so each
    node whose inputs are all known values is evaluated (onnx's reference runtime), and a node
    whose outputs inference left open is inferred alone with its inputs' static types and values.
    """

    index: GraphIndex
    metas: dict[str, TensorMeta] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)

    def meta(self, name: str) -> TensorMeta | None:
        from .kernels.api import TensorMeta

        if name in self.metas:
            return self.metas[name]
        vt = self.index.value_type(name)
        if vt is None or vt.shape is None or not vt.elem_type:
            return None
        dims = [d for d in vt.shape if isinstance(d, int)]
        if len(dims) != len(vt.shape):
            return None
        meta = TensorMeta(tuple(dims), helper.tensor_dtype_to_np_dtype(vt.elem_type))
        self.metas[name] = meta
        return meta

    def value(self, name: str) -> np.ndarray | None:
        if name in self.values:
            return self.values[name]
        meta = self.meta(name)
        if meta is not None and meta.size > _MAX_VALUE_INPUT:
            return None
        value = self.index.constant(name)
        if value is not None and value.size <= _MAX_VALUE_INPUT:
            self.values[name] = value
            return value
        return None

    def kernel_input(self, name: str) -> Input:
        """Integer constants as values (K, axes), everything else as its meta."""
        meta = self.meta(name)
        if meta is None or np.issubdtype(meta.dtype, np.integer):
            value = self.value(name)
            if value is not None and np.issubdtype(value.dtype, np.integer):
                return value
        return meta

    def fold(self, node: onnx.NodeProto) -> bool:
        """Evaluate `node` if all it reads is known (a Shape needs only its input's shape);
        True if every output became a known value."""
        if node.op_type == "Shape":
            meta = self.meta(node.input[0])
            if meta is None:
                return False
            shape = np.array(meta.shape, np.int64)
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            start, end = attrs.get("start", 0), attrs.get("end", len(shape))
            self._set(node.output[0], shape[start:end])
            return True
        if node.op_type in _NOT_FOLDED or not node.output:
            return False
        feeds = {}
        for name in node.input:
            if name:
                value = self.value(name)
                if value is None:
                    return False
                feeds[name] = value
        results = _evaluate(node, feeds, self.index.opsets)
        if results is None:
            return False
        for name, value in zip(node.output, results, strict=False):
            if name:
                self._set(name, value)
        return True

    def infer(self, node: onnx.NodeProto) -> None:
        """Static output metas for a node whose outputs shape inference left open."""
        from .kernels.api import TensorMeta

        if all(self.meta(o) is not None for o in node.output if o):
            return
        types, data = {}, {}
        for name in node.input:
            if not name:
                continue
            meta = self.meta(name)
            if meta is None:
                return
            elem = helper.np_dtype_to_tensor_dtype(meta.dtype)
            types[name] = helper.make_tensor_type_proto(elem, list(meta.shape))
            value = self.value(name) if np.issubdtype(meta.dtype, np.integer) else None
            if value is not None:
                data[name] = onnx.numpy_helper.from_array(value, name)
        domain = node.domain or ""
        try:
            schema = onnx.defs.get_schema(node.op_type, self.index.opset(domain), domain)
            out = onnx.shape_inference.infer_node_outputs(schema, node, types, data)
        except Exception:  # an op onnx cannot infer alone: its outputs stay unknown
            return
        for name, tp in out.items():
            t = tp.tensor_type
            if not tp.HasField("tensor_type") or not t.HasField("shape") or not t.elem_type:
                continue
            if all(d.HasField("dim_value") for d in t.shape.dim):
                shape = tuple(d.dim_value for d in t.shape.dim)
                dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
                self.metas.setdefault(name, TensorMeta(shape, dtype))

    def _set(self, name: str, value: np.ndarray) -> None:
        from .kernels.api import TensorMeta

        value = np.asarray(value)
        self.metas[name] = TensorMeta.of(value)
        if value.size <= _MAX_VALUE_INPUT:
            self.values[name] = value


# Ops never evaluated at compile time: not functions of their inputs, or with subgraphs.
_NOT_FOLDED = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
     "Bernoulli", "Dropout", "If", "Loop", "Scan"}
)  # fmt: skip


def _evaluate(
    node: onnx.NodeProto, feeds: Mapping[str, np.ndarray], opsets: Mapping[str, int]
) -> list[np.ndarray] | None:
    from onnx.reference import ReferenceEvaluator

    if node.domain not in ("", "ai.onnx"):
        return None
    inputs = [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in feeds]
    outputs = [
        helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in node.output if n
    ]
    graph = helper.make_graph([node], "fold", inputs, outputs)
    version = opsets.get("", opsets.get("ai.onnx", 0))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", version)])
    try:
        results = ReferenceEvaluator(model).run(None, dict(feeds))
    except Exception:  # an op the reference runtime lacks: not folded
        return None
    return [np.asarray(r) for r in results]


# -- one node ----------------------------------------------------------------------------------


def _run_node(
    node: onnx.NodeProto,
    values: _Values,
    npu: Machine,
    timeline: bool,
    tuned: bool,
) -> tuple[RunStats, str]:
    from .kernels import registry
    from .kernels.api import KernelError, TensorMeta
    from .kernels.npu.errors import NpuError

    inputs: list[Input] = [values.kernel_input(n) if n else None for n in node.input]
    outputs = [values.meta(n) if n else None for n in node.output]
    kernel = registry.get_kernel(node.domain, node.op_type)
    has_subgraph = any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    )
    note = ""
    if kernel is not None and not has_subgraph:
        missing = [n for n, x in zip(node.input, inputs, strict=True) if n and x is None]
        if missing:
            note = f"no static shape for '{missing[0]}'"
        else:
            try:
                stats, produced = _run_kernel(kernel, node, inputs, npu, timeline, tuned)
            except (KernelError, NpuError) as exc:
                note = f"kernel refused: {exc}"
            else:
                for name, meta in zip(node.output, produced, strict=False):
                    values.metas.setdefault(name, meta)
                return stats, ""
    elif has_subgraph:
        note = "has a subgraph (not profiled inside)"
    else:
        note = "no kernel"
    metas = [x if isinstance(x, TensorMeta) or x is None else TensorMeta.of(x) for x in inputs]
    return registry.estimate(node.op_type, metas, outputs, npu), note


def _folded(npu: Machine) -> RunStats:
    """A node the graph compiler folds: no launch, no cycles, no bytes."""
    from types import MappingProxyType

    from .kernels.npu.stats import RunStats

    return RunStats(
        cycles=0.0, us=0.0, core_cycles=0.0, pipe_busy=MappingProxyType({}),
        pipe_utilization=MappingProxyType({}), gm_read=0, gm_write=0, ub=0, l1=0, l0a=0, l0b=0,
        l0c=0, launches=0, cores=0, bound="none", estimated=False,
    )  # fmt: skip


def _collective_input(node: onnx.NodeProto) -> int | None:
    if node.domain == "com.microsoft" and node.op_type == "AllGather":
        return 0
    if node.domain == fusedop.DOMAIN:
        return fusedop.get(node.op_type).collective_input
    return None


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    if node.domain == fusedop.DOMAIN:
        op = fusedop.get(node.op_type)
        return kernel_attrs(op, op.attribute_values(node))
    values: dict[str, Any] = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, list | tuple):
            value = [v.decode() if isinstance(v, bytes) else v for v in value]
        values[attr.name] = value
    return values


def _kernel_call(node: onnx.NodeProto, inputs: list[Input]) -> tuple[list[Input], dict[str, Any]]:
    """Inputs and attributes as the kernel takes them (gathered input stacked, rank 0)."""
    from .kernels.api import TensorMeta, meta_of

    attrs = _attrs(node)
    gathered = _collective_input(node)
    if gathered is not None:
        local = meta_of(inputs[gathered])
        if local is None:
            raise UsageError(f"{node.name}: the gathered input is absent")
        group = int(attrs.get("group_size", 1))
        stacked = TensorMeta((group, *local.shape), local.dtype)
        inputs = [stacked if i == gathered else x for i, x in enumerate(inputs)]
        attrs["rank"] = 0
        # com.microsoft AllGather allows a negative axis; the kernel takes it normalized.
        if int(attrs.get("axis", 0)) < 0:
            attrs["axis"] = int(attrs["axis"]) + len(local.shape)
    return inputs, attrs


def _run_kernel(
    kernel: Kernel,
    node: onnx.NodeProto,
    inputs: list[Input],
    npu: Machine,
    timeline: bool,
    tuned: bool,
) -> tuple[RunStats, tuple[TensorMeta, ...]]:
    """The node's timing-only run and its output metas (for values shape inference missed)."""
    from .kernels.api import KernelError, meta_of

    call_inputs, attrs = _kernel_call(node, inputs)
    metas = [meta_of(x) for x in call_inputs]
    tiling = None
    if tuned and kernel.domain != fusedop.DOMAIN and kernel.tiling_from_attrs(attrs) is None:
        tiling = _searched_tiling(kernel, metas, attrs, npu)
    run = kernel.run(npu, call_inputs, attrs, tiling=tiling, functional=False, timeline=timeline)
    try:
        produced = kernel.infer(metas, attrs)
    except KernelError:  # e.g. TopK's k given as an input only `run` reads: shapes from onnx
        produced = ()
    return run.stats, produced


def _searched_tiling(
    kernel: Kernel, metas: list[TensorMeta | None], attrs: Mapping[str, Any], npu: Machine
) -> Tiling | None:
    """The tiling search's pick for an op with a cost model, or None (kernel default)."""
    from .kernels.api import KernelError
    from .kernels.npu.errors import NpuError
    from .kernels.search import host_tiling, model_for

    if model_for(kernel.domain, kernel.op_type) is None:
        return None
    try:
        return host_tiling(kernel, metas, attrs, npu)
    except (KernelError, NpuError):  # the model cannot price these inputs: kernel default
        return None


# -- the model's timeline --------------------------------------------------------------------


def _node_timeline(stats: RunStats, npu: Machine, label: str) -> Timeline:
    """The node's own timeline with its launches named after the node; an estimated node gets
    one block on the kernels track."""
    from .kernels.npu.timeline import Timeline

    if stats.timeline is None:
        return Timeline(npu.clock_hz, (), ((0.0, stats.cycles, label),))
    t = stats.timeline
    kernels = tuple((s, e, f"{label}: {k}" if k != label else k) for s, e, k in t.kernels)
    return Timeline(t.clock_hz, t.intervals, kernels or ((0.0, stats.cycles, label),))


def _model_timeline(parts: list[tuple[Timeline, float, str]], npu: Machine) -> Timeline:
    from .kernels.npu.timeline import Timeline, concat

    if not parts:
        return Timeline(npu.clock_hz, ())
    return concat([t for t, _, _ in parts], [off for _, off, _ in parts])
