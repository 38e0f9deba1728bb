"""What a pattern is: the subgraph it matches, its own checks, and the fused op it emits.

A pattern is anchored at one op type and walks outward from an anchor node. It answers with a
`Match` (which nodes, how the fused node is wired, which internal values it could also output),
a `Rejection` (a near-miss, with a reason a user can act on and the value at fault), or None
(the anchor is not the start of this pattern at all). Universal rules (no escaping internal
values, no cycles, no overlap, supported dtypes) are the matcher's job, not the pattern's.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import onnx

from .fusedop import FusedOp
from .graph import GraphIndex


@dataclass(frozen=True)
class Rejection:
    """A near-miss: the pattern almost matched here, and this is why it did not."""

    pattern: str
    nodes: tuple[str, ...]
    reason: str
    value: str | None = None


@dataclass(frozen=True)
class Match:
    """A proposed fusion, with everything the rewrite needs (no state is kept elsewhere).

    `outputs[i]` is the original value the fused op's output i stands for ("" = not produced).
    `exportable` maps an internal value to the output position that can carry it if something
    outside the match reads it; the matcher fills that position in only when needed.
    `shape_sources` lets `Shape` readers of an internal value read a same-shaped input instead.
    """

    pattern: str
    op: FusedOp
    nodes: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: Mapping[str, Any]
    exportable: Mapping[str, int] = field(default_factory=dict)
    new_initializers: tuple[onnx.TensorProto, ...] = ()
    notes: tuple[str, ...] = ()
    # internal value -> an input of the match with the same shape: a `Shape` node outside the
    # match that reads the internal value is re-pointed there, so the value need not be output
    # just for its dims. The matcher fills `rewires` with the (Shape node, old, new) it applies.
    shape_sources: Mapping[str, str] = field(default_factory=dict)
    rewires: tuple[tuple[int, str, str], ...] = ()

    @functools.cached_property
    def attributes_key(self) -> Hashable | None:
        """`attributes` as one hashable value, for the memos of decisions on repeated chains
        (the body check and the cost model both key on it; computed once per match). Equal
        keys mean equal attributes, value and type alike (1, 1.0 and True differ, as do 0.0
        and -0.0); None when a value cannot be frozen (then nothing is memoized)."""
        return attributes_key(self.attributes)

    def input_facts(self, graph: GraphIndex) -> InputFacts:
        """What every decision on this match reads of its inputs, read off `graph` once per
        match (the type rule, the cost model and the inferred-type check all key on it).

        Per input position: None if absent; () if `graph` has no type for it; (element type,
        shape) of a graph value (shape None: rank unknown; symbolic dims by name); (element
        type, dims, FOLDED) of an initializer the match creates (`new_initializers`). Read on
        the first ask and kept with the graph asked: a match is checked and decided before
        any rewrite, and asking about another graph reads that one."""
        known = self.__dict__.get("_input_facts")  # set only here (a cached_property's home)
        if known is not None and known[0] is graph:
            return known[1]
        facts = _read_input_facts(graph, self)
        self.__dict__["_input_facts"] = (graph, facts)
        return facts

    def signature(self, graph: GraphIndex) -> Hashable | None:
        """(pattern, fused op, `attributes_key`, `input_facts`): what the decisions on a match
        read of it besides the matched nodes and the graph around them; equal signatures,
        equal verdicts of the type rule, the body check and the fused node's inference. None
        when the attributes cannot be frozen (then nothing is memoized)."""
        attributes = self.attributes_key
        if attributes is None:
            return None
        return (self.pattern, self.op.name, attributes, self.input_facts(graph))

    def completed(
        self,
        outputs: tuple[str, ...],
        notes: tuple[str, ...],
        rewires: tuple[tuple[int, str, str], ...],
    ) -> Match:
        """This match with its outputs, notes and rewires completed (by the matcher), keeping
        what was already read of it (`attributes_key`, `input_facts`: its inputs and
        attributes are unchanged). Match(...) rather than dataclasses.replace, whose
        generality costs ~10 us per fusion."""
        done = Match(
            pattern=self.pattern,
            op=self.op,
            nodes=self.nodes,
            inputs=self.inputs,
            outputs=outputs,
            attributes=self.attributes,
            exportable=self.exportable,
            new_initializers=self.new_initializers,
            notes=notes,
            shape_sources=self.shape_sources,
            rewires=rewires,
        )
        for cached in ("attributes_key", "_input_facts"):
            if cached in self.__dict__:
                done.__dict__[cached] = self.__dict__[cached]
        return done


#: Marks an input fact as an initializer the match creates (see `Match.input_facts`).
FOLDED = "folded"
InputFact = tuple[Any, ...] | None
InputFacts = tuple[InputFact, ...]


def _read_input_facts(graph: GraphIndex, match: Match) -> InputFacts:
    """See `Match.input_facts`. Written for speed (thousands of matches per model): plain
    loops, the folded weights looked up only where the match makes any."""
    new = {t.name: t for t in match.new_initializers} if match.new_initializers else None
    # the graph's own table first (`GraphIndex.value_type` asks it, then the enclosing graphs)
    own, value_type = graph.types.get, graph.value_type
    facts: list[InputFact] = []
    for name in match.inputs:
        if not name:
            facts.append(None)
            continue
        tensor = new.get(name) if new is not None else None
        if tensor is not None:
            facts.append((tensor.data_type, tuple(tensor.dims[:]), FOLDED))  # one C call
            continue
        vt = own(name)
        if vt is None:
            vt = value_type(name)
        facts.append(() if vt is None else (vt.elem_type, vt.shape))
    return tuple(facts)


_PLAIN_SCALARS = (int, float, str, bool, type(None))


#: Value types whose pickle is exact: equal pickles, equal values of equal types (1, 1.0 and
#: True pickle apart, as do 0.0 and -0.0, and a list and a tuple).
_PICKLED_KINDS = frozenset({*_PLAIN_SCALARS, list, tuple})


def attributes_key(attributes: Mapping[str, Any]) -> Hashable | None:
    """See `Match.attributes_key`. Plain values (numbers, strings, lists and tuples of them)
    enter by the pickle of the sorted items: exact, and made in C (a key is made per match,
    thousands per model); a list holding anything else pickles exactly too, or, if it cannot
    be pickled, goes the way of the other values: the repr of the sorted items (exact for
    plain values), with anything else (an array, whose repr elides its middle) entering by
    its bytes as well."""
    if set(map(type, attributes.values())) <= _PICKLED_KINDS:
        try:
            return pickle.dumps(sorted(attributes.items()), pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError):
            pass
    exact: list[tuple[str, Hashable]] = []
    for name, value in attributes.items():
        kind = type(value)
        if kind in _PLAIN_SCALARS:
            continue
        if (kind is list or kind is tuple) and all(type(v) in _PLAIN_SCALARS for v in value):
            continue
        try:
            frozen = _frozen(value)
            hash(frozen)
        except TypeError:
            return None
        exact.append((name, frozen))
    text = repr(sorted(attributes.items()))
    return (text, tuple(sorted(exact, key=lambda item: item[0]))) if exact else text


def _frozen(value: Any) -> Hashable:
    if isinstance(value, np.ndarray):
        return (type(value).__name__, value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    return (type(value).__name__, repr(value), value)


class Pattern(Protocol):
    """A fusion family. One instance per family, registered by its module's `PATTERN`."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def anchors(self) -> tuple[tuple[str, str], ...]:
        """(domain, op_type) pairs a match may start at."""
        ...

    @property
    def ops(self) -> tuple[FusedOp, ...]:
        """The fused op types this pattern emits."""
        ...

    def match(self, graph: GraphIndex, node_id: int) -> Match | Rejection | None: ...


def rejection(
    pattern: str,
    graph: GraphIndex,
    node_ids: tuple[int, ...] | list[int],
    reason: str,
    value: str | None = None,
) -> Rejection:
    """A Rejection naming the nodes by their (or their op type's) name."""
    return Rejection(pattern, tuple(graph.describe(i) for i in node_ids), reason, value)
