"""onnxruntime plugin: run fused models (and collectives) in a normal InferenceSession.

onnxruntime-extensions serves custom Python ops only in domain `ai.onnx.contrib`, passes only
int/float/string attributes, and registers ops with a fixed input/output count and dtypes. So
the plugin rewrites a copy of the model in memory: every node it handles becomes a contrib op
named after its signature (op, present inputs/outputs, dtypes), registered once per process,
with all of the node's attributes packed into one JSON string. The saved model keeps domain
`fuser` and its real attribute types.

Handlers: every fused op runs its numpy `reference` or its simulated NPU kernel (`kernel=`);
com.microsoft AllGather runs on an in-process communicator (one session per rank, see
`fuser.collective`), which also serves fused ops that gather.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from . import fusedop, plugin_clock
from .engine import infer_types
from .errors import UsageError
from .graph import TypeTable, ValueType
from .modelio import (
    LoadedModel,
    ModelSource,
    has_external_data,
    load_model,
    read_tensor,
    save_model,
)
from .registry import ensure_fused_ops_registered

if TYPE_CHECKING:
    import onnxruntime

    from .collective import Communicator

CONTRIB = "ai.onnx.contrib"
KERNELS = ("reference", "npu")
_PACKED = "fuser_node"


@dataclass(frozen=True)
class RunContext:
    """What a handler knows besides its inputs: how to compute and where it runs."""

    kernel: str
    target: str
    rank: int
    communicator: Communicator | None
    # With kernel "npu": where a fused node's kernel refuses because the machine has no unit
    # for its inputs (float64), the node runs its reference instead and its name -> that
    # limit is recorded here. None: such a refusal fails the node, as every other refusal does.
    fallbacks: dict[str, str] | None = None


Handler = Callable[
    [Sequence["np.ndarray | None"], Mapping[str, Any], RunContext], Sequence[np.ndarray]
]
_HANDLERS: dict[tuple[str, str], Handler] = {}
_CONTEXTS: dict[str, RunContext] = {}
_CONTEXT_IDS = itertools.count()


def register_handler(domain: str, op_type: str, handler: Handler) -> None:
    """Make nodes of (domain, op_type) run through `handler` in plugin sessions."""
    _HANDLERS[(domain, op_type)] = handler


def _fused_handler(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any], ctx: RunContext
) -> Sequence[np.ndarray]:
    op = fusedop.get(attrs["__op__"])
    values = {k: v for k, v in attrs.items() if not k.startswith("__")}
    full = {a.name: a.default for a in op.attributes} | values
    if op.collective_input is not None:
        from .collective import gather

        local = inputs[op.collective_input]
        assert local is not None
        stacked = np.stack(gather(local, values, ctx))
        inputs = [stacked if i == op.collective_input else x for i, x in enumerate(inputs)]
        full["rank"] = ctx.rank
    if ctx.kernel == "npu":
        from .npu_run import NpuLimitError, run_fused_on_npu

        try:
            return run_fused_on_npu(op.name, inputs, full, ctx)
        except NpuLimitError as exc:
            if ctx.fallbacks is None:
                raise
            ctx.fallbacks[str(attrs.get("__name__") or op.name)] = exc.limit
    start = time.perf_counter()
    outputs = op.reference(inputs, full)
    plugin_clock.add(plugin_clock.REFERENCE, time.perf_counter() - start)
    return outputs


def session(
    model: ModelSource | LoadedModel,
    *,
    kernel: str = "npu",
    target: str = "ascend910b",
    rank: int = 0,
    communicator: Communicator | None = None,
    options: onnxruntime.SessionOptions | None = None,
    fused_ops: bool = True,
    extra_outputs: Sequence[str] = (),
    fallback: bool = False,
) -> onnxruntime.InferenceSession:
    """An onnxruntime session that runs `model`, fused ops and collectives included.

    `fused_ops=False` leaves fused nodes to onnxruntime itself (their ONNX function bodies, when
    the model has them) and runs only the collectives onnxruntime's CPU package lacks.
    `extra_outputs` names values of the main graph the session also returns (validation
    compares them). `fallback=True` (with kernel "npu") runs a fused node the machine has no
    unit for (float64) on its reference instead of failing; `fallbacks(sess)` says which.

    >>> sess = session("model.fused.onnx")              # doctest: +SKIP
    >>> sess.run(None, {"x": x})                        # doctest: +SKIP
    """
    import onnxruntime
    from onnxruntime_extensions import get_library_path

    if kernel not in KERNELS:
        raise UsageError(f"unknown kernel '{kernel}'; choose one of {', '.join(KERNELS)}")
    ensure_fused_ops_registered()
    _ensure_builtin_handlers()
    _register_catalogue()
    _install_array_bridge()
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    copy = onnx.ModelProto()
    copy.CopyFrom(loaded.model)
    if not fused_ops and _bodies_need_plugin(copy):
        # A body holding a collective (AllGatherMatMul's com.microsoft AllGather) cannot run in
        # onnxruntime as a function: inline the bodies so the plugin serves the collective alone.
        from .functions import inline

        copy = inline(copy, _typed(copy))
    context = RunContext(kernel, target, rank, communicator, {} if fallback else None)
    context_id = f"ctx{next(_CONTEXT_IDS)}"
    _CONTEXTS[context_id] = context
    types = _typed(copy)
    table: Mapping[str, ValueType] = types.get("") or {}
    for name in extra_outputs:
        known = table.get(name)
        copy.graph.output.append(
            helper.make_tensor_value_info(name, known.elem_type, None)
            if known is not None and known.elem_type
            else onnx.ValueInfoProto(name=name)
        )
    constants = _main_constants(copy.graph)
    if _remap_graph(copy.graph, "", types, context_id, fused_ops, constants):
        _hold_constants(copy.graph, loaded, context_id, constants)
        dropped = (fusedop.DOMAIN, CONTRIB) if fused_ops else (CONTRIB,)
        kept = [o for o in copy.opset_import if o.domain not in dropped]
        del copy.opset_import[:]
        copy.opset_import.extend([*kept, helper.make_opsetid(CONTRIB, 1)])
    session_class = _session_class()
    opts = options or onnxruntime.SessionOptions()
    opts.register_custom_ops_library(get_library_path())
    providers = ["CPUExecutionProvider"]
    if has_external_data(copy) and loaded.base_dir is not None:
        # onnxruntime reads the external tensors from the model's own folder (locations were
        # checked at load): no staged copy of gigabytes of weights.
        opts.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(loaded.base_dir)
        )
        sess = session_class(copy.SerializeToString(), opts, providers=providers)
    elif has_external_data(copy):
        # Big models cannot pass through one protobuf: stage them (data streamed) in a folder.
        with tempfile.TemporaryDirectory(prefix="fuser-ort-") as folder:
            path = Path(folder) / "model.onnx"
            save_model(copy, path, source=loaded, external=True)
            sess = session_class(str(path), opts, providers=providers)
    else:
        sess = session_class(copy.SerializeToString(), opts, providers=providers)
    sess.fuser_context = context_id
    return sess


def _bodies_need_plugin(model: onnx.ModelProto) -> bool:
    """Whether a fuser function body holds a node that only the plugin runs (a collective)."""
    _ensure_builtin_handlers()
    return any(
        (node.domain, node.op_type) in _HANDLERS
        for function in model.functions
        if function.domain == fusedop.DOMAIN
        for node in function.node
    )


def _session_class() -> type[onnxruntime.InferenceSession]:
    """An InferenceSession whose `run` raises what failed inside fused ops (see `_dispatch`)."""
    import onnxruntime

    class FuserSession(onnxruntime.InferenceSession):
        fuser_context = ""

        def __del__(self) -> None:
            # the session's constants (weights) and context live as long as the session
            _CONSTANTS.pop(self.fuser_context, None)
            _CONTEXTS.pop(self.fuser_context, None)
            parent = getattr(super(), "__del__", None)
            if parent is not None:
                parent()

        def run(self, output_names: Any, input_feed: Any, run_options: Any = None) -> Any:
            _ERRORS.pop(self.fuser_context, None)
            try:
                result = super().run(output_names, input_feed, run_options)
            except Exception as exc:
                _raise_recorded(self.fuser_context, exc)
                raise
            _raise_recorded(self.fuser_context)
            return result

    return FuserSession


SKELETON_BYTES = 4096  # initializers larger than this are left out of type inference


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` without its large initializers' data, for shape inference.

    onnx's shape inference serializes the whole model (twice); for a large model that costs
    more than everything else validation does before running. Large initializers become graph
    inputs of the same type and shape (inference needs values only of small shape tensors).
    """
    graph = model.graph
    big = [
        t
        for t in graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        or int(np.prod(t.dims, dtype=np.int64)) * 8 > SKELETON_BYTES  # no ByteSize: it is slow
    ]
    if not big:
        return model
    big_names = {t.name for t in big}
    light = onnx.GraphProto(name=graph.name)
    light.node.extend(graph.node)
    light.input.extend(graph.input)
    listed = {v.name for v in graph.input}
    light.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in big
        if t.name not in listed
    )
    light.output.extend(graph.output)
    light.value_info.extend(graph.value_info)
    light.initializer.extend(t for t in graph.initializer if t.name not in big_names)
    light.sparse_initializer.extend(graph.sparse_initializer)
    copy = onnx.ModelProto(
        ir_version=model.ir_version, producer_name=model.producer_name, graph=light
    )
    copy.opset_import.extend(model.opset_import)
    copy.functions.extend(model.functions)
    return copy


