"""The tiling search: cost models by op type, the search over a kernel's tiling space, and the
host-side tiling kernels use at run time when a node carries no tiling.

    >>> from fuser.kernels.api import TensorMeta
    >>> from fuser.kernels.npu.machine import load_target
    >>> import numpy as np
    >>> a, b = TensorMeta((512, 768), np.float16), TensorMeta((768, 768), np.float16)
    >>> r = search("", "MatMul", [a, b], {}, load_target("ascend910b"))
    >>> r.best.cycles <= r.runner_up.cycles
    True

The space is the model's, plus the kernel's own default tiling and the articles' rule of thumb
when they fit (so the search never prefers a tiling the model rates below either). The best is
the cheapest by the model, except that candidates within `TIE` (1%) of it count
as tied and the one with the biggest tiles wins.

Two searches share that space and ranking (`candidate_space`, `ranked`):

- `best`, what decisions run (`fuse`, a staged schedule's stages, a kernel's run-time tiling):
  exact branch and bound. A cost model that bounds a whole space at once (`Bounded`: numpy
  over the space's fields, e.g. Conv's and MatMul's Cube, MTE1, copy and FixPipe work) has its
  tilings priced in the order of their lower bounds until the next bound is above the
  `keep`-th cheapest price, then, of the tilings whose bound is within `TIE` of the cheapest,
  the biggest: the pick and the first `keep` of the ranking are those of pricing every
  tiling, from a few priced tilings of thousands. A model without a bound (or whose tiling
  gained a field its bound does not name) is priced as `search` prices it. Memoized per
  process by (op, inputs, attributes, target).
- `search`, the whole ranking (`fuser tune`, the accuracy benchmark): every tiling priced when
  the space holds at most `EXHAUSTIVE_LIMIT`; beyond it a two-level beam (every distinct tile
  shape priced once by its first variant, then every variant of the best `BEAM` shapes).

Pricing a tiling takes tens of microseconds. The big spaces (Conv's and MatMul's, tens of
thousands of candidates; LayerNormMatMul's, RmsNormMatMul's and AllGatherMatMul's, thousands)
are built as numpy columns (`TilingColumns`), filtered by the kernels' fit rules over columns,
bounded over the same columns, and a `Tiling` is made only for a row the search reads (the
few it prices): a decision takes a few milliseconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ._columns import TilingColumns
from ._cost_base import CostModel
from .api import Kernel, KernelError, TensorMeta, Tiling, TilingError
from .npu.machine import Machine
from .registry import all_models, get_kernel, get_model

#: Bumped when a cost model or the simulated machine changes what a tiling costs, so that
#: tuning-cache entries priced by an older model are not reused (`cache_target`).
MODEL_REVISION = 9  # 9: split-K MatMul/Gemm bound fixed (best could prune the true pick)

EXHAUSTIVE_LIMIT = 4096
#: Tiling fields that are switches or core counts rather than tile sizes.
FLAGS = frozenset({"double_buffer", "db_l1", "db_l0", "db_l0c", "cores", "a_resident"})
BEAM = 32
TIE = 0.01


def _volume(t: Tiling) -> int:
    """Product of a tiling's size fields (everything but flags and core counts)."""
    v = 1
    for f in dataclasses.fields(t):
        if f.name not in FLAGS:
            v *= max(1, int(getattr(t, f.name)))
    return v


def models() -> Mapping[tuple[str, str], CostModel]:
    """Every cost model keyed by (domain, op_type) (each kernel package's `MODELS`)."""
    return all_models()


def model_for(domain: str, op_type: str) -> CostModel | None:
    """The cost model of (domain, op_type), or None (importing only its module)."""
    return get_model(domain, op_type)


@dataclass(frozen=True)
class Priced:
    """A tiling and its predicted cycles."""

    tiling: Tiling
    cycles: float


@dataclass(frozen=True)
class SearchResult:
    """The best tiling, the runner-up, and every candidate priced (cheapest first)."""

    best: Priced
    runner_up: Priced | None
    candidates: tuple[Priced, ...]
    space_size: int
    exhaustive: bool


