"""`unfuse`: every fused node replaced by its body gives plain ONNX that validates against the
original (AllGatherMatMul on 2 ranks, its AllGather on fuser's communicator); the CLI command
and its error contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from fuser.models import get_example, parallel

import fuser
from fuser.functions import graphs
from fuser.fusedop import DOMAIN
from fuser.testing import fuse_all


def assert_plain(model: onnx.ModelProto) -> None:
    for graph in graphs(model.graph):
        assert all(n.domain != DOMAIN for n in graph.node)
    assert all(f.domain != DOMAIN for f in model.functions)
    assert DOMAIN not in {o.domain for o in model.opset_import}


UNFUSE_EXAMPLES = ["resnet", "cnn-edge", "conv1d", "bert", "bert17", "gpt2", "gpt-noaffine"]
UNFUSE_EXAMPLES += ["moe", "moe-fp16", "qwen-router", "topk-softmax-router"]


@pytest.mark.parametrize("name", UNFUSE_EXAMPLES)
def test_unfused_model_is_plain_and_validates(name: str) -> None:
    original = get_example(name)
    fused = fuse_all(original)
    assert fused.report.fusions
    plain = fuser.unfuse(fused)
    assert_plain(plain.model)
    assert sum(plain.inlined.values()) == len(fused.report.fusions)
    result = fuser.validate(original, plain)
    assert result.ok, result.outputs
    onnx.checker.check_model(plain.model, full_check=True)


def test_folded_weights_stay_folded() -> None:
    original = get_example("resnet")
    plain = fuser.unfuse(fuse_all(original)).model
    assert "BatchNormalization" in {n.op_type for n in original.graph.node}
    assert "BatchNormalization" not in {n.op_type for n in plain.graph.node}
    folded = {t.name for t in plain.graph.initializer if "bn_folded" in t.name}
    assert folded and all(
        n in folded for c in plain.graph.node if c.op_type == "Conv" for n in c.input[1:]
    )


def test_unfuse_of_bare_ops_gives_the_same_model() -> None:
    original = get_example("cnn-edge")
    with_bodies = fuser.fuse(original, decider=fuser.decide.AlwaysFuse()).model
    bare = fuser.fuse(original, decider=fuser.decide.AlwaysFuse(), functions=False).model
    a, b = fuser.unfuse(with_bodies).model, fuser.unfuse(bare).model
    assert list(a.graph.node) == list(b.graph.node)


def test_unfuse_of_a_plain_model_changes_nothing_in_its_graph() -> None:
    original = get_example("bert")
    plain = fuser.unfuse(original)
    assert plain.inlined == {}
    assert list(plain.model.graph.node) == list(original.graph.node)


def test_unknown_fused_op_is_refused_with_its_name() -> None:
    model = fuse_all(get_example("resnet")).model
    model.graph.node[0].op_type = "ConvBnGelu"
    with pytest.raises(Exception, match="ConvBnGelu"):
        fuser.unfuse(model)


# -- AllGatherMatMul: onnxruntime's CPU package has no AllGather kernel ---------------------


def gathered_output_model(dtype: str) -> onnx.ModelProto:
    """AllGather(axis=1) -> MatMul without bias, the gathered value also a graph output."""
    model = parallel.tp_mlp(bias=False, dtype=dtype, hidden=10, group_size=2)
    gather = next(n for n in model.graph.node if n.op_type == "AllGather")
    for attr in gather.attribute:
        if attr.name == "axis":
            attr.i = 1  # sequence parallel on a [batch, seq, hidden] shard
    x = model.graph.input[0]
    x.type.tensor_type.shape.dim[2].dim_value = 10
    # a [B, S, 10] shard gathered on S: the first MatMul's weight stays [10, 32]
    mm = next(n for n in model.graph.node if n.op_type == "MatMul")
    weight = next(t for t in model.graph.initializer if t.name == mm.input[1])
    array = onnx.numpy_helper.to_array(weight)
    weight.CopyFrom(
        onnx.numpy_helper.from_array(np.resize(array, (10, array.shape[1])), weight.name)
    )
    del model.graph.value_info[:]
    elem = model.graph.input[0].type.tensor_type.elem_type
    model.graph.output.append(
        onnx.helper.make_tensor_value_info(gather.output[0], elem, ["batch", "seq2", 10])
    )
    out = model.graph.output[0]
    out.type.tensor_type.shape.dim[1].dim_param = "seq2"
    out.type.tensor_type.shape.dim[2].ClearField("dim_value")
    out.type.tensor_type.shape.dim[2].dim_param = "h"
    return model


ALLGATHER_CASES: dict[str, Any] = {
    "tp-bias": lambda dtype: parallel.tp_mlp(dtype=dtype),
    "tp-nobias-negaxis": lambda dtype: parallel.tp_mlp(bias=False, negative_axis=True, dtype=dtype),
    "sp-sbh": lambda dtype: parallel.sp_mlp(layout="sbh", dtype=dtype),
    "sp-bsh-nobias": lambda dtype: parallel.sp_mlp(layout="bsh", bias=False, dtype=dtype),
    "gathered-output": gathered_output_model,
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", list(ALLGATHER_CASES))
def test_allgather_matmul_body_runs_on_two_ranks(case: str, dtype: str) -> None:
    original = ALLGATHER_CASES[case](dtype)
    fused = fuse_all(original)
    (node,) = [n for n in fused.model.graph.node if n.domain == DOMAIN]
    assert node.op_type == "AllGatherMatMul"
    with_bias = "nobias" not in case and case != "gathered-output"
    assert node.overload.startswith("bias" if with_bias else "nobias")
    assert node.overload.endswith("_nogathered") == (case != "gathered-output")
    plain = fuser.unfuse(fused)
    ops = [n.op_type for n in plain.model.graph.node]
    assert ops.count("AllGather") == 1 and "MatMul" in ops
    result = fuser.validate(original, plain)
    assert result.ranks == 2
    assert result.ok, result.outputs


# The variants (issue 8 item 5): one body per Linear layout, run on 2 ranks after unfuse.
ALLGATHER_VARIANTS: dict[str, tuple[Any, str]] = {
    "qkv": (lambda dtype: parallel.tp_attention(dtype=dtype), "mmb_mmb_mmb"),
    "qkv-nobias": (lambda dtype: parallel.tp_attention(bias=False, dtype=dtype), "mm_mm_mm"),
    "gemm": (lambda dtype: parallel.tp_linear(dtype=dtype), "gemmbft_a1.0_b1.0"),
    "reshape-gemm": (
        lambda dtype: parallel.tp_linear(form="reshape-gemm", dtype=dtype),
        "gemmbft_a1.0_b1.0",
    ),
    "reshape-matmul": (
        lambda dtype: parallel.tp_linear(form="reshape-matmul", dtype=dtype),
        "mmbf",
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", list(ALLGATHER_VARIANTS))
def test_allgather_variant_bodies_run_on_two_ranks(case: str, dtype: str) -> None:
    build, variant = ALLGATHER_VARIANTS[case]
    original = build(dtype)
    fused = fuse_all(original)
    (node,) = [n for n in fused.model.graph.node if n.domain == DOMAIN]
    assert node.op_type == "AllGatherMatMul"
    # A single Linear drops the trailing unused `gathered`; QKV passes "" in its place.
    assert node.overload == (variant if case.startswith("qkv") else variant + "_nogathered")
    plain = fuser.unfuse(fused)
    ops = [n.op_type for n in plain.model.graph.node]
    assert ops.count("AllGather") == 1
    result = fuser.validate(original, plain)
    assert result.ranks == 2
    assert result.ok, result.outputs


def test_allgather_body_is_not_runnable_by_stock_onnxruntime_cpu() -> None:
    """Why the test above registers fuser's communicator: the CPU package lacks AllGather."""
    fused = fuse_all(parallel.tp_mlp()).model
    with pytest.raises(Exception, match="AllGather"):
        onnxruntime.InferenceSession(fused.SerializeToString())


