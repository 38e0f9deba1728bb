"""AllGather (com.microsoft) on the stacked-shards convention: concatenation, ring timing."""

from __future__ import annotations

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels._link import step_cycles
from fuser.kernels.allgather import AllGatherTiling
from fuser.kernels.api import KernelError, TensorMeta
from fuser.kernels.npu.machine import load_target

M = load_target("ascend910b")
KERNEL = registry.get_kernel("com.microsoft", "AllGather")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(
    ("p", "shard", "axis"), [(2, (3, 5), 0), (4, (1, 7, 9), 1), (8, (4, 3), 1)]
)
def test_concatenates_in_rank_order(p, shard, axis, dtype) -> None:
    x = np.random.default_rng(p).standard_normal((p, *shard)).astype(dtype)
    for rank in (0, p - 1):
        (y,) = KERNEL.run(M, [x], {"group_size": p, "axis": axis, "rank": rank}).outputs
        np.testing.assert_array_equal(y, np.concatenate(list(x), axis=axis))


def test_time_is_the_ring_and_timing_only_agrees() -> None:
    x = np.zeros((4, 256, 1024), np.float16)
    attrs = {"group_size": 4, "axis": 0, "rank": 2}
    f = KERNEL.run(M, [x], attrs).stats
    t = KERNEL.run(M, [TensorMeta.of(x)], attrs, functional=False).stats
    assert f.cycles == t.cycles
    step = step_cycles(M, 256 * 1024 * 2)
    assert f.cycles == pytest.approx(M.kernel_launch_cycles + 3 * step)
    assert f.timeline is not None
    link = [i for i in f.timeline.intervals if i.pipe == "LINK"]
    assert [i.label for i in link] == ["shard 1", "shard 0", "shard 3"]
    assert f.gm_write == x.nbytes
    chunked = KERNEL.run(M, [x], attrs, tiling=AllGatherTiling(4), functional=False).stats
    assert chunked.cycles == pytest.approx(f.cycles + 3 * 3 * M.link_latency_s * M.clock_hz)


def test_errors() -> None:
    with pytest.raises(KernelError, match="group_size"):
        KERNEL.infer([TensorMeta((4, 3, 5), np.float32)], {"group_size": 2})
    with pytest.raises(KernelError, match="rank"):
        KERNEL.infer([TensorMeta((2, 3, 5), np.float32)], {"group_size": 2, "rank": 2})
    with pytest.raises(KernelError, match="axis"):
        KERNEL.infer([TensorMeta((2, 3, 5), np.float32)], {"group_size": 2, "axis": 2})
    with pytest.raises(KernelError, match="links 8 chips"):
        KERNEL.run(M, [TensorMeta((16, 3), np.float32)], {"group_size": 16}, functional=False)
    with pytest.raises(KernelError, match="no chip-to-chip links"):
        KERNEL.run(load_target("ascend310p"), [TensorMeta((2, 3), np.float32)],
                   {"group_size": 2}, functional=False)  # fmt: skip
