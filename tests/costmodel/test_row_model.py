"""The SoftmaxTopK row model against the simulator where tiles per core and buffering vary."""

from __future__ import annotations

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels.api import TensorMeta
from fuser.kernels.npu.machine import load_target
from fuser.kernels.search import model_for
from fuser.kernels.softmax_topk import SoftmaxTopKTiling as Rows

M = load_target("ascend910b")
KERNEL = registry.get_kernel("fuser", "SoftmaxTopK")
MODEL = model_for("fuser", "SoftmaxTopK")


@pytest.mark.parametrize(
    ("shape", "k", "dtype", "tiling"),
    [
        ((12000, 8), 1, np.float32, Rows(125, 1, 48)),  # 2 tiles per core, double-buffered
        ((2048, 32), 4, np.float16, Rows(15, 1, 48)),  # 3 tiles per core
        ((12000, 8), 1, np.float32, Rows(250, 1, 48)),  # 1 tile per core
        ((2048, 32), 4, np.float16, Rows(22, 0, 48)),  # single-buffered
    ],
)
def test_copy_out_head_overlaps_the_later_tiles(shape, k, dtype, tiling) -> None:
    """Double-buffered over several tiles, the copy-out pipe's start-up head runs under the
    next tiles' copy-in and vector work: the model charges it there, not before the stream
    (it was 14% over the simulator at 12000x8, 2 tiles per core)."""
    assert MODEL is not None
    metas = [TensorMeta(shape, np.dtype(dtype))]
    attrs = {"k": k}
    predicted = MODEL.cost(metas, attrs, tiling, M)
    simulated = KERNEL.run(M, metas, attrs, tiling=tiling, functional=False).stats.cycles
    assert predicted == pytest.approx(simulated, rel=0.03)
