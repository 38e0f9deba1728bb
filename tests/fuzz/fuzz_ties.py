"""The judge of a discrete choice made on a near-tie: TopK indices (an expert, an expert group)
that differ from the original's only where the competing values are within rounding noise.

A MoE gate picks experts, and a DeepSeek-V3 gate first picks expert groups, by TopK over
values (sigmoid scores plus a selection bias, group sums of the top-2 scores) that saturate or
differ in their last bits: onnxruntime's approximate Sigmoid says 0 where an exact one says
1e-31, two group sums differ in their last ulp. The fused op may then keep another group or
expert than the original, and the weights it reports (the unbiased scores of what it picked)
differ by far more than any tolerance. Such a result is right when it is what the original
computes for a choice that exact arithmetic cannot tell apart from the original's:

1. every TopK in the original is replayed in float64 (the `float64_twin`, in onnx's
   ReferenceEvaluator: numpy's exact sigmoid, no onnxruntime approximation);
2. a TopK whose indices are a model output (directly, or as the output of an If branch or a
   Loop body of the main graph) takes the fused model's indices instead of its own, if they
   are a valid near-tie choice (`valid_choice`);
3. a TopK whose indices are read inside the model (the group choice: ScatterElements of the
   kept groups) has every near-tie alternative of its chosen set (`alternatives`), searched
   jointly over its rows (at most `MAX_REPLAYS` replays);
4. the fused result is accepted if one replay gives all its outputs within the tolerance.

The noise bound (`noise`): a value compared by a TopK went through a short chain of elementwise
ops in the original's narrowest float dtype (unit roundoff u: 2^-24 float32, 2^-11 float16),
each with an error of a few ulps of the largest magnitude involved (an approximated sigmoid, an
Add of the bias, each Add of a group sum). Two values within `NOISE_ULPS` * u * M of each
other, M the largest finite |value| in the TopK's row, are a near tie: 16 ulps = up to 8 ulps
for each of the 2 summed scores of a group. Values exactly equal in float64 are exact ties and
keep ONNX's rule (the lower index first) in every replay: exact ties are not loosened.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops import op_loop

NOISE_ULPS = 16
MAX_REPLAYS = 256
UNIT_ROUNDOFF = {
    np.dtype(np.float16): 2.0**-11,
    np.dtype(np.float32): 2.0**-24,
    np.dtype(np.float64): 2.0**-53,
}


def noise(row: np.ndarray, u: float) -> float:
    """The near-tie bound of one TopK row (see the module docstring)."""
    finite = np.abs(row[np.isfinite(row)])
    scale = float(finite.max()) if finite.size else 0.0
    return NOISE_ULPS * u * max(scale, np.finfo(np.float64).tiny)


def _near(a: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return (a == b) | (np.abs(a - b) <= eps)


def _keeps_exact_ties(row: np.ndarray, chosen: np.ndarray) -> bool:
    """Among values exactly equal in float64, the chosen ones are the lowest indices."""
    picked = {int(i) for i in chosen}
    return all(int(j) in picked for i in picked for j in np.flatnonzero(row[:i] == row[i]))


def _exact_order(row: np.ndarray, k: int) -> np.ndarray:
    """ONNX's TopK (largest) on one row: value descending, lower index first on ties."""
    return np.lexsort((np.arange(row.size), -row))[:k]


def valid_choice(row: np.ndarray, target: np.ndarray, u: float, sorted_: bool) -> bool:
    """Whether `target` (indices into `row`, largest first) is a top-k of `row` up to its
    noise: position by position within the bound of the exact top-k values (as sets if the
    TopK is unsorted), exact ties broken by ONNX's rule."""
    k = target.size
    if len(set(target.tolist())) != k or (k and (target.min() < 0 or target.max() >= row.size)):
        return False
    exact = row[_exact_order(row, k)]
    got = row[target]
    if not sorted_:
        got = -np.sort(-got)
    if not bool(np.all(_near(got, exact, noise(row, u)))):
        return False
    if sorted_ and not all(
        target[j] < target[j + 1] for j in range(k - 1) if got[j] == got[j + 1]
    ):  # fmt: skip
        return False
    return _keeps_exact_ties(row, target)