def candidate_space(
    domain: str,
    op_type: str,
    metas: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    machine: Machine,
) -> tuple[CostModel, Sequence[Tiling]]:
    """The op's cost model and the tilings both searches rank: the model's space plus the
    kernel's own default and the articles' rule of thumb where they fit; `TilingError` if the
    op has no model or nothing fits. A list, or numpy columns (`TilingColumns`) where the
    model builds its space so: tilings are then made only where read."""
    model = model_for(domain, op_type)
    if model is None:
        raise TilingError(f"{op_type}: no cost model")
    space = model.space(metas, attrs, machine)
    # The kernel's own default and the articles' rule of thumb are candidates too (when they
    # fit): the search then never prefers a tiling the model rates below either.
    kernel = get_kernel(model.domain, model.op_type)
    extra: list[Tiling | None] = [model.rule_of_thumb(metas, attrs, machine)]
    if kernel is not None:
        with contextlib.suppress(TilingError):
            extra.append(kernel.default_tiling(metas, attrs, machine))
    added: list[Tiling] = []
    for t in extra:
        if t is None or t in added or t in space or kernel is None:
            continue
        try:
            kernel.check_tiling(metas, attrs, t, machine)
        except TilingError:
            continue
        added.append(t)
    if added:  # appended at once (columns are copied on each append)
        space = space.extended(added) if isinstance(space, TilingColumns) else [*space, *added]
    if not space:
        raise TilingError(f"{op_type}: no tiling fits {machine.name}")
    return model, space


def ranked(priced: Sequence[Priced]) -> list[Priced]:
    """Candidates cheapest first (equal cycles in the order given), except that near-ties
    (within `TIE` of the cheapest, below the model's error) go to the biggest tiles: fewer
    instructions to issue, and fewer numpy calls in a functional simulation."""
    out = sorted(priced, key=lambda p: p.cycles)
    limit = out[0].cycles * (1 + TIE)
    near = [p for p in out if p.cycles <= limit]
    if len(near) > 1:
        top = max(near, key=lambda p: (_volume(p.tiling), -p.cycles))
        out.remove(top)
        out.insert(0, top)
    return out


def search(
    domain: str,
    op_type: str,
    metas: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    machine: Machine,
) -> SearchResult:
    """Price the tiling space of the op's kernel, every tiling of it (up to `EXHAUSTIVE_LIMIT`,
    else the two-level beam): the whole ranking, for `fuser tune` and the accuracy benchmark.
    Decisions take `best` (the same pick, pricing only what can win). `TilingError` if
    nothing fits."""
    model, space = candidate_space(domain, op_type, metas, attrs, machine)
    priced, exhaustive = _price_all(model, space, metas, attrs, machine)
    out = ranked(priced)
    return SearchResult(
        out[0], out[1] if len(out) > 1 else None, tuple(out), len(space), exhaustive
    )


def _price_all(
    model: CostModel,
    space: Sequence[Tiling],
    metas: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    machine: Machine,
) -> tuple[list[Priced], bool]:
    """Every tiling priced (up to `EXHAUSTIVE_LIMIT`, else the beam), and whether every one was."""
    if len(space) <= EXHAUSTIVE_LIMIT:
        return [Priced(t, model.cost(metas, attrs, t, machine)) for t in space], True
    return _beam(model, space, metas, attrs, machine), False


@runtime_checkable
class Bounded(Protocol):
    """A cost model that can bound a whole space at once (optional, see `best`).

    `lower_bounds` returns, for each tiling, cycles its `cost` never goes below (vectorized
    over the space: one numpy pass instead of one Python call per tiling). It covers the
    tiling fields named in `bound_fields`: a tiling type with other fields (one a kernel gained
    later) is searched without the bound, so a stale bound can never prune a tiling it does
    not understand."""

    bound_fields: frozenset[str]

    def lower_bounds(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tilings: Sequence[Tiling],
        machine: Machine,
    ) -> np.ndarray: ...


#: Relative slack on a lower bound: a bound computed in another order of floating-point
#: operations may exceed the exact cost by a few ulps.
BOUND_SLACK = 1e-9


def bound_of(model: CostModel, space: Sequence[Tiling]) -> Bounded | None:
    """`model` as a `Bounded` when its bound covers every field of the space's tilings."""
    if not isinstance(model, Bounded) or not space:
        return None
    if isinstance(space, TilingColumns):
        names = set(space.columns)
    else:
        names = {f.name for kind in {type(t) for t in space} for f in dataclasses.fields(kind)}
    return model if names == set(model.bound_fields) else None


def best(
    domain: str,
    op_type: str,
    metas: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    machine: Machine,
    keep: int = 2,
) -> SearchResult:
    """The search decisions run: the same best tiling (and the same first `keep` of the
    ranking) as pricing the whole space, in milliseconds. Memoized per process by (op, input
    shapes and dtypes, attributes, target): a model repeats its layers, and a fused op's staged
    schedule prices the very nodes the unfused side prices.

    Exact branch and bound: where the model bounds the space (`Bounded`), tilings are priced
    in the order of their lower bounds until the next bound exceeds the `keep`-th cheapest
    price (no tiling left is among the `keep` cheapest), then the near ties' candidates
    (bound within `TIE` of the cheapest price) biggest first, until the biggest true near
    tie is known (no tiling left could be the winner `ranked` moves to the front). Without a
    bound every tiling is priced (`search`). `candidates` holds the tilings priced, ranked as
    `search` ranks them (equal cycles in space order)."""
    key = _memo_key(domain, op_type, metas, attrs, machine, keep)
    hit = _BEST.get(key) if key is not None else None
    if hit is not None:
        return hit
    model, space = candidate_space(domain, op_type, metas, attrs, machine)
    bounded = bound_of(model, space)
    exhaustive = True
    if bounded is None:
        priced, exhaustive = _price_all(model, space, metas, attrs, machine)
    else:
        lower = np.asarray(bounded.lower_bounds(metas, attrs, space, machine), dtype=float)
        priced = _branch_and_bound(model, space, lower * (1 - BOUND_SLACK), metas, attrs,
                                   machine, max(1, keep))  # fmt: skip
    out = ranked(priced)
    runner_up = out[1] if len(out) > 1 else None
    result = SearchResult(out[0], runner_up, tuple(out), len(space), exhaustive)
    if key is not None:
        if len(_BEST) > 4096:
            _BEST.clear()
        _BEST[key] = result
    return result


