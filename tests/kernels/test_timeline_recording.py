"""Runs without a timeline (the plugin's functional runs) keep no per-instruction list, and
that changes nothing else: the same numbers to the bit, the same cycles, bytes and bound."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels.npu.core import Core
from fuser.kernels.npu.pipes import Pipe
from kernel_oracle import MACHINE


def _cases() -> list[tuple[str, str, list[np.ndarray | None], dict[str, Any]]]:
    r = np.random.default_rng(7)
    f32 = np.float32

    def normal(*shape: int, dtype: Any = f32) -> np.ndarray:
        return r.standard_normal(shape).astype(dtype)

    return [
        # odd channels, a row tail and padding: several tiles of unequal sizes
        ("fuser", "ConvBnRelu",
         [normal(2, 5, 13, 11), normal(7, 5, 3, 3), normal(7), r.uniform(0.5, 1.5, 7).astype(f32),
          normal(7), normal(7), r.uniform(0.5, 2.0, 7).astype(f32)],
         {"pads": [1, 1, 1, 1], "relu": 1}),
        ("fuser", "LayerNormMatMul",
         [normal(2, 3, 20), normal(20), normal(20), normal(20, 9), normal(9), normal(20, 4)],
         {"has_bias": [1, 0], "flatten": [0, 0]}),
        ("fuser", "SoftmaxTopK", [normal(3, 5, 9, dtype=np.float16)], {"k": 2, "renormalize": 1}),
        ("fuser", "AllGatherMatMul", [normal(2, 3, 8), normal(8, 5), normal(5)],
         {"group_size": 2, "axis": 0, "rank": 1}),
        ("", "MatMul", [normal(67, 45), normal(45, 33)], {}),
        ("", "LayerNormalization", [normal(5, 37), normal(37), normal(37)], {"axis": -1}),
    ]  # fmt: skip


@pytest.mark.parametrize(("domain", "op", "inputs", "attrs"), _cases(), ids=lambda c: str(c)[:18])
def test_a_run_without_timeline_computes_and_costs_the_same(
    domain: str, op: str, inputs: list[np.ndarray | None], attrs: dict[str, Any]
) -> None:
    kernel = registry.get_kernel(domain, op)
    assert kernel is not None
    traced = kernel.run(MACHINE, inputs, attrs, timeline=True)
    plain = kernel.run(MACHINE, inputs, attrs, timeline=False)
    assert traced.stats.timeline is not None and traced.stats.timeline.intervals
    assert plain.stats.timeline is None
    assert plain.stats.to_dict() == traced.stats.to_dict()
    assert len(plain.outputs) == len(traced.outputs) > 0
    for a, b in zip(plain.outputs, traced.outputs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def test_a_core_that_does_not_record_schedules_the_same() -> None:
    cores = [Core(MACHINE, 0, 1, functional=False, record=r) for r in (True, False)]
    for core in cores:
        x = core.ub.queue("x", 4096, depth=2)
        for _ in range(3):
            t = x.alloc()
            core.copy_in(t, 4096)
            core.vector("Add", np.dtype(np.float32), 1024, (t,), (t,))
            core.copy_out(t, 4096)
    recorded, plain = cores
    assert len(recorded.intervals) == 9 and plain.intervals == []
    assert plain.makespan == recorded.makespan > 0
    assert plain.busy == recorded.busy and plain.busy[Pipe.VECTOR] > 0
    assert plain.moved == recorded.moved
