"""A staged schedule's stage without a cost model (LayerNorm, Cast, ...) is timed once per
process per (op, input metas, attributes, target): `search.timed_cycles` gives what the
unmemoized timing-only run of `_staged.stage` gives, and runs the kernel only on a miss."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from fuser.kernels import _staged
from fuser.kernels import search as ks
from fuser.kernels.api import Kernel, TensorMeta
from fuser.kernels.npu.machine import load_target
from fuser.kernels.registry import get_kernel

from fuser.check_infer import infer_types
from fuser.costmodel import CostModelDecider
from fuser.graph import GraphIndex
from fuser.modelio import load_model

B910 = load_target("ascend910b")
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)


def counted_runs(monkeypatch: pytest.MonkeyPatch, kernel: Kernel) -> list[tuple[Any, ...]]:
    """Every `run` of `kernel`'s class from now on, by input shapes."""
    calls: list[tuple[Any, ...]] = []
    original = type(kernel).run

    def run(self: Kernel, machine: Any, inputs: Any, attrs: Any, **kw: Any) -> Any:
        calls.append(tuple(None if x is None else tuple(x.shape) for x in inputs))
        return original(self, machine, inputs, attrs, **kw)

    monkeypatch.setattr(type(kernel), "run", run)
    return calls


def indexed(text: str) -> tuple[GraphIndex, onnx.NodeProto]:
    """Model `text` (ONNX's text syntax) loaded and indexed as a fuse does it; its first node."""
    loaded = load_model(onnx.parser.parse_model(text))
    graph = GraphIndex.build(loaded.model.graph, loaded, {"": 17}, infer_types(loaded.model)[""])
    return graph, loaded.model.graph.node[0]


@pytest.mark.parametrize(
    ("shape", "dtype"), [((1, 1, 8), F32), ((3, 17, 13), F16), ((256, 256, 8), F32)]
)
def test_timed_cycles_equal_the_stage_run(shape: tuple[int, ...], dtype: np.dtype) -> None:
    ks.clear_memo()
    metas = [TensorMeta(shape, dtype), TensorMeta(shape[-1:], dtype), TensorMeta(shape[-1:], dtype)]
    attrs = {"axis": -1, "epsilon": 1e-5}
    direct = _staged.stage(B910, "LayerNormalization", metas, attrs, False, False).stats.cycles
    kernel = get_kernel("", "LayerNormalization")
    assert kernel is not None
    assert ks.timed_cycles(kernel, metas, attrs, B910) == direct
    assert _staged.stage_cycles(B910, "LayerNormalization", metas, attrs) == direct


