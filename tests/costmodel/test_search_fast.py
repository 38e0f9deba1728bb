"""The fast search (`search.best`) against pricing every tiling: the same pick, exactly.

Over seeded random shapes per kernel (awkward sizes: tails, odd and small channel counts,
batch 1, strides, dilations, groups, a stem with Cin = 3), every tiling of the space is
priced and ranked as `search` ranks them; `best` must return the same best tiling and the
same runner-up (or, where two tilings tie exactly, the same cycles), and every lower bound
must stay at or below its tiling's cost. The spaces are numpy columns filtered by a
vectorized fit: on random tilings off the aligned steps it must say what the kernel's own
`check_tiling` says of each. `FUSER_SEARCH_SHAPES` raises the shapes per kernel
(default 6; the closing note quotes a run at 60).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fuser.kernels import search as ks
from fuser.kernels._budget import fits_each
from fuser.kernels._columns import TilingColumns
from fuser.kernels.api import TensorMeta, TilingError
from fuser.kernels.conv_bn_relu.geometry import conv_geometry
from fuser.kernels.conv_bn_relu.tiling import ConvTiling, conv_fits
from fuser.kernels.matmul.kernel import Gemm, MatMul, MatMulTiling, gemm_queues
from fuser.kernels.npu.machine import Machine, load_target
from fuser.kernels.registry import get_kernel

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
SHAPES = int(os.environ.get("FUSER_SEARCH_SHAPES", "6"))
B910 = load_target("ascend910b")


def m(*shape: int, dtype: np.dtype = F16) -> TensorMeta:
    return TensorMeta(shape, dtype)


def conv_case(rng: np.random.Generator, fused: bool) -> tuple[str, str, list[Any], dict[str, Any]]:
    n = int(rng.choice([1, 1, 2, 3, 8]))
    group_kind = rng.integers(3)
    cin = int(rng.choice([3, 5, 16, 24, 40, 64, 96, 130, 256]))
    cout = int(rng.choice([8, 16, 24, 48, 64, 100, 128, 300]))
    group = 1
    if group_kind == 0 and cin >= 8:
        group, cout = cin, cin  # depthwise
    k = int(rng.choice([1, 3, 3, 5, 7]))
    stride = int(rng.choice([1, 1, 2]))
    dil = int(rng.choice([1, 1, 2])) if k > 1 else 1
    one_d = bool(rng.integers(5) == 0)
    h = 1 if one_d else int(rng.choice([7, 14, 17, 28, 56, 64]))
    w = int(rng.choice([7, 15, 28, 56, 100])) if not one_d else int(rng.choice([100, 513, 1000]))
    x = m(n, cin, w) if one_d else m(n, cin, h, w)
    wt = m(cout, cin // group, k) if one_d else m(cout, cin // group, k, k)
    dims = 1 if one_d else 2
    attrs: dict[str, Any] = {
        "kernel_shape": [k] * dims,
        "strides": [stride] * dims,
        "dilations": [dil] * dims,
        "pads": [dil * (k // 2)] * (2 * dims),
        "group": group,
    }
    if not fused:
        return "", "Conv", [x, wt], attrs
    p = m(cout)
    return "fuser", "ConvBnRelu", [x, wt, p, p, p, p, p], {**attrs, "relu": 1, "epsilon": 1e-5}


def gemm_case(rng: np.random.Generator, gemm: bool) -> tuple[str, str, list[Any], dict[str, Any]]:
    rows = int(rng.choice([1, 7, 33, 100, 256, 300, 1000]))
    k = int(rng.choice([40, 64, 200, 768, 1000]))
    n = int(rng.choice([16, 50, 128, 384, 1000]))
    dtype = F32 if rng.integers(4) == 0 else F16
    if gemm:
        return "", "Gemm", [m(rows, k, dtype=dtype), m(k, n, dtype=dtype), m(n, dtype=dtype)], {}
    batch = [int(rng.choice([2, 3]))] if rng.integers(4) == 0 else []
    return "", "MatMul", [m(*batch, rows, k, dtype=dtype), m(k, n, dtype=dtype)], {}


def conv_transpose_case(
    rng: np.random.Generator, fused: bool
) -> tuple[str, str, list[Any], dict[str, Any]]:
    """Decoder upsampling: the kernel runs the equivalent conv over the zero-inserted input,
    whose zeros are written into L1 but never read from HBM (the bound must not count them)."""
    n = int(rng.choice([1, 2]))
    cin, cout = int(rng.choice([8, 32, 64, 130])), int(rng.choice([3, 16, 32, 64]))
    k, stride = int(rng.choice([2, 3, 4])), int(rng.choice([1, 2, 3]))
    h, w = int(rng.choice([7, 14, 28])), int(rng.choice([7, 15, 28]))
    attrs: dict[str, Any] = {
        "kernel_shape": [k, k],
        "strides": [stride, stride],
        "pads": [k // 2] * 4 if k // 2 < k else [0] * 4,
    }
    x, wt = m(n, cin, h, w), m(cin, cout, k, k)
    if not fused:
        return "", "ConvTranspose", [x, wt], attrs
    p = m(cout)
    full = {**attrs, "transposed": 1, "relu": 1, "epsilon": 1e-5}
    return "fuser", "ConvBnRelu", [x, wt, p, p, p, p, p], full


def split_k_case(rng: np.random.Generator) -> tuple[str, str, list[Any], dict[str, Any]]:
    """K from `SPLIT_K_MIN`: the space holds split-K tilings (the blocks of a partly filled
    last wave cut along K, a reduce pass after), whose cost is not one block walk per block."""
    rows = int(rng.choice([1, 16, 100, 300]))
    k = int(rng.choice([1024, 1536, 4096]))
    n = int(rng.choice([50, 384, 1000]))
    dtype = F32 if rng.integers(3) == 0 else F16
    if rng.integers(2):
        return "", "Gemm", [m(rows, k, dtype=dtype), m(k, n, dtype=dtype), m(n, dtype=dtype)], {}
    return "", "MatMul", [m(rows, k, dtype=dtype), m(k, n, dtype=dtype)], {}


MAKERS = {
    "ConvBnRelu": lambda rng: conv_case(rng, True),
    "ConvBnRelu transposed": lambda rng: conv_transpose_case(rng, True),
    "ConvTranspose": lambda rng: conv_transpose_case(rng, False),
    "Conv": lambda rng: conv_case(rng, False),
    "MatMul": lambda rng: gemm_case(rng, False),
    "Gemm": lambda rng: gemm_case(rng, True),
    "MatMul split-K": split_k_case,
}


def cases(op: str) -> Iterator[tuple[str, str, list[Any], dict[str, Any]]]:
    rng = np.random.default_rng(sum(map(ord, op)))
    found = 0
    while found < SHAPES:
        case = MAKERS[op](rng)
        try:
            ks.candidate_space(*case, B910)
        except TilingError:
            continue  # a shape the kernel refuses: nothing to compare
        found += 1
        yield case


def every_tiling(
    domain: str, op: str, metas: list[Any], attrs: dict[str, Any], machine: Machine
) -> tuple[Any, list[Any], np.ndarray, list[ks.Priced]]:
    """The model, its space, every tiling's cost and the ranking `search` would make."""
    model, space = ks.candidate_space(domain, op, metas, attrs, machine)
    costs = [model.cost(metas, attrs, t, machine) for t in space]
    ranking = ks.ranked([ks.Priced(t, c) for t, c in zip(space, costs, strict=True)])
    return model, space, np.array(costs), ranking


