"""The cost-model decider: fuse a match only where the target's cost model says it pays.

For a match, `CostModelDecider` prices

- the fused op: the tiling search of its kernel (`fuser.kernels.search.search`: every legal
  tiling of the kernel's space priced analytically) gives the best tiling and its cycles;
- the unfused chain: each matched node on the same target. Ops with a cost model (MatMul, Gemm,
  Conv) at their best tiling, so both sides are tuned alike; other ops with a kernel by that
  kernel's timing-only simulation at its default tiling (what would run); ops without a kernel
  by the roofline estimate (`registry.estimate`); views (Reshape, Squeeze, ...) cost nothing.

A fusion predicted slower is refused with the reason "cost model predicts fused X cycles >
unfused Y cycles on T" unless `force` (every fused kernel's space holds its unfused chain's own
schedule, so that only happens where the fused op cannot run that schedule for less). For
static shapes the chosen tiling goes onto the fused node as `tile_<field>` attributes. With
symbolic dims no tiling is stored: the kernel computes it at run time from the actual shapes
through the same search (`Kernel.run` -> `host_tiling`), so the decision must hold at every
size: symbolic dims named in `dims` take that size, the others each size of
`symbolic_range` (default 1, 16, 256, 4096) in turn, the fusion is refused if it is slower at
any of them, and the reason says over which range it was decided (the prediction reported is
the one at `symbolic_size`).

Both sides are searched with `search.best` (exact branch and bound, memoized per process by
op, inputs, attributes and target: each distinct problem is searched once per run), and both
are kept in the tuning cache (`fuser.tuning_cache`) keyed by op, shapes, dtype, attributes,
target and fuser version: the fused op's chosen tiling and cycles, and each unfused node's
cycles by its signature. A second run reuses them without searching.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from .decide import Decision
from .graph import GraphIndex
from .pattern import Match
from .report import Prediction
from .tuning_cache import CacheKey, TuningCache

#: Size given to a symbolic (or unknown) dim when pricing a match with symbolic shapes.
SYMBOLIC_SIZE = 256
#: Sizes a symbolic dim takes in turn: a decision at symbolic shapes must hold at each.
SYMBOLIC_RANGE = (1, 16, 256, 4096)

#: Ops that only reinterpret a tensor (no data movement on the NPU): priced at zero.
_FREE_OPS = frozenset(
    {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Shape", "Constant", "Size"}
)

CacheOption = bool | str | os.PathLike[str] | TuningCache | None


class UnpriceableError(Exception):
    """A node or op the cost model cannot price (unknown shape or type); the message says why."""


@dataclass(frozen=True)
class Priced:
    """The price of one side of a decision."""

    cycles: float
    tiling: Mapping[str, int] = field(default_factory=dict)
    symbolic: bool = False


@dataclass(frozen=True)
class CostModelDecider:
    """The `Decider` backed by the target's cost model (see the module docstring). The memo
    of unfused node prices is the only state: repeated layers are priced once."""

    target: str
    machine: Any  # fuser.kernels.npu.machine.Machine
    force: bool = False
    cache: TuningCache | None = None
    symbolic_size: int = SYMBOLIC_SIZE
    _memo: dict[Hashable, Any] = field(default_factory=dict, repr=False)
    #: Sizes of named symbolic dims (e.g. from `--dim`); the others range over
    #: `symbolic_range`.
    dims: Mapping[str, int] = field(default_factory=dict)
    symbolic_range: tuple[int, ...] = SYMBOLIC_RANGE

    @classmethod
    def for_target(
        cls,
        target: str,
        *,
        force: bool = False,
        cache: CacheOption = None,
        symbolic_size: int = SYMBOLIC_SIZE,
        dims: Mapping[str, int] | None = None,
    ) -> CostModelDecider:
        """The decider for `target` (a shipped name or a target JSON path).

        `cache`: None or True = the user's tuning cache, False = none, a path = that file, or
        a `TuningCache`. `dims`: sizes of named symbolic dims (`--dim`); the others are decided
        over `symbolic_range`.
        """
        from .kernels.npu.machine import load_target

        return cls(
            target,
            load_target(target),
            force,
            _open_cache(cache),
            symbolic_size,
            dims=dict(dims or {}),
        )

    # -- the decision -------------------------------------------------------------------------
    def decide(self, graph: GraphIndex, match: Match) -> Decision:
        # Same pattern, same nodes (op types and attributes), same input types and shapes:
        # same verdict. Large models repeat a layer thousands of times; decide it once. The
        # match's own signature (symbolic dims by name) is asked first: on a miss, the one
        # that prices all unnamed symbolic dims alike (`_signature`), which then answers for
        # the match's signature too.
        nodes = _node_facts(graph, match)
        exact = match.signature(graph)
        first = None if exact is None else ("decision", exact, nodes)
        known = self._memo.get(first) if first is not None else None
        if isinstance(known, Decision):
            return known
        signature = ("decision", _signature(graph, match, self.dims, nodes))
        known = self._memo.get(signature)
        if not isinstance(known, Decision):
            known = self._memo[signature] = self._decide(graph, match)
        if first is not None:
            self._memo[first] = known
        return known

    def _decide(self, graph: GraphIndex, match: Match) -> Decision:
        try:
            fused = self.price_fused(graph, match)
            unfused = self.price_unfused(graph, match)
        except UnpriceableError as e:
            # Nothing to compare: the pattern's own checks already accepted the match.
            return Decision(fuse=True, reason=f"not priced by the cost model: {e}")
        note = ""
        slower: tuple[int, Priced, Priced] | None = None
        if fused.symbolic:
            sizes = sorted({*self.symbolic_range, self.symbolic_size})
            for s in sizes:
                if slower is not None:
                    break  # the first size it is slower at decides: the rest cannot change it
                if s == self.symbolic_size:
                    f, u = fused, unfused
                else:
                    other = dataclasses.replace(self, symbolic_size=s, _memo=self._memo)
                    try:
                        f, u = other.price_fused(graph, match), other.price_unfused(graph, match)
                    except UnpriceableError:
                        continue
                if f.cycles > u.cycles and slower is None:
                    slower = (s, f, u)
            named = "".join(f", {k}={v}" for k, v in sorted(self.dims.items()))
            note = (
                f" (symbolic dims decided over sizes {sizes[0]}..{sizes[-1]} "
                f"({', '.join(map(str, sizes))}{named}), prediction at {self.symbolic_size}; "
                "tiling chosen at run time)"
            )
        prediction = Prediction(fused.cycles, unfused.cycles, dict(fused.tiling))
        if fused.cycles > unfused.cycles and slower is None:
            slower = (self.symbolic_size, fused, unfused)
        if slower is not None and not self.force:
            size, f, u = slower
            at = f" at symbolic size {size}" if fused.symbolic else ""
            return Decision(
                fuse=False,
                reason=(
                    f"cost model predicts fused {f.cycles:.0f} cycles > unfused "
                    f"{u.cycles:.0f} cycles on {self.target}{at}{note}"
                ),
                prediction=prediction,
            )
        attrs = {} if fused.symbolic else {f"tile_{k}": v for k, v in fused.tiling.items()}
        reason = f"predicted {unfused.cycles / max(fused.cycles, 1.0):.2f}x faster{note}"
        if slower is not None:
            reason = f"forced: predicted slower{note}"
        return Decision(fuse=True, reason=reason, prediction=prediction, attributes=attrs)

    # -- the fused side -----------------------------------------------------------------------
    def price_fused(self, graph: GraphIndex, match: Match) -> Priced:
        """The fused op at its best tiling (cached).

        An input whose rank shape inference lost (symbolic Reshapes upstream) is taken as
        [symbolic_size, D], D read from the op's weights (`_guess_input`)."""
        from .kernels import search as kernel_search
        from .kernels.api import KernelError
        from .kernels.registry import get_kernel

        op = match.op
        kernel = get_kernel("fuser", op.name)
        if kernel is None or kernel_search.model_for("fuser", op.name) is None:
            raise UnpriceableError(f"no kernel or cost model for {op.name}")
        attrs = {k: _plain(v) for k, v in match.attributes.items() if v is not None}
        sizes: dict[str, int] = {}
        known = _initializer_metas(match)
        metas, symbolic = self._metas(graph, match.inputs, sizes, known, guess=True)
        if op.collective_input is not None:
            metas = _stacked(metas, op.collective_input, int(attrs.get("group_size", 1)))
        # Large models repeat the same layer thousands of times: price each shape once per run
        # before paying for the cache key's digest and a SQLite lookup.
        memo_key = (
            "fused",
            op.name,
            tuple(None if m is None else (tuple(m.shape), m.dtype.name) for m in metas),
            repr(sorted(attrs.items())),
        )
        memoized = self._memo.get(memo_key)
        if isinstance(memoized, Priced):
            return Priced(memoized.cycles, dict(memoized.tiling), symbolic)
        key = self._key(op.name, metas, attrs)
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                self._memo[memo_key] = Priced(hit.predicted_cycles, dict(hit.tiling), symbolic)
                return Priced(hit.predicted_cycles, dict(hit.tiling), symbolic)
        try:
            result = kernel_search.best("fuser", op.name, metas, attrs, self.machine)
        except KernelError as e:
            raise UnpriceableError(f"{op.name}: {e}") from None
        tiling = {
            k[len("tile_") :]: v for k, v in kernel.tiling_to_attrs(result.best.tiling).items()
        }
        if self.cache is not None:
            self.cache.put(key, tiling, result.best.cycles)
        self._memo[memo_key] = Priced(result.best.cycles, dict(tiling), symbolic)
        return Priced(result.best.cycles, tiling, symbolic)

    def _key(self, op: str, metas: Sequence[Any], attrs: Mapping[str, Any]) -> CacheKey:
        shapes = tuple(None if m is None else tuple(m.shape) for m in metas)
        dtypes = ",".join(sorted({m.dtype.name for m in metas if m is not None}))
        from .kernels.search import cache_target

        return CacheKey.make(op, shapes, dtypes, cache_target(self.machine), attrs)

    # -- the unfused side ---------------------------------------------------------------------
    def price_unfused(self, graph: GraphIndex, match: Match) -> Priced:
        """The matched nodes one after the other, each its own kernel launch."""
        sizes: dict[str, int] = {}
        known = _initializer_metas(match)
        fused_inputs, _ = self._metas(graph, match.inputs, sizes, known, guess=True)
        for name, meta in zip(match.inputs, fused_inputs, strict=True):
            if name and meta is not None:
                known.setdefault(name, meta)
        total = 0.0
        symbolic = False
        for node_id in match.nodes:
            cycles, sym = self.price_node(graph, graph.node(node_id), sizes, known)
            total += cycles
            symbolic = symbolic or sym
        return Priced(total, {}, symbolic)

    def price_node(
        self,
        graph: GraphIndex,
        node: onnx.NodeProto,
        sizes: dict[str, int] | None = None,
        known: dict[str, Any] | None = None,
    ) -> tuple[float, bool]:
        """Cycles of one ONNX node on the target, and whether symbolic dims were priced.

        `known` holds metas of values the graph has no type for (filled in here with this
        node's inferred outputs, so the next node of a chain can be priced)."""
        from .kernels import search as kernel_search
        from .kernels.api import KernelError, meta_of
        from .kernels.registry import estimate, get_kernel

        if node.op_type in _FREE_OPS and node.domain in ("", "ai.onnx"):
            # Free on the NPU, but the next node of the chain needs its output's shape.
            if known is not None:
                self._propagate(graph, node, sizes or {}, known)
            return 0.0, False
        if known is not None:
            self._propagate(graph, node, sizes or {}, known)
        sizes = {} if sizes is None else sizes
        known = {} if known is None else known
        attrs = {a.name: _plain(helper.get_attribute_value(a)) for a in node.attribute}
        metas, symbolic = self._metas(graph, node.input, sizes, known)
        domain = "" if node.domain == "ai.onnx" else node.domain
        if domain == "com.microsoft" and node.op_type == "AllGather":
            metas = _stacked(metas, 0, int(attrs.get("group_size", 1)))
            shard = metas[0]
            if shard is not None and int(attrs.get("axis", 0)) < 0:
                # The kernel takes the axis normalized, as the fused op's is at fuse time.
                attrs["axis"] = int(attrs["axis"]) + len(shard.shape) - 1
        kernel = get_kernel(domain, node.op_type)
        inputs = self._with_constants(graph, node, metas) if kernel is not None else metas
        # The node's signature: op, input shapes and dtypes (and the small constants a kernel
        # reads, e.g. TopK's k: the ones its `value_inputs` names, all of them where it names
        # none), attributes. Priced once per run (a LayerNorm repeated with other weights is
        # priced once), and kept in the tuning cache across runs (a warm-cache fuse then
        # searches neither side).
        reads = kernel.value_inputs if kernel is not None else None
        consts = {
            f"input{i}": np.asarray(x).tolist()
            for i, x in enumerate(inputs)
            if isinstance(x, np.ndarray) and (reads is None or i in reads)
        }
        key = (domain, node.op_type, _freeze(metas), _freeze(attrs), _freeze(consts))
        if key in self._memo:
            return self._memo[key], symbolic
        # As `domain::op_type` (never a fused op's name), the constants among the attributes.
        stored = self._key(f"{domain or 'ai.onnx'}::{node.op_type}", metas, {**attrs, **consts})
        hit = self.cache.get(stored) if self.cache is not None and kernel is not None else None
        if hit is not None:
            self._memo[key] = hit.predicted_cycles
            return hit.predicted_cycles, symbolic
        cycles: float | None = None
        tiling: Mapping[str, int] = {}
        if kernel is not None:
            try:
                if kernel_search.model_for(domain, node.op_type) is not None:
                    found = kernel_search.best(domain, node.op_type, metas, attrs, self.machine)
                    cycles = found.best.cycles
                    tiling = kernel.tiling_to_attrs(found.best.tiling)
                elif not consts and kernel.tiling_from_attrs(attrs) is None:
                    # The run at its run-time tiling that a fused op's staged schedule times
                    # too (a LayerNormalization before the MatMuls it feeds): one run, shared.
                    # Constants it does not read (`consts` holds those it does: a LayerNorm's
                    # scale is not) go as their metas.
                    timing = [None if x is None else meta_of(x) for x in inputs]
                    cycles = kernel_search.timed_cycles(kernel, timing, attrs, self.machine)
                else:
                    run = kernel.run(self.machine, inputs, attrs, functional=False, timeline=False)
                    cycles = run.stats.cycles
            except (KernelError, ValueError, TypeError, IndexError):
                cycles = None
            if cycles is not None and self.cache is not None:
                self.cache.put(stored, {k.removeprefix("tile_"): v for k, v in tiling.items()},
                               float(cycles))  # fmt: skip
        if cycles is None:
            outs, sym_out = self._metas(graph, node.output, sizes, known)
            symbolic = symbolic or sym_out
            ins = [m for m in metas if m is not None]
            if not ins and not any(o is not None for o in outs):
                raise UnpriceableError(f"{node.op_type} {node.name!r}: no shapes known")
            cycles = estimate(node.op_type, metas, outs, self.machine).cycles
        assert isinstance(cycles, float | int)
        self._memo[key] = float(cycles)
        return float(cycles), symbolic

    def _with_constants(
        self, graph: GraphIndex, node: onnx.NodeProto, metas: Sequence[Any]
    ) -> list[Any]:
        """Inputs for a timing-only run: metas, but small constants as arrays (TopK's k, axes
        given as inputs: kernels read their values). A value whose inferred shape has a
        symbolic dim is computed at run time (as `patterns._walk.operand_const` judges), and
        is not looked up: it is small here only because its symbolic dims are priced small,
        and the first such question on a graph makes `graph.constant` sweep all of it."""
        out: list[Any] = []
        for name, meta in zip(node.input, metas, strict=False):
            value = None
            if name and meta is not None and meta.size <= 64:
                shape = graph.shape(name)
                if shape is None or _static(shape):
                    value = graph.constant(name)
            out.append(value if value is not None else meta)
        return out

    def _metas(
        self,
        graph: GraphIndex,
        names: Sequence[str],
        sizes: dict[str, int],
        known: Mapping[str, Any] | None = None,
        guess: bool = False,
    ) -> tuple[list[Any], bool]:
        """`TensorMeta`s of values (None for "" = absent); symbolic dims take `symbolic_size`
        (the same size for the same dim name). `known` metas come first. With `guess`, an
        input of unknown rank is left None for `_guess_input`; otherwise `UnpriceableError`."""
        from .kernels.api import TensorMeta

        metas: list[Any] = []
        symbolic = False
        unknown: list[int] = []
        for name in names:
            if not name:
                metas.append(None)
                continue
            if known is not None and name in known:
                metas.append(known[name])
                continue
            shape = graph.shape(name)
            elem = graph.elem_type(name)
            if shape is None or elem is None or elem == 0:
                if guess and elem:
                    unknown.append(len(metas))
                    metas.append(TensorMeta((), helper.tensor_dtype_to_np_dtype(elem)))
                    continue
                raise UnpriceableError(f"value {name!r} has no known type or rank")
            dims = []
            for d in shape:
                if isinstance(d, int) and d >= 0:
                    dims.append(d)
                else:
                    symbolic = True
                    size = self.dims.get(str(d), self.symbolic_size)
                    dims.append(sizes.setdefault(str(d), size))
            try:
                dtype = helper.tensor_dtype_to_np_dtype(elem)
            except (KeyError, ValueError) as e:
                raise UnpriceableError(f"value {name!r}: element type {elem}: {e}") from None
            metas.append(TensorMeta(tuple(dims), dtype))
        for i in unknown:
            metas[i] = _guess_input(metas, i, self.symbolic_size)
            if metas[i] is None:
                raise UnpriceableError(f"value {names[i]!r} has no known rank")
            symbolic = True
        return metas, symbolic

    def _propagate(
        self, graph: GraphIndex, node: onnx.NodeProto, sizes: dict[str, int], known: dict[str, Any]
    ) -> None:
        """Metas of this node's outputs the graph has no shape for, from its kernel's `infer`
        (or, without a kernel, its largest input's: elementwise ops keep the shape)."""
        from .kernels.api import KernelError
        from .kernels.registry import get_kernel

        # Views are recomputed whenever the graph's shape is not fully static (it often lost
        # their leading dims); other ops only when the graph has no shape at all.
        view = node.op_type in ("Reshape", "Flatten")
        missing = [
            o
            for o in node.output
            if o
            and o not in known
            and (graph.shape(o) is None or (view and not _static(graph.shape(o))))
        ]
        if not missing:
            return
        try:
            ins, _ = self._metas(graph, node.input, sizes, known)
        except UnpriceableError:
            return
        if node.op_type in ("Reshape", "Flatten") and ins and ins[0] is not None:
            # The graph often lost the leading dims here (Reshape to [-1, D]); pricing them as
            # a symbolic size would disagree with the chain's other nodes. Compute them.
            view = _view_meta(graph, node, ins[0])
            if view is not None:
                known[node.output[0]] = view
                return
        attrs = {a.name: _plain(helper.get_attribute_value(a)) for a in node.attribute}
        if node.domain == "com.microsoft" and node.op_type == "AllGather":
            # Its kernel infers from the stacked shards (as `price_node` passes them); an
            # AllGather output without value_info (onnx has no schema) is then the gathered
            # shape, not the shard's.
            ins = _stacked(ins, 0, int(attrs.get("group_size", 1)))
            if ins[0] is not None and int(attrs.get("axis", 0)) < 0:
                attrs["axis"] = int(attrs["axis"]) + len(ins[0].shape) - 1
        kernel = get_kernel("" if node.domain == "ai.onnx" else node.domain, node.op_type)
        outs: list[Any] = []
        if kernel is not None:
            try:
                outs = list(kernel.infer(self._with_constants(graph, node, ins), attrs))
            except (KernelError, ValueError, TypeError, IndexError):
                outs = []
        if not outs:
            present = [m for m in ins if m is not None]
            if not present:
                return
            outs = [max(present, key=lambda m: m.size)] * len(node.output)
        for name, meta in zip(node.output, outs, strict=False):
            if name in missing:
                known[name] = meta


