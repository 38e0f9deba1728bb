"""Repeat a block of nodes many times at C++ speed, for the large synthetic graphs.

Building 100k nodes one Python proto at a time takes tens of seconds on a busy machine. Here a
block is built once, with the :class:`GraphBuilder`, in a scope whose name holds a fixed-width
placeholder id; each of its nodes and initializers is serialized once as a ``GraphProto`` field.
A copy is then the same bytes with the placeholder ids replaced by same-width block ids (so every
length prefix stays valid) and, for random initializers, freshly drawn values spliced in as the
trailing ``raw_data`` field. The concatenated fields are parsed once by protobuf.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ._graph import DType, GraphBuilder, RandomSpec

ID_WIDTH = 8
_SELF = "#" * ID_WIDTH  # this block's id
_PREV = "$" * ID_WIDTH  # the previous block's id (its output is this block's input)
_NODE_FIELD, _INIT_FIELD, _RAW_DATA_FIELD = 1, 5, 9


def block_value(block_id: int, scope: str) -> str:
    """The name of block ``block_id``'s output (block 0 is whatever feeds the first block)."""
    return f"/{scope}.{block_id:0{ID_WIDTH}d}/out"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


@dataclass(frozen=True)
class _RandomInit:
    """A random initializer: serialized field minus its values, and how to redraw them."""

    head: bytes  # GraphProto field header + TensorProto without raw_data + raw_data header
    spec: RandomSpec
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BlockTemplate:
    """One block, serialized; ``items`` are fixed bytes or random initializers, in order."""

    items: tuple[bytes | _RandomInit, ...]
    node_count: int
    np_dtype: type[np.generic]


def make_template(
    build: Callable[[GraphBuilder, str], str],
    *,
    scope: str,
    opset: int,
    dtype: DType,
    seed: int,
) -> BlockTemplate:
    """Build one block with ``build(builder, input_name) -> output_name`` and serialize it."""
    b = GraphBuilder("template", opset=opset, dtype=dtype, seed=seed)
    with b.scope(f"{scope}.{_SELF}"):
        out = build(b, f"/{scope}.{_PREV}/out")
    b.rename(out, f"/{scope}.{_SELF}/out")
    graph = b.graph
    items: list[bytes | _RandomInit] = []
    for node in graph.node:
        # Placeholders are replaced in whole serialized nodes: they must only occur in names.
        data = b"".join(a.t.raw_data for a in node.attribute)
        if _SELF.encode() in data or _PREV.encode() in data:
            raise AssertionError(f"placeholder id inside the constant data of {node.name}")
        items.append(_field(_NODE_FIELD, node.SerializeToString()))
    for init in graph.initializer:
        spec = b.random_specs.get(init.name)
        if spec is None:
            if _SELF.encode() in init.raw_data or _PREV.encode() in init.raw_data:
                raise AssertionError(f"placeholder id inside the data of {init.name}")
            items.append(_field(_INIT_FIELD, init.SerializeToString()))
            continue
        # raw_data (field 9) is the highest field set, so protobuf serializes it last: the
        # values are a suffix of the tensor's bytes, preceded by their field header.
        data = init.raw_data
        body = init.SerializeToString()
        raw_header = _varint(_RAW_DATA_FIELD << 3 | 2) + _varint(len(data))
        if not body.endswith(raw_header + data):
            raise AssertionError(f"unexpected serialization of {init.name}")
        prefix = body[: len(body) - len(data)]
        head = _varint(_INIT_FIELD << 3 | 2) + _varint(len(body)) + prefix
        items.append(_RandomInit(head, spec, tuple(init.dims)))
    return BlockTemplate(tuple(items), len(graph.node), b.np_dtype)


def repeat_blocks(
    b: GraphBuilder,
    templates: Sequence[BlockTemplate],
    order: Sequence[int],
    *,
    first_id: int = 1,
) -> int:
    """Append ``templates[order[i]]`` as block ``first_id + i`` for each i; return the last id.

    Block k reads ``block_value(k - 1)`` and writes ``block_value(k)``; random initializers are
    redrawn per copy from the builder's RNG, from the distribution the template used.
    """
    rng = b.rng
    # Draw every copy's values per (template, initializer) in one vectorized call.
    uses = [sum(1 for k in order if k == t) for t in range(len(templates))]
    drawn: dict[tuple[int, int], bytes] = {}
    for t, template in enumerate(templates):
        for j, item in enumerate(template.items):
            if isinstance(item, _RandomInit) and uses[t]:
                values = item.spec.draw(rng, (uses[t], *item.shape)).astype(template.np_dtype)
                drawn[t, j] = values.tobytes()
    seen = [0] * len(templates)
    chunks: list[bytes] = []
    nodes = 0
    self_b, prev_b = _SELF.encode(), _PREV.encode()
    for i, t in enumerate(order):
        block_id = first_id + i
        this = f"{block_id:0{ID_WIDTH}d}".encode()
        prev = f"{block_id - 1:0{ID_WIDTH}d}".encode()
        template = templates[t]
        copy = seen[t]
        seen[t] += 1
        for j, item in enumerate(template.items):
            if isinstance(item, bytes):
                chunks.append(item.replace(self_b, this).replace(prev_b, prev))
            else:
                size = len(drawn[t, j]) // uses[t]
                chunks.append(item.head.replace(self_b, this))
                chunks.append(drawn[t, j][copy * size : (copy + 1) * size])
        nodes += template.node_count
    b.extend_serialized(b"".join(chunks), nodes)
    return first_id + len(order) - 1
