"""onnx's checker and shape inference on a large graph a piece at a time.

Given a whole model, each C++ tool parses all of it into its own messages (at 100k nodes some
hundreds of MB beside Python's copy of the model). Here the main graph's nodes go to the
tools in pieces of `PIECE_NODES` (half as many for the checker alone), in order, each piece
a model of its own, so at most one piece is parsed at a time. The pieces are cut from the
model's elements as their bytes (from
the file it was read from where it is unchanged, parsed with message types that keep each
node, tensor and value info as its bytes, `RawTypes`): a piece is laid out by one
serialization, and the names a plan reads and the types inference gives come back as lists
made in one C call each, not a Python message per element (at 100k nodes those were most of
the stage's Python time).

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
  and constant values. Inference names an unknown dim `unk__N`, the first N not taken in the
  graph it is given (`_Symbols`): a piece's own names start again from the lowest N its
  types leave free, and are renumbered after it as the whole graph would have numbered them
  (the k-th name a piece made is the k-th N free in the whole graph so far). Where inference
  fails in any piece, the caller does what it does when the whole graph's fails (both fail on
  the same node or the same initializer).

The graph must be one these rules cover (`plan`): no subgraphs, IR version 4 or later, no
sparse initializers, every graph output and value info a value some node defines, and no graph
output also an input or initializer. Others take the whole-graph route.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import onnx
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message
from onnx.onnx_cpp2py_export import shape_inference as c_inference

from .checkview import copy_field
from .graph import TypeTable
from .stream_save import length_key, length_prefix

# Nodes per piece: the tools' memory is a piece's; each piece costs a few parses of the
# model's own fields (opset imports, functions), so pieces are not made tiny. 2048 rather
# than 8192: at 10k nodes the whole-graph tools were the fuse's peak (cnn 118 -> 111 MB,
# transformer 101 -> 95 MB of a CLI fuse in pieces of 2048) and at 100k 49 pieces took no
# longer than 13 (interleaved CLI runs; the outputs byte-identical).
PIECE_NODES = 2048
# Below this many nodes the graph goes whole (the tools' copy is small).
MIN_NODES = 2 * PIECE_NODES


def _piece_nodes(check_only: bool) -> tuple[int, int]:
    """(nodes per piece, fewest nodes of a graph cut in pieces): for the checker alone (the
    output check) half those of check and inference. The output check is a small model's
    fuse peak (a piece's bytes and the checker's parse, on top of all the passes left), and a
    piece that is only checked costs little (no types carried in, no unknown dims): at 10k
    nodes pieces of 1024 took the fuse peak from 104 to 100 MB (cnn), 87 to 85 (transformer),
    98 to 95 (mixed; benchmarks/fuse_memory.py), for no more time at 100k (verify 0.41-0.51 s
    in pieces of 1024, 0.41-0.70 s in 2048). Check and inference stay at 2048: in pieces of
    1024 a 100k-node transformer's took 0.25 s longer (per piece, its types carried and its
    unknown dims' names)."""
    if check_only:
        return max(1, PIECE_NODES // 2), MIN_NODES // 2
    return PIECE_NODES, MIN_NODES


_UNKNOWN_PREFIX = "unk__"  # onnx's SymbolTableImpl names unknown dims so
_CONSTANT_DOMAINS = ("", "ai.onnx")


def _number(
    message: type[onnx.ModelProto | onnx.GraphProto | onnx.ValueInfoProto], name: str
) -> bytes:
    return length_key(message.DESCRIPTOR.fields_by_name[name].number)


_VI_NAME = _number(onnx.ValueInfoProto, "name")
_VI_TYPE = _number(onnx.ValueInfoProto, "type")


def _field(key: bytes, payload: bytes) -> bytes:
    return key + length_prefix(len(payload)) + payload


def _name_field(name: str) -> bytes:
    data = name.encode()
    return _VI_NAME + length_prefix(len(data)) + data


def _placeholder_type() -> bytes:
    kind = onnx.TypeProto()
    kind.tensor_type.elem_type = onnx.TensorProto.FLOAT
    kind.tensor_type.shape.SetInParent()
    return kind.SerializeToString()


# A graph input's type as the checker asks of a main graph's (any type: it checks none).
_PLACEHOLDER_FIELD = _field(_VI_TYPE, _placeholder_type())


# A generated dim as inference lays it out: a Dimension holding only its dim_param; and any
# dim_param-shaped `unk__N` field (if these find more, the value infos are walked instead).
_STRICT_SYMBOL = re.compile(rb"\x0a[\x07-\x7f]\x12[\x05-\x7d]unk__[0-9]+")
_LOOSE_SYMBOL = re.compile(rb"\x12[\x05-\x7f]unk__[0-9]+")


def _new_symbols(types: Sequence[bytes | None]) -> set[str]:
    """The `unk__N` dim names among `types` (serialized TypeProtos of inference's value infos
    and outputs; None: no type): found in their bytes, or by a walk where the bytes are not
    plain."""
    data = b"\x00".join([t for t in types if t])  # a separator no match can span
    # each distinct match once (a few symbols repeat over most values)
    strict = Counter(_STRICT_SYMBOL.findall(data))
    loose = Counter(_LOOSE_SYMBOL.findall(data))
    found = {m[4:] for m in strict if m[1] == m[3] + 2 and m[3] == len(m) - 4}
    plain = sum(strict[m] for m in strict if m[4:] in found)
    if plain == sum(n for m, n in loose.items() if m[1] == len(m) - 2):
        return {s.decode() for s in found}
    return _type_symbols(onnx.TypeProto.FromString(t) for t in types if t)


def _symbol_number(name: str) -> int | None:
    """N of an `unk__N` name inference could make (N in decimal, no leading zero), else None."""
    digits = name[len(_UNKNOWN_PREFIX) :]
    if not (name.startswith(_UNKNOWN_PREFIX) and digits.isascii() and digits.isdigit()):
        return None
    return int(digits) if digits == "0" or digits[0] != "0" else None


class _Symbols:
    """The N of the `unk__N` names taken in the whole graph so far: the graph's own and those
    inference made in the pieces before. Inference, given a graph, names the k-th unknown dim
    it makes `unk__N`, N the k-th number (from 0) that no dim of the graph's inputs, outputs
    and value infos is named after; in the whole graph, that of a piece is the k-th number not
    taken here. So a piece is inferred on its own (not with a value info carrying every name
    taken: at 100k nodes each piece parsed some 50 thousand, and inference stepped over them
    one by one for its first new name) and the names it made are renumbered (`renumbering`;
    by rank, so a name it made that no type kept changes no other).

    Every number below `dense` is taken, `dense` is not, and `above` holds the others taken,
    ascending (usually none: each piece takes the lowest free numbers)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.dense = 0
        self.above: list[int] = []
        self._take([n for n in map(_symbol_number, names) if n is not None])

    def _take(self, numbers: Iterable[int]) -> None:
        taken = set(self.above)
        taken.update(numbers)
        dense = self.dense
        while dense in taken:
            taken.discard(dense)
            dense += 1
        self.dense = dense
        self.above = sorted(n for n in taken if n > dense)

    def _free(self, ranks: Sequence[int]) -> list[int]:
        """The k-th free number (from 0) for each k of `ranks` (ascending, distinct)."""
        found = []
        base, passed, i, above = self.dense, 0, 0, self.above
        for rank in ranks:  # `base` is free, the `passed`-th; every above[i:] exceeds it
            number = base + rank - passed
            while i < len(above) and above[i] <= number:
                number += 1
                i += 1
            found.append(number)
            base, passed = number, rank
        return found

    def renumbering(self, made: Iterable[str], given: Iterable[str]) -> dict[str, str]:
        """The whole graph's names of the `unk__N` names a piece's inference made (`made`:
        those in its results that are not among `given`, the dim names of the types the
        piece was given), as far as they differ; the whole graph's names are taken from now
        on. A piece's k-th name is its k-th number not given; in the whole graph, the k-th
        number not taken."""
        given_numbers = sorted({n for n in map(_symbol_number, given) if n is not None})
        # a name inference made is one it could make (any other came with a given type)
        given_set = set(given_numbers)
        numbers = sorted({n for n in map(_symbol_number, made) if n is not None} - given_set)
        ranks = [n - bisect.bisect_left(given_numbers, n) for n in numbers]
        wholes = self._free(ranks)
        self._take(wholes)
        prefix = _UNKNOWN_PREFIX
        return {
            f"{prefix}{n}": f"{prefix}{w}" for n, w in zip(numbers, wholes, strict=True) if n != w
        }


def _rename_dims(kind: onnx.TypeProto, names: dict[str, str]) -> bool:
    """Name the dims of `kind` as `names` says; whether any was renamed."""
    changed = False
    for dim in _dims(kind):
        new = names.get(dim.dim_param)
        if new is not None:
            dim.dim_param = new
            changed = True
    return changed


def _renamed_type(kind: bytes, names: dict[str, str]) -> bytes:
    """`kind` (a serialized TypeProto) with its dims named as `names` says."""
    parsed = onnx.TypeProto.FromString(kind)
    return parsed.SerializeToString() if _rename_dims(parsed, names) else kind


def _renamed_info(info: bytes, names: dict[str, str]) -> bytes:
    """`info` (a serialized ValueInfoProto) with its type's dims named as `names` says."""
    parsed = onnx.ValueInfoProto.FromString(info)
    return parsed.SerializeToString() if _rename_dims(parsed.type, names) else info


def may_go_in_pieces(model: onnx.ModelProto, nested: bool, check_only: bool = False) -> bool:
    """`plan`'s first look (no walk): False where `model` surely goes whole."""
    graph = model.graph
    fewest = _piece_nodes(check_only)[1]
    if nested or len(graph.node) < fewest or model.ir_version < 4:
        return False
    return not (len(graph.sparse_initializer) or len(model.training_info))


class _Elements:
    """A graph's elements as `raw_types().graph` holds them (each as its bytes), from the graph
    itself, each serialized when a piece asks for it (a piece's nodes twice: for the plan and
    for the walk; kept, they would be a copy of the graph's nodes on the walk's peak)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.node = _Serializing(graph.node, onnx.NodeProto)
        self.initializer = _Serializing(graph.initializer, onnx.TensorProto)
        self.input = _Serializing(graph.input, onnx.ValueInfoProto)
        self.output = _Serializing(graph.output, onnx.ValueInfoProto)
        self.value_info = _Serializing(graph.value_info, onnx.ValueInfoProto)


class _Serializing:
    """The serializations of a repeated field's messages (of type `kind`), each made when
    asked for: many at once by `kind`'s own method mapped over them (no Python call per
    message: at 100k nodes a piece's plan and walk ask for some 350k)."""

    def __init__(self, messages: Sequence[Message], kind: type[Message]) -> None:
        self._messages = messages
        self._serialize = kind.SerializeToString

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice):
            return list(map(self._serialize, self._messages[index]))
        return self._serialize(self._messages[index])

    def take(self, indices: Iterable[int]) -> list[bytes]:
        """The serializations of the messages at `indices`, in that order."""
        return list(map(self._serialize, map(self._messages.__getitem__, indices)))


