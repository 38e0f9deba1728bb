"""onnx's checker and shape inference on a large graph a piece at a time.

Given a whole model, each C++ tool parses all of it into its own messages (at 100k nodes some
hundreds of MB beside Python's copy of the model). Here the main graph's nodes go to the
tools in pieces of `PIECE_NODES`, in order, each piece a model of its own laid out byte by byte
(the nodes serialized once, nothing copied), so at most one piece is parsed at a time.

One serialization of a piece serves both tools. It declares, as inputs, the graph inputs and
initializers its nodes read or write (an initializer's values, like a Constant's, feed the
inference of ops such as Reshape) and the values of earlier pieces they read or write, typed
as inference typed them; the model's value infos and the graph outputs of the values it
defines; the Constant nodes of earlier pieces it reads (inference reads their tensors). The
last piece also takes the inputs and initializers no node reads, so every one is checked.

- The checker passes the pieces where it passes the whole graph: a read of a name defined
  later or nowhere, a second definition of any name, a bad node or tensor, fail in some piece.
  When a piece fails, the whole graph's check decides (and gives its message): the pieces
  only ever spare the whole check of a valid model. Where inference left an earlier value
  without a full tensor type (the checker wants a shape of a main graph's input), the piece's
  checker copy declares it with a placeholder type (`full_check=False` checks no types).
- Inference types each value as it does in the whole graph: a node sees the same input types
  and constant values. Inference names an unknown dim `unk__N`, the first N not yet taken in
  the whole graph: each piece carries every such name taken so far (an extra value info), so
  its names are the whole graph's. Where inference fails in any piece, the caller does what
  it does when the whole graph's fails (both fail on the same node or the same initializer).

The graph must be one these rules cover (`plan`): no subgraphs, IR version 4 or later, no
sparse initializers, every graph output and value info a value some node defines, and no graph
output also an input or initializer. Others take the whole-graph route.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import onnx
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message
from onnx.onnx_cpp2py_export import shape_inference as c_inference

from .checkview import copy_field
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
        if fd.name != "graph":
            copy_field(fd, value, head)
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


class PieceRefusedError(Exception):
    """A piece failed onnx's checker (the whole graph's check says whether, and why)."""


def check_pieces(model: onnx.ModelProto, steps: list[Step]) -> None:
    """onnx's checker on `model` a piece at a time (`steps`: its `plan`); raises `PieceRefusedError`
    where a piece fails (then the whole graph's check gives the verdict and the message)."""
    for _ in _walk(model, steps, infer=False):
        pass


def infer_pieces(
    model: onnx.ModelProto, source: onnx.ModelProto, steps: list[Step]
) -> TypeTable | None:
    """`check_pieces`, and the main graph's types from shape inference a piece at a time, as
    the whole graph's inference gives them (inputs, outputs, value infos, then `source`'s
    initializers); None where inference failed (for any piece: the whole graph's would too).
    Raises `PieceRefusedError` as `check_pieces` (the types of a model the whole check passes
    after all are `infer_checked_pieces`')."""
    *_, found = _walk(model, steps, infer=True)
    return _table(model, source, found)


def infer_checked_pieces(
    model: onnx.ModelProto, source: onnx.ModelProto, steps: list[Step]
) -> TypeTable | None:
    """`infer_pieces` without the checker (the caller has checked the model whole)."""
    *_, found = _walk(model, steps, infer=True, check=False)
    return _table(model, source, found)


def _table(
    model: onnx.ModelProto, source: onnx.ModelProto, found: _Found | None
) -> TypeTable | None:
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


def _complete(value: onnx.ValueInfoProto) -> bool:
    """Whether the checker takes `value` as a main-graph input (a tensor type with an element
    type and a shape; other kinds are left to the checker, which the whole check overrules)."""
    kind = value.type
    if kind.WhichOneof("value") != "tensor_type":
        return kind.WhichOneof("value") is not None
    return bool(kind.tensor_type.elem_type) and kind.tensor_type.HasField("shape")


def _walk(
    model: onnx.ModelProto, steps: list[Step], infer: bool, check: bool = True
) -> Iterator[_Found | None]:
    """Check (and infer) piece by piece; yields after each piece, lastly what inference found
    (graph outputs and model value infos by name, new value infos in order) or None where it
    failed or was not asked. A piece the checker refuses raises `PieceRefusedError`."""
    graph = model.graph
    head = _head(model)
    name = _field(_NAME, graph.name.encode()) if graph.name else b""
    inputs = {v.name: v for v in graph.input}
    initializers: dict[str, onnx.TensorProto] = {}
    for tensor in graph.initializer:
        initializers.setdefault(tensor.name, tensor)
    # what the whole check checks once over the graph: names unique, initializers named
    if check and (len(inputs) < len(graph.input) or len(initializers) < len(graph.initializer)):
        raise PieceRefusedError("a graph input or initializer name is not unique")
    if check and "" in initializers:
        raise PieceRefusedError("an initializer has no name")
    # the inputs and initializers no node reads go with the last piece (checked there)
    unread = set(inputs) | set(initializers)
    for step in steps:
        unread.difference_update(step.reads)
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
    failed = not infer
    values_class = typed_values_class()
    nodes = graph.node
    for number, step in enumerate(steps):
        last = number == len(steps) - 1
        before = set(step.before)
        outer = [n for n in step.before if n in inputs or n in initializers]
        if last:
            outer += [v.name for v in graph.input if v.name in unread]
            outer += [t.name for t in graph.initializer if t.name in unread]
        shared = [n for n in step.before if n in constants]  # Constants seen again
        earlier = [n for n in step.before if n not in inputs and n not in initializers]
        earlier = [n for n in earlier if n not in constants]
        typed = [n for n in earlier if n in carried and _complete(carried[n])] if infer else []
        untyped = [n for n in earlier if n not in typed]
        loose = [n for n in untyped if n in carried] if infer else []
        carrier = "fuser.unknown_dims"
        while carrier in step.reads or carrier in step.written:
            carrier += "_"
        own = sorted(model_infos[n] for n in step.written if n in model_infos)
        given = [carried[n] for n in shared if n in carried] if infer else []
        common = [
            _fields(_INPUT, [inputs[n].SerializeToString() for n in outer if n in inputs]),
            _fields(
                _INITIALIZER,
                [initializers[n].SerializeToString() for n in outer if n in initializers],
            ),
            _fields(_INPUT, [carried[n].SerializeToString() for n in typed]),
            _fields(_VALUE_INFO, [graph.value_info[i].SerializeToString() for i in own]),
            _fields(_VALUE_INFO, [v.SerializeToString() for v in given]),
            _fields(
                _OUTPUT,
                [
                    outputs_wanted[n].SerializeToString()
                    for n in step.written
                    if n in outputs_wanted
                ],
            ),
            *([constants[n] for n in shared] if infer else []),
            _fields(_NODE, [n.SerializeToString() for n in nodes[step.start : step.stop]]),
        ]
        # the checker's inputs for the values of earlier pieces inference has no full type of
        # (inference must not see them: an untyped input is not an unknown one)
        stand_ins = [
            _INPUT + _length(len(f)) + f
            for f in [_name_field(n) + _PLACEHOLDER_FIELD for n in untyped]
        ]
        if not infer:  # Constants of earlier pieces are not brought along: they are inputs
            stand_ins += [
                _INPUT + _length(len(f)) + f
                for f in [_name_field(n) + _PLACEHOLDER_FIELD for n in shared]
            ]
        if check:
            data = head + _field(_GRAPH, b"".join([name, *stand_ins, *common]))
            try:
                onnx.checker.check_model(data, full_check=False)
            except onnx.checker.ValidationError as exc:
                raise PieceRefusedError(str(exc)) from exc
            infer_data = data if not stand_ins and not failed else None
            del data
        else:
            infer_data = None
        if not failed:
            if infer_data is None:
                infer_data = head + _field(_GRAPH, b"".join([name, *common]))
            # further graph fields (protobuf merges them), value infos after the ones above:
            # the types of earlier values too partial for a checked input, then the names
            if loose:
                infer_data += _field(
                    _GRAPH, _fields(_VALUE_INFO, [carried[n].SerializeToString() for n in loose])
                )
            if symbols:
                infer_data += _field(_GRAPH, _symbol_carrier(carrier, symbol_dims))
            del common
            try:
                result = c_inference.infer_shapes(infer_data, False, False, False)
            except Exception:  # as the whole graph's inference failing: the caller decides
                failed = True
            else:
                values = values_class()
                values.ParseFromString(result)
                infos = values.graph.value_info
                # inference keeps the value infos it was given, in order, and appends the rest
                first = len(own) + len(given) + len(loose) + bool(symbols)
                made = infos[first:]
                if any(n not in carried for n in shared):
                    made = [v for v in made if v.name not in before]  # a Constant seen again
                # copied out: the parsed result's memory holds the whole piece (its nodes and
                # tensors as unknown fields) for as long as any of its messages lives
                kept = values_class().graph
                kept.value_info.extend(infos[: len(own)])
                kept.value_info.extend(made)
                kept.output.extend(values.graph.output)
                del values, infos, made
                for value in kept.value_info[: len(own)]:
                    existing.setdefault(value.name, value)
                new.extend(kept.value_info[len(own) :])
                for value in kept.output:
                    outputs.setdefault(value.name, value)
                if wanted:
                    for value in (*kept.value_info, *kept.output):
                        if value.name in wanted and value.HasField("type"):
                            carried[value.name] = value
                if _UNKNOWN_PREFIX.encode() in result:
                    found = _new_symbols(kept) - symbols
                    symbols |= found
                    symbol_dims += _dim_fields(sorted(found))
                del result, kept
            del infer_data
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
