"""Writing a model (with external data or inline) without a second copy of it in memory.

The model is written in protobuf's wire format piece by piece, as `SerializeToString` would
lay it out (fields in number order, each repeated element tag + length + bytes): the graph's
nodes and initializers one at a time. An initializer whose data goes to the data file is
written as a staged TensorProto built field by field around its data (never copied); a node
whose attributes hold such a tensor (a large Constant, a subgraph's initializer) is staged
alone. So what is held at once beyond the model is one node's staged copy at most.

The data file gets the tensors in `iter_all_tensors` order, at the offsets the staged protos
name; the bytes are the ones copying the whole model and externalizing it would give.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import shutil
import tempfile
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import BinaryIO

import onnx
from google.protobuf import unknown_fields

from .checkview import copy_field
from .modelio import EXTERNAL_THRESHOLD_BYTES, KEY_BYTES, node_tensors, size_beside_elements

_LEN = 2  # wire type of a length-delimited field
# Reads the data of one external tensor of the input (from its validated file).
ReadExternal = Callable[[onnx.TensorProto], bytes]


def varint(value: int) -> bytes:
    """`value` as protobuf's base-128 varint."""
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def length_key(number: int) -> bytes:
    """The key of length-delimited field `number` (what precedes its length and bytes)."""
    return varint(number << 3 | _LEN)


# Lengths below this are looked up (most elements and fields are shorter).
_SHORT = 1 << 14
_LENGTHS = [varint(n) for n in range(_SHORT)]


def length_prefix(n: int) -> bytes:
    """`varint(n)`, looked up where `n` is small (a large model has ~10^5 elements)."""
    return _LENGTHS[n] if n < _SHORT else varint(n)


def moves_out(tensor: onnx.TensorProto) -> bool:
    """Whether saving with external data writes `tensor`'s data to the data file."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return True
    return tensor.HasField("raw_data") and len(tensor.raw_data) >= EXTERNAL_THRESHOLD_BYTES


def _may_hold_tensors(node: onnx.NodeProto) -> bool:
    kinds = (
        onnx.AttributeProto.TENSOR,
        onnx.AttributeProto.TENSORS,
        onnx.AttributeProto.GRAPH,
        onnx.AttributeProto.GRAPHS,
    )
    return any(a.type in kinds for a in node.attribute)


def _point_at(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _staged_tensor(
    tensor: onnx.TensorProto, location: str, offset: int, length: int
) -> onnx.TensorProto:
    """`tensor` pointing at its data in the data file, built without copying its data."""
    staged = onnx.TensorProto()
    for fd, value in tensor.ListFields():
        if fd.name not in ("raw_data", "external_data", "data_location"):
            copy_field(fd, value, staged)
    _point_at(staged, location, offset, length)
    return staged


def write_external(
    model: onnx.ModelProto, model_file: BinaryIO, data_file: BinaryIO, location: str,
    read_external: ReadExternal, scratch: Path | None = None,
) -> None:  # fmt: skip
    """Write `model` to `model_file` and its large tensors to `data_file` (named `location`
    beside it); `model` is not changed. `scratch`: as `write_inline`'s."""
    graph = model.graph
    # 1. The data, in iter_all_tensors order: main-graph initializers, then node by node.
    spans: list[tuple[int, int]] = []
    by_initializer: dict[int, tuple[int, int]] = {}
    by_node: dict[int, list[tuple[int, int]]] = {}

    def move(tensor: onnx.TensorProto) -> tuple[int, int]:
        raw = read_external(tensor) if tensor.data_location == onnx.TensorProto.EXTERNAL else None
        data = raw if raw is not None else tensor.raw_data
        span = (data_file.tell(), len(data))
        data_file.write(data)
        spans.append(span)
        return span

    for i, tensor in enumerate(graph.initializer):
        if moves_out(tensor):
            by_initializer[i] = move(tensor)
    for i, node in enumerate(graph.node):
        if _may_hold_tensors(node):
            found = [move(t) for t in node_tensors(node) if moves_out(t)]
            if found:
                by_node[i] = found
    # 2. The model, piece by piece, those elements staged.
    staged_inits = {
        i: _staged_tensor(graph.initializer[i], location, *span)
        for i, span in by_initializer.items()
    }

    def staged_node(i: int) -> onnx.NodeProto:
        copy = onnx.NodeProto()
        copy.CopyFrom(graph.node[i])
        spans_left = iter(by_node[i])
        for tensor in node_tensors(copy):
            if moves_out(tensor):
                offset, length = next(spans_left)
                tensor.ClearField("raw_data")
                _point_at(tensor, location, offset, length)
        return copy

    _write_pieces(model, model_file, staged_inits, by_node.keys(), staged_node, scratch)