@dataclass(frozen=True)
class Plan:
    """The pieces of a graph (`steps`) and what they are cut from: `graph`, its elements as
    their bytes (`_Elements`), the initializers' names in order, and those of the graph's
    inputs and initializers no node reads."""

    steps: list[Step]
    graph: _Elements
    initializers: list[str]
    unread: set[str]  # the graph inputs and initializers no node reads


def plan(model: onnx.ModelProto, nested: bool, check_only: bool = False) -> Plan | None:
    """The pieces of `model`'s main graph, where `check_pieces`/`infer_pieces` see it as the
    whole-graph tools do (see the module docstring); None where it goes whole. `nested`:
    whether a node may hold a subgraph (`NodeScan.nested`); `check_only`: pieces for
    `check_pieces` alone (smaller: `_piece_nodes`)."""
    if not may_go_in_pieces(model, nested, check_only):
        return None
    graph = model.graph
    initializers = [t.name for t in graph.initializer]
    outer = frozenset([v.name for v in graph.input] + initializers)
    named = [v.name for v in graph.output] + [v.name for v in graph.value_info]
    if any(n in outer for n in named):
        return None
    # each element serialized on its own: a serialization of the whole model and its parse
    # side by side would be two more copies of its tensors (at a fused 100k-node CNN, 100 MB
    # on verify's peak)
    raw = _Elements(graph)
    wanted = frozenset(named)
    steps, unread = _plan(raw, graph.node, outer, wanted, _piece_nodes(check_only)[0])
    produced = {n for step in steps for n in step.named}
    if len(produced) < len(wanted):
        return None
    return Plan(steps, raw, initializers, unread)


