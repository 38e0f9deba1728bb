"""The lower bounds of LayerNormMatMul, RmsNormMatMul, SoftmaxTopK and AllGatherMatMul, and the
numpy-built LayerNormMatMul space, against pricing every tiling.

Over seeded random problems per kernel (tails, odd sizes, batch 1, float16 / float32, the
variadic Linears with and without biases, LayerNorm over two axes, `matmul_type` Cast, the
normalized output emitted; expert counts and k, sigmoid scores with a selection bias, expert
groups, probabilities emitted; world sizes 2 to 8, leading-axis and K gathers), every tiling
is priced: each bound must stay at or below its tiling's cost, and `best` must return the
tiling and the first three prices (best, runner-up, third) that ranking every tiling gives.
`FUSER_SEARCH_SHAPES` raises the problems per kernel (default 4).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from fuser.kernels import search as ks
from fuser.kernels.api import KernelError, TensorMeta, TilingError
from fuser.kernels.layernorm_matmul.plan import default_tiling
from fuser.kernels.layernorm_matmul.plan import problem as lnmm_problem
from fuser.kernels.layernorm_matmul.space import default_tiling_fast
from fuser.kernels.npu.machine import load_target
from fuser.kernels.rmsnorm_matmul.plan import problem as rms_problem

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
SHAPES = int(os.environ.get("FUSER_SEARCH_SHAPES", "4"))
B910 = load_target("ascend910b")
Case = tuple[str, list[Any], dict[str, Any]]


def m(*shape: int, dtype: np.dtype = F16) -> TensorMeta:
    return TensorMeta(shape, dtype)


def pick(rng: np.random.Generator, options: list[Any]) -> Any:
    return options[int(rng.integers(len(options)))]


def linears(
    rng: np.random.Generator,
    k: int,
    dtype: np.dtype,
    widths: tuple[int, ...] = (16, 50, 128, 384, 1000, 2304),
) -> tuple[list[TensorMeta], list[int]]:
    """1 to 3 Linears (the variadic QKV forms), each with or without a bias."""
    metas, bias = [], []
    for _ in range(int(rng.integers(1, 4))):
        n = int(pick(rng, list(widths)))
        b = int(rng.integers(2))
        metas += [m(k, n, dtype=dtype)] + ([m(n, dtype=dtype)] if b else [])
        bias.append(b)
    return metas, bias


def lnmm_case(rng: np.random.Generator) -> Case:
    lead = pick(rng, [(1,), (7,), (33,), (100,), (257,), (2, 9), (1, 1), (3, 4)])
    d = int(pick(rng, [40, 64, 200, 384, 768, 1000]))
    dtype = F32 if rng.integers(3) == 0 else F16
    cast = dtype == F32 and rng.integers(2) == 0  # autocast: N cast to float16 for the Cube
    two_axes = len(lead) == 2 and rng.integers(2) == 0  # normalized over [lead[-1], d]
    norm = (lead[-1], d) if two_axes else (d,)
    ws, bias = linears(rng, d, F16 if cast else dtype)
    attrs: dict[str, Any] = {
        "has_bias": bias,
        "flatten": [int(rng.integers(2)) for _ in bias],
        "axis": -2 if two_axes else -1,
        "emit_normalized": int(rng.integers(2)),
    }
    if cast:
        attrs["matmul_type"] = 10
    x = m(*lead, d, dtype=dtype)
    return "LayerNormMatMul", [x, m(*norm, dtype=dtype), m(*norm, dtype=dtype), *ws], attrs


def rms_case(rng: np.random.Generator) -> Case:
    lead = pick(rng, [(1,), (5,), (64,), (300,), (2, 17)])
    d = int(pick(rng, [64, 96, 200, 512, 1000]))
    dtype = F32 if rng.integers(3) == 0 else F16
    ws, bias = linears(rng, d, dtype)
    rounded = int(rng.integers(2))
    attrs = {"has_bias": bias, "flatten": [0] * len(bias), "round_before_scale": rounded}
    return "RmsNormMatMul", [m(*lead, d, dtype=dtype), m(d, dtype=dtype), *ws], attrs


def softmax_topk_case(rng: np.random.Generator) -> Case:
    pts = pick(rng, [(1,), (16,), (97,), (777,), (4096,), (2, 2049), (1, 1024)])
    e = int(pick(rng, [4, 8, 16, 60, 64, 160, 256]))
    dtype = F32 if rng.integers(2) == 0 else F16
    attrs: dict[str, Any] = {"k": int(min(e, pick(rng, [1, 2, 4, 6, 8]))), "axis": -1}
    attrs["renormalize"] = int(rng.integers(2))
    attrs["emit_probs"] = int(rng.integers(2))
    metas = [m(*pts, e, dtype=dtype)]
    kind = int(rng.integers(4))
    if kind == 0:
        attrs["order"] = "topk_softmax"
    elif kind == 1:  # DeepSeek-style: sigmoid scores, a selection bias, expert groups
        attrs.update(score="sigmoid", scale=2.5)
        metas.append(m(e, dtype=dtype))
        if e % 4 == 0 and e >= 8:
            attrs.update(n_group=4, topk_group=2)
    elif kind == 2:
        attrs["score"] = "log_softmax"
    return "SoftmaxTopK", metas, attrs


def allgather_case(rng: np.random.Generator) -> Case:
    p = int(pick(rng, [2, 4, 8]))
    mm, kk = int(pick(rng, [1, 16, 100, 128, 500])), int(pick(rng, [64, 96, 320, 512, 1024]))
    axis = int(rng.integers(2))
    dtype = F32 if rng.integers(4) == 0 else F16
    k = kk * p if axis == 1 else kk
    ws, bias = linears(rng, k, dtype, (16, 50, 128, 384))  # spaces of a few thousand at most
    attrs = {"group_size": p, "rank": int(rng.integers(p)), "axis": axis, "has_bias": bias}
    return "AllGatherMatMul", [m(p, mm, kk, dtype=dtype), *ws], attrs


MAKERS: dict[str, Callable[[np.random.Generator], Case]] = {
    "LayerNormMatMul": lnmm_case,
    "RmsNormMatMul": rms_case,
    "SoftmaxTopK": softmax_topk_case,
    "AllGatherMatMul": allgather_case,
}


def cases(op: str) -> Iterator[Case]:
    rng = np.random.default_rng(sum(map(ord, op)) + 10)
    found = 0
    while found < SHAPES:
        case = MAKERS[op](rng)
        try:
            ks.candidate_space("fuser", *case, B910)
        except (TilingError, KernelError):
            continue  # a problem the kernel refuses: nothing to compare
        found += 1
        yield case


@pytest.mark.parametrize("op", list(MAKERS))
def test_bounds_stay_below_every_cost_and_best_is_exact(op: str) -> None:
    pruned = 0
    for op_type, metas, attrs in cases(op):
        model, space = ks.candidate_space("fuser", op_type, metas, attrs, B910)
        assert ks.bound_of(model, space) is model, f"{op}: no bound used"
        costs = np.array([model.cost(metas, attrs, t, B910) for t in space])
        lower = np.asarray(model.lower_bounds(metas, attrs, space, B910))  # type: ignore[attr-defined]
        label = (op, [x.shape for x in metas], attrs)
        worst = int(np.argmax(lower / costs))
        assert lower[worst] <= costs[worst] * (1 + 1e-12), (label, space[worst])
        full = ks.ranked([ks.Priced(t, c) for t, c in zip(space, costs, strict=True)])
        ks.clear_memo()
        fast = ks.best("fuser", op_type, metas, attrs, B910, keep=3)
        assert fast.best.tiling == full[0].tiling, label
        assert [p.cycles for p in fast.candidates[:3]] == [p.cycles for p in full[:3]], label
        assert fast.runner_up is not None and fast.runner_up.cycles == full[1].cycles, label
        pruned += len(space) - len(fast.candidates)
    assert pruned > 0  # the bound does prune


@pytest.mark.parametrize("op", ["LayerNormMatMul", "RmsNormMatMul", "AllGatherMatMul"])
def test_the_numpy_space_is_the_walked_space(op: str) -> None:
    """The space built in numpy (`layernorm_matmul.space`, `allgather_matmul.space`) holds the
    walked space's tilings in its order, staged schedule included: the model it extends (the
    walk, `lnmm_space` / `agmm_space`) builds the reference."""
    for op_type, metas, attrs in cases(op):
        model = ks.model_for("fuser", op_type)
        assert model is not None
        walked = type(model).__bases__[0].space(model, metas, attrs, B910)  # type: ignore[attr-defined]
        space = model.space(metas, attrs, B910)
        assert type(model).space is not type(model).__bases__[0].space  # type: ignore[attr-defined]
        assert list(space) == walked, (op, [x.shape for x in metas])
        assert [type(t) for t in space] == [type(t) for t in walked]
        # Built without the dataclass's __init__, they are ordinary tilings all the same.
        rebuilt = [dataclasses.replace(t) for t in space]
        assert rebuilt == list(space) and [hash(t) for t in rebuilt] == [hash(t) for t in space]
        assert all(type(getattr(t, f.name)) is int for t in space for f in dataclasses.fields(t))


def test_a_bound_above_a_cost_would_change_the_pick(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The exactness above depends on the bounds: one that overestimates the cheapest tiling
    prunes it, and `best` then misses it (so the test above can fail)."""
    op_type, metas, attrs = next(cases("LayerNormMatMul"))
    model, space = ks.candidate_space("fuser", op_type, metas, attrs, B910)
    full = ks.ranked([ks.Priced(t, model.cost(metas, attrs, t, B910)) for t in space])
    winner = space.index(full[0].tiling)
    honest = model.lower_bounds  # type: ignore[attr-defined]

    def lying(*args: Any) -> np.ndarray:
        out = np.array(honest(*args), dtype=float)
        out[winner] = 10 * full[-1].cycles
        return out

    monkeypatch.setattr(model, "lower_bounds", lying, raising=False)
    ks.clear_memo()
    assert ks.best("fuser", op_type, metas, attrs, B910).best.tiling != full[0].tiling
    ks.clear_memo()