def _initializer_metas(match: Match) -> dict[str, Any]:
    """Metas of the initializers a match creates (folded weights): not in the graph yet."""
    from .kernels.api import TensorMeta

    return {
        t.name: TensorMeta(tuple(t.dims), helper.tensor_dtype_to_np_dtype(t.data_type))
        for t in match.new_initializers
    }


def _guess_input(metas: list[Any], i: int, size: int) -> Any:
    """An input of unknown rank as [size, D]: D from the first 2-D weight [D, N] after it
    (LayerNormMatMul's W, AllGatherMatMul's W) or a 1-D parameter [D] (LayerNorm's scale)."""
    from .kernels.api import TensorMeta

    m = metas[i]
    for other in metas[i + 1 :]:
        if other is not None and len(other.shape) == 2:
            return TensorMeta((size, other.shape[0]), m.dtype)
    for other in metas[i + 1 :]:
        if other is not None and len(other.shape) == 1:
            return TensorMeta((size, other.shape[0]), m.dtype)
    return None


def _stacked(metas: list[Any], index: int, group_size: int) -> list[Any]:
    """Kernels of gathering ops take every rank's shard stacked on a new leading axis."""
    from .kernels.api import TensorMeta

    out = list(metas)
    m = out[index]
    if m is not None:
        out[index] = TensorMeta((max(1, group_size), *m.shape), m.dtype)
    return out


