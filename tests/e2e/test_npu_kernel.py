"""Fused models in onnxruntime with every fused node on its simulated NPU kernel (`--kernel npu`).

Each models/ example is fused and validated against the original with the NPU kernels; each
fused op's kernel returns the same outputs as its `reference` (optional ones included); a tiling
that does not fit is refused with a reason naming the op and the node, never a wrong answer.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from fuser.kernels import registry
from fuser.models import EXAMPLES, cnn_edge, get_example
from onnx import helper

from fuser import fusedop
from fuser.api import fuse, validate
from fuser.npu_run import NpuKernelError, check_tilings, run_fused_on_npu
from fuser.ort import RunContext
from fuser.registry import ensure_fused_ops_registered

CTX = RunContext(kernel="npu", target="ascend910b", rank=0, communicator=None)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_validates_on_npu_kernels(name: str) -> None:
    model = get_example(name)
    result = fuse(model)
    assert sum(result.report.summary.values()) >= 1, f"example:{name} fused nothing"
    checked = validate(model, result, kernel="npu", runs=2)
    assert checked.kernel == "npu"
    bad = [o for o in checked.outputs if not o.ok]
    assert checked.ok, f"example:{name}: {bad}"


def _rng() -> np.random.Generator:
    return np.random.default_rng(0)


def _cases() -> list[tuple[str, list[np.ndarray | None], dict[str, Any]]]:
    r = _rng()
    f32 = np.float32

    def normal(*shape: int, dtype: Any = f32) -> np.ndarray:
        return r.standard_normal(shape).astype(dtype)

    return [
        (
            "ConvBnRelu",
            [normal(1, 3, 7, 6), normal(5, 3, 3, 3), normal(5), r.uniform(0.5, 1.5, 5).astype(f32),
             normal(5), normal(5), r.uniform(0.5, 2.0, 5).astype(f32)],
            {"pads": [1, 1, 1, 1], "relu": 1},
        ),
        (
            "LayerNormMatMul",
            [normal(2, 3, 20), normal(20), normal(20), normal(20, 9), normal(9), normal(20, 4)],
            {"has_bias": [1, 0], "flatten": [0, 0]},
        ),
        ("SoftmaxTopK", [normal(2, 5, 8, dtype=np.float16)], {"k": 2, "renormalize": 1}),
        (
            "AllGatherMatMul",
            [normal(2, 3, 8), normal(8, 5), normal(5)],
            {"group_size": 2, "axis": 0, "rank": 1},
        ),
    ]  # fmt: skip


@pytest.mark.parametrize(("op_name", "inputs", "attrs"), _cases(), ids=lambda c: str(c)[:20])
def test_kernel_returns_every_output_of_reference(
    op_name: str, inputs: list[np.ndarray | None], attrs: dict[str, Any]
) -> None:
    ensure_fused_ops_registered()
    op = fusedop.get(op_name)
    full = {a.name: a.default for a in op.attributes} | attrs
    expected = op.reference(inputs, full)
    actual = run_fused_on_npu(op_name, inputs, full, CTX)
    assert len(actual) == len(expected)
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert (a.shape, a.dtype) == (e.shape, e.dtype), f"output {i}"
        tol = 2e-2 if e.dtype == np.float16 else 1e-4
        np.testing.assert_allclose(
            a.astype(np.float64), e.astype(np.float64), rtol=tol, atol=tol, err_msg=f"output {i}"
        )


def _tile_attrs(op_name: str, **values: int) -> dict[str, int]:
    kernel = registry.get_kernel("fuser", op_name)
    assert kernel is not None
    return {f"tile_{f.name}": values.get(f.name, 1) for f in dataclasses.fields(kernel.tiling_type)}


def test_tiling_that_does_not_fit_is_refused_with_its_reason() -> None:
    op_name, inputs, attrs = _cases()[0]
    ensure_fused_ops_registered()
    op = fusedop.get(op_name)
    full = {a.name: a.default for a in op.attributes} | attrs
    too_many_cores = _tile_attrs(op_name, cores=1000, tile_h=2, tile_w=2, tile_co=16, tile_ci=16)
    with pytest.raises(NpuKernelError, match=r"ConvBnRelu on ascend910b: .*1000 cores"):
        run_fused_on_npu(op_name, inputs, full | too_many_cores, CTX)
    zero_rows = _tile_attrs(op_name, tile_h=0, tile_w=2, tile_co=16, tile_ci=16)
    with pytest.raises(NpuKernelError, match=r"ConvBnRelu on ascend910b: .*tile_h"):
        run_fused_on_npu(op_name, inputs, full | zero_rows, CTX)
    partial = dict(list(too_many_cores.items())[:2])
    with pytest.raises(NpuKernelError, match=r"tiling attributes missing: tile_"):
        run_fused_on_npu(op_name, inputs, full | partial, CTX)


def _pin_batch(model: onnx.ModelProto) -> None:
    """Give the symbolic batch N the size 1 in the graph's inputs, outputs and value infos."""
    g = model.graph
    for value in (*g.input, *g.output, *g.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == "N":
                dim.Clear()
                dim.dim_value = 1


def _badly_tiled(tmp_path: Path) -> tuple[Path, Path, str]:
    """A CNN with static shapes and its fused model whose first ConvBnRelu asks for 1000 cores
    (fused with a symbolic batch, so no tiling is stored, then pinned to batch 1)."""
    model = cnn_edge()
    fused = fuse(model).model
    _pin_batch(model)
    _pin_batch(fused)
    node = next(n for n in fused.graph.node if n.domain == "fuser")
    kept = [a for a in node.attribute if not a.name.startswith("tile_")]
    del node.attribute[:]
    node.attribute.extend(kept)
    for name, value in _tile_attrs("ConvBnRelu", cores=1000, tile_h=2, tile_w=2).items():
        node.attribute.append(helper.make_attribute(name, value))
    original, bad = tmp_path / "cnn.onnx", tmp_path / "cnn.badtile.onnx"
    onnx.save(model, original)
    onnx.save(fused, bad)
    return original, bad, node.name


def test_check_tilings_names_the_node(tmp_path: Path) -> None:
    _, bad, node_name = _badly_tiled(tmp_path)
    with pytest.raises(NpuKernelError, match=rf"node '{node_name}' \(ConvBnRelu\).*1000 cores"):
        check_tilings(onnx.load(bad), "ascend910b")


def test_tilings_chosen_at_fuse_time_pass_the_kernel_check() -> None:
    fused = fuse(cnn_edge(batch=1)).model
    assert any(a.name.startswith("tile_") for n in fused.graph.node for a in n.attribute)
    check_tilings(fused, "ascend910b")


def test_cli_validate_with_a_bad_tiling_fails_with_one_line(tmp_path: Path) -> None:
    original, bad, node_name = _badly_tiled(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "fuser.cli", "validate", str(original), str(bad), "--runs", "1"],
        capture_output=True, text=True, cwd=Path(__file__).anchor, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    # onnxruntime may log its own warning about the failed op's outputs; fuser says one line.
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and node_name in errors[0] and "1000 cores" in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_cli_validate_defaults_to_the_npu_kernel(tmp_path: Path) -> None:
    model = get_example("moe")
    original, fused_path = tmp_path / "moe.onnx", tmp_path / "moe.fused.onnx"
    onnx.save(model, original)
    onnx.save(fuse(model).model, fused_path)
    done = subprocess.run(
        [sys.executable, "-m", "fuser.cli", "validate", str(original), str(fused_path), "--json"],
        capture_output=True, text=True, cwd=Path(__file__).anchor, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"kernel": "npu"' in done.stdout