def alternatives(row: np.ndarray, k: int, u: float, limit: int = 16) -> list[np.ndarray]:
    """The near-tie choices of a top-k set of `row`, ONNX's own first, each in ONNX's order:
    values above the k-th by more than the noise are always kept, the rest of the k are any
    of the values within the noise of the k-th (exact ties keeping the lower index)."""
    own = _exact_order(row, k)
    if k == 0 or k >= row.size:
        return [own]
    eps = noise(row, u)
    kth = row[own[-1]]
    with np.errstate(invalid="ignore"):
        sure = np.flatnonzero((row > kth) & ~_near(row, kth, eps))
        open_ = np.flatnonzero(_near(row, kth, eps))
    out = [own]
    for extra in itertools.combinations(open_.tolist(), k - sure.size):
        chosen = np.array(sorted([*sure.tolist(), *extra]), np.int64)
        if set(chosen.tolist()) == set(own.tolist()) or not _keeps_exact_ties(row, chosen):
            continue
        out.append(chosen[np.lexsort((chosen, -row[chosen]))])
        if len(out) >= limit:
            break
    return out


@dataclass
class _Replay:
    """What the TopK replacement reads and writes during one evaluator run."""

    u: float
    targets: Mapping[str, tuple[np.ndarray, bool]]  # indices output -> (fused value, stacked)
    read: frozenset[str]  # values some node reads (an unread TopK index has nothing to choose)
    pick: Mapping[tuple[str, int, int], int] = field(default_factory=dict)
    choices: dict[tuple[str, int, int], int] = field(default_factory=dict)  # found this run
    calls: dict[str, int] = field(default_factory=dict)
    refused: bool = False  # a target was no valid near-tie choice


_ACTIVE: list[_Replay] = []


class TopK(OpRun):
    """ONNX TopK whose choice among near ties the active `_Replay` decides."""

    op_domain = ""

    def _run(
        self,
        data: np.ndarray,
        k: np.ndarray,
        axis: int | None = None,
        largest: int | None = None,
        sorted: int | None = None,  # the attribute's name
    ) -> tuple[np.ndarray, np.ndarray]:
        replay = _ACTIVE[-1]
        axis = -1 if axis is None else int(axis)
        sign = -1.0 if largest == 0 else 1.0
        moved = np.moveaxis(np.asarray(data), axis, -1)
        rows = moved.reshape(-1, moved.shape[-1]).astype(np.float64) * sign
        kk = int(np.asarray(k).reshape(-1)[0])
        sorted_ = sorted != 0
        name = self.onnx_node.output[1] if len(self.onnx_node.output) > 1 else ""
        call = replay.calls.get(name, 0)
        replay.calls[name] = call + 1
        target = replay.targets.get(name)
        want = None
        if target is not None:
            value, stacked = target
            fused = np.moveaxis(np.asarray(value[call] if stacked else value), axis, -1)
            want = fused.reshape(-1, kk) if fused.shape == (*moved.shape[:-1], kk) else None
            replay.refused |= want is None
        chosen = []
        for r, row in enumerate(rows):
            mine = _exact_order(row, kk)
            if want is not None:
                if valid_choice(row, want[r], replay.u, sorted_):
                    mine = want[r]
                else:
                    replay.refused = True
            elif name in replay.read:
                options = alternatives(row, kk, replay.u)
                key = (name, call, r)
                if len(options) > 1:
                    replay.choices[key] = len(options)
                mine = options[min(replay.pick.get(key, 0), len(options) - 1)]
            chosen.append(mine)
        idx = np.stack(chosen).astype(np.int64).reshape(*moved.shape[:-1], kk)
        values = np.take_along_axis(moved, idx, axis=-1)
        return np.moveaxis(values, -1, axis), np.moveaxis(idx, -1, axis)


class GatherElements(OpRun):
    """ONNX GatherElements (onnx's reference implementation mishandles a negative axis);
    the evaluator takes an op by its class name."""

    op_domain = ""

    def _run(
        self, data: np.ndarray, indices: np.ndarray, axis: int | None = None
    ) -> tuple[np.ndarray]:
        axis = 0 if axis is None else int(axis)
        idx = np.where(indices < 0, indices + data.shape[axis], indices)
        return (np.take_along_axis(data, idx, axis=axis),)


class Loop(op_loop.Loop):
    """ONNX Loop (onnx's reference implementation reads an absent condition as false and
    concatenates scan outputs instead of stacking them)."""

    op_domain = ""

    def _run(
        self,
        M: np.ndarray | None,
        cond: np.ndarray | None,
        *carried: np.ndarray,
        context: dict | None = None,
        body: Any = None,
        attributes: Any = None,
        bindings: Any = None,
    ) -> tuple[np.ndarray, ...]:
        names = self.body.input_names
        state = list(carried)
        scans: list[list[np.ndarray]] = [[] for _ in range(self.K)]
        go, it = cond is None or bool(np.asarray(cond).item()), 0
        while go and (M is None or it < int(np.asarray(M).item())):
            inputs = dict(context or {})
            inputs[names[0]] = np.array(it, np.int64)
            inputs[names[1]] = np.array(go)
            inputs.update(zip(names[2:], state, strict=True))
            outs = self._run_body(inputs, attributes=attributes, bindings=bindings)
            go = bool(np.asarray(outs[0]).item())
            state = list(outs[1 : 1 + self.N])
            for scan, value in zip(scans, outs[1 + self.N :], strict=True):
                scan.append(value)
            it += 1
        return (*state, *(np.stack(scan) for scan in scans))