def _typed(model: onnx.ModelProto) -> dict[str, TypeTable]:
    """Types of every value, with what shape inference cannot know filled in.

    onnx has no schema for com.microsoft collectives, so inference stops at an AllGather whose
    output no value_info declares; its output has its input's element type (a concatenation),
    which is declared on the copy and inference rerun, once per level of such nodes.
    """
    types = infer_types(skeleton(model))
    for _ in range(8):
        table: Mapping[str, ValueType] = types.get("") or {}
        added = False
        for node in model.graph.node:
            if node.domain == fusedop.DOMAIN or (node.domain, node.op_type) not in _HANDLERS:
                continue
            source = table.get(node.input[0]) if node.input else None
            for out in node.output:
                known = table.get(out)
                if out and (known is None or not known.elem_type) and source and source.elem_type:
                    model.graph.value_info.append(
                        helper.make_tensor_value_info(out, source.elem_type, None)
                    )
                    added = True
        if not added:
            break
        types = infer_types(skeleton(model))
    return types


# Constant inputs of plugin nodes (weights) never cross the bridge: the handler reads them from
# here, loaded once per session in their own dtype, and onnxruntime's copy of the model drops
# them. So a fused model's weights are held once, not once in onnxruntime plus a float64 copy
# made on every run (a 2.5 GB model took 17 GB that way).
_CONSTANTS: dict[str, dict[str, np.ndarray]] = {}