def _head(model: onnx.ModelProto) -> bytes:
    """`model`'s fields but its graph, serialized."""
    head = onnx.ModelProto()
    for fd, value in model.ListFields():
        if fd.name != "graph":
            copy_field(fd, value, head)
    return head.SerializeToString()


@dataclass(frozen=True)
class RawTypes:
    """Message types laid out as onnx's (the same field numbers) that read a serialization in
    large C calls: parsing into them makes few Python objects.

    - `model`/`graph`: ModelProto's graph; GraphProto's node, name, initializer, input,
      output and value_info, each element as its bytes (a piece is laid out from them).
    - `node_names`: NodeProto's input, output and op_type. Several nodes' bytes one after
      the other parse as one message (protobuf merges them): their inputs, outputs and op
      types in order, each list made in one call.
    - `values`: ValueInfoProto's name, and its type as bytes, merged the same way;
      `result`: ModelProto whose graph's input, output and value_info are each one merged
      `values` (each list of an inference result's value infos made in one call).
    """

    model: type[Message]
    graph: type[Message]
    node_names: type[Message]
    values: type[Message]
    result: type[Message]


_RAW_PACKAGE = "fuser.raw_pieces"


@functools.cache
def raw_types() -> RawTypes:
    """The message types of `RawTypes` (made once, in protobuf's default pool)."""
    kinds = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="fuser/raw_pieces.proto", package=_RAW_PACKAGE, syntax="proto2"
    )

    def message(
        name: str, source: Descriptor, fields: dict[str, tuple[int, str]], merged: bool = False
    ) -> None:
        # fields: name -> (protobuf type, message type name or ""), numbers as `source`'s;
        # `merged`: every field repeated (each occurrence of it in the bytes kept, in order).
        # A message field is optional: its occurrences merge into one message.
        added = file.message_type.add(name=name)
        for field_name, (kind, type_name) in fields.items():
            repeated = merged or source.fields_by_name[field_name].is_repeated
            field = added.field.add(
                name=field_name,
                number=source.fields_by_name[field_name].number,
                label=kinds.LABEL_REPEATED if repeated and not type_name else kinds.LABEL_OPTIONAL,
                type=kind,
            )
            if type_name:
                field.type_name = f".{_RAW_PACKAGE}.{type_name}"

    raw, text = (kinds.TYPE_BYTES, ""), (kinds.TYPE_STRING, "")
    graph, model = onnx.GraphProto.DESCRIPTOR, onnx.ModelProto.DESCRIPTOR
    fields = ("node", "name", "initializer", "input", "output", "value_info")
    message("Graph", graph, dict.fromkeys(fields, raw))
    message("Model", model, {"graph": (kinds.TYPE_MESSAGE, "Graph")})
    message(
        "NodeNames",
        onnx.NodeProto.DESCRIPTOR,
        dict.fromkeys(("input", "output", "op_type"), text),
        merged=True,
    )
    message("Values", onnx.ValueInfoProto.DESCRIPTOR, {"name": text, "type": raw}, merged=True)
    merged = (kinds.TYPE_MESSAGE, "Values")
    message("ResultGraph", graph, {"input": merged, "output": merged, "value_info": merged})
    message("Result", model, {"graph": (kinds.TYPE_MESSAGE, "ResultGraph")})
    pool = descriptor_pool.Default()
    try:
        pool.FindMessageTypeByName(f"{_RAW_PACKAGE}.Result")
    except KeyError:
        pool.Add(file)

    def made(name: str) -> type[Message]:
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_RAW_PACKAGE}.{name}"))

    return RawTypes(made("Model"), made("Graph"), made("NodeNames"), made("Values"), made("Result"))