def _branch_and_bound(
    model: CostModel,
    space: Sequence[Tiling],
    lower: np.ndarray,
    metas: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    machine: Machine,
    keep: int,
) -> list[Priced]:
    """The tilings `ranked` needs priced, in space order: the `keep` cheapest (in the order of
    their bounds, until the next bound exceeds the `keep`-th price), then of the tilings whose
    bound is within `TIE` of the cheapest price, the biggest ones (by `_volume`, largest
    first, a whole volume at a time) until one is found truly within `TIE`: no tiling left
    could be the near-tie winner or in the first `keep`."""
    found: dict[int, float] = {}  # index in the space -> cycles
    cheapest: list[float] = []  # the `keep` lowest prices so far, ascending
    for i in _ascending(lower):
        if len(cheapest) >= keep and lower[i] > cheapest[-1]:
            break  # the bounds ascend: nothing left is among the `keep` cheapest
        c = model.cost(metas, attrs, space[i], machine)
        found[i] = c
        if len(cheapest) < keep or c < cheapest[-1]:
            cheapest.append(c)
            cheapest.sort()
            del cheapest[keep:]
    limit = cheapest[0] * (1 + TIE)
    near = np.flatnonzero(lower <= limit)
    volume = volumes(space, near)
    biggest = max((volume[j] for j, i in enumerate(near.tolist())
                   if i in found and found[i] <= limit), default=0)  # fmt: skip
    by_volume = np.argsort(-volume, kind="stable")
    j = 0
    while j < len(by_volume):
        v = volume[by_volume[j]]
        if v < biggest:
            break  # smaller than a true near tie: never the winner
        while j < len(by_volume) and volume[by_volume[j]] == v:
            i = int(near[by_volume[j]])
            if i not in found:
                found[i] = model.cost(metas, attrs, space[i], machine)
            if found[i] <= limit:
                biggest = max(biggest, int(v))
            j += 1
    # Space order within equal cycles, as `search` ranks them.
    return [Priced(space[i], found[i]) for i in sorted(found)]


def _ascending(lower: np.ndarray) -> Iterator[int]:
    """Indices by ascending bound, ties in space order (a stable sort), sorting the few lowest
    bounds first: the walk rarely goes past them, and a space holds tens of thousands."""
    low = np.flatnonzero(lower <= lower.min() * 1.05)
    yield from low[np.argsort(lower[low], kind="stable")].tolist()
    rest = np.flatnonzero(lower > lower.min() * 1.05)
    yield from rest[np.argsort(lower[rest], kind="stable")].tolist()


def volumes(space: Sequence[Tiling], rows: np.ndarray) -> np.ndarray:
    """`_volume` of the given rows of a space (numpy over the columns of a `TilingColumns`)."""
    if isinstance(space, TilingColumns):
        v = np.ones(len(rows), dtype=np.int64)
        for name, c in space.columns.items():
            if name not in FLAGS:
                v *= np.maximum(1, c[rows])
        return v
    return np.array([_volume(space[i]) for i in rows.tolist()], dtype=np.int64)


_BEST: dict[Hashable, SearchResult] = {}
_TIMED: dict[Hashable, float] = {}


def clear_memo() -> None:
    """Forget the memoized searches and timing runs (benchmarks time a cold search)."""
    _BEST.clear()
    _TIMED.clear()


def timed_cycles(
    kernel: Kernel,
    metas: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    machine: Machine,
) -> float:
    """Cycles of a timing-only run of `kernel` at its run-time tiling (`host_tiling`): how a
    staged schedule prices a stage whose op has no cost model. Memoized per process as `best`
    is: the same stage recurs in every decision whose chain holds it (a LayerNorm of one width
    before MatMuls of many), at each symbolic size, and in every priced staged candidate."""
    key = _timed_key(kernel, metas, attrs, machine)
    hit = _TIMED.get(key) if key is not None else None
    if hit is not None:
        return hit
    tiling = host_tiling(kernel, metas, attrs, machine)
    run = kernel.run(machine, metas, attrs, tiling=tiling, functional=False, timeline=False)
    cycles = run.stats.cycles
    if key is not None:
        if len(_TIMED) > 4096:
            _TIMED.clear()
        _TIMED[key] = cycles
    return cycles