def _open_cache(cache: CacheOption) -> TuningCache | None:
    if cache is False:
        return None
    if isinstance(cache, TuningCache):
        return cache
    if cache is None or cache is True:
        return TuningCache()
    return TuningCache(cache)


def _plain(value: Any) -> Any:
    """Attribute values as kernels take them: str for bytes, lists of Python numbers."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _freeze(value: Any) -> Hashable:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return (tuple(value.shape), str(value.dtype))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _node_facts(graph: GraphIndex, match: Match) -> tuple[Hashable, ...]:
    """What the unfused side's price reads of the matched nodes: op types and attributes.

    Per node (op type, domain, each attribute's serialization...): a flat tuple, and the
    attributes serialized only where there are any (a key is made per match)."""
    serialize = onnx.AttributeProto.SerializeToString
    nodes = graph.nodes  # graph.node, inline
    facts: list[Hashable] = []
    for node_id in match.nodes:
        n = nodes[node_id]
        attributes = n.attribute
        if attributes:
            facts.append((n.op_type, n.domain, *map(serialize, attributes)))
        else:
            facts.append((n.op_type, n.domain))
    return tuple(facts)


def _signature(
    graph: GraphIndex, match: Match, dims: Mapping[str, int], nodes: tuple[Hashable, ...]
) -> Hashable:
    """What a decision depends on: pattern, matched nodes and their attributes (`nodes`), the
    fused node's attributes, and each input's element type and shape (`Match.input_facts`).

    Symbolic dims are all priced at one representative size, whatever their names (shape
    inference invents a fresh `unk__N` per value): they sign alike, as "?", unless `dims`
    names them (`--dim`), which gives them a size of their own: ("?", size)."""
    inputs: list[Hashable] = []
    for fact in match.input_facts(graph):
        if fact and fact[1] is not None and not all(type(d) is int and d >= 0 for d in fact[1]):
            shape = tuple(
                d
                if isinstance(d, int) and d >= 0
                else ("?" if (size := dims.get(str(d))) is None else ("?", size))
                for d in fact[1]
            )
            fact = (fact[0], shape, *fact[2:])
        inputs.append(fact)
    attributes = match.attributes_key  # shared with the body check: made once per match
    if attributes is None:
        attributes = repr(sorted(match.attributes.items()))
    return (match.pattern, nodes, attributes, tuple(inputs))


def _static(shape: Any) -> bool:
    return shape is not None and all(isinstance(d, int) for d in shape)


def _view_meta(graph: GraphIndex, node: onnx.NodeProto, source: Any) -> Any:
    """The output meta of a Reshape (constant target shape) or Flatten of a known input."""
    from .kernels.api import TensorMeta

    dims = list(source.shape)
    total = int(np.prod(dims)) if dims else 1
    if node.op_type == "Flatten":
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        axis = axis + len(dims) if axis < 0 else axis
        lead = int(np.prod(dims[:axis])) if axis else 1
        return TensorMeta((lead, total // max(lead, 1)), source.dtype)
    target = graph.constant(node.input[1]) if len(node.input) > 1 else None
    if target is None:
        return None
    allowzero = next((a.i for a in node.attribute if a.name == "allowzero"), 0)
    out = [
        dims[i] if (d == 0 and not allowzero and i < len(dims)) else int(d)
        for i, d in enumerate(target.tolist())
    ]
    if out.count(-1) == 1:
        rest = int(np.prod([d for d in out if d != -1])) or 1
        out[out.index(-1)] = total // rest
    if -1 in out or int(np.prod(out)) != total:
        return None
    return TensorMeta(tuple(out), source.dtype)