class PieceRefusedError(Exception):
    """A piece failed onnx's checker (the whole graph's check says whether, and why)."""


def check_pieces(model: onnx.ModelProto, pieces: Plan) -> None:
    """onnx's checker on `model` a piece at a time (`pieces`: its `plan`); raises
    `PieceRefusedError` where a piece fails (then the whole graph's check gives the verdict
    and the message)."""
    for _ in _walk(model, pieces, infer=False):
        pass


def infer_pieces(model: onnx.ModelProto, source: onnx.ModelProto, pieces: Plan) -> TypeTable | None:
    """`check_pieces`, and the main graph's types from shape inference a piece at a time, as
    the whole graph's inference gives them (inputs, outputs, value infos, then `source`'s
    initializers); None where inference failed (for any piece: the whole graph's would too).
    Raises `PieceRefusedError` as `check_pieces` (the types of a model the whole check passes
    after all are `infer_checked_pieces`')."""
    *_, found = _walk(model, pieces, infer=True)
    return _table(model, source, found)


def infer_checked_pieces(
    model: onnx.ModelProto, source: onnx.ModelProto, pieces: Plan
) -> TypeTable | None:
    """`infer_pieces` without the checker (the caller has checked the model whole)."""
    *_, found = _walk(model, pieces, infer=True, check=False)
    return _table(model, source, found)