def _main_constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Initializers of the main graph a caller cannot override (not also graph inputs)."""
    inputs = {v.name for v in graph.input}
    return {t.name: t for t in graph.initializer if t.name not in inputs}


def _hold_constants(
    graph: onnx.GraphProto,
    loaded: LoadedModel,
    context_id: str,
    constants: Mapping[str, onnx.TensorProto],
) -> None:
    """Load the constants plugin nodes read; drop those nothing else in the graph reads."""
    from .graph import subgraph_free_names

    wanted: set[str] = set()
    for node in graph.node:
        if node.domain == CONTRIB:
            for attr in node.attribute:
                if attr.name == _PACKED:
                    wanted.update(json.loads(attr.s)["__const__"].values())
    if not wanted:
        return
    _CONSTANTS[context_id] = {name: read_tensor(loaded, constants[name]) for name in wanted}
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node.input)
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subs:
                used |= subgraph_free_names(sub)
    kept = [t for t in graph.initializer if t.name not in wanted or t.name in used]
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)


def _remap_graph(
    graph: onnx.GraphProto,
    path: str,
    types: Mapping[str, Mapping[str, ValueType]],
    context_id: str,
    fused_ops: bool = True,
    constants: Mapping[str, onnx.TensorProto] | None = None,
) -> bool:
    from .engine import sub_path

    changed = False
    table: Mapping[str, ValueType] = types.get(path) or {}
    rebuilt: list[onnx.NodeProto] = []
    for node in graph.node:
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for i, sub in enumerate(subs):
                changed |= _remap_graph(
                    sub, sub_path(path, node, attr.name, i, len(subs)), types, context_id, fused_ops
                )
        if (fused_ops and node.domain == fusedop.DOMAIN) or (
            node.domain != fusedop.DOMAIN and (node.domain, node.op_type) in _HANDLERS
        ):
            rebuilt.extend(_remap_node(node, table, types, context_id, constants or {}))
            changed = True
        else:
            rebuilt.append(node)
    if changed:
        del graph.node[:]
        graph.node.extend(rebuilt)
    return changed


def _elem_type(
    name: str, table: Mapping[str, ValueType], types: Mapping[str, Mapping[str, ValueType]]
) -> int:
    found = table.get(name)
    if found is None:
        for other in types.values():  # outer scopes
            found = other.get(name)
            if found is not None:
                break
    if found is None or found.elem_type == 0:
        raise UsageError(f"cannot run: element type of '{name}' is unknown to shape inference")
    return found.elem_type


# Every tensor crosses the plugin boundary as float64, through Cast nodes on either side, and
# the dispatcher restores the real dtype, so handlers see exactly what the graph holds. Why:
# - onnxruntime-extensions 0.15 aborts the process on float16 tensors ("Type float16 not
#   supported by python customops api");
# - it keeps raw pointers into its list of Python ops, so registering an op after a session
#   exists leaves that session dangling (a segfault on its next run). With one wire type, an
#   op's signature is just its input and output counts, and the whole catalogue is registered
#   once, before the first session.
# float64 holds float16/float32/int32/bool exactly, and int64 up to 2**53 (indices, shapes).
_WIRE = onnx.TensorProto.DOUBLE
MAX_WIRE_INPUTS, MAX_WIRE_OUTPUTS = 24, 12
_EXACT_ON_WIRE = {
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.INT64,
    onnx.TensorProto.INT32,
    onnx.TensorProto.INT16,
    onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.UINT32,
    onnx.TensorProto.BOOL,
}


def fallbacks(sess: Any) -> Mapping[str, str]:
    """The fused nodes a `session(..., fallback=True)` ran on their reference because the
    machine has no unit for their inputs: node name -> the limit ("no float64 unit")."""
    ctx = _CONTEXTS.get(getattr(sess, "fuser_context", ""))
    return dict(ctx.fallbacks or {}) if ctx is not None else {}


def held_constants(sess: Any) -> Mapping[str, np.ndarray]:
    """The constant inputs of plugin nodes a `session` holds on the Python side (weights)."""
    return _CONSTANTS.get(getattr(sess, "fuser_context", ""), {})


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """A node's attributes as plain Python values (strings decoded), as handlers receive them."""
    attrs: dict[str, Any] = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        attrs[attr.name] = value.decode() if isinstance(value, bytes) else value
        if isinstance(attrs[attr.name], list | tuple):
            attrs[attr.name] = [v.decode() if isinstance(v, bytes) else v for v in attrs[attr.name]]
    return attrs