def write_inline(
    model: onnx.ModelProto,
    model_file: BinaryIO,
    scratch: Path | None = None,
    limit: int | None = None,
) -> bool:
    """Write `model` to `model_file` as `SerializeToString(deterministic=True)` lays it out,
    one graph element at a time: the whole serialization (a copy of the model's size) is
    never held. For a `streamable` model. `scratch`: the folder of the graph's scratch file
    (see `_write_pieces`). With `limit`, where `too_large_for_one_protobuf`'s count (taken of
    the elements as they are serialized) passes it, nothing is written: returns False."""
    try:
        _write_pieces(model, model_file, {}, scratch=scratch, limit=limit)
    except _PastLimitError:
        return False
    return True


class _PastLimitError(Exception):
    """The model passed `write_inline`'s limit (before anything was written)."""


def _write_pieces(
    model: onnx.ModelProto,
    model_file: BinaryIO,
    staged_inits: dict[int, onnx.TensorProto],
    restaged: Container[int] = (),
    staged_node: Callable[[int], onnx.NodeProto] | None = None,
    scratch: Path | None = None,
    limit: int | None = None,
) -> None:
    """`model` laid out field by field, the graph element by element, with the initializers of
    `staged_inits` and the nodes numbered in `restaged` (as `staged_node` makes them, when
    written) in place of the graph's own. With `limit`: `_PastLimitError`, before anything
    is written to `model_file`, where `too_large_for_one_protobuf`'s count passes it.

    The graph's length prefix precedes its elements: they are serialized once, into an
    anonymous scratch file in folder `scratch` (the output's: the bytes go to that disk
    anyway; the system's temp folder if None) as their lengths are summed, then copied from
    it. Where no scratch file can be made, they are serialized twice: once for their sizes
    (`ByteSize`, itself a serialization in upb), once to write them."""
    graph = model.graph

    def sizes_of_pieces() -> Iterator[tuple[bytes, int]]:
        """(key, size) per field element (key b"" for a field laid out whole, its size with
        its key): where there is no scratch file, the lengths before the elements."""
        for fd, value in graph.ListFields():
            if fd.is_repeated and fd.message_type is not None:
                key = length_key(fd.number)
                for i, element in enumerate(value):
                    if fd.name == "node" and i in restaged and staged_node is not None:
                        element = staged_node(i)
                    elif fd.name == "initializer" and i in staged_inits:
                        element = staged_inits[i]
                    yield key, element.ByteSize()
            else:
                single = onnx.GraphProto()
                copy_field(fd, value, single)
                yield b"", len(single.SerializeToString(deterministic=True))

    # what too_large_for_one_protobuf counts beside the elements (each element: its size and
    # KEY_BYTES), and what it may come to
    counted = size_beside_elements(model) if limit is not None else 0
    allowed = limit if limit is not None else -1

    def runs() -> Iterator[tuple[bytes, list[bytes]]]:
        """(key, serializations) per run of elements of a repeated field, in order; key b""
        for a field laid out whole. A run is serialized by one `map` (a Python step per
        element was most of the save's own time at 100k nodes); its length grows from one
        element while the elements are small (`next_run`)."""
        for fd, value in graph.ListFields():
            if not (fd.is_repeated and fd.message_type is not None):
                single = onnx.GraphProto()
                copy_field(fd, value, single)
                yield b"", [single.SerializeToString(deterministic=True)]
                continue
            key = length_key(fd.number)
            restage = staged_node if fd.name == "node" else None
            swapped = fd.name == "initializer" and bool(staged_inits)
            start, count = 0, 1
            while start < len(value):
                run = value[start : start + count]
                if restage is not None or swapped:
                    for k in range(len(run)):
                        if restage is not None and start + k in restaged:
                            run[k] = restage(start + k)
                        elif swapped and start + k in staged_inits:
                            run[k] = staged_inits[start + k]
                datas = list(map(_serialize, run))
                yield key, datas
                start += len(run)
                count = next_run(count, len(datas), sum(map(len, datas)))

    def write_graph(out: BinaryIO, counting: bool) -> int:
        """The graph's elements written to `out`; returns their length. `counting`: against
        the limit, as they are serialized (a run at a time: the count only grows, so it
        passes the limit in some run where it passes it at some element)."""
        nonlocal counted
        total = 0
        for key, datas in runs():
            if not key:
                out.write(datas[0])
                total += len(datas[0])
                continue
            lengths = list(map(len, datas))
            if counting:
                counted += KEY_BYTES * len(datas) + sum(lengths)
                if counted > allowed >= 0:
                    raise _PastLimitError
            short = not lengths or max(lengths) < _SHORT
            prefixes = map(_LENGTHS.__getitem__ if short else length_prefix, lengths)
            keyed = map(key.__add__, prefixes)
            data = b"".join(itertools.chain.from_iterable(zip(keyed, datas, strict=True)))
            out.write(data)
            total += len(data)
        return total

    def piece_len(key: bytes, size: int) -> int:
        return size if not key else len(key) + len(length_prefix(size)) + size

    with _scratch_file(scratch) as body:
        if body is not None:
            graph_size = write_graph(body, counting=True)
            body.seek(0)
        else:
            sizes = list(sizes_of_pieces())
            counted += sum(KEY_BYTES + s for k, s in sizes if k)
            if counted > allowed >= 0:
                raise _PastLimitError
            graph_size = sum(piece_len(k, s) for k, s in sizes)
        for fd, value in model.ListFields():
            if fd.name != "graph":
                single = onnx.ModelProto()
                copy_field(fd, value, single)
                model_file.write(single.SerializeToString(deterministic=True))
                continue
            model_file.write(length_key(fd.number) + varint(graph_size))
            if body is None:
                write_graph(model_file, counting=False)  # counted while sizing
            else:
                shutil.copyfileobj(body, model_file, _COPY_CHUNK)


