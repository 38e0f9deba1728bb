"""Kernel discovery and the roofline estimate for ops without a kernel."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels.api import Kernel, TensorMeta
from kernel_oracle import MACHINE

MINE = [
    ("fuser", "ConvBnRelu"), ("", "Conv"), ("", "BatchNormalization"), ("", "Relu"),
    ("", "Add"), ("", "Sub"), ("", "Mul"), ("", "Div"), ("", "Pow"), ("", "Sqrt"),
    ("", "Reciprocal"), ("", "Cast"), ("", "MatMul"), ("", "Gemm"),
]  # fmt: skip


@pytest.mark.parametrize(("domain", "op"), MINE)
def test_kernels_are_discovered(domain: str, op: str) -> None:
    k = registry.get_kernel(domain, op)
    assert isinstance(k, Kernel)
    assert (k.domain, k.op_type) == (domain, op)
    assert registry.all_kernels()[(domain, op)] is k


def test_ai_onnx_domain_is_the_default_domain_and_unknown_ops_have_no_kernel() -> None:
    assert registry.get_kernel("ai.onnx", "Relu") is registry.get_kernel("", "Relu")
    assert registry.get_kernel("", "NoSuchOp") is None
    assert registry.get_kernel("fuser", "Conv") is None


def test_every_kernel_declares_a_tiling_that_round_trips_as_attributes() -> None:
    for k in registry.all_kernels().values():
        fields = dataclasses.fields(k.tiling_type)
        t = k.tiling_type(**{f.name: 1 for f in fields})
        assert k.tiling_from_attrs(k.tiling_to_attrs(t)) == t


def test_estimate_is_a_marked_roofline() -> None:
    x = TensorMeta((64, 1024, 1024), np.float16)
    s = registry.estimate("Transpose", [x], [x], MACHINE)
    assert s.estimated is True
    assert s.timeline is None
    assert s.gm_read == x.nbytes
    assert s.gm_write == x.nbytes
    mem = 2 * x.nbytes / MACHINE.hbm_bytes_per_cycle
    assert s.cycles == pytest.approx(MACHINE.kernel_launch_cycles + mem)
    assert s.bound == "memory"
    tiny = registry.estimate("Shape", [TensorMeta((4,), np.int64)], [], MACHINE)
    assert tiny.cycles == pytest.approx(
        MACHINE.kernel_launch_cycles + 32 / MACHINE.hbm_bytes_per_cycle
    )