# A value's type: its TypeProto serialized, None where its value info has no type.
_Type = bytes | None
# What inference found: graph outputs' and the model's value infos' types by name, and the
# names and types of the value infos it added, in order.
_Found = tuple[dict[str, _Type], dict[str, _Type], list[str], list[_Type]]


def _table(
    model: onnx.ModelProto, source: onnx.ModelProto, found: _Found | None
) -> TypeTable | None:
    if found is None:
        return None
    graph = model.graph
    outputs, existing, new_names, new_types = found
    table = TypeTable()
    table.add_protos(graph.input)
    for known, values in ((outputs, graph.output), (existing, graph.value_info)):
        names = [v.name for v in values if v.name in known]
        table.add_types(names, [known[n] for n in names])
    table.add_types(new_names, new_types)
    table.add_initializers(source.graph.initializer)
    return table


def _complete(kind: bytes) -> bool:
    """Whether the checker takes a value of type `kind` (serialized) as a main-graph input (a
    tensor type with an element type and a shape; other kinds are left to the checker, which
    the whole check overrules)."""
    parsed = onnx.TypeProto.FromString(kind)
    if parsed.WhichOneof("value") != "tensor_type":
        return parsed.WhichOneof("value") is not None
    return bool(parsed.tensor_type.elem_type) and parsed.tensor_type.HasField("shape")


def _values(merged: Message, raw: Sequence[bytes]) -> tuple[list[str], list[_Type]]:
    """The names and types of value infos `raw` (their bytes), read from `merged` (the same
    value infos parsed as one `values` message) where each has exactly one name and one type
    (inference's serialization sets a field once), else from each one's own parse."""
    names, types = list(merged.name), list(merged.type)
    if len(names) == len(types) == len(raw):
        return names, types
    protos = [onnx.ValueInfoProto.FromString(data) for data in raw]
    kinds = [v.type.SerializeToString() if v.HasField("type") else None for v in protos]
    return [v.name for v in protos], kinds


