"""The tiling search: legal spaces only, ranked output, the model agreeing with the simulator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fuser.kernels import search as kernel_search
from fuser.kernels.api import TensorMeta, TilingError
from fuser.kernels.npu.machine import Machine, load_target
from fuser.kernels.registry import get_kernel

from fuser.tune import spearman

F16 = np.dtype(np.float16)


def m(*shape: int, dtype: np.dtype = F16) -> TensorMeta:
    return TensorMeta(shape, dtype)


# (domain, op, inputs, attributes): each fused kernel and the unfused Cube ops, with shapes
# that press on the buffers (wide rows, big K, many channels, tails).
CASES = [
    ("fuser", "ConvBnRelu", [m(1, 256, 30, 30), m(512, 256, 3, 3), *[m(512)] * 5],
     {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "relu": 1}),
    ("", "Conv", [m(1, 64, 56, 56), m(64, 64, 3, 3)], {"kernel_shape": [3, 3], "pads": [1] * 4}),
    ("fuser", "LayerNormMatMul", [m(300, 4096), m(4096), m(4096), m(4096, 1000), m(1000)],
     {"has_bias": [1], "flatten": [0]}),
    ("fuser", "SoftmaxTopK", [m(1000, 3000)], {"k": 8, "renormalize": 1}),
    ("fuser", "AllGatherMatMul", [m(4, 100, 2048), m(8192, 700), m(700)],
     {"group_size": 4, "rank": 1, "axis": 1}),
    ("", "MatMul", [m(1000, 3000), m(3000, 1000)], {}),
]  # fmt: skip


@pytest.fixture(scope="module")
def machine() -> Machine:
    return load_target("ascend910b")


def small_machine(machine: Machine) -> Machine:
    """A target with half the buffers: many tilings of the big space no longer fit."""
    return dataclasses.replace(
        machine, name="tiny", ub_bytes=machine.ub_bytes // 2, l1_bytes=machine.l1_bytes // 2,
        l0a_bytes=machine.l0a_bytes // 2, l0b_bytes=machine.l0b_bytes // 2,
        l0c_bytes=machine.l0c_bytes // 2,
    )  # fmt: skip


@pytest.mark.parametrize(("domain", "op", "metas", "attrs"), CASES, ids=[c[1] for c in CASES])
@pytest.mark.parametrize("tiny", [False, True], ids=["910b", "half-buffers"])
def test_capacity_violating_tilings_are_never_in_the_space_nor_chosen(
    machine: Machine, domain: str, op: str, metas: list, attrs: dict, tiny: bool
) -> None:
    target = small_machine(machine) if tiny else machine
    kernel = get_kernel(domain, op)
    assert kernel is not None
    result = kernel_search.search(domain, op, metas, attrs, target)
    for priced in result.candidates:
        kernel.check_tiling(metas, attrs, priced.tiling, target)  # raises if it does not fit
    assert result.best is result.candidates[0]
    cheapest = min(p.cycles for p in result.candidates)
    # Near-ties (within 1%) go to the biggest tiles; the rest is ranked by the model.
    assert result.best.cycles <= (1 + kernel_search.TIE) * cheapest
    assert result.runner_up is not None
    cycles = [p.cycles for p in result.candidates[1:]]
    assert cycles == sorted(cycles)
    assert result.space_size == len(result.candidates) or not result.exhaustive


def test_the_check_is_real_a_too_big_tiling_raises(machine: Machine) -> None:
    """The filter above means something: the kernel does refuse an oversized tiling."""
    domain, op, metas, attrs = CASES[0]
    kernel = get_kernel(domain, op)
    assert kernel is not None
    best = kernel_search.search(domain, op, metas, attrs, machine).best.tiling
    huge = dataclasses.replace(best, tile_co=512, tile_ci=256, tile_h=30, tile_w=30)
    with pytest.raises(TilingError):
        kernel.check_tiling(metas, attrs, huge, machine)


@pytest.mark.parametrize(
    ("domain", "op", "metas", "attrs"),
    [
        ("fuser", "SoftmaxTopK", [m(4096, 64)], {"k": 6, "renormalize": 1}),
        ("", "MatMul", [m(256, 512), m(512, 768)], {}),
    ],
    ids=["SoftmaxTopK", "MatMul"],
)
def test_model_ranks_tilings_as_the_simulator_does(
    machine: Machine, domain: str, op: str, metas: list, attrs: dict
) -> None:
    kernel = get_kernel(domain, op)
    assert kernel is not None
    result = kernel_search.search(domain, op, metas, attrs, machine)
    # Every 8th candidate of the ranking: the whole range, a fast test.
    sample = list(result.candidates[:: max(1, len(result.candidates) // 24)])
    sims = [
        kernel.run(
            machine, metas, attrs, tiling=p.tiling, functional=False, timeline=False
        ).stats.cycles
        for p in sample
    ]
    rho = spearman([p.cycles for p in sample], sims)
    assert rho is not None and rho >= 0.9, rho
    pick = kernel.run(machine, metas, attrs, tiling=result.best.tiling, functional=False)
    assert pick.stats.cycles <= 1.05 * min(sims)


def test_roofline_floor_is_below_every_simulated_run(machine: Machine) -> None:
    metas = [m(512, 1024), m(1024, 1024)]
    kernel = get_kernel("", "MatMul")
    assert kernel is not None
    flops, nbytes = 2 * 512 * 1024 * 1024, 2 * (2 * 512 * 1024 + 1024**2)
    floor = kernel_search.roofline_floor(flops, nbytes, machine, F16)
    best = kernel_search.search("", "MatMul", metas, {}, machine).best.tiling
    run = kernel.run(machine, metas, {}, tiling=best, functional=False, timeline=False)
    assert 0 < floor < run.stats.cycles