def run_node(
    node: onnx.NodeProto,
    inputs: Sequence[np.ndarray | None],
    *,
    kernel: str = "npu",
    target: str = "ascend910b",
    rank: int = 0,
    communicator: Communicator | None = None,
    fallbacks: dict[str, str] | None = None,
) -> list[np.ndarray | None]:
    """One fused node (or handled collective) run alone, as a plugin session would run it.

    `inputs` follow `node.input` (None where the name is empty); the result follows
    `node.output` (None where the name is empty). Validation feeds a fused node the original
    model's own values this way, so a broken node shows whatever lies around it. Given
    `fallbacks`, a node the machine has no unit for runs on its reference and is recorded
    there, as in `session(..., fallback=True)`.
    """
    if kernel not in KERNELS:
        raise UsageError(f"unknown kernel '{kernel}'; choose one of {', '.join(KERNELS)}")
    ensure_fused_ops_registered()
    _ensure_builtin_handlers()
    ctx = RunContext(kernel, target, rank, communicator, fallbacks)
    attrs = {"__op__": node.op_type, "__name__": node.name, **node_attributes(node)}
    if node.domain == fusedop.DOMAIN:
        results = _fused_handler(inputs, attrs, ctx)
    else:
        results = _HANDLERS[(node.domain, node.op_type)](inputs, attrs, ctx)
    return [np.asarray(results[i]) if name else None for i, name in enumerate(node.output)]