# -- the CLI -------------------------------------------------------------------------------


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fuser.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def test_cli_fuse_then_unfuse(tmp_path: Path) -> None:
    fused, plain, bare = tmp_path / "f.onnx", tmp_path / "p.onnx", tmp_path / "b.onnx"
    done = cli("fuse", "example:cnn-edge", "-o", str(fused), "--force", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    before = fused.read_bytes()
    done = cli("unfuse", str(fused), "-o", str(plain), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "unfused 4 fused nodes (ConvBnRelu x4)" in done.stdout
    assert fused.read_bytes() == before
    assert_plain(onnx.load(plain))
    assert fuser.validate(get_example("cnn-edge"), str(plain)).ok
    done = cli(
        "fuse", "example:cnn-edge", "-o", str(bare), "--force", "--no-functions", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert not onnx.load(bare).functions and onnx.load(fused).functions


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.onnx", "-o", "out.onnx"], "missing.onnx"),
        (["same.onnx", "-o", "same.onnx"], "would overwrite the input"),
        (["garbage.onnx", "-o", "out.onnx"], "garbage.onnx"),
    ],
)
def test_cli_unfuse_errors_are_one_line_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "same.onnx").write_bytes(fuse_all(get_example("resnet")).model.SerializeToString())
    (tmp_path / "garbage.onnx").write_bytes(b"not a model")
    done = cli("unfuse", *args, cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.onnx").exists()


def test_fuser_unfuse_stays_the_function_once_its_module_is_imported() -> None:
    """The lazy public API: a submodule named `unfuse` would replace the function on import."""
    import importlib

    module = importlib.import_module("fuser.unfused")
    assert fuser.unfuse is module.unfuse
    assert callable(fuser.unfuse)