@pytest.mark.parametrize("op", list(MAKERS))
def test_best_picks_what_pricing_every_tiling_picks(op: str) -> None:
    pruned = 0
    for domain, op_type, metas, attrs in cases(op):
        model, space, costs, full = every_tiling(domain, op_type, metas, attrs, B910)
        assert ks.bound_of(model, space) is not None, f"{op}: no bound used"
        lower = np.asarray(model.lower_bounds(metas, attrs, space, B910))
        worst = int(np.argmax(lower / costs))
        assert lower[worst] <= costs[worst] * (1 + 1e-12), (op, metas, space[worst])
        ks.clear_memo()
        fast = ks.best(domain, op_type, metas, attrs, B910, keep=3)
        label = (op, [x.shape for x in metas])
        assert fast.best.tiling == full[0].tiling, label
        assert fast.best.cycles == full[0].cycles, label
        for got, want in zip(fast.candidates[:3], full[:3], strict=True):
            assert got.cycles == want.cycles, label
        assert fast.runner_up is not None
        assert fast.runner_up.cycles == full[1].cycles, label
        assert fast.space_size == len(space)
        pruned += len(space) - len(fast.candidates)
    # The bound does prune: most of each space is never priced.
    assert pruned > 0


def test_a_kernel_without_a_bound_is_priced_whole(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    metas, attrs = [m(1000, 300)], {"k": 6, "renormalize": 1}
    model, space, _, full = every_tiling("fuser", "SoftmaxTopK", metas, attrs, B910)
    # Every kernel has a bound now: this one is made to have none.
    monkeypatch.setattr(model, "bound_fields", frozenset(), raising=False)
    assert ks.bound_of(model, space) is None
    ks.clear_memo()
    fast = ks.best("fuser", "SoftmaxTopK", metas, attrs, B910)
    assert len(fast.candidates) == len(space)
    assert fast.best == full[0]
    assert fast.best == ks.search("fuser", "SoftmaxTopK", metas, attrs, B910).best


def test_a_tiling_field_the_bound_does_not_know_turns_the_bound_off(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A kernel that gained a tiling field (another lane's) is searched whole until its bound
    covers the field: a stale bound never prunes a tiling it does not understand."""
    domain, op, metas, attrs = next(cases("Conv"))
    model, space = ks.candidate_space(domain, op, metas, attrs, B910)
    assert ks.bound_of(model, space) is model
    known = model.bound_fields  # type: ignore[attr-defined]
    monkeypatch.setattr(model, "bound_fields", known - {"tile_n"}, raising=False)
    assert ks.bound_of(model, space) is None
    calls = []
    cost = model.cost
    monkeypatch.setattr(model, "cost", lambda *a: calls.append(1) or cost(*a))
    ks.clear_memo()
    fast = ks.best(domain, op, metas, attrs, B910)
    assert len(calls) == len(space) == len(fast.candidates)


def test_a_bound_above_a_cost_would_change_the_pick(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The equivalence above depends on the bound: one that overestimates the cheapest
    tiling prunes it, and `best` then misses it (so the tests above can fail)."""
    domain, op, metas, attrs = next(cases("MatMul"))
    model, space, _, full = every_tiling(domain, op, metas, attrs, B910)
    winner = space.index(full[0].tiling)
    honest = model.lower_bounds  # type: ignore[attr-defined]

    def lying(*args: Any) -> np.ndarray:
        out = np.array(honest(*args), dtype=float)
        out[winner] = 10 * full[-1].cycles
        return out

    monkeypatch.setattr(model, "lower_bounds", lying, raising=False)
    ks.clear_memo()
    assert ks.best(domain, op, metas, attrs, B910).best.tiling != full[0].tiling
    ks.clear_memo()


def test_best_is_memoized_per_problem(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    domain, op, metas, attrs = next(cases("ConvBnRelu"))
    model = ks.model_for(domain, op)
    assert model is not None
    spaces = []
    space = model.space
    monkeypatch.setattr(model, "space", lambda *a: spaces.append(1) or space(*a))
    ks.clear_memo()
    first = ks.best(domain, op, metas, attrs, B910)
    assert ks.best(domain, op, list(metas), dict(attrs), B910) is first
    assert len(spaces) == 1
    # Another target or other attributes are another search.
    half = dataclasses.replace(B910, name="half-l1", l1_bytes=B910.l1_bytes // 2)
    ks.best(domain, op, metas, attrs, half)
    ks.best(domain, op, metas, {**attrs, "relu": 0}, B910)
    assert len(spaces) == 3
    ks.clear_memo()
    ks.best(domain, op, metas, attrs, B910)
    assert len(spaces) == 4


# -- the space's vectorized fit is the kernel's own check ---------------------------------------


def awkward_conv_tilings(rng: np.random.Generator, grouped: bool, count: int) -> TilingColumns:
    """Tilings off the space's aligned steps too (odd sizes, past the problem, every switch)."""
    return TilingColumns(
        ConvTiling,
        {
            "tile_h": rng.integers(1, 40, count),
            "tile_w": rng.integers(1, 300, count),
            "tile_co": rng.integers(1, 320, count),
            "tile_ci": rng.integers(1, 600, count),
            "double_buffer": rng.integers(0, 2, count),
            "cores": rng.integers(1, B910.cube_cores + 1, count),
            "fold_taps": 0 if grouped else rng.integers(0, 2, count),
            "tile_n": rng.integers(1, 6, count),
        },
    )


@pytest.mark.parametrize("op", ["ConvBnRelu", "ConvBnRelu transposed", "ConvTranspose", "Conv"])
def test_conv_space_fit_is_the_kernels_check(op: str) -> None:
    """`conv_fits` over a space's columns says, for every tiling, what `check_tiling` says
    of that tiling alone; and every tiling of the space passes `check_tiling`."""
    rng = np.random.default_rng(7)
    answers: set[bool] = set()
    for domain, op_type, metas, attrs in cases(op):
        kernel = get_kernel(domain, op_type)
        assert kernel is not None
        full = {**attrs, "transposed": 1} if op_type == "ConvTranspose" else attrs
        g = conv_geometry(metas[0], metas[1], full, op_type)
        has_params = len(metas) > 2
        cols = awkward_conv_tilings(rng, g.group > 1, 300)
        vector = conv_fits(g, metas[0].dtype, has_params, cols, B910)
        scalar = [_passes(kernel, metas, attrs, t) for t in cols]
        assert vector.tolist() == scalar, (op, [x.shape for x in metas])
        answers |= set(scalar)
        _, space = ks.candidate_space(domain, op_type, metas, attrs, B910)
        assert all(_passes(kernel, metas, attrs, t) for t in space)
    assert answers == {True, False}  # the tilings probe both sides of the rule


@pytest.mark.parametrize("op", ["MatMul", "Gemm", "MatMul split-K"])
def test_gemm_space_fit_is_the_kernels_check(op: str) -> None:
    rng = np.random.default_rng(11)
    answers: set[bool] = set()
    for domain, op_type, metas, attrs in cases(op):
        kernel = get_kernel(domain, op_type)
        assert isinstance(kernel, MatMul | Gemm)
        count = 300
        tk = rng.integers(1, 1200, count)
        cols = TilingColumns(
            MatMulTiling,
            {
                "tile_m": rng.integers(1, 300, count),
                "tile_n": rng.integers(1, 300, count),
                "tile_k": tk,
                "tile_k0": np.maximum(1, (tk * rng.random(count)).astype(np.int64)),
                "db_l1": rng.integers(0, 2, count),
                "db_l0": rng.integers(0, 2, count),
                "db_l0c": rng.integers(0, 2, count),
                "cores": rng.integers(1, B910.cube_cores + 1, count),
                "split_k": rng.integers(1, 9, count),
            },
        )
        p = kernel.problem(metas, attrs)
        queues = [(level, nbytes, depth) for level, _, nbytes, depth in gemm_queues(p, cols)]
        vector = fits_each(B910, queues)
        scalar = [_passes(kernel, metas, attrs, t) for t in cols]
        assert vector.tolist() == scalar, (op, [x.shape for x in metas])
        answers |= set(scalar)
        _, space = ks.candidate_space(domain, op_type, metas, attrs, B910)
        assert all(_passes(kernel, metas, attrs, t) for t in space[:: max(1, len(space) // 500)])
    assert answers == {True, False}


def _passes(kernel: Any, metas: list[Any], attrs: dict[str, Any], t: Any) -> bool:
    try:
        kernel.check_tiling(metas, attrs, t, B910)
    except TilingError:
        return False
    return True


def test_columns_read_as_the_tilings_they_hold() -> None:
    """A space's columns make the very tilings a list of them holds: in order, by index,
    `in` and `index` (what `candidate_space` and the searches read)."""
    domain, op, metas, attrs = next(cases("ConvBnRelu"))
    _, space = ks.candidate_space(domain, op, metas, attrs, B910)
    assert isinstance(space, TilingColumns)
    listed = list(space)
    assert [space[i] for i in range(len(space))] == listed
    assert space[-1] == listed[-1]
    probe = listed[len(listed) // 2]
    assert probe in space and space.index(probe) == listed.index(probe)
    assert dataclasses.replace(probe, tile_h=probe.tile_h + 1000) not in space
    assert list(space[3:9]) == listed[3:9]
    more = space.extended([probe])
    assert len(more) == len(space) + 1 and more[-1] == probe