def _remap_node(
    node: onnx.NodeProto,
    table: Mapping[str, ValueType],
    types: Mapping[str, Mapping[str, ValueType]],
    context_id: str,
    constants: Mapping[str, onnx.TensorProto],
) -> list[onnx.NodeProto]:
    present = [i for i, n in enumerate(node.input) if n]
    held = {i: node.input[i] for i in present if node.input[i] in constants}
    if len(held) == len(present) and present:
        held.pop(present[0])  # a contrib op takes at least one input over the wire
    in_pos = [i for i in present if i not in held]
    out_pos = [i for i, n in enumerate(node.output) if n]
    in_types = [_elem_type(node.input[i], table, types) for i in in_pos]
    out_types = [_elem_type(node.output[i], table, types) for i in out_pos]
    attrs = node_attributes(node)
    packed = {
        "__op__": node.op_type,
        "__domain__": node.domain,
        "__context__": context_id,
        "__inputs__": in_pos,
        "__n_inputs__": len(node.input),
        "__outputs__": out_pos,
        "__name__": node.name,
        "__in_dtypes__": [helper.tensor_dtype_to_np_dtype(t).name for t in in_types],
        "__const__": {str(i): name for i, name in held.items()},
        "__out_dtypes__": [helper.tensor_dtype_to_np_dtype(t).name for t in out_types],
        **attrs,
    }
    for t in [*in_types, *out_types]:
        if t not in _EXACT_ON_WIRE:
            raise UsageError(
                f"node '{node.name}' ({node.op_type}): tensors of type "
                f"{helper.tensor_dtype_to_np_dtype(t).name} cannot pass through the plugin"
            )
    wire_in = [_WIRE] * len(in_types)
    wire_out = [_WIRE] * len(out_types)
    contrib_name = _contrib_op_name(len(in_types), len(out_types))
    before: list[onnx.NodeProto] = []
    after: list[onnx.NodeProto] = []
    inputs, outputs = [], []
    for i, t, w in zip(in_pos, in_types, wire_in, strict=True):
        name = node.input[i]
        if t != w:
            wired = f"{name}__fuser_wire_{node.name or id(node)}_{i}"
            before.append(helper.make_node("Cast", [name], [wired], to=w))
            name = wired
        inputs.append(name)
    for i, t, w in zip(out_pos, out_types, wire_out, strict=True):
        name = node.output[i]
        if t != w:
            wired = f"{name}__fuser_wire_out"
            after.append(helper.make_node("Cast", [wired], [name], to=t))
            name = wired
        outputs.append(name)
    del node.input[:], node.output[:], node.attribute[:]
    node.input.extend(inputs)
    node.output.extend(outputs)
    node.attribute.append(helper.make_attribute(_PACKED, json.dumps(packed)))
    node.op_type, node.domain = contrib_name, CONTRIB
    return [*before, node, *after]


_REGISTERED_CONTRIB: set[str] = set()


def _contrib_op_name(n_inputs: int, n_outputs: int) -> str:
    name = f"FuserOp_{n_inputs}_{n_outputs}"
    if name not in _REGISTERED_CONTRIB:
        # Only beyond the catalogue; a session created earlier in this process may not survive.
        _register_contrib_op(name, n_inputs, n_outputs)
    return name


_HOOKED = False


def _install_array_bridge() -> None:
    """Return op outputs to onnxruntime as arrays, not through `flatten().tolist()`.

    onnxruntime-extensions' own Python hook turns every output into a Python list, which its
    C++ side then turns back into an array with `numpy.ascontiguousarray`: for a [1, 512, 3072]
    output that is ~200 ms per call. The C++ side accepts the array itself (measured: 6 ms), so
    fuser installs the same hook without the list. The hook is process-wide; it serves every
    `onnx_op` as the library's does (attributes cast by the op's own declaration).
    """
    global _HOOKED
    if _HOOKED:
        return
    from onnxruntime_extensions import Opdef, PyCustomOpDef

    table = getattr(Opdef, "_odlist", None)
    if not isinstance(table, dict):  # another library version: keep its own hook
        return

    def invoke(op_id: int, feed: Any, attributes: Any) -> tuple[Any, ...]:
        op = table[op_id]
        returned = op.body(*feed, **op.cast_attributes(attributes))
        flat: list[Any] = []
        for array in returned if isinstance(returned, tuple) else (returned,):
            # strings still travel as a list: the C++ side reads those as std::string
            textual = array.dtype.kind in "OUS"
            flat.extend((array.shape, array.flatten().tolist() if textual else array))
        return (op_id, *flat)

    PyCustomOpDef.install_hooker(invoke)
    _HOOKED = True


