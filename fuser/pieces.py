"""onnx's checker and shape inference on a large graph a piece at a time.

Given a whole model, each C++ tool parses all of it into its own messages (at 100k nodes some
hundreds of MB beside Python's copy of the model). Here the main graph's nodes go to the
tools in pieces of `PIECE_NODES`, in order, each piece a model of its own laid out byte by byte
(the nodes serialized once, nothing copied), so at most one piece is parsed at a time.

What the whole-graph tools see and decide, the pieces see and decide:

- The checker. Piece 0 is the graph without nodes: every graph input, every initializer (its
  checks, in order, come before any node's), and each graph output declared as an input (its
  value info checked as the checker checks an output's; no node piece declares outputs). A
  node piece declares, as placeholder inputs, the names its nodes read or write that are
  defined before it (graph inputs, initializers, earlier pieces' outputs): a read of a name
  defined later or nowhere, and a second definition of any name, fail in the piece where the
  whole-graph checker fails, with its own message, and since pieces run in order the first
  failure is the one the whole graph's check reports. `check_full_check=False` checks no
  types, so a placeholder's type does not matter.
- Shape inference. A piece declares the graph inputs and initializers its nodes read (an
  initializer's values, like a Constant's, feed the inference of ops such as Reshape), the
  model's value infos and graph outputs of the values it defines, and as value infos the types
  inference gave the values it reads from earlier pieces; the Constant nodes of earlier pieces
  it reads come with it (inference reads their tensors). Inference names an unknown dim
  `unk__N`, the first N not yet taken in the whole graph: each piece carries every such name
  taken so far (one extra value info), so its names are the whole graph's. Graph-level
  failures (an initializer disagreeing with its input's type) come from a piece 0 of those
  inputs. Where inference fails anywhere, the caller does what it does when the whole graph's
  fails.

The graph must be one these rules cover (`pieceable`): no subgraphs, IR version 4 or later,
no sparse initializers, every graph output and value info a value some node defines and no
graph output also an input or initializer. Others take the whole-graph route.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import onnx
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message
from onnx.onnx_cpp2py_export import shape_inference as c_inference

from .graph import TypeTable
from .stream_save import length_key, varint

# Nodes per piece: the tools' memory is a piece's; each piece costs a few parses of the
# model's own fields (opset imports, functions), so pieces are not made tiny.
PIECE_NODES = 8192
# Below this many nodes the graph goes whole (the tools' copy is small).
MIN_NODES = 2 * PIECE_NODES

_UNKNOWN_PREFIX = "unk__"  # onnx's SymbolTableImpl names unknown dims so
_CONSTANT_DOMAINS = ("", "ai.onnx")


def _number(
    message: type[onnx.ModelProto | onnx.GraphProto | onnx.ValueInfoProto], name: str
) -> bytes:
    return length_key(message.DESCRIPTOR.fields_by_name[name].number)


_GRAPH = _number(onnx.ModelProto, "graph")
_NODE = _number(onnx.GraphProto, "node")
_NAME = _number(onnx.GraphProto, "name")
_INITIALIZER = _number(onnx.GraphProto, "initializer")
_INPUT = _number(onnx.GraphProto, "input")
_OUTPUT = _number(onnx.GraphProto, "output")
_VALUE_INFO = _number(onnx.GraphProto, "value_info")
_VI_NAME = _number(onnx.ValueInfoProto, "name")
_VI_TYPE = _number(onnx.ValueInfoProto, "type")


# Lengths below this are looked up (most fields are shorter): a piece has ~10^5 fields.
_SHORT = 1 << 14
_LENGTHS = [varint(n) for n in range(_SHORT)]


def _length(n: int) -> bytes:
    return _LENGTHS[n] if n < _SHORT else varint(n)


def _field(key: bytes, payload: bytes) -> bytes:
    return key + _length(len(payload)) + payload


def _fields(key: bytes, payloads: list[bytes]) -> bytes:
    """Repeated field `key` with each of `payloads`, laid out."""
    lengths, short = _LENGTHS, _SHORT
    return b"".join(
        [key + (lengths[len(p)] if len(p) < short else varint(len(p))) + p for p in payloads]
    )


def _name_field(name: str) -> bytes:
    data = name.encode()
    return _VI_NAME + _length(len(data)) + data


def _placeholder_type() -> bytes:
    kind = onnx.TypeProto()
    kind.tensor_type.elem_type = onnx.TensorProto.FLOAT
    kind.tensor_type.shape.SetInParent()
    return kind.SerializeToString()


# A graph input's type as the checker asks of a main graph's (any type: it checks none).
_PLACEHOLDER_FIELD = _field(_VI_TYPE, _placeholder_type())


def _symbol_carrier(name: str, dims: bytes) -> bytes:
    """A value info whose dims (`dims`: laid out dim_param dims) inference takes as names in use:
    TypeProto.tensor_type (1) of elem_type (1) float and shape (2) of those dims."""
    tensor = b"\x08\x01" + _field(b"\x12", dims)
    kind = _field(b"\x0a", tensor)
    return _field(_VALUE_INFO, _name_field(name) + _field(_VI_TYPE, kind))


def _dim_fields(symbols: Iterable[str]) -> bytes:
    """TensorShapeProto.dim (1) fields of Dimension.dim_param (2) `symbols`."""
    return b"".join(_field(b"\x0a", _field(b"\x12", s.encode())) for s in symbols)


# A generated dim as inference lays it out: a Dimension holding only its dim_param; and any
# dim_param-shaped `unk__N` field (if these find more, the value infos are walked instead).
_STRICT_SYMBOL = re.compile(rb"\x0a[\x07-\x7f]\x12[\x05-\x7d]unk__[0-9]+")
_LOOSE_SYMBOL = re.compile(rb"\x12[\x05-\x7f]unk__[0-9]+")


def _new_symbols(values: Message) -> set[str]:
    """The `unk__N` dim names among `values`' (a parsed typed-values graph) value infos and
    outputs: found in their bytes, or by a walk where the bytes are not plain."""
    values.DiscardUnknownFields()
    data = values.SerializeToString()
    # each distinct match once (a few symbols repeat over most values)
    strict = Counter(_STRICT_SYMBOL.findall(data))
    loose = Counter(_LOOSE_SYMBOL.findall(data))
    found = {m[4:] for m in strict if m[1] == m[3] + 2 and m[3] == len(m) - 4}
    plain = sum(strict[m] for m in strict if m[4:] in found)
    if plain == sum(n for m, n in loose.items() if m[1] == len(m) - 2):
        return {s.decode() for s in found}
    return _unknown_symbols((*values.value_info, *values.output))


def plan(model: onnx.ModelProto, nested: bool) -> list[Step] | None:
    """The pieces of `model`'s main graph, where `check_pieces`/`infer_pieces` see it as the
    whole-graph tools do (see the module docstring); None where it goes whole. `nested`:
    whether a node may hold a subgraph (`NodeScan.nested`)."""
    graph = model.graph
    if nested or len(graph.node) < MIN_NODES or model.ir_version < 4:
        return None
    if len(graph.sparse_initializer) or len(model.training_info):
        return None
    outer = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    steps = _plan(graph.node, set(outer))
    named = [v.name for v in graph.output] + [v.name for v in graph.value_info]
    if any(n in outer for n in named):
        return None
    produced: set[str] = set()
    for step in steps if named else ():
        produced.update(step.written)
    return steps if all(n in produced for n in named) else None


def _head(model: onnx.ModelProto) -> bytes:
    """`model`'s fields but its graph, serialized."""
    head = onnx.ModelProto()
    for fd, value in model.ListFields():
        if fd.name == "graph":
            continue
        if fd.is_repeated:
            getattr(head, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(head, fd.name).CopyFrom(value)
        else:
            setattr(head, fd.name, value)
    return head.SerializeToString()


@functools.cache
def typed_values_class() -> type[Message]:
    """A message type laid out as ModelProto whose `graph` holds only GraphProto's `input`,
    `output` and `value_info` (same field numbers and element type): parsing a model into it
    makes Python messages of the value infos alone."""
    graph_fields = onnx.GraphProto.DESCRIPTOR.fields_by_name
    value_info = onnx.ValueInfoProto.DESCRIPTOR
    file = descriptor_pb2.FileDescriptorProto(
        name="fuser/typed_values.proto",
        package="fuser.typed_values",
        dependency=[value_info.file.name],
        syntax="proto2",
    )
    graph = file.message_type.add(name="Values")
    for name in ("input", "output", "value_info"):
        graph.field.add(
            name=name,
            number=graph_fields[name].number,
            label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
            type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
            type_name=f".{value_info.full_name}",
        )
    model = file.message_type.add(name="Model")
    model.field.add(
        name="graph",
        number=onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
        type_name=".fuser.typed_values.Values",
    )
    pool = descriptor_pool.Default()
    try:
        found = pool.FindMessageTypeByName("fuser.typed_values.Model")
    except KeyError:
        found = pool.Add(file).message_types_by_name["Model"]
    return message_factory.GetMessageClass(found)


@contextlib.contextmanager
def anonymous_file() -> Iterator[str | None]:
    """A path to a new, empty file that has no name on disk (Linux's O_TMPFILE, reached through
    /proc/self/fd): onnx's C++ tools read and write it by path, and it vanishes with its handle
    however the process ends. None where the system has no such files."""
    flag = getattr(os, "O_TMPFILE", 0)
    fd = None
    if flag and os.path.isdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fd = os.open(tempfile.gettempdir(), flag | os.O_RDWR, 0o600)
    try:
        yield None if fd is None else f"/proc/self/fd/{fd}"
    finally:
        if fd is not None:
            os.close(fd)


def _check(chunks: Iterable[bytes]) -> None:
    """The checker on a model given as consecutive byte chunks (through an anonymous file, so
    the chunks are never joined in memory, where there is one)."""
    with anonymous_file() as path:
        if path is not None:
            with open(path, "wb") as handle:
                for chunk in chunks:
                    handle.write(chunk)
            onnx.checker.check_model(path, full_check=False)
            return
    onnx.checker.check_model(b"".join(chunks), full_check=False)


def _check_outer(model: onnx.ModelProto, head: bytes, name: bytes) -> None:
    """Piece 0 of the checker: graph inputs, graph outputs (as inputs), initializers."""
    graph = model.graph
    inputs = [v.SerializeToString() for v in graph.input]
    declared = {v.name for v in graph.input}
    for value in graph.output:
        if value.name not in declared:
            declared.add(value.name)
            inputs.append(value.SerializeToString())

    def chunks() -> Iterator[bytes]:
        yield head
        yield _field(_GRAPH, name + b"".join(_field(_INPUT, v) for v in inputs))
        batch: list[bytes] = []
        # the graph field may appear many times (protobuf merges them): a batch at a time
        for tensor in graph.initializer:
            batch.append(tensor.SerializeToString())
            if len(batch) == 1024:
                yield _field(_GRAPH, _fields(_INITIALIZER, batch))
                batch = []
        if batch:
            yield _field(_GRAPH, _fields(_INITIALIZER, batch))

    _check(chunks())


def check_pieces(model: onnx.ModelProto, steps: list[Step]) -> None:
    """onnx's checker on `model` a piece at a time (`steps`: its `plan`); raises its
    ValidationError, with the message the whole-graph check gives."""
    for _ in _walk(model, steps, infer=False):
        pass


def infer_pieces(
    model: onnx.ModelProto, source: onnx.ModelProto, steps: list[Step]
) -> TypeTable | None:
    """`check_pieces`, then the main graph's types from shape inference a piece at a time, as
    the whole graph's inference gives them (inputs, outputs, value infos, then `source`'s
    initializers); None where inference failed (for any piece: the whole graph's would too)."""
    *_, found = _walk(model, steps, infer=True)
    if found is None:
        return None
    graph = model.graph
    outputs, existing, new = found
    table = TypeTable()
    table.add_protos(graph.input)
    table.add_protos(outputs[v.name] for v in graph.output if v.name in outputs)
    table.add_protos(existing[v.name] for v in graph.value_info if v.name in existing)
    table.add_protos(new)
    table.add_protos(source.graph.initializer)
    return table


_Found = tuple[
    dict[str, onnx.ValueInfoProto], dict[str, onnx.ValueInfoProto], list[onnx.ValueInfoProto]
]


def _walk(model: onnx.ModelProto, steps: list[Step], infer: bool) -> Iterator[_Found | None]:
    """Check (and infer) piece by piece; yields after each piece, lastly what inference found
    (graph outputs and model value infos by name, new value infos in order) or None where it
    failed. Check errors propagate."""
    graph = model.graph
    head = _head(model)
    name = _field(_NAME, graph.name.encode()) if graph.name else b""
    _check_outer(model, head, name)
    inputs = {v.name: v for v in graph.input}
    initializers: dict[str, onnx.TensorProto] = {}
    for tensor in graph.initializer:
        initializers.setdefault(tensor.name, tensor)
    # the values a later piece reads (their types travel to it)
    wanted = {n for step in steps for n in step.before} - inputs.keys() - initializers.keys()
    outputs_wanted = {v.name: v for v in graph.output}
    model_infos = {v.name: i for i, v in enumerate(graph.value_info)}
    symbols = _unknown_symbols((*graph.input, *graph.output, *graph.value_info))
    symbol_dims = _dim_fields(sorted(symbols))
    carried: dict[str, onnx.ValueInfoProto] = {}  # typed values defined so far that are wanted
    constants: dict[str, bytes] = {}  # Constant nodes defined so far, by output
    outputs: dict[str, onnx.ValueInfoProto] = {}
    existing: dict[str, onnx.ValueInfoProto] = {}
    new: list[onnx.ValueInfoProto] = []
    failed = not infer or not _infer_outer(head, name, graph, inputs)
    values_class = typed_values_class()
    nodes = graph.node
    for step in steps:
        piece = nodes[step.start : step.stop]
        serialized = _fields(_NODE, [n.SerializeToString() for n in piece])
        before = step.before
        typed = _PLACEHOLDER_FIELD
        placeholders = b"".join(
            [_INPUT + _length(len(f)) + f for f in [_name_field(n) + typed for n in before]]
        )
        onnx.checker.check_model(head + _field(_GRAPH, name + placeholders + serialized))
        if not failed:
            defined_before = set(before)
            read_before = [n for n in step.reads if n in defined_before]
            own = sorted(model_infos[n] for n in step.written if n in model_infos)
            earlier = [n for n in read_before if n in carried]
            carrier = "fuser.unknown_dims"
            while carrier in step.reads or carrier in step.written:
                carrier += "_"
            body = [
                name,
                _fields(
                    _INPUT, [inputs[n].SerializeToString() for n in read_before if n in inputs]
                ),
                _fields(
                    _INITIALIZER,
                    [initializers[n].SerializeToString() for n in read_before if n in initializers],
                ),
                _fields(_VALUE_INFO, [graph.value_info[i].SerializeToString() for i in own]),
                _fields(_VALUE_INFO, [carried[n].SerializeToString() for n in earlier]),
                _symbol_carrier(carrier, symbol_dims) if symbols else b"",
                _fields(
                    _OUTPUT,
                    [
                        outputs_wanted[n].SerializeToString()
                        for n in step.written
                        if n in outputs_wanted
                    ],
                ),
                *[constants[n] for n in read_before if n in constants],
                serialized,
            ]
            data = head + _field(_GRAPH, b"".join(body))
            del body
            try:
                result = c_inference.infer_shapes(data, False, False, False)
            except Exception:  # as the whole graph's inference failing: the caller decides
                failed = True
            else:
                del data
                values = values_class()
                values.ParseFromString(result)
                infos = values.graph.value_info
                # inference keeps the value infos it was given, in order, and appends the rest
                given = len(own) + len(earlier) + bool(symbols)
                for value in infos[: len(own)]:
                    existing.setdefault(value.name, value)
                made = infos[given:]
                if any(n in constants and n not in carried for n in read_before):
                    made = [
                        v for v in made if v.name not in defined_before
                    ]  # a Constant seen again
                new.extend(made)
                for value in values.graph.output:
                    outputs.setdefault(value.name, value)
                if wanted:
                    for value in (*infos[: len(own)], *made, *values.graph.output):
                        if value.name in wanted and value.HasField("type"):
                            carried[value.name] = value
                if _UNKNOWN_PREFIX.encode() in result:
                    found = _new_symbols(values.graph) - symbols
                    symbols |= found
                    symbol_dims += _dim_fields(sorted(found))
                del result, values, infos, made
        for i in step.constants:
            constants[nodes[i].output[0]] = _field(_NODE, nodes[i].SerializeToString())
        yield None
    yield None if failed else (outputs, existing, new)


@dataclass(frozen=True)
class Step:
    """One piece of a graph: its nodes (`start`:`stop`), the names they read and write (in
    order, once each), those defined before the piece, and its Constant nodes' indices."""

    start: int
    stop: int
    reads: dict[str, None]
    written: dict[str, None]
    before: list[str]
    constants: list[int]


def _plan(nodes: Sequence[onnx.NodeProto], defined: set[str]) -> list[Step]:
    """The pieces of `nodes`, given the names defined before the first (one walk)."""
    steps = []
    for start in range(0, len(nodes), PIECE_NODES):
        stop = min(start + PIECE_NODES, len(nodes))
        read: list[str] = []
        wrote: list[str] = []
        constants = []
        for i in range(start, stop):
            node = nodes[i]
            read += node.input
            wrote += node.output
            constant = node.op_type == "Constant" and node.domain in _CONSTANT_DOMAINS
            if constant and len(node.output) == 1:
                constants.append(i)
        reads = dict.fromkeys(read)
        written = dict.fromkeys(wrote)
        reads.pop("", None)
        written.pop("", None)
        before = [n for n in {**reads, **written} if n in defined]
        steps.append(Step(start, stop, reads, written, before, constants))
        defined.update(written)
    return steps


def _infer_outer(
    head: bytes, name: bytes, graph: onnx.GraphProto, inputs: dict[str, onnx.ValueInfoProto]
) -> bool:
    """Inference's graph-level checks (an initializer disagreeing with its graph input): the
    inputs with an initializer and those initializers, alone; whether it passed."""
    both = [t for t in graph.initializer if t.name in inputs]
    if not both:
        return True
    body = [name]
    body += [_field(_INPUT, inputs[t.name].SerializeToString()) for t in both]
    body += [_field(_INITIALIZER, t.SerializeToString()) for t in both]
    try:
        c_inference.infer_shapes(head + _field(_GRAPH, b"".join(body)), False, False, False)
    except Exception:
        return False
    return True


def _unknown_symbols(values: Iterable[onnx.ValueInfoProto]) -> set[str]:
    """The dim names of `values` that inference could have made (`unk__N`)."""
    found = set()
    for value in values:
        for dim in _dims(value.type):
            if dim.dim_param.startswith(_UNKNOWN_PREFIX):
                found.add(dim.dim_param)
    return found


def _dims(kind: onnx.TypeProto) -> Iterator[onnx.TensorShapeProto.Dimension]:
    """The dims inference's symbol table reads of a type (tensor, sparse tensor, and through
    sequences, optionals and maps)."""
    which = kind.WhichOneof("value")
    if which in ("tensor_type", "sparse_tensor_type"):
        tensor = getattr(kind, which)
        if tensor.HasField("shape"):
            yield from tensor.shape.dim
    elif which in ("sequence_type", "optional_type"):
        yield from _dims(getattr(kind, which).elem_type)
    elif which == "map_type":
        yield from _dims(kind.map_type.value_type)