def graph_value_types(data: bytes) -> list[tuple[list[str], list[_Type]]]:
    """The names and types of the main graph's inputs, outputs and value infos (in that
    order) of the model serialized as `data` (its nodes and tensors only skipped over)."""
    classes = raw_types()
    merged = classes.result.FromString(data).graph
    raw = classes.model.FromString(data).graph
    fields = ("input", "output", "value_info")
    return [_values(getattr(merged, f), getattr(raw, f)) for f in fields]


def _walk(
    model: onnx.ModelProto, pieces: Plan, infer: bool, check: bool = True
) -> Iterator[_Found | None]:
    """Check (and infer) piece by piece; yields after each piece, lastly what inference found
    (`_Found`) or None where it failed or was not asked. A piece the checker refuses raises
    `PieceRefusedError`."""
    graph, raw, steps = model.graph, pieces.graph, pieces.steps
    classes = raw_types()
    head = _head(model)
    # indices of the raw graph's elements, by name (a repeated name: the first initializer,
    # the last input, as the whole graph's tools take them)
    inputs = {v.name: i for i, v in enumerate(graph.input)}
    initializers: dict[str, int] = {}
    for i, tensor_name in enumerate(pieces.initializers):
        initializers.setdefault(tensor_name, i)
    # what the whole check checks once over the graph: names unique, initializers named
    if check and (len(inputs) < len(graph.input) or len(initializers) < len(pieces.initializers)):
        raise PieceRefusedError("a graph input or initializer name is not unique")
    if check and "" in initializers:
        raise PieceRefusedError("an initializer has no name")
    # the inputs and initializers no node reads go with the last piece (checked there)
    unread = pieces.unread
    wanted = set().union(*(step.earlier for step in steps))
    outputs_wanted = {v.name: i for i, v in enumerate(graph.output)}
    model_infos = {v.name: i for i, v in enumerate(graph.value_info)}
    symbols = _Symbols(_unknown_symbols((*graph.input, *graph.output, *graph.value_info)))
    # typed values defined so far that are wanted: their value infos' bytes and types
    carried: dict[str, tuple[bytes, bytes]] = {}
    constants: dict[str, bytes] = {}  # Constant nodes defined so far, by output
    outputs: dict[str, _Type] = {}
    existing: dict[str, _Type] = {}
    new_names: list[str] = []
    new_types: list[_Type] = []
    failed = not infer
    for number, step in enumerate(steps):
        last = number == len(steps) - 1
        outer = step.outer
        if last:
            outer = outer + [v.name for v in graph.input if v.name in unread]
            outer += [n for n in pieces.initializers if n in unread]
        shared = [n for n in step.earlier if n in constants]  # Constants seen again
        earlier = [n for n in step.earlier if n not in constants]
        typed = [n for n in earlier if n in carried and _complete(carried[n][1])] if infer else []
        untyped = [n for n in earlier if n not in typed]
        loose = [n for n in untyped if n in carried] if infer else []
        own = sorted(model_infos[n] for n in step.named if n in model_infos)
        given = [carried[n][0] for n in shared if n in carried] if infer else []
        ends = [n for n in step.named if n in outputs_wanted]
        # the head's fields kept as unknown fields, written back as they are: a piece's model is
        # one serialization (not the graph's bytes copied again behind the head's)
        container = classes.model.FromString(head)
        piece = container.graph
        if graph.name:
            piece.name = graph.name.encode()
        if infer:
            piece.node.extend([constants[n] for n in shared])
        piece.node.extend(raw.node[step.start : step.stop])
        piece.initializer.extend(
            raw.initializer.take([initializers[n] for n in outer if n in initializers])
        )
        own_infos = raw.value_info.take(own)
        piece.value_info.extend(own_infos)
        piece.value_info.extend(given)
        end_infos = raw.output.take([outputs_wanted[n] for n in ends])
        piece.output.extend(end_infos)
        graph_inputs = raw.input.take([inputs[n] for n in outer if n in inputs])
        declared = graph_inputs + [carried[n][0] for n in typed]
        # the checker's inputs for the values of earlier pieces inference has no full type of
        # (inference must not see them: an untyped input is not an unknown one)
        stand_ins = [_name_field(n) + _PLACEHOLDER_FIELD for n in untyped]
        if not infer:  # Constants of earlier pieces are not brought along: they are inputs
            stand_ins += [_name_field(n) + _PLACEHOLDER_FIELD for n in shared]
        infer_data = None
        if check:
            piece.input.extend(stand_ins)
            piece.input.extend(declared)
            data = container.SerializeToString()
            try:
                onnx.checker.check_model(data, full_check=False)
            except onnx.checker.ValidationError as exc:
                raise PieceRefusedError(str(exc)) from exc
            same = not stand_ins and not loose and not failed
            infer_data = data if same else None
            del data
        if not failed:
            if infer_data is None:
                piece.ClearField("input")
                piece.input.extend(declared)
                # value infos after the ones above: the types of earlier values too partial
                # for a checked input (the checker's copy has none)
                piece.value_info.extend([carried[n][0] for n in loose])
                infer_data = container.SerializeToString()
            del piece, container
            try:
                result = c_inference.infer_shapes(infer_data, False, False, False)
            except Exception:  # as the whole graph's inference failing: the caller decides
                failed = True
            else:
                del infer_data
                # the result's value infos and outputs (its nodes and tensors are only skipped
                # over: nothing of the parse outlives this piece)
                merged = classes.result.FromString(result).graph
                found = classes.model.FromString(result).graph
                infos, ends_found = found.value_info, found.output
                names, types = _values(merged.value_info, infos)
                end_names, end_types = _values(merged.output, ends_found)
                del merged
                # inference keeps the value infos it was given, in order, and appends the rest
                first = len(own) + len(given) + len(loose)
                made: Sequence[int] = range(first, len(names))
                if any(n not in carried for n in shared):  # a Constant seen again
                    before = set(step.before)
                    made = [k for k in made if names[k] not in before]
                kept = [*range(len(own)), *made]
                # of `kept` and of the outputs, the types whose dims were renamed
                renamed: set[int] = set()
                ends_renamed: set[int] = set()
                renames: dict[str, str] = {}
                if _UNKNOWN_PREFIX.encode() in result:
                    # the dim names of the types the piece was given (its inputs, value infos
                    # and outputs): inference made none of them
                    supplied: list[_Type] = [carried[n][1] for n in (*typed, *loose)]
                    supplied += [carried[n][1] for n in shared if n in carried]
                    raw_supplied = [*graph_inputs, *own_infos, *end_infos]
                    if raw_supplied:
                        parsed = classes.values.FromString(b"".join(raw_supplied))
                        supplied += _values(parsed, raw_supplied)[1]
                    renames = symbols.renumbering(
                        _new_symbols([*(types[k] for k in kept), *end_types]),
                        _new_symbols(supplied),
                    )
                    if renames:
                        renamed = _rename_types(types, kept, renames)
                        ends_renamed = _rename_types(end_types, range(len(end_types)), renames)
                for k in range(len(own)):
                    existing.setdefault(names[k], types[k])
                new_names += [names[k] for k in made]
                new_types += [types[k] for k in made]
                for end_name, end_type in zip(end_names, end_types, strict=True):
                    outputs.setdefault(end_name, end_type)
                if wanted:
                    for k in kept:
                        kind = types[k]
                        if kind is not None and names[k] in wanted:
                            info = _renamed_info(infos[k], renames) if k in renamed else infos[k]
                            carried[names[k]] = (info, kind)
                    for k, end_name in enumerate(end_names):
                        kind = end_types[k]
                        if kind is not None and end_name in wanted:
                            info = ends_found[k]
                            if k in ends_renamed:
                                info = _renamed_info(info, renames)
                            carried[end_name] = (info, kind)
                del result, found, infos, ends_found
        for i in step.constants:
            constants[graph.node[i].output[0]] = raw.node[i]
        yield None
    yield None if failed else (outputs, existing, new_names, new_types)


