"""Where validate's time goes: the plugin's clock splits a step into the fused ops' own work."""

from __future__ import annotations

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels.npu.clock import ARITHMETIC
from fuser.kernels.npu.machine import load_target
from fuser.models import get_example

from fuser import plugin_clock
from fuser.api import fuse, validate
from fuser.decide import AlwaysFuse


def test_tile_arithmetic_is_counted_in_functional_runs_only() -> None:
    kernel = registry.get_kernel("", "MatMul")
    assert kernel is not None
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((67, 45), np.float32), rng.standard_normal((45, 33), np.float32)
    npu = load_target("ascend910b")
    before = ARITHMETIC.seconds
    kernel.run(npu, [a, b], {}, functional=False)
    assert ARITHMETIC.seconds == before
    kernel.run(npu, [a, b], {})
    assert ARITHMETIC.seconds > before


@pytest.mark.parametrize("kernel", ["reference", "npu"])
def test_validate_splits_the_fused_step_by_kernel(kernel: str) -> None:
    original = get_example("cnn-edge")
    fused = fuse(original, decider=AlwaysFuse())
    result = validate(original, fused, kernel=kernel, runs=1, dim_size=2)
    assert result.ok
    seconds = result.seconds
    work = {k for k in seconds if k.startswith(("fused: ", "isolated nodes: "))}
    if kernel == "reference":
        assert work == {
            f"fused: {plugin_clock.REFERENCE}",
            f"isolated nodes: {plugin_clock.REFERENCE}",
        }
    else:
        # no stored tilings (every match fused unpriced): the kernel searches them at run time
        for step in ("fused", "isolated nodes"):
            assert seconds[f"{step}: {plugin_clock.ARITHMETIC}"] > 0
            assert seconds[f"{step}: {plugin_clock.SIMULATE}"] > 0
        assert seconds[f"fused: {plugin_clock.SEARCH}"] > 0
        assert f"fused: {plugin_clock.REFERENCE}" not in seconds
    for step in ("fused", "isolated nodes"):
        parts = sum(v for k, v in seconds.items() if k.startswith(f"{step}: "))
        assert parts <= seconds[step]
    assert seconds["compare"] > 0


def test_since_reports_only_what_was_added() -> None:
    before = plugin_clock.snapshot()
    plugin_clock.add(plugin_clock.SEARCH, 0.5)
    assert plugin_clock.since(before) == {plugin_clock.SEARCH: 0.5}
