"""The graph index: who produces and who reads each value, in a topological order kept valid.

Built once per graph in O(nodes + edges) and updated incrementally by each rewrite, so a whole
fusion pass stays linear in the size of the graph. Nodes are addressed by integer ids that stay
stable across rewrites; `order` holds them in a valid topological order (dead slots are None).

Values read by a subgraph (If/Loop/Scan bodies) from the enclosing scope count as read by the
node that owns the subgraph: a fusion must never hide a value a subgraph still needs.
"""

from __future__ import annotations

import heapq
import operator
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from .errors import ModelLoadError
from .modelio import LoadedModel, read_tensor

# Ops whose value is not a function of their inputs: never treated as constants.
_NONDETERMINISTIC = frozenset(
    {
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "Dropout",
    }
)
# Standard ops that carry subgraphs; other domains are checked attribute by attribute.
_SUBGRAPH_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})
SUBGRAPH_OPS = _SUBGRAPH_OPS  # public: see may_hold_subgraphs
# A constant cone larger than this is not folded at fuse time (it would cost more than it saves).
_MAX_CONSTANT_CONE = 64

Dim = int | str | None
Shape = tuple[Dim, ...]


@dataclass(frozen=True, slots=True)
class ValueType:
    """Element type (onnx.TensorProto enum) and shape (None if rank unknown) of a tensor."""

    elem_type: int
    shape: Shape | None


def subgraph_free_names(graph: onnx.GraphProto) -> set[str]:
    """Names a graph reads from its enclosing scope (used but not defined inside it)."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {s.values.name for s in graph.sparse_initializer}
    used: set[str] = set()
    for node in graph.node:
        used.update(name for name in node.input if name)
        for sub in _node_subgraphs(node):
            used |= subgraph_free_names(sub)
        defined.update(node.output)
    used.update(o.name for o in graph.output)
    return used - defined


def all_value_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name defined or read in `graph` and, recursively, in its subgraphs.

    Interned: the names are those the index keys its edges and types by, so the set costs its
    table, not another copy of every name."""
    intern = sys.intern
    names = {intern(v.name) for v in (*graph.input, *graph.output, *graph.value_info)}
    names.update(intern(t.name) for t in graph.initializer)
    names.update(intern(s.values.name) for s in graph.sparse_initializer)
    for node in graph.node:
        names.update(map(intern, node.input))
        names.update(map(intern, node.output))
        for sub in _node_subgraphs(node):
            names |= all_value_names(sub)
    names.discard("")
    return names


def _never(name: str) -> bool:
    return False


def may_hold_subgraphs(node: onnx.NodeProto) -> bool:
    """Whether `node` can carry graph attributes: a standard op whose schema has them (If,
    Loop, Scan, SequenceMap) or any op of another domain. No other standard op declares one
    and onnx's checker refuses undeclared attributes, so a walk skips reading the attributes
    of the other standard nodes (reading them is most of a walk over a large graph)."""
    return node.op_type in _SUBGRAPH_OPS or node.domain not in ("", "ai.onnx")


def may_hold_kind(domain: str, op_type: str) -> bool:
    """`may_hold_subgraphs` of the nodes of one (domain, op_type) kind (`GraphIndex.by_kind`)."""
    return op_type in _SUBGRAPH_OPS or domain not in ("", "ai.onnx")


def _node_subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    if not may_hold_subgraphs(node):
        return
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


node_subgraphs = _node_subgraphs  # public: the subgraphs held in a node's attributes


def _constant_node_value(node: onnx.NodeProto, source: LoadedModel) -> np.ndarray | None:
    """The value of a Constant node, whichever of its attributes holds it."""
    for attr in node.attribute:
        if attr.name == "value":
            return read_tensor(source, attr.t)
        if attr.name == "value_float":
            return np.array(attr.f, dtype=np.float32)
        if attr.name == "value_floats":
            return np.array(list(attr.floats), dtype=np.float32)
        if attr.name == "value_int":
            return np.array(attr.i, dtype=np.int64)
        if attr.name == "value_ints":
            return np.array(list(attr.ints), dtype=np.int64)
    return None  # sparse_value or strings: not a tensor fuser folds


def _type_proto_value_type(type_proto: onnx.TypeProto) -> ValueType | None:
    if type_proto.WhichOneof("value") != "tensor_type":
        return None
    tensor = type_proto.tensor_type
    shape: Shape | None = None
    if tensor.HasField("shape"):
        dims: list[Dim] = []
        for dim in tensor.shape.dim:  # one WhichOneof per dim rather than two HasField calls
            kind = dim.WhichOneof("value")
            if kind == "dim_value":
                dims.append(dim.dim_value)
            elif kind == "dim_param":
                dims.append(dim.dim_param)
            else:
                dims.append(None)
        shape = tuple(dims)
    return ValueType(tensor.elem_type, shape)


# A value's readers (`GraphIndex.consumers`), in the order they were added: a tuple while they
# are few, a dict once many. Most values of a large graph have one reader, and a tuple of one
# is a fifth of a dict of one (48 bytes against 224: 44 MB at 250k values); past
# `_FEW_READERS` the dict keeps adding one O(1). Readers of the index only iterate, count
# and test them, which both answer alike; an emptied entry stays, as `()`.
Readers = tuple[int, ...] | dict[int, None]
_FEW_READERS = 8


def _with_reader(readers: Readers | None, node_id: int) -> Readers:
    """`readers` with `node_id` added at the end (unless there already)."""
    if readers is None:
        return (node_id,)
    if type(readers) is tuple:
        if node_id in readers:
            return readers
        if len(readers) < _FEW_READERS:
            return (*readers, node_id)
        readers = dict.fromkeys(readers)
    readers[node_id] = None  # type: ignore[index]
    return readers


def _drop_reader(consumers: dict[str, Readers], name: str, node_id: int) -> None:
    """Take `node_id` out of `name`'s readers (the entry stays, if emptied)."""
    readers = consumers.get(name)
    if readers is None:
        return
    if type(readers) is tuple:
        if node_id in readers:
            consumers[name] = tuple([r for r in readers if r != node_id])
    else:
        readers.pop(node_id, None)  # type: ignore[union-attr]


