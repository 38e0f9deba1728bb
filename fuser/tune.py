"""`fuser tune`: the tiling search of each fused node, ranked, optionally checked on the simulator.

For every fused node of a model (or one op given by type and shapes), the cost model prices
the kernel's whole tiling space (`fuser.kernels.search.search`). With `simulate`, the best `top`
candidates by the model (and the kernel's default tiling) also run on the event-level simulator
in timing-only mode, which gives the Spearman rank correlation of predicted and simulated
cycles and the regret of the model's pick (`sim(pick) / min sim - 1`). The simulator's best is
then what the tuning cache keeps for `fuse` (source "simulated"); without `simulate` the
model's pick is kept.

Symbolic dims are priced at `symbolic_size` (as `fuse` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from .costmodel import SYMBOLIC_SIZE, _guess_input, _plain
from .tuning_cache import CacheKey, TuningCache

#: Called as progress(done, total, label) while simulating.
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Candidate:
    """One tiling: its fields (without the `tile_` prefix) and its cycles."""

    tiling: Mapping[str, int]
    predicted_cycles: float
    simulated_cycles: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "tiling": dict(self.tiling),
            "predicted_cycles": self.predicted_cycles,
            "simulated_cycles": self.simulated_cycles,
        }


@dataclass(frozen=True)
class NodeTuning:
    """The search for one node: the chosen tiling, the ranked candidates, model quality."""

    name: str
    op: str
    shapes: tuple[tuple[int, ...] | None, ...]
    chosen: Mapping[str, int]
    candidates: tuple[Candidate, ...]
    space_size: int
    exhaustive: bool
    spearman: float | None = None
    regret: float | None = None
    default: Candidate | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "shapes": [list(s) if s is not None else None for s in self.shapes],
            "chosen": dict(self.chosen),
            "candidates": [c.to_dict() for c in self.candidates],
            "spearman": self.spearman,
            "regret": self.regret,
            "space_size": self.space_size,
            "exhaustive": self.exhaustive,
            "default": None if self.default is None else self.default.to_dict(),
        }


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties); None for fewer than 3 points or a
    constant side."""
    if len(a) < 3:
        return None
    ra, rb = _ranks(a), _ranks(b)
    if np.std(ra) == 0 or np.std(rb) == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: Sequence[float]) -> np.ndarray:
    arr = np.asarray(x, dtype=float)
    order = np.argsort(arr, kind="stable")
    ranks = np.empty(len(arr))
    i = 0
    while i < len(arr):
        j = i
        while j + 1 < len(arr) and arr[order[j + 1]] == arr[order[i]]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2
        i = j + 1
    return ranks


def tune_op(
    op_type: str,
    metas: Sequence[Any],
    attrs: Mapping[str, Any],
    machine: Any,
    *,
    name: str = "",
    domain: str = "fuser",
    simulate: bool = False,
    top: int = 20,
    cache: TuningCache | None = None,
    progress: Progress | None = None,
) -> NodeTuning:
    """Search one op's tilings; with `simulate` run the `top` best (and the default)."""
    from .kernels import search as kernel_search
    from .kernels.registry import get_kernel

    kernel = get_kernel(domain, op_type)
    if kernel is None:
        raise ValueError(f"no kernel for {domain}:{op_type}")
    attrs = {k: v for k, v in attrs.items() if not k.startswith("tile_")}
    result = kernel_search.search(domain, op_type, metas, attrs, machine)

    def fields(t: Any) -> dict[str, int]:
        return {f.name: int(getattr(t, f.name)) for f in dataclasses.fields(t)}

    ranked = list(result.candidates)
    sims: list[float | None] = [None] * len(ranked)
    default: Candidate | None = None
    chosen = fields(result.best.tiling)
    sp = regret = None
    if simulate:
        n = len(ranked) if top <= 0 else min(top, len(ranked))
        total = n + 1
        for i in range(n):
            if progress is not None:
                progress(i, total, f"{name or op_type}")
            run = kernel.run(
                machine, metas, attrs, tiling=ranked[i].tiling, functional=False, timeline=False
            )
            sims[i] = run.stats.cycles
        base = kernel.default_tiling(metas, attrs, machine)
        run = kernel.run(machine, metas, attrs, tiling=base, functional=False, timeline=False)
        model = kernel_search.model_for(domain, op_type)
        assert model is not None
        default = Candidate(fields(base), model.cost(metas, attrs, base, machine), run.stats.cycles)
        if progress is not None:
            progress(total, total, f"{name or op_type}")
        done = [(p.cycles, s) for p, s in zip(ranked, sims, strict=True) if s is not None]
        sp = spearman([d[0] for d in done], [d[1] for d in done])
        best_sim = min(d[1] for d in done)
        regret = done[0][1] / best_sim - 1
        # The simulator's best of the checked candidates is what the cache keeps.
        i_best = min(range(n), key=lambda i: sims[i] or float("inf"))
        chosen = fields(ranked[i_best].tiling)
    if cache is not None:
        shapes = tuple(None if m is None else tuple(m.shape) for m in metas)
        dtypes = ",".join(sorted({m.dtype.name for m in metas if m is not None}))
        key = CacheKey.make(op_type, shapes, dtypes, kernel_search.cache_target(machine), attrs)
        cycles = next(p.cycles for p in ranked if fields(p.tiling) == chosen)
        cache.put(key, chosen, cycles, "simulated" if simulate else "model")
    candidates = tuple(
        Candidate(fields(p.tiling), p.cycles, s) for p, s in zip(ranked, sims, strict=True)
    )
    return NodeTuning(
        name=name or op_type,
        op=op_type,
        shapes=tuple(None if m is None else tuple(m.shape) for m in metas),
        chosen=chosen,
        candidates=candidates,
        space_size=result.space_size,
        exhaustive=result.exhaustive,
        spearman=sp,
        regret=regret,
        default=default,
    )


def fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes of domain `fuser` in the main graph."""
    from .fusedop import DOMAIN

    return [n for n in model.graph.node if n.domain == DOMAIN]


def node_metas(
    model: onnx.ModelProto,
    node: onnx.NodeProto,
    symbolic_size: int = SYMBOLIC_SIZE,
    dims: Mapping[str, int] | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """Input metas (a symbolic dim at `dims[name]`, else `symbolic_size`; stacked shards for
    gathering ops) and plain attributes of a fused node, from shape inference of the fused
    model."""
    sizes = dims or {}
    from . import engine, fusedop
    from .kernels.api import TensorMeta

    types = _types(model, engine)
    attrs = {a.name: _plain(helper.get_attribute_value(a)) for a in node.attribute}
    metas: list[Any] = []
    unknown: list[int] = []
    for name in node.input:
        if not name:
            metas.append(None)
            continue
        vt = types.get(name)
        if vt is None or not vt.elem_type:
            raise ValueError(f"{node.name}: input {name!r} has no known type")
        dtype = helper.tensor_dtype_to_np_dtype(vt.elem_type)
        if vt.shape is None:
            # Rank lost upstream (symbolic Reshapes): [symbolic_size, D] as `fuse` prices it.
            unknown.append(len(metas))
            metas.append(TensorMeta((), dtype))
            continue
        shape = tuple(
            d if isinstance(d, int) and d >= 0 else sizes.get(str(d), symbolic_size)
            for d in vt.shape
        )
        metas.append(TensorMeta(shape, dtype))
    for i in unknown:
        metas[i] = _guess_input(metas, i, symbolic_size)
        if metas[i] is None:
            raise ValueError(f"{node.name}: input {node.input[i]!r} has no known shape")
    op = fusedop.get(node.op_type)
    if op.collective_input is not None and metas[op.collective_input] is not None:
        m = metas[op.collective_input]
        metas[op.collective_input] = TensorMeta(
            (int(attrs.get("group_size", 1)), *m.shape), m.dtype
        )
    return metas, attrs


_TYPES: dict[int, Any] = {}


def _types(model: onnx.ModelProto, engine: Any) -> Any:
    key = id(model)
    if key not in _TYPES:
        _TYPES.clear()
        _TYPES[key] = engine.infer_types(model)[""]
    return _TYPES[key]


def tune_model(
    model: onnx.ModelProto,
    machine: Any,
    *,
    node: str | None = None,
    simulate: bool = False,
    top: int = 20,
    cache: TuningCache | None = None,
    progress: Progress | None = None,
    symbolic_size: int = SYMBOLIC_SIZE,
    dims: Mapping[str, int] | None = None,
) -> list[NodeTuning]:
    """Tune every fused node of `model` (or only the one named `node`); symbolic dims at
    `dims[name]`, else `symbolic_size`."""
    nodes = fused_nodes(model)
    if node is not None:
        nodes = [n for n in nodes if n.name == node]
        if not nodes:
            raise ValueError(f"no fused node named {node!r}")
    out: list[NodeTuning] = []
    # Identical nodes (a model repeats its layers) are searched (and simulated) once: same op,
    # input shapes and dtypes, attributes (without `tile_*`); the others reuse that result.
    done: dict[Hashable, NodeTuning] = {}
    for n in nodes:
        metas, attrs = node_metas(model, n, symbolic_size, dims)
        key = node_signature(n.op_type, metas, attrs)
        tuned = done.get(key)
        if tuned is None:
            tuned = done[key] = tune_op(
                n.op_type, metas, attrs, machine, name=n.name, simulate=simulate, top=top,
                cache=cache, progress=progress,
            )  # fmt: skip
        else:
            tuned = dataclasses.replace(tuned, name=n.name)
        out.append(tuned)
    return out


def node_signature(op_type: str, metas: Sequence[Any], attrs: Mapping[str, Any]) -> Hashable:
    """What a node's tuning depends on: op, input shapes and dtypes, attributes other than
    `tile_*` (by their repr: list values hash that way)."""
    return (
        op_type,
        tuple(None if m is None else (tuple(m.shape), m.dtype.str) for m in metas),
        repr(sorted((k, v) for k, v in attrs.items() if not k.startswith("tile_"))),
    )