# The most elements `_write_pieces` serializes and writes at a time, and about the most bytes.
# A run's elements cost some 1.7 KB each while it is held (not only their bytes): at the
# fused cnn 100k, runs of 4096 raised the save's peak by 7 MB, runs of 512 by 1 MB (the
# batch of one write before, 4096 elements serialized one by one: 5 MB), for no more time.
RUN_ELEMENTS = 512
RUN_BYTES = 1 << 20


def next_run(count: int, elements: int, size: int) -> int:
    """How many elements the next run takes, after a run of `elements` of `size` bytes in all
    that was asked for `count`: up to 8 times as many, about `RUN_BYTES` at their size."""
    each = size // max(1, elements) + 1
    return max(1, min(RUN_ELEMENTS, 8 * count, RUN_BYTES // each))


# An element's serialization as `SerializeToString(deterministic=True)` of its own type.
_serialize = operator.methodcaller("SerializeToString", deterministic=True)
# The scratch file is copied to the model file a chunk of this many bytes at a time.
_COPY_CHUNK = 1 << 20


@contextlib.contextmanager
def _scratch_file(folder: Path | None) -> Iterator[BinaryIO | None]:
    """A new anonymous read-write file in `folder` (gone when closed, however the process
    ends where the system has O_TMPFILE), or None where none can be made there."""
    with contextlib.ExitStack() as stack:
        handle: BinaryIO | None
        try:
            handle = stack.enter_context(tempfile.TemporaryFile(dir=folder))
        except OSError:
            handle = None
        yield handle


def streamable(model: onnx.ModelProto) -> bool:
    """Whether `write_external` and `write_inline` lay `model` out as protobuf would: no
    unknown fields at the two levels they write field by field (deeper ones travel inside
    each element's bytes)."""
    return not (
        len(unknown_fields.UnknownFieldSet(model))
        or len(unknown_fields.UnknownFieldSet(model.graph))
    )