def _register_catalogue() -> None:
    """Register every op signature the plugin can need, before any session exists."""
    for n_in in range(1, MAX_WIRE_INPUTS + 1):
        for n_out in range(1, MAX_WIRE_OUTPUTS + 1):
            _register_contrib_op(f"FuserOp_{n_in}_{n_out}", n_in, n_out)


def _register_contrib_op(name: str, n_inputs: int, n_outputs: int) -> None:
    if name in _REGISTERED_CONTRIB:
        return
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    onnx_op(
        op_type=name,
        inputs=[PyCustomOpDef.dt_double] * n_inputs,
        outputs=[PyCustomOpDef.dt_double] * n_outputs,
        attrs={_PACKED: PyCustomOpDef.dt_string},
    )(_dispatch)
    _REGISTERED_CONTRIB.add(name)


def _dispatch(*arrays: np.ndarray, **kwargs: Any) -> Any:
    """The body of every contrib op. It must never raise: onnxruntime-extensions 0.15 turns a
    Python exception inside an op into std::terminate, killing the user's process. A failure is
    recorded against the session and placeholder outputs are returned; `FuserSession.run`
    raises the recorded error once onnxruntime gives control back."""
    packed = json.loads(kwargs[_PACKED])
    try:
        return _compute(arrays, packed)
    except BaseException as exc:
        name, op_type = packed.get("__name__", ""), packed.get("__op__", "")
        error = NodeFailedError(f"node '{name}' ({op_type}) failed: {exc}")
        error.__cause__ = exc
        _ERRORS.setdefault(packed["__context__"], []).append(error)
        ctx = _CONTEXTS.get(packed["__context__"])
        if ctx is not None and ctx.communicator is not None:
            ctx.communicator.abort(str(error), rank=ctx.rank)  # the others must not wait forever
        empty = [np.zeros((0,), dtype=_wire_dtype(d)) for d in packed["__out_dtypes__"]]
        return empty[0] if len(empty) == 1 else tuple(empty)


def _compute(arrays: Sequence[np.ndarray], packed: dict[str, Any]) -> Any:
    inputs: list[np.ndarray | None] = [None] * packed["__n_inputs__"]
    for position, array, dtype in zip(
        packed["__inputs__"], arrays, packed["__in_dtypes__"], strict=True
    ):
        inputs[position] = array.astype(dtype, copy=False)
    held = _CONSTANTS.get(packed["__context__"], {})
    for position_text, name in packed.get("__const__", {}).items():
        inputs[int(position_text)] = held[name]
    ctx = _CONTEXTS[packed["__context__"]]
    domain, op_type = packed["__domain__"], packed["__op__"]
    handler = _fused_handler if domain == fusedop.DOMAIN else _HANDLERS[(domain, op_type)]
    results = handler(inputs, packed, ctx)
    selected = [
        np.ascontiguousarray(
            np.asarray(results[i], dtype=dtype).astype(_wire_dtype(dtype), copy=False)
        )
        for i, dtype in zip(packed["__outputs__"], packed["__out_dtypes__"], strict=True)
    ]
    return selected[0] if len(selected) == 1 else tuple(selected)


class NodeFailedError(RuntimeError):
    """A fused op or collective failed inside an onnxruntime session run by fuser."""


_ERRORS: dict[str, list[NodeFailedError]] = {}


def _raise_recorded(context_id: str, during: BaseException | None = None) -> None:
    errors = _ERRORS.pop(context_id, [])
    if errors:
        raise errors[0] from (errors[0].__cause__ or during)


def _wire_dtype(dtype: str) -> str:
    return "float64"


_BUILTINS_LOADED = False


def _ensure_builtin_handlers() -> None:
    """Handlers for standard ops onnxruntime's CPU package lacks (com.microsoft collectives)."""
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        from . import collective  # registers its handlers on import

        del collective
        _BUILTINS_LOADED = True
