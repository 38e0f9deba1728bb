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

Search: exhaustive when the space holds at most `EXHAUSTIVE_LIMIT` tilings (the spaces are
already pruned at construction to aligned sizes and deduplicated by what the kernel would run,
so most shapes stay under it). Beyond it, a two-level search: first every distinct tile shape
priced once (its first variant), then every variant (buffering, cores) of the best `BEAM`
shapes. Pricing a tiling takes tens to hundreds of microseconds, so a search takes well under
a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._cost_base import CostModel
from .api import Kernel, TensorMeta, Tiling, TilingError
from .npu.machine import Machine
from .registry import all_models, get_kernel

#: Bumped when a cost model or the simulated machine changes what a tiling costs, so that
#: tuning-cache entries priced by an older model are not reused (`cache_target`).
MODEL_REVISION = 7

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
    """The cost model of (domain, op_type), or None."""
    return models().get(("" if domain == "ai.onnx" else domain, op_type))


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


def search(
    domain: str,
    op_type: str,
    metas: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    machine: Machine,
) -> SearchResult:
    """Price the tiling space of the op's kernel; `TilingError` if nothing fits."""
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
    for t in extra:
        if t is None or t in space or kernel is None:
            continue
        try:
            kernel.check_tiling(metas, attrs, t, machine)
        except TilingError:
            continue
        space.append(t)
    if not space:
        raise TilingError(f"{op_type}: no tiling fits {machine.name}")
    exhaustive = len(space) <= EXHAUSTIVE_LIMIT
    if exhaustive:
        priced = [Priced(t, model.cost(metas, attrs, t, machine)) for t in space]
    else:
        priced = _beam(model, space, metas, attrs, machine)
    priced.sort(key=lambda p: p.cycles)
    # Near-ties (within TIE of the best, below the model's error) go to the biggest tiles:
    # fewer instructions to issue, and fewer numpy calls in a functional simulation.
    limit = priced[0].cycles * (1 + TIE)
    near = [p for p in priced if p.cycles <= limit]
    if len(near) > 1:
        top = max(near, key=lambda p: (_volume(p.tiling), -p.cycles))
        priced.remove(top)
        priced.insert(0, top)
    return SearchResult(
        priced[0], priced[1] if len(priced) > 1 else None, tuple(priced), len(space), exhaustive
    )


def _shape_key(t: Tiling) -> Hashable:
    return tuple(
        getattr(t, f.name)
        for f in dataclasses.fields(t)
        if f.name not in FLAGS or f.name == "a_resident"
    )


def _beam(
    model: CostModel,
    space: list[Tiling],
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
    key = (
        kernel.domain,
        kernel.op_type,
        tuple(None if m is None else (m.shape, m.dtype.str) for m in metas),
        _freeze(dict(attrs)),
        machine,
    )
    try:
        return _host_tiling_cached(key, tuple(metas), machine)
    except TypeError:  # an unhashable attribute: search without the memo
        return search(kernel.domain, kernel.op_type, metas, attrs, machine).best.tiling


_MEMO: dict[Hashable, Tiling] = {}


def _host_tiling_cached(
    key: tuple[Any, ...], metas: tuple[TensorMeta | None, ...], machine: Machine
) -> Tiling:
    hash(key)
    hit = _MEMO.get(key)
    if hit is None:
        domain, op_type, _, frozen, _ = key
        attrs = dict(frozen)
        hit = search(domain, op_type, metas, _thaw(attrs), machine).best.tiling
        if len(_MEMO) > 4096:
            _MEMO.clear()
        _MEMO[key] = hit
    return hit


class Searched:
    """Mixin of fused kernels: without `tile_*` attributes (symbolic shapes at fuse time), the
    run-time tiling is the search's pick by the cost model `fuse` uses."""

    def host_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Tiling:
        """The search's best tiling for these inputs (see `host_tiling`)."""
        assert isinstance(self, Kernel)
        return host_tiling(self, inputs_meta, attrs, machine)


def _thaw(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()}


def cache_target(machine: Machine) -> str:
    """The target as a tuning-cache key: its name, a digest of its numbers, the model revision."""
    return f"{machine.name}@{machine.fingerprint}/r{MODEL_REVISION}"


def roofline_floor(flops: float, gm_bytes: float, machine: Machine, dtype: np.dtype) -> float:
    """Cycles no tiling can beat: max(Cube FLOPs / peak, compulsory GM bytes / HBM bandwidth)."""
    k0 = machine.cube_k_block(dtype)
    peak = 2 * machine.cube_m * machine.cube_n * k0 * machine.cube_cores  # FLOPs per cycle
    return max(flops / peak, gm_bytes / machine.hbm_bytes_per_cycle) if peak else math.inf