def _timed_key(
    kernel: Kernel,
    metas: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    machine: Machine,
) -> Hashable | None:
    """The memo key of a timing run: the kernel's `timing_key` where it has one (a key that
    cannot be made leaves the run to raise its own error), else that of `best`."""
    try:
        problem = kernel.timing_key(metas, attrs)
    except (KernelError, ValueError, TypeError, IndexError):
        problem = None
    if problem is None:
        return _memo_key(kernel.domain, kernel.op_type, metas, attrs, machine, 0)
    key = ("timing", kernel.domain, kernel.op_type, problem, cache_target(machine))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _memo_key(
    domain: str,
    op_type: str,
    metas: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    machine: Machine,
    keep: int,
) -> Hashable | None:
    """What a search depends on, hashable; None for an unhashable attribute (no memo)."""
    key = (
        "" if domain == "ai.onnx" else domain,
        op_type,
        tuple(None if m is None else (tuple(m.shape), m.dtype.str) for m in metas),
        _freeze(dict(attrs)),
        # the target by its numbers: `Machine` equality leaves out `vector_ops`, so two targets
        # that differ only in their vector costs would share each other's results
        cache_target(machine),
        keep,
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _shape_key(t: Tiling) -> Hashable:
    return tuple(
        getattr(t, f.name)
        for f in dataclasses.fields(t)
        if f.name not in FLAGS or f.name == "a_resident"
    )


def _beam(
    model: CostModel,
    space: Sequence[Tiling],
    metas: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    machine: Machine,
) -> list[Priced]:
    groups: dict[Hashable, list[Tiling]] = {}
    for t in space:
        groups.setdefault(_shape_key(t), []).append(t)
    heads = [Priced(g[0], model.cost(metas, attrs, g[0], machine)) for g in groups.values()]
    heads.sort(key=lambda p: p.cycles)
    # Every priced head stays a candidate (e.g. a fused op's staged schedule, a shape of its
    # own); the best BEAM shapes add their other variants.
    out: list[Priced] = list(heads)
    for h in heads[:BEAM]:
        out.extend(
            Priced(t, model.cost(metas, attrs, t, machine))
            for t in groups[_shape_key(h.tiling)][1:]
        )
    return out


def _freeze(value: Any) -> Hashable:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, np.ndarray):
        return tuple(value.tolist())
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def host_tiling(
    kernel: Kernel,
    metas: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    machine: Machine,
) -> Tiling:
    """The run-time tiling of a node without `tile_*` attributes: the search's best where the
    op has a cost model (the same model `fuse` uses), else the kernel's `default_tiling`."""
    if model_for(kernel.domain, kernel.op_type) is None:
        return kernel.default_tiling(metas, attrs, machine)
    return best(kernel.domain, kernel.op_type, metas, attrs, machine).best.tiling


class Searched:
    """Mixin of fused kernels: without `tile_*` attributes (symbolic shapes at fuse time), the
    run-time tiling is the search's pick by the cost model `fuse` uses."""

    def host_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Tiling:
        """The search's best tiling for these inputs (see `host_tiling`)."""
        assert isinstance(self, Kernel)
        return host_tiling(self, inputs_meta, attrs, machine)


def cache_target(machine: Machine) -> str:
    """The target as a tuning-cache key: its name, a digest of its numbers, the model revision.

    Made once per machine object (by identity: equal machines may still differ in a field that
    takes no part in equality): the digest hashes the machine's repr, about 0.14 ms, and every
    priced node and fused op makes a cache key."""
    known = _CACHE_TARGETS.get(id(machine))
    if known is not None and known[0] is machine:
        return known[1]
    key = f"{machine.name}@{machine.fingerprint}/r{MODEL_REVISION}"
    if len(_CACHE_TARGETS) > 64:
        _CACHE_TARGETS.clear()
    _CACHE_TARGETS[id(machine)] = (machine, key)  # the machine is kept: its id is not reused
    return key


_CACHE_TARGETS: dict[int, tuple[Machine, str]] = {}


def roofline_floor(flops: float, gm_bytes: float, machine: Machine, dtype: np.dtype) -> float:
    """Cycles no tiling can beat: max(Cube FLOPs / peak, compulsory GM bytes / HBM bandwidth)."""
    k0 = machine.cube_k_block(dtype)
    peak = 2 * machine.cube_m * machine.cube_n * k0 * machine.cube_cores  # FLOPs per cycle
    return max(flops / peak, gm_bytes / machine.hbm_bytes_per_cycle) if peak else math.inf