# Stored for a value whose proto carries no tensor type: known (`in`), but without a type.
_UNTYPED = object()
_tensor_name = operator.attrgetter("name")
# tensors, their names, and the tensors by name (`TypeTable.add_initializers`)
_Tensors = tuple[list[onnx.TensorProto], list[str], dict[str, onnx.TensorProto]]


def _same_tensors(
    last: _Tensors,
    tensors: list[onnx.TensorProto],
    names: list[str],
    entries: dict[str, object],
) -> bool:
    """Whether `TypeTable.add_tensors` of `tensors` (named `names`) would answer what it
    answered last (`last`: its tensors, their names and its answer), `entries` its table."""
    listed, listed_names, by_name = last
    return (
        len(listed) == len(tensors)
        and all(map(operator.is_, listed, tensors))
        and listed_names == names
        and all(map(entries.__contains__, by_name))
    )


class TypeTable(MutableMapping[str, ValueType]):
    """Types of a graph's values, converted from their protos only when asked for.

    Shape inference annotates every value; converting all of them up front costs more than the
    whole fusion pass on a large model, and a pass asks about a small fraction. One dict holds
    each value's type until its first lookup, then the converted `ValueType` in its place, so
    a lookup is one dict access and a type check (`get` is direct, not Mapping's try/except
    around `__getitem__`: a fusion pass asks several times per match).

    A value info is kept as its TypeProto's serialization (some 20 bytes), not as the proto:
    holding the protos kept every inferred value info alive, with a Python object for each
    (about 75 MB at 100k nodes, through every pass). Equal serializations are one bytes object,
    converted once: a large model repeats a few types for most of its values (`_by_bytes`
    maps each to itself until converted, then to its `ValueType`, or `_UNTYPED`). An
    initializer is kept as the model's own TensorProto (its dims are read when asked), and
    equal (element type, dims) share one `ValueType` (`_by_dims`).
    """

    def __init__(self) -> None:
        self._entries: dict[str, object] = {}
        self._by_bytes: dict[bytes, object] = {}
        self._by_dims: dict[tuple[int, tuple[int, ...]], ValueType] = {}
        # `add_initializers`' tensors, their names and by name, until the next `add_tensors`
        self._last_tensors: _Tensors | None = None

    def add_proto(self, name: str, proto: onnx.ValueInfoProto | onnx.TensorProto) -> None:
        """Remember `proto` as the source of `name`'s type, unless one is known already."""
        name = sys.intern(name)
        if name not in self._entries:
            self._entries[name] = self._source(proto)

    def add_protos(self, protos: Iterable[onnx.ValueInfoProto | onnx.TensorProto]) -> None:
        """`add_proto(p.name, p)` for each of `protos`."""
        entries, intern, shared = self._entries, sys.intern, self._by_bytes
        tensor = onnx.TensorProto
        for proto in protos:
            # interned: the index keys its edges by the same names (one str per name, not
            # one per table; a large graph has hundreds of thousands)
            name = intern(proto.name)
            if name not in entries:
                if isinstance(proto, tensor):
                    entries[name] = proto
                else:  # b"" when it has no type: converted, an untyped value
                    data = proto.type.SerializeToString()
                    entries[name] = shared.setdefault(data, data)

    def add_types(self, names: Iterable[str], types: Iterable[bytes | None]) -> None:
        """`add_protos` of value infos given as their names and their types' serializations
        (None: no type), in step (what `fuser.pieces` reads of inference's results)."""
        entries, intern, shared = self._entries, sys.intern, self._by_bytes
        for name, data in zip(names, types, strict=True):
            name = intern(name)
            if name not in entries:
                data = data or b""  # as an untyped value info's `type.SerializeToString()`
                entries[name] = shared.setdefault(data, data)

    def add_tensors(self, tensors: Iterable[onnx.TensorProto]) -> dict[str, onnx.TensorProto]:
        """`add_protos(tensors)`, returning the tensors by (interned) name: one read of each
        name for both (a large model has a hundred thousand initializers).

        Given the tensors of the last `add_initializers` (the same tensor objects in the same
        order, of the same names, each name still in the table), the dict that one made."""
        listed = list(tensors)
        last, self._last_tensors = self._last_tensors, None
        names = list(map(_tensor_name, listed))
        if last is not None and _same_tensors(last, listed, names, self._entries):
            return last[2]
        return self._add_tensors(listed, names)

    def add_initializers(self, tensors: Iterable[onnx.TensorProto]) -> None:
        """`add_protos` of a graph's initializers, whose next `add_tensors` (the graph's
        index, `GraphIndex.build`) reads only their names again: the names interned and the
        dict by name made here serve it (a second time, 0.1 s at 150k initializers)."""
        listed = list(tensors)
        names = list(map(sys.intern, map(_tensor_name, listed)))  # the table's own strs
        self._last_tensors = (listed, names, self._add_tensors(listed, names))

    def _add_tensors(
        self, tensors: list[onnx.TensorProto], names: list[str]
    ) -> dict[str, onnx.TensorProto]:
        entries, intern = self._entries, sys.intern
        by_name: dict[str, onnx.TensorProto] = {}
        for tensor, name in zip(tensors, names, strict=True):
            name = intern(name)
            by_name[name] = tensor
            if name not in entries:
                entries[name] = tensor
        return by_name

    def add_tensor(self, name: str, tensor: onnx.TensorProto) -> None:
        """`name` is (from now on) the tensor `tensor`, its type read when asked: tensors
        of equal element type and dims share one `ValueType` (`_by_dims`)."""
        self._entries[name] = tensor

    def _source(self, proto: onnx.ValueInfoProto | onnx.TensorProto) -> object:
        """What the table keeps of `proto` until asked (see the class docstring)."""
        if isinstance(proto, onnx.TensorProto):
            return proto
        data = proto.type.SerializeToString()
        return self._by_bytes.setdefault(data, data)

    def get(self, name: str, default: ValueType | None = None) -> ValueType | None:  # type: ignore[override]
        found = self._entries.get(name)
        if type(found) is ValueType:
            return found
        if found is None or found is _UNTYPED:
            return default
        converted = self._convert(name, found)
        return default if converted is None else converted

    def elem_type(self, name: str) -> int | None:
        """`get(name).elem_type`, without converting an initializer's dims to read it."""
        found = self._entries.get(name)
        if type(found) is ValueType:
            return found.elem_type
        if isinstance(found, onnx.TensorProto):
            return int(found.data_type)
        converted = self.get(name)
        return None if converted is None else converted.elem_type

    def _convert(self, name: str, source: object) -> ValueType | None:
        if type(source) is bytes:
            known = self._by_bytes.get(source, source)
            if type(known) is bytes:  # the first value of this type asked about
                parsed = _type_proto_value_type(onnx.TypeProto.FromString(source))
                known = self._by_bytes[source] = _UNTYPED if parsed is None else parsed
        else:
            assert isinstance(source, onnx.TensorProto)
            # a slice reads the dims in one C call (iterating the field: one a dim)
            key = (source.data_type, tuple(source.dims[:]))
            known = self._by_dims.get(key)
            if known is None:
                known = self._by_dims[key] = ValueType(*key)
        self._entries[name] = known
        return None if known is _UNTYPED else known  # type: ignore[return-value]

    def __getitem__(self, name: str) -> ValueType:
        found = self.get(name)
        if found is None:
            raise KeyError(name)
        return found

    def __setitem__(self, name: str, value: ValueType) -> None:
        self._entries[name] = value

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class GraphIndex:
    """Producers, consumers, constants and types of one graph (a model's or a subgraph)."""

    graph: onnx.GraphProto
    source: LoadedModel
    opsets: Mapping[str, int]
    types: TypeTable
    outer: GraphIndex | None = None
    path: str = ""  # where this graph lives, for messages: "" for the main graph

    nodes: dict[int, onnx.NodeProto] = field(default_factory=dict)
    order: list[int | None] = field(default_factory=list)
    pos: dict[int, int] = field(default_factory=dict)
    producer: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, Readers] = field(default_factory=dict)  # see `Readers`
    initializers: dict[str, onnx.TensorProto] = field(default_factory=dict)
    graph_inputs: set[str] = field(default_factory=set)
    graph_outputs: set[str] = field(default_factory=set)
    # each node name, by itself: the names a rewrite records of the nodes it replaces are
    # these strs (`describe_all`), not one new copy per read of a name (~7 MB at 100k nodes)
    node_names: dict[str, str] = field(default_factory=dict)
    reserved_names: set[str] = field(default_factory=set)
    # initializers dropped (`_drop_dead`) since the last `write_back`, which cuts those no
    # longer in `initializers` off the graph (a set of their names held 4 MB at 100k nodes)
    _dropped_initializers: int = 0
    _constants: dict[str, np.ndarray | None] = field(default_factory=dict)
    _runtime: dict[str, bool] = field(default_factory=dict)  # see `_runtime_dependent`
    _runtime_swept: bool = False  # `_sweep_runtime` done
    # what each node that may hold subgraphs reads (`read_names`, interned: its inputs and
    # what its subgraphs take from outside), by id, until it is gone. Any other node reads its
    # non-empty inputs, read from its proto when asked (`_reads_of`): a tuple per node held
    # 6 MB at 100k nodes, and a rewrite reads the inputs of the few nodes it removes.
    _reads: dict[int, tuple[str, ...]] = field(default_factory=dict)
    _taken: set[str] | None = None  # main graph only: every value name in the model (lazy)
    # main graph only, `_taken` made without a walk (see `_model_names`): then the index's own
    # tables and `_retired` stand for the main graph's names, `_taken` holds the rest
    _taken_from_index: bool = False
    _retired: set[str] = field(default_factory=set)  # names removed from the index's tables
    # ids of the nodes that may hold subgraphs (`may_hold_subgraphs`), dead ones included: a
    # rewrite asks of each node it removes, without reading its op_type and domain again
    _holders: set[int] = field(default_factory=set)
    _next_id: int = 0
    _version: int = 0  # bumped by every change to nodes or edges (`_window_memo`'s validity)
    _window_memo: tuple[Any, list[int], str | None] | None = None  # descendants_in_window's last
    # ids of the nodes of each (domain, op_type) ever added, dead ones included (`anchored`)
    by_kind: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    modified: bool = False

    @classmethod
    def build(
        cls,
        graph: onnx.GraphProto,
        source: LoadedModel,
        opsets: Mapping[str, int],
        types: TypeTable,
        *,
        outer: GraphIndex | None = None,
        path: str = "",
    ) -> GraphIndex:
        """Index `graph`, sorting its nodes topologically; a cycle or dangling input is an error."""
        index = cls(graph=graph, source=source, opsets=opsets, types=types, outer=outer, path=path)
        intern = sys.intern  # one str per name, shared with the type table and the edges
        index.graph_inputs = {intern(v.name) for v in graph.input}
        index.graph_outputs = {intern(v.name) for v in graph.output}
        types.add_protos(graph.input)
        types.add_protos(graph.output)
        types.add_protos(graph.value_info)
        index.initializers = types.add_tensors(graph.initializer)
        if index._index_nodes(graph.node):
            # already in topological order (the usual case): Kahn's algorithm would keep it
            # the ids' own int objects, shared (ranges would make two new ints per node)
            order: list[int | None] = list(index.nodes)
            index.order = order
            index.pos = dict(zip(index.nodes, index.nodes, strict=True))
        else:
            index._sort_topologically()
        return index

    # -- construction ---------------------------------------------------------------------------

    def _index_nodes(self, nodes: Iterable[onnx.NodeProto]) -> bool:
        """`_add_node` for each of a graph's nodes, in one loop (a build's main cost at 100k
        nodes is per-node Python overhead). Returns whether they are in topological order as
        given: each value read is produced by an earlier node or is known outside the graph
        and produced by no node. Otherwise (or on a dangling input or a cycle) the caller
        sorts, which names the problem."""
        producer, consumers, reads_of = self.producer, self.consumers, self._reads
        by_kind, names, index_of, holders = self.by_kind, self.node_names, self.nodes, self._holders
        early: set[str] = set()  # read before any node produced it
        intern = sys.intern  # each read of a name makes a new str: one copy of each is kept
        node_id = self._next_id
        for node in nodes:
            index_of[node_id] = node
            name = node.name
            if name:
                names[name] = name
            op_type, domain = node.op_type, node.domain
            kind = (domain or "", op_type)
            same = by_kind.get(kind)
            if same is None:
                by_kind[kind] = [node_id]
            else:
                same.append(node_id)
            reads: Iterable[str]
            if op_type in _SUBGRAPH_OPS or domain not in ("", "ai.onnx"):
                reads = reads_of[node_id] = tuple(map(intern, self.read_names(node)))
                holders.add(node_id)
            else:
                reads = map(intern, filter(None, node.input))  # no Python frame
            solo = (node_id,)  # one tuple for every value only this node reads
            for name in reads:
                readers = consumers.get(name)  # `_with_reader`, inline (a build's hot loop)
                if readers is None:
                    consumers[name] = solo
                elif type(readers) is tuple:
                    if node_id not in readers:
                        consumers[name] = _with_reader(readers, node_id)
                else:
                    readers[node_id] = None  # type: ignore[index]
                if name not in producer:
                    early.add(name)
            for name in node.output:
                if name:
                    if name in producer:
                        self._twice_produced(name, node)
                    producer[intern(name)] = node_id
            node_id += 1
        self._next_id = node_id
        # In order unless a name read early is produced later, or is not known outside (set
        # operations: `early` holds every initializer and input read, most of a large graph).
        if not early.isdisjoint(producer):
            return False
        outside = early.difference(self.graph_inputs, self.initializers)
        return all(self.outer is not None and self.outer.defines(name) for name in outside)

    def _twice_produced(self, name: str, node: onnx.NodeProto) -> None:
        raise ModelLoadError(
            f"{self.where()}value '{name}' is produced by two nodes "
            f"('{self.nodes[self.producer[name]].name}' and '{node.name}')"
        )

    def _add_node(self, node: onnx.NodeProto, *, at_end: bool) -> int:
        # interned, as `_index_nodes` does: one str per name, the one the tables hold
        reads = tuple(map(sys.intern, self.read_names(node)))
        node_id = self._index_added(node, reads, node.output, holder=may_hold_subgraphs(node))
        if at_end:
            self.pos[node_id] = len(self.order)
            self.order.append(node_id)
        return node_id

    def _index_added(
        self, node: onnx.NodeProto, reads: tuple[str, ...], outputs: Iterable[str], *, holder: bool
    ) -> int:
        """Give `node` the next id and put it in the tables (not in the order), `reads` being
        what it reads (`read_names`, interned), `outputs` its outputs, and `holder` whether it
        may hold subgraphs (`_holders`)."""
        self._version += 1
        node_id = self._next_id
        self._next_id += 1
        self.nodes[node_id] = node
        name = node.name
        if name:
            self.node_names.setdefault(name, name)
        self.by_kind.setdefault((node.domain or "", node.op_type), []).append(node_id)
        if holder:
            self._holders.add(node_id)
            self._reads[node_id] = reads
        consumers, producer = self.consumers, self.producer
        for name in reads:  # `_with_reader`'s common cases inline (a rewrite adds one node)
            readers = consumers.get(name)
            if readers is None:
                consumers[name] = (node_id,)
            elif type(readers) is tuple and len(readers) < _FEW_READERS:
                if node_id not in readers:
                    consumers[name] = (*readers, node_id)
            else:
                consumers[name] = _with_reader(readers, node_id)
        for name in outputs:
            if name:
                if name in producer:
                    self._twice_produced(name, node)
                producer[sys.intern(name)] = node_id
        return node_id

    def _reads_of(self, node_id: int, node: onnx.NodeProto) -> Iterable[str]:
        """What live node `node_id` (`node`) reads: `read_names`, from `_reads` for a node that
        may hold subgraphs, else its non-empty inputs (not interned)."""
        found = self._reads.get(node_id)
        return filter(None, node.input) if found is None else found

    @staticmethod
    def read_names(node: onnx.NodeProto) -> list[str]:
        """Every value a node reads: its inputs and what its subgraphs take from outer scope."""
        names = [name for name in node.input if name]
        if may_hold_subgraphs(node):
            for sub in _node_subgraphs(node):
                names.extend(sorted(subgraph_free_names(sub)))
        return names

    def _known_outside(self, name: str) -> bool:
        if name in self.graph_inputs or name in self.initializers:
            return True
        return self.outer is not None and self.outer.defines(name)

    def defines(self, name: str) -> bool:
        """Whether `name` is visible in this graph (or, for subgraphs, an enclosing one)."""
        return name in self.producer or self._known_outside(name)

    def _sort_topologically(self) -> None:
        """Kahn's algorithm taking the lowest original position first, so a graph that is
        already sorted keeps its order exactly (fusing a fused model must change nothing)."""
        ids = list(self.nodes)
        waiting: dict[int, int] = {}
        readers: dict[int, list[int]] = {}
        for node_id in ids:
            count = 0
            for name in self._reads_of(node_id, self.nodes[node_id]):
                src = self.producer.get(name)
                if src is None:
                    if not self._known_outside(name):
                        raise ModelLoadError(
                            f"{self.where()}node '{self.describe(node_id)}' reads '{name}', "
                            "which no node, input or initializer provides (dangling input)"
                        )
                    continue
                if src == node_id:
                    raise ModelLoadError(
                        f"{self.where()}node '{self.describe(node_id)}' reads its own output "
                        f"'{name}' (cycle)"
                    )
                count += 1
                readers.setdefault(src, []).append(node_id)
            waiting[node_id] = count
        ready = [i for i in ids if waiting[i] == 0]  # ids ascend: already a valid heap
        order: list[int | None] = []
        while ready:
            node_id = heapq.heappop(ready)
            order.append(node_id)
            for reader in readers.get(node_id, ()):
                waiting[reader] -= 1
                if waiting[reader] == 0:
                    heapq.heappush(ready, reader)
        if len(order) != len(ids):
            stuck = next(i for i in ids if waiting[i] > 0)
            raise ModelLoadError(
                f"{self.where()}the graph has a cycle through node '{self.describe(stuck)}'"
            )
        self.order = order
        self.pos = {node_id: i for i, node_id in enumerate(order) if node_id is not None}
        if order != ids:
            self.modified = True

    # -- queries ----------------------------------------------------------------------------------

    def where(self) -> str:
        return f"subgraph {self.path}: " if self.path else ""

    def describe(self, node_id: int) -> str:
        node = self.nodes[node_id]
        return node.name or f"{node.op_type}#{node_id}"

    def describe_all(self, node_ids: Iterable[int]) -> tuple[str, ...]:
        """`describe` of each of `node_ids` (a rewrite names every node it replaces)."""
        nodes, names = self.nodes, self.node_names
        described = []
        for node_id in node_ids:
            name = nodes[node_id].name
            described.append(
                names.get(name, name) if name else f"{nodes[node_id].op_type}#{node_id}"
            )
        return tuple(described)

    def anchored(self, kinds: Iterable[tuple[str, str]]) -> list[int]:
        """The live nodes of the given (domain, op_type) kinds, in topological order: what a
        pass over `live_nodes` that skips every other kind visits, without visiting them."""
        pos = self.pos
        found = [i for kind in set(kinds) for i in self.by_kind.get(kind, ()) if i in pos]
        found.sort(key=pos.__getitem__)
        return found

    def live_nodes(self) -> Iterator[int]:
        """Node ids in topological order."""
        return (node_id for node_id in self.order if node_id is not None)

    def node(self, node_id: int) -> onnx.NodeProto:
        return self.nodes[node_id]

    def producer_of(self, name: str) -> onnx.NodeProto | None:
        node_id = self.producer.get(name)
        return None if node_id is None else self.nodes[node_id]

    def readers(self, name: str) -> list[int]:
        return list(self.consumers.get(name, ()))

    def is_graph_output(self, name: str) -> bool:
        return name in self.graph_outputs

    def value_type(self, name: str) -> ValueType | None:
        found = self.types.get(name)
        if found is None and self.outer is not None:
            return self.outer.value_type(name)
        return found

    def elem_type(self, name: str) -> int | None:
        vt = self.value_type(name)
        return None if vt is None else vt.elem_type

    def shape(self, name: str) -> Shape | None:
        vt = self.value_type(name)
        return None if vt is None else vt.shape

    def opset(self, domain: str = "") -> int:
        return self.opsets.get("ai.onnx" if domain == "" else domain, self.opsets.get(domain, 0))

    def constant(self, name: str) -> np.ndarray | None:
        """The value of `name` if it is known at fuse time, else None.

        Known: a non-overridable initializer, a Constant node, or a small deterministic subgraph
        of those (ConstantOfShape, Cast, Reshape, ...), evaluated with onnx's reference runtime.
        An initializer that is also a graph input can be overridden at run time: not constant.
        """
        if name in self._constants:
            return self._constants[name]
        if name in self.initializers and name not in self.producer:
            # Read anew each time rather than kept: reading one is cheap, and keeping every
            # weight a pass looked at would hold a copy of the model's tensors.
            return self._compute_constant(name)
        value = self._compute_constant(name)
        self._constants[name] = value
        return value

    def _compute_constant(self, name: str) -> np.ndarray | None:
        if not name:
            return None
        if name in self.initializers:
            if name in self.graph_inputs:
                return None
            return read_tensor(self.source, self.initializers[name])
        if name not in self.producer:
            if name in self.graph_inputs or self.outer is None:
                return None
            return self.outer.constant(name)
        node = self.nodes[self.producer[name]]
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            # Read directly: the reference evaluator costs ~1 ms per call, per Constant node.
            return _constant_node_value(node, self.source)
        if self._runtime_dependent(name):
            return None
        cone = self._constant_cone(name)
        if cone is None:
            return None
        return self._evaluate(cone, name)

    def _runtime_dependent(self, name: str) -> bool:
        """Whether `name` depends on a value only known at run time: a leaf that is not
        constant (a graph input, an outer value), or a nondeterministic or subgraph-carrying
        producer, anywhere upstream. Memoized per value, so asking about every value of a
        graph is linear in its size; without it each question about a value deep in the graph
        walks back `_MAX_CONSTANT_CONE` nodes before giving up.

        Rewrites keep the answers valid: a fused node computes the same values from the
        non-constant inputs of the nodes it replaces, and new names are never reused.
        """
        memo = self._runtime
        found = memo.get(name)
        if found is not None:
            return found
        if not self._runtime_swept:
            self._sweep_runtime()
            found = memo.get(name)
            if found is not None:
                return found
        stack = [name]
        while stack:
            value = stack[-1]
            if value in memo:
                stack.pop()
                continue
            node_id = self.producer.get(value)
            if node_id is None:  # a leaf, judged without reading any tensor
                memo[value] = self._leaf_runtime_dependent(value)
                stack.pop()
                continue
            node = self.nodes[node_id]
            if node.op_type in _NONDETERMINISTIC or any(True for _ in _node_subgraphs(node)):
                memo[value] = True
                stack.pop()
                continue
            inputs = [i for i in node.input if i]
            if any(memo.get(i) for i in inputs):
                memo[value] = True
                stack.pop()
                continue
            pending = [i for i in inputs if i not in memo]
            if pending:  # the first input (the data, usually) is looked at first
                stack.extend(reversed(pending))
                continue
            memo[value] = False  # every input known, none runtime-dependent
            stack.pop()
        return memo[name]

    def _sweep_runtime(self) -> None:
        """`_runtime_dependent` of every value the graph's nodes produce, in one pass in
        topological order: the first question about a value deep in a graph walks back over
        most of it anyway, and a forward pass does that work at a fraction of the walk's cost
        per node. Values made by later rewrites are answered by the walk."""
        self._runtime_swept = True
        memo, nodes, reads, intern = self._runtime, self.nodes, self._reads, sys.intern
        # The nodes that may be dependent whatever their inputs, found by kind: the others'
        # op_type and domain are not read (two strs made per node, most of a sweep's cost).
        kinds = [k for k in self.by_kind if k[1] in _NONDETERMINISTIC or may_hold_kind(*k)]
        special = {i for kind in kinds for i in self.by_kind[kind]}
        for node_id in self.order:
            if node_id is None:
                continue
            node = nodes[node_id]
            dependent = node_id in special and (
                node.op_type in _NONDETERMINISTIC or any(True for _ in _node_subgraphs(node))
            )
            if not dependent:
                # the node's inputs (and what its subgraphs read: only nodes with a subgraph
                # have any, and those are dependent already)
                for value in reads.get(node_id) or filter(None, node.input):
                    known = memo.get(value)
                    if known is None:  # not produced before this node: a leaf
                        # interned: the key is the tables' str, not a new copy of the name
                        known = memo[intern(value)] = self._leaf_runtime_dependent(value)
                    if known:
                        dependent = True
                        break
            for value in node.output:
                if value:
                    memo[value] = dependent

    def _leaf_runtime_dependent(self, name: str) -> bool:
        """`_runtime_dependent` of a value no node of this graph produces (as
        `_compute_constant` treats it: an overridable initializer or a graph input is not
        constant; an outer value is what the enclosing graph says)."""
        if name in self.initializers:
            return name in self.graph_inputs
        if name in self.graph_inputs or self.outer is None:
            return True
        return self.outer._runtime_dependent(name)

    def _constant_cone(self, name: str) -> list[int] | None:
        """Producer nodes of `name` back to constants, or None if any leaf is not constant."""
        cone: dict[int, None] = {}
        stack = [name]
        while stack:
            value = stack.pop()
            node_id = self.producer.get(value)
            if node_id is None:
                if self.constant(value) is None:
                    return None
                continue
            if node_id in cone:
                continue
            node = self.nodes[node_id]
            if node.op_type in _NONDETERMINISTIC or any(True for _ in _node_subgraphs(node)):
                return None
            cone[node_id] = None
            if len(cone) > _MAX_CONSTANT_CONE:
                return None
            stack.extend(i for i in node.input if i)
        return sorted(cone, key=self.pos.__getitem__)

    def _evaluate(self, cone: list[int], name: str) -> np.ndarray | None:
        from onnx.reference import ReferenceEvaluator

        nodes = [self.nodes[i] for i in cone]
        produced = {o for n in nodes for o in n.output}
        leaves = sorted({i for n in nodes for i in n.input if i and i not in produced})
        feeds = {}
        for leaf in leaves:
            value = self.constant(leaf)
            if value is None:
                return None
            feeds[leaf] = value
        inputs = [
            onnx.helper.make_tensor_value_info(leaf, onnx.TensorProto.UNDEFINED, None)
            for leaf in leaves
        ]
        outputs = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)]
        graph = onnx.helper.make_graph(nodes, "constant_cone", inputs, outputs)
        opsets = [onnx.helper.make_opsetid(d, v) for d, v in self.opsets.items()]
        model = onnx.helper.make_model(graph, opset_imports=opsets)
        try:
            (result,) = ReferenceEvaluator(model).run(None, feeds)
        except Exception:  # an op the reference runtime lacks: then it is simply not constant
            return None
        return np.asarray(result)

    # -- rewriting ------------------------------------------------------------------------------

    def unique_node_name(self, base: str) -> str:
        name, counter = base, 1
        while name in self.node_names:
            counter += 1
            name = f"{base}_{counter}"
        self.node_names[name] = name
        return name

    def unique_value_name(self, base: str) -> str:
        """A value name used nowhere in the model: not in this graph, not in an enclosing graph
        (a subgraph's new name would shadow an outer value the subgraph reads) and not in any
        subgraph (ONNX names are unique across scopes: a main-graph name a subgraph defines
        again breaks SSA)."""
        taken = self._taken
        if taken is not None and self.outer is None and self._taken_from_index:
            return self._unique_root_name(base, taken)  # the usual case, asked without a call
        taken = self._model_names()
        root = self._root()
        if self is root and root._taken_from_index:  # the usual case: a main graph's pass
            return self._unique_root_name(base, taken)
        indexed = root._indexed_name if root._taken_from_index else _never
        name, counter = base, 1
        while (
            name in taken
            or indexed(name)
            or name in self.producer
            or name in self.initializers
            or name in self.types
            or name in self.reserved_names
        ):
            counter += 1
            name = f"{base}_{counter}"
        name = sys.intern(name)  # the tables key the new value by this same str
        self.reserved_names.add(name)
        taken.add(name)
        return name

    def _unique_root_name(self, base: str, taken: set[str]) -> str:
        """`unique_value_name` in the main graph with `_taken_from_index`: the same tests,
        `_indexed_name`'s inline and those it already makes (producer, initializers, types)
        made once (a CNN's fold asks two names per fusion)."""
        producer, consumers, types = self.producer, self.consumers, self.types
        initializers, inputs, outputs = self.initializers, self.graph_inputs, self.graph_outputs
        retired, reserved = self._retired, self.reserved_names
        name, counter = base, 1
        while (
            name in taken
            or name in producer
            or name in consumers
            or name in types
            or name in initializers
            or name in inputs
            or name in outputs
            or name in retired
            or name in reserved
        ):
            counter += 1
            name = f"{base}_{counter}"
        name = sys.intern(name)  # the tables key the new value by this same str
        taken.add(name)  # what `reserved_names` would add: every path checks `taken` too
        return name

    def _root(self) -> GraphIndex:
        root = self
        while root.outer is not None:
            root = root.outer
        return root

    def _model_names(self) -> set[str]:
        """Every value name of the model (all graphs), kept by the main graph's index; with
        `_taken_from_index`, those of the main graph itself are `_indexed_name`'s instead.

        Asked first by the main graph's own pass, before its rewrites are written back: its
        GraphProto is then the one the index was built from, whose every name the index's
        tables still hold (a name a rewrite took out of them is in `_retired`), so only the
        subgraphs are walked (a walk of every node cost more than the rest of a large CNN's
        folds; were it asked after, the names a rewrite removed would only stay reserved).
        Asked first from a subgraph (the main graph written back), the whole model is
        walked."""
        root = self._root()
        if root._taken is None:
            if self is root:
                root._taken = {s.values.name for s in root.graph.sparse_initializer}
                for node_id in root.anchored(k for k in root.by_kind if may_hold_kind(*k)):
                    for sub in _node_subgraphs(root.nodes[node_id]):  # none on a fused node
                        root._taken |= all_value_names(sub)
                root._taken.discard("")
                root._taken_from_index = True
            else:
                root._taken = all_value_names(root.graph)
        return root._taken

    def _indexed_name(self, name: str) -> bool:
        """Whether the main graph's index knows `name` (see `_model_names`)."""
        return (
            name in self.producer
            or name in self.consumers
            or name in self.types
            or name in self.initializers
            or name in self.graph_inputs
            or name in self.graph_outputs
            or name in self._retired
        )

    def _retire(self, node: onnx.NodeProto) -> None:
        """Remember the names of a node the index drops (see `_model_names`): those its
        tables then no longer hold (a value that was read keeps its `consumers` entry)."""
        consumers, types = self.consumers, self.types
        self._retired.update(o for o in node.output if o not in consumers and o not in types)
        self._retire_subgraphs(node)

    def _retire_subgraphs(self, node: onnx.NodeProto) -> None:
        """`_retire`'s names of the subgraphs of `node`."""
        for sub in _node_subgraphs(node):  # none unless may_hold_subgraphs(node)
            self._retired |= all_value_names(sub)

    def descendants_in_window(
        self, members: Iterable[int], fused_inputs: set[str]
    ) -> tuple[list[int], str | None]:
        """Nodes outside `members` that read (transitively) what `members` produce, limited to
        the topological window of the members; and the first value through which such a node
        feeds the fused node (`fused_inputs`: a rewrite would then create a cycle), or None.

        Only what the fused node reads counts: a member's other inputs (say a Reshape's shape,
        folded at fuse time) go away with it. A node placed after the window cannot reach back
        into it, so the search stays local.
        """
        member_set = set(members)
        # check_match asks first, then replace asks the same with nothing changed between
        key = (self._version, frozenset(member_set), frozenset(fused_inputs))
        memo = self._window_memo
        if memo is not None and memo[0] == key:
            return list(memo[1]), memo[2]
        after, back_edge = self._descendants(member_set, fused_inputs)
        self._window_memo = (key, after, back_edge)
        return list(after), back_edge

    def _descendants(
        self, member_set: set[int], fused_inputs: set[str]
    ) -> tuple[list[int], str | None]:
        hi = max(self.pos[m] for m in member_set)
        found: dict[int, None] = {}
        queue = deque(member_set)
        while queue:
            node_id = queue.popleft()
            for out in self.nodes[node_id].output:
                if node_id not in member_set and out in fused_inputs:
                    return [], out
                for reader in self.consumers.get(out, ()):
                    if reader in member_set:
                        continue
                    if self.pos[reader] <= hi and reader not in found:
                        found[reader] = None
                        queue.append(reader)
        return sorted(found, key=self.pos.__getitem__), None

    def rewire_input(self, node_id: int, old: str, new: str) -> None:
        """Make node `node_id` read `new` where it read `old` (`new` is produced earlier)."""
        node = self.nodes[node_id]
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        _drop_reader(self.consumers, old, node_id)
        self.consumers[new] = _with_reader(self.consumers.get(new), node_id)
        if node_id in self._reads:  # a node that may hold subgraphs: its reads are kept
            self._reads[node_id] = tuple(map(sys.intern, self.read_names(node)))
        self._version += 1
        self.modified = True

    def new_node(self) -> onnx.NodeProto:
        """An empty node at the end of the graph's node list, to be filled and then given to
        `replace(..., placed=True)`: built where it stays, it is not copied there."""
        return self.graph.node.add()

    def replace(
        self,
        members: Iterable[int],
        fused: onnx.NodeProto,
        new_initializers: Iterable[onnx.TensorProto] = (),
        *,
        placed: bool = False,
        inputs: Sequence[str] | None = None,
        outputs: Sequence[str] | None = None,
    ) -> int:
        """Replace `members` by `fused`, keeping the order topological. Returns the new id.

        The caller has checked (via `descendants_in_window`) that no cycle results. `placed`:
        `fused` is the graph's last node already (`new_node`), indexed as it is; otherwise a
        copy of it is appended. `inputs` and `outputs`: the lists `fused`'s inputs and outputs
        were set from, when the caller has them and `fused` holds no subgraph (a fused op):
        the index takes its names from them instead of reading them back out of the proto.
        """
        member_set = set(members)
        pos, order, producer, consumers = self.pos, self.order, self.producer, self.consumers
        slots = [pos[m] for m in member_set]
        lo, hi = min(slots), max(slots)
        intern = sys.intern
        read = [name for name in (fused.input if inputs is None else inputs) if name]
        holder = inputs is None and may_hold_subgraphs(fused)
        if holder:  # and what its subgraphs read
            fused_reads = tuple(map(intern, self.read_names(fused)))
        else:  # interned, as `_index_nodes` does: one str per name, the one the tables hold
            fused_reads = tuple(map(intern, read))
        # When every value the fused node reads comes from before the first member's slot
        # (or from outside this graph: an initializer, a graph input, an outer value), no
        # cycle is possible: a path from the node back to its own input would end at that
        # input's producer, which would have to read (transitively) the node's output and
        # so come after that slot; the same holds for every fused node placed at its first
        # member's slot, one after another. Then only the nodes of the window that read what
        # the members produce need moving: none when the members fill their window (a
        # chain, the common case), and the search is skipped.
        for name in read:
            src = producer.get(name)
            if src is not None and pos[src] >= lo:
                after, back_edge = self.descendants_in_window(member_set, set(read))
                if back_edge is not None:
                    if placed:  # the graph as it was
                        del self.graph.node[-1]
                    raise AssertionError(f"rewrite would create a cycle through '{back_edge}'")
                break
        else:
            if hi - lo + 1 == len(member_set):
                after = []
            else:
                after = self._descendants(member_set, set())[0]
        # The members leave the tables. A value they read that is left without readers may
        # be dead (`_drop_dead`): only those are looked at again, once the fused node reads
        # what it reads (a chain's input is read by the fused node instead).
        emptied: list[str] = []
        nodes, reads, holders = self.nodes, self._reads, self._holders
        retired, types, none = self._retired, self.types, ()
        for member in member_set:
            node = nodes.pop(member)
            for name in node.output:  # `_retire`'s outputs, inline (the outputs read once)
                if name not in consumers and name not in types:
                    retired.add(name)
                if producer.get(name) == member:
                    del producer[name]
            if member in holders:
                self._retire_subgraphs(node)
            gone = reads.pop(member, None)
            for name in filter(None, node.input) if gone is None else gone:
                readers = consumers.get(name)  # `_drop_reader`, inline
                if type(readers) is tuple:
                    if member in readers:
                        if len(readers) == 1:
                            consumers[name] = none
                            emptied.append(name)
                        else:
                            consumers[name] = tuple([r for r in readers if r != member])
                elif readers is not None and member in readers:
                    del readers[member]  # type: ignore[union-attr]
                    if not readers:
                        emptied.append(name)
            del pos[member]
        # The new node and tensors are copied into the graph now, and the index keeps the
        # graph's copies: the caller's are freed with the match (held until `write_back`,
        # each in its own protobuf arena, they were about 4 KB per Conv fusion).
        for tensor in new_initializers:
            kept = self.graph.initializer.add()
            kept.CopyFrom(tensor)
            name = intern(tensor.name)  # the str `unique_value_name` reserved
            self.initializers[name] = kept
            types.add_tensor(name, kept)
        if placed:
            placed_node = fused
        else:
            placed_node = self.graph.node.add()
            placed_node.CopyFrom(fused)
        fused_id = self._index_added(
            placed_node,
            fused_reads,
            placed_node.output if outputs is None else outputs,
            holder=holder,
        )
        if after or hi - lo + 1 != len(member_set):
            after_set = set(after)
            window = [i for i in order[lo : hi + 1] if i is not None and i not in member_set]
            before = [i for i in window if i not in after_set]
            new_slots: list[int | None] = [*before, fused_id, *after]
            new_slots += [None] * (hi + 1 - lo - len(new_slots))
            order[lo : hi + 1] = new_slots
            for offset, node_id in enumerate(new_slots):
                if node_id is not None:
                    pos[node_id] = lo + offset
        else:  # the members filled the window: the fused node takes its first slot
            order[lo : hi + 1] = [fused_id] + [None] * (hi - lo)
            pos[fused_id] = lo
        if emptied:  # `_drop_dead(emptied)`, its first step inline: most are dead weights
            initializers, more, dropped = self.initializers, [], 0
            graph_outputs, graph_inputs = self.graph_outputs, self.graph_inputs
            for name in emptied:  # what is dead does not depend on the order asked
                if consumers[name] or name in graph_outputs:
                    continue
                if name in initializers and name not in graph_inputs:
                    del initializers[name]
                    dropped += 1
                elif name in producer:  # a live node's output: maybe a dead node, and more
                    more.append(name)
            self._dropped_initializers += dropped  # counted here: an attribute store less each
            if more:
                self._drop_dead(more)
        self._version += 1
        self.modified = True
        return fused_id

    def _drop_dead(self, names: Iterable[str]) -> None:
        """Remove initializers and producer nodes that the rewrite left without readers."""
        stack = list(names)
        consumers, outputs, initializers = self.consumers, self.graph_outputs, self.initializers
        producer = self.producer
        while stack:
            name = stack.pop()
            if consumers.get(name) or name in outputs:
                continue
            if name in initializers and name not in self.graph_inputs:
                del initializers[name]
                self._dropped_initializers += 1
                continue
            node_id = producer.get(name)
            if node_id is None:
                continue
            node = self.nodes[node_id]
            if node.op_type in _NONDETERMINISTIC or any(
                consumers.get(o) or o in outputs for o in node.output if o
            ):
                continue
            self.nodes.pop(node_id)
            self._retire(node)
            for out in node.output:
                producer.pop(out, None)
            self.order[self.pos.pop(node_id)] = None
            gone = self._reads.pop(node_id, None)
            for read in filter(None, node.input) if gone is None else gone:
                _drop_reader(consumers, read, node_id)
                stack.append(read)

    def write_back(self) -> None:
        """Put the graph's nodes in the index's order and cut off the dead nodes and
        initializers; untouched graphs stay as is. The rewrites already appended their new
        nodes and tensors to the graph (`replace`): nothing is copied here."""
        if not self.modified:
            return
        # One in-place sort puts every node at its place, the dead ones last, and they are
        # cut off (a rebuilt list would be a copy of every node: protobuf copies on extend).
        live_ids = list(self.live_nodes())
        rank = {id(self.nodes[node_id]): r for r, node_id in enumerate(live_ids)}
        dead = len(live_ids)
        self.graph.node.sort(key=lambda node: rank.get(id(node), dead))
        del self.graph.node[len(live_ids) :]
        if self._dropped_initializers:
            # the kept ones in their order: the input's, then the new ones as they were made
            live, tensors = self.initializers, self.graph.initializer
            # A CNN's folds drop every tensor the model had and keep the new ones, made after
            # them: the kept ones are then the last ones, as `initializers` lists them (its
            # order is the graph's: built in it, new ones added at the end), and the dead are
            # cut off the front. That is checked on the kept tensors alone: reading the dead
            # ones makes a Python object for each (most of this step at 150k tensors).
            kept = list(live.values())
            dropped = len(tensors) - len(kept)
            if dropped == self._dropped_initializers and all(
                map(operator.is_, tensors[dropped:], kept)
            ):
                del tensors[:dropped]
            else:
                tensors.sort(key=lambda t: t.name not in live)  # stable: order kept
                # one tensor per dropped name (names are unique), which the boundary confirms;
                # were they not, the kept ones are counted
                count = len(tensors) - self._dropped_initializers
                if not (
                    0 <= count <= len(tensors)
                    and (count == 0 or tensors[count - 1].name in live)
                    and (count == len(tensors) or tensors[count].name not in live)
                ):
                    count = sum(1 for t in tensors if t.name in live)
                del tensors[count:]
            self._dropped_initializers = 0