def test_the_numpy_default_tiling_is_plan_default_tiling() -> None:
    """`space.default_tiling_fast` (what the kernels use) shrinks every start as
    `plan.default_tiling`'s `fit` loops do and keeps the same tiling: on 910B, on a combined
    core (910) and on a 910B with quartered buffers (many shrink steps, some starts with
    nothing left to shrink)."""
    tight = dataclasses.replace(
        B910, name="tight", l1_bytes=B910.l1_bytes // 4, ub_bytes=B910.ub_bytes // 4,
        l0a_bytes=B910.l0a_bytes // 2,
    )  # fmt: skip
    machines = (B910, load_target("ascend910"), tight)
    checked = 0
    for op in ("LayerNormMatMul", "RmsNormMatMul"):
        make = lnmm_problem if op == "LayerNormMatMul" else rms_problem
        rng = np.random.default_rng(7)
        for _ in range(6 * SHAPES):
            _, metas, attrs = MAKERS[op](rng)
            try:
                p = make(metas, attrs)
            except KernelError:
                continue
            for machine in machines:
                want: Any
                try:
                    want = default_tiling(p, machine)
                except TilingError as e:
                    want = str(e)
                try:
                    got: Any = default_tiling_fast(p, machine)
                except TilingError as e:
                    got = str(e)
                assert got == want, (op, machine.name, [x.shape for x in metas], attrs)
                checked += 1
    assert checked >= 20