def test_a_repeated_stage_runs_its_kernel_once(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = get_kernel("", "LayerNormalization")
    assert kernel is not None
    ks.clear_memo()
    calls = counted_runs(monkeypatch, kernel)
    x = [TensorMeta((5, 9, 24), F16), TensorMeta((24,), F16), TensorMeta((24,), F16)]
    first = _staged.stage_cycles(B910, "LayerNormalization", x, {"axis": -1, "epsilon": 1e-5})
    again = _staged.stage_cycles(B910, "LayerNormalization", x, {"axis": -1, "epsilon": 1e-5})
    assert first == again and len(calls) == 1
    # Another epsilon takes no part in the timing (`timing_key`: the row plan): the same run.
    # Another width or a cleared memo is another run.
    assert (
        _staged.stage_cycles(B910, "LayerNormalization", x, {"axis": -1, "epsilon": 1e-3})
        == (
            kernel.run(B910, x, {"axis": -1, "epsilon": 1e-3}, functional=False, timeline=False)
        ).stats.cycles
    )
    assert len(calls) == 2  # the check's own run
    wider = [TensorMeta((5, 9, 40), F16), TensorMeta((40,), F16), TensorMeta((40,), F16)]
    _staged.stage_cycles(B910, "LayerNormalization", wider, {"axis": -1, "epsilon": 1e-5})
    assert len(calls) == 3
    ks.clear_memo()
    assert (
        _staged.stage_cycles(B910, "LayerNormalization", x, {"axis": -1, "epsilon": 1e-5}) == first
    )
    assert len(calls) == 4 and calls[-1] == ((5, 9, 24), (24,), (24,))


def test_an_unfused_node_and_a_stage_of_the_same_op_share_one_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The cost model times an unfused LayerNormalization (no cost model: a timing-only run at
    # its run-time tiling) through `timed_cycles`: a fused op's staged schedule that times the
    # same LayerNorm as a stage does not run it again, and the cycles are the plain run's.
    kernel = get_kernel("", "LayerNormalization")
    assert kernel is not None
    ks.clear_memo()
    graph, node = indexed(
        """<ir_version: 9, opset_import: ["" : 17]>
        g (float16[7, 33, 40] x, float16[40] s, float16[40] b) => (float16[7, 33, 40] y) {
            y = LayerNormalization <axis = -1, epsilon = 0.001> (x, s, b)
        }"""
    )
    metas = [TensorMeta((7, 33, 40), F16), TensorMeta((40,), F16), TensorMeta((40,), F16)]
    attrs = {"axis": -1, "epsilon": float(np.float32(0.001))}
    direct = kernel.run(B910, metas, attrs, functional=False, timeline=False).stats.cycles
    calls = counted_runs(monkeypatch, kernel)
    decider = CostModelDecider.for_target("ascend910b", cache=False)
    cycles, symbolic = decider.price_node(graph, node)
    assert (cycles, symbolic) == (direct, False)
    assert ks.timed_cycles(kernel, metas, attrs, B910) == direct
    assert len(calls) == 1 and calls[0] == ((7, 33, 40), (40,), (40,))


@pytest.mark.parametrize(("dtype", "runs"), [(F32, 1), (F16, 2)])
def test_stash_type_is_timed_once_where_it_leaves_the_plan_alone(
    monkeypatch: pytest.MonkeyPatch, dtype: np.dtype, runs: int
) -> None:
    # stash_type only picks the Mean/InvStdDev dtype: float32 either way for a float32 input
    # (one run for both, and for the attribute left out), float16 or float32 for a float16 one.
    kernel = get_kernel("", "LayerNormalization")
    assert kernel is not None
    x = [TensorMeta((6, 11, 40), dtype), TensorMeta((40,), dtype), TensorMeta((40,), dtype)]
    variants = [{"axis": -1, "stash_type": 1}, {"axis": -1, "stash_type": 0}, {"axis": 2}]
    direct = [
        kernel.run(B910, x, attrs, functional=False, timeline=False).stats.cycles
        for attrs in variants
    ]
    ks.clear_memo()
    calls = counted_runs(monkeypatch, kernel)
    assert [ks.timed_cycles(kernel, x, attrs, B910) for attrs in variants] == direct
    assert len(calls) == runs
    assert (kernel.timing_key(x, variants[0]) == kernel.timing_key(x, variants[1])) == (runs == 1)


def test_a_layernorm_with_constant_weights_is_timed_from_their_metas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Small initializers reach `price_node` as arrays; LayerNorm's timing reads none of them
    # (`value_inputs`), so the node is timed from metas through `timed_cycles`: the very run a
    # stage of the same LayerNorm makes, at the cycles of the run with the arrays.
    kernel = get_kernel("", "LayerNormalization")
    assert kernel is not None
    ks.clear_memo()
    graph, node = indexed(
        """<ir_version: 9, opset_import: ["" : 17]>
        g (float[7, 33, 40] x) => (float[7, 33, 40] y)
        <float[40] s = {1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0,
            7.0, 8.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
            8.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0}> {
            y = LayerNormalization <axis = -1, epsilon = 0.001> (x, s, s)
        }"""
    )
    weights = np.arange(40, dtype=np.float32)
    attrs = {"axis": -1, "epsilon": float(np.float32(0.001))}
    arrays = [TensorMeta((7, 33, 40), F32), weights, weights]
    direct = kernel.run(B910, arrays, attrs, functional=False, timeline=False).stats.cycles
    calls = counted_runs(monkeypatch, kernel)
    decider = CostModelDecider.for_target("ascend910b", cache=False)
    assert decider.price_node(graph, node) == (direct, False)
    metas = [TensorMeta((7, 33, 40), F32), TensorMeta((40,), F32), TensorMeta((40,), F32)]
    assert _staged.stage_cycles(B910, "LayerNormalization", metas, attrs) == direct
    assert calls == [((7, 33, 40), (40,), (40,))]  # the stage was the node's run, memoized