def _rename_types(types: list[_Type], indices: Iterable[int], renames: dict[str, str]) -> set[int]:
    """Rename the dims of `types[k]` for each k of `indices` as `renames` says (a piece's
    names as the whole graph's, `_Symbols.renumbering`); returns the k whose type changed.
    Equal types are renamed once (a piece's values repeat a few types)."""
    done: dict[bytes, bytes] = {}
    changed = set()
    unknown = _UNKNOWN_PREFIX.encode()
    for k in indices:
        kind = types[k]
        if kind is None or unknown not in kind:
            continue
        new = done.get(kind)
        if new is None:
            new = done[kind] = _renamed_type(kind, renames)
        if new != kind:
            types[k] = new
            changed.add(k)
    return changed


@dataclass(frozen=True)
class Step:
    """One piece of a graph: its nodes (`start`:`stop`); the names they read or write that are
    defined before the piece, in order, once each (`before`: of them, the graph's inputs and
    initializers, `outer`, and the values of earlier pieces, `earlier`); the graph outputs
    and value infos they write (`named`, in order); and its Constant nodes' indices. Not the
    names it reads and writes: a plan is held through the walk, and at 100k nodes those were
    some 40 MB."""

    start: int
    stop: int
    before: list[str]
    outer: list[str]
    earlier: list[str]
    named: list[str]
    constants: list[int]