def index_targets(
    model: onnx.ModelProto, fused: Mapping[str, np.ndarray]
) -> dict[str, tuple[np.ndarray, bool]]:
    """TopK indices outputs of `model` that the fused outputs show: main-graph outputs, If
    branch outputs, Loop body scan outputs (stacked per iteration)."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    found: dict[str, tuple[np.ndarray, bool]] = {}
    topk = {n.output[1] for n in graph.node if n.op_type == "TopK" and len(n.output) > 1}
    for name in topk & outputs:
        if name in fused:
            found[name] = (fused[name], False)
    for node in graph.node:
        if node.op_type not in ("If", "Loop"):
            continue
        for attr in node.attribute:
            if attr.type != onnx.AttributeProto.GRAPH:
                continue
            body = attr.g
            inner = {n.output[1] for n in body.node if n.op_type == "TopK" and len(n.output) > 1}
            # a Loop body's outputs are its condition, then the node's outputs: the final
            # loop-carried values, then the scan outputs (stacked per iteration)
            loop = node.op_type == "Loop"
            carried = len(node.input) - 2 if loop else 0
            for j, out in enumerate(body.output[int(loop) :]):
                if out.name in inner and j < len(node.output) and node.output[j] in fused:
                    found[out.name] = (fused[node.output[j]], loop and j >= carried)
    return found


def narrowest_roundoff(model: onnx.ModelProto) -> float:
    """Unit roundoff of the narrowest float dtype among the original's inputs/initializers."""
    elems = [v.type.tensor_type.elem_type for v in model.graph.input]
    elems += [t.data_type for t in model.graph.initializer]
    dtypes = [onnx.helper.tensor_dtype_to_np_dtype(e) for e in elems if e]
    found = [UNIT_ROUNDOFF[d] for d in dtypes if d in UNIT_ROUNDOFF]
    return max(found) if found else UNIT_ROUNDOFF[np.dtype(np.float32)]


def _inputs_read(graph: onnx.GraphProto) -> Iterator[str]:
    for node in graph.node:
        yield from node.input
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _inputs_read(attr.g)


def has_topk(graph: onnx.GraphProto) -> bool:
    """Whether `graph` or a subgraph has a TopK (only then is there a choice to replay)."""
    return any(
        node.op_type == "TopK"
        or any(a.type == onnx.AttributeProto.GRAPH and has_topk(a.g) for a in node.attribute)
        for node in graph.node
    )


def replays(
    original: onnx.ModelProto,
    twin: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    fused: Mapping[str, np.ndarray],
) -> Iterator[dict[str, np.ndarray]]:
    """The float64 outputs of `twin` (the original's float64 twin) under each near-tie choice
    its TopKs allow, with the fused model's own indices where they show (a replay in which
    they are no valid near-tie choice is left out; see the module docstring)."""
    try:
        evaluator = ReferenceEvaluator(twin, new_ops=[TopK, GatherElements, Loop])  # by class name
    except Exception:  # an op onnx's evaluator does not know: no replay
        return
    names = [o.name for o in twin.graph.output]
    u = narrowest_roundoff(original)
    targets = index_targets(twin, fused)
    read = frozenset(_inputs_read(twin.graph))
    wide = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}

    def run(pick: Mapping[tuple[str, int, int], int]) -> tuple[_Replay, dict[str, Any]]:
        replay = _Replay(u, targets, read, pick)
        _ACTIVE.append(replay)
        try:
            values = evaluator.run(None, wide)
        except Exception:  # an op the evaluator lacks: no replay, the difference stands
            replay.refused = True
            values = []
        finally:
            _ACTIVE.pop()
        return replay, dict(zip(names, values, strict=False))

    first, outputs = run({})
    if not first.refused:
        yield outputs
    keys = sorted(first.choices)
    combos = itertools.product(*(range(first.choices[key]) for key in keys))
    next(combos, None)  # all zeros: the run above
    for combo in itertools.islice(combos, MAX_REPLAYS - 1):
        replay, outputs = run(dict(zip(keys, combo, strict=True)))
        if not replay.refused:
            yield outputs