def _plan(
    raw: _Elements,
    nodes: Sequence[onnx.NodeProto],
    outer: frozenset[str],
    named: frozenset[str],
    size: int,
) -> tuple[list[Step], set[str]]:
    """The pieces of `nodes` (`size` nodes each; `raw`: their graph's elements as bytes), given the
    graph's inputs and initializers (`outer`) and its outputs and value infos (`named`): each
    piece's names read from its nodes' bytes at once (`RawTypes.node_names`); and the names
    of `outer` no node reads."""
    steps = []
    names_class = raw_types().node_names
    defined = set(outer)
    unread = set(outer)
    for start in range(0, len(nodes), size):
        stop = min(start + size, len(nodes))
        names = names_class.FromString(b"".join(raw.node[start:stop]))
        reads = dict.fromkeys(names.input)
        written = dict.fromkeys(names.output)
        reads.pop("", None)
        written.pop("", None)
        op_types = list(names.op_type)
        del names
        # one op type per node (a node without one fails the piece's check before its
        # Constants are read); else each node's own
        if len(op_types) != stop - start:
            candidates: Iterable[int] = range(start, stop)
        elif "Constant" in op_types:
            candidates = [start + k for k, op in enumerate(op_types) if op == "Constant"]
        else:
            candidates = ()
        constants = [i for i in candidates if _is_constant(nodes[i])]
        before = [n for n in {**reads, **written} if n in defined]
        earlier = [n for n in before if n not in outer]
        mine = [n for n in before if n in outer] if earlier else before
        ends = [n for n in written if n in named] if named else []
        steps.append(Step(start, stop, before, mine, earlier, ends, constants))
        defined.update(written)
        unread.difference_update(reads)
    return steps, unread


def _is_constant(node: onnx.NodeProto) -> bool:
    """A Constant node of the ONNX domain with one output (inference reads its tensor)."""
    return node.op_type == "Constant" and node.domain in _CONSTANT_DOMAINS and len(node.output) == 1


def _unknown_symbols(values: Iterable[onnx.ValueInfoProto]) -> set[str]:
    """The dim names of `values` that inference could have made (`unk__N`)."""
    return _type_symbols(value.type for value in values)


def _type_symbols(kinds: Iterable[onnx.TypeProto]) -> set[str]:
    """The dim names of types `kinds` that inference could have made (`unk__N`)."""
    found = set()
    for kind in kinds:
        for dim in _dims(kind):
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
