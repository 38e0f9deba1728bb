"""The CLI end to end, as a user runs it: real files, the installed `fuser` command, exit codes.

Bad input must give one clear line on stderr, a non-zero exit, no output file, and leave the
input byte-for-byte unchanged.
"""

from __future__ import annotations

import hashlib
import json
import pstats
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

FUSER = [sys.executable, "-m", "fuser.cli"]


def fuser(*args: str) -> subprocess.CompletedProcess[str]:
    # Run outside the repository: `python -m` puts the working directory first on sys.path, and
    # the repo's own fuser/ folder (without patterns/ mapped in) must not shadow the install.
    return subprocess.run(
        [*FUSER, *args], capture_output=True, text=True, cwd=Path(__file__).anchor, timeout=300
    )


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def small_cnn(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    c = 4
    inits = [
        numpy_helper.from_array(rng.standard_normal((c, 3, 3, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), "s"),
        numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b"),
        numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "m"),
        numpy_helper.from_array(rng.uniform(0.1, 1, c).astype(np.float32), "v"),
        numpy_helper.from_array(rng.standard_normal((c, c, 1, 1)).astype(np.float32), "W2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "W2"], ["y"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 6, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c, 6, 5])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "in" / "model.onnx"
    path.parent.mkdir()
    onnx.save(small_cnn(), path)
    return path


def test_fuse_validate_and_report(model_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "model.fused.onnx"
    report = tmp_path / "report.json"
    before = digest(model_file)
    result = fuser("fuse", str(model_file), "-o", str(out), "--validate", "--report", str(report))
    assert result.returncode == 0, result.stderr
    assert "conv_bn_relu" in result.stdout and "nodes: 4 -> 2" in result.stdout
    data = json.loads(report.read_text())
    assert data["summary"] == {
        "conv_bn_relu": 1,
        **{k: 0 for k in data["summary"] if k != "conv_bn_relu"},
    }
    assert data["fusions"][0]["nodes"] == ["conv", "bn", "relu"]
    assert data["nodes_before"] == 4 and data["nodes_after"] == 2
    assert data["validation"]["ok"] is True
    assert digest(model_file) == before
    fused = onnx.load(out)
    assert [n.op_type for n in fused.graph.node] == ["ConvBnRelu", "Conv"]


def test_validate_command_json_and_exit_code(model_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "f.onnx"
    assert fuser("fuse", str(model_file), "-o", str(out)).returncode == 0
    ok = fuser("validate", str(model_file), str(out), "--json", "--runs", "2")
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert data["ok"] is True and data["outputs"][0]["name"] == "y"
    assert data["outputs"][0]["max_rel"] <= 1e-4
    # break the fused model's folded weight: validation must fail with exit 1
    broken = onnx.load(out)
    for tensor in broken.graph.initializer:
        if "bn_folded" in tensor.name and tensor.dims[0] == 4 and len(tensor.dims) == 1:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) + 1, tensor.name))
    onnx.save(broken, tmp_path / "broken.onnx")
    bad = fuser("validate", str(model_file), str(tmp_path / "broken.onnx"), "--json")
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["ok"] is False


def test_validate_with_given_inputs(model_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "f.onnx"
    assert fuser("fuse", str(model_file), "-o", str(out)).returncode == 0
    np.save(tmp_path / "x.npy", np.ones((1, 3, 6, 5), np.float32))
    result = fuser(
        "validate", str(model_file), str(out), "--input", f"x={tmp_path / 'x.npy'}", "--json"
    )
    assert result.returncode == 0, result.stderr
    wrong = fuser("validate", str(model_file), str(out), "--input", "nope=missing.npy")
    assert wrong.returncode == 2 and "nope" in wrong.stderr


def test_same_input_gives_same_bytes_and_fusing_twice_changes_nothing(
    model_file: Path, tmp_path: Path
) -> None:
    a, b, c = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "c.onnx"
    for out in (a, b):
        assert fuser("fuse", str(model_file), "-o", str(out)).returncode == 0
    assert a.read_bytes() == b.read_bytes()
    assert fuser("fuse", str(a), "-o", str(c)).returncode == 0
    assert c.read_bytes() == a.read_bytes()


def test_external_data_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    model = small_cnn()
    onnx.save(
        model,
        src / "model.onnx",
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=0,
    )
    assert (src / "weights.bin").exists()
    out = tmp_path / "elsewhere" / "fused.onnx"
    result = fuser("fuse", str(src / "model.onnx"), "-o", str(out), "--validate")
    assert result.returncode == 0, result.stderr
    assert (out.parent / "fused.onnx.data").exists()
    fused = onnx.load(out, load_external_data=False)
    # every tensor stays external (the whole model was never one protobuf with its data)
    big = [t for t in fused.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert {t.name for t in big} >= {"W2"}
    assert out.stat().st_size < 2000
    check = fuser("validate", str(src / "model.onnx"), str(out))
    assert check.returncode == 0, check.stderr


def test_api_keeps_external_tensors_unloaded(tmp_path: Path) -> None:
    import fuser

    model = small_cnn()
    onnx.save(
        model, tmp_path / "m.onnx", save_as_external_data=True, location="m.bin", size_threshold=0
    )
    result = fuser.fuse(tmp_path / "m.onnx")
    w2 = next(t for t in result.model.graph.initializer if t.name == "W2")
    assert w2.data_location == TensorProto.EXTERNAL and not w2.raw_data


@pytest.mark.parametrize(
    ("make_input", "expected"),
    [
        (lambda d: d / "missing.onnx", "no such file"),
        (lambda d: _write(d / "text.onnx", b"this is not a model\n"), "not a valid ONNX model"),
        (
            lambda d: _write(d / "trunc.onnx", small_cnn().SerializeToString()[:300]),
            "not a valid ONNX model",
        ),
        (lambda d: _save(d / "cycle.onnx", _cycle_model()), "cycle"),
        (lambda d: _save(d / "dangling.onnx", _dangling_model()), "dangling"),
        (lambda d: _traversal_model(d), "outside the model's folder"),
    ],
    ids=["missing", "not-onnx", "truncated", "cycle", "dangling", "path-traversal"],
)
def test_bad_input_fails_cleanly(tmp_path: Path, make_input: object, expected: str) -> None:
    path = make_input(tmp_path)  # type: ignore[operator]
    before = digest(path) if path.exists() else None
    out = tmp_path / "out.onnx"
    result = fuser("fuse", str(path), "-o", str(out))
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0] and path.name in lines[0]
    assert not out.exists()
    assert list(tmp_path.glob("*.tmp")) == [] and list(tmp_path.glob(".out.onnx*")) == []
    if before is not None:
        assert digest(path) == before


def test_unknown_pattern_is_refused(model_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.onnx"
    result = fuser("fuse", str(model_file), "-o", str(out), "--patterns", "conv_bn_relu,nope")
    assert result.returncode == 2
    assert "unknown pattern 'nope'" in result.stderr and "conv_bn_relu" in result.stderr
    assert not out.exists()


def test_output_over_input_is_refused(model_file: Path) -> None:
    before = digest(model_file)
    result = fuser("fuse", str(model_file), "-o", str(model_file))
    assert result.returncode == 2 and "overwrite the input" in result.stderr
    assert digest(model_file) == before


def test_disable_and_inspect(model_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.onnx"
    result = fuser("fuse", str(model_file), "-o", str(out), "--disable", "conv_bn_relu", "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout)["summary"].get("conv_bn_relu", 0) == 0
    inspected = fuser("inspect", str(model_file), "--json")
    data = json.loads(inspected.stdout)
    assert [m["nodes"] for m in data["fusions"]] == [["conv", "bn", "relu"]]


def test_patterns_lists_every_family() -> None:
    result = fuser("patterns", "--json")
    assert result.returncode == 0
    names = {row["name"] for row in json.loads(result.stdout)}
    assert "conv_bn_relu" in names


def test_installed_console_script_runs() -> None:
    exe = shutil.which("fuser", path=str(Path(sys.executable).parent))
    assert exe is not None
    result = subprocess.run([exe, "patterns"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ConvBnRelu" in result.stdout


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _save(path: Path, model: onnx.ModelProto) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def _cycle_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [
            helper.make_node("Neg", ["b"], ["a"], name="n1"),
            helper.make_node("Relu", ["a"], ["b"], name="n2"),
        ],
        "g",
        [],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _dangling_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Neg", ["ghost"], ["a"], name="n1")],
        "g",
        [],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _traversal_model(folder: Path) -> Path:
    secret = folder / "secret.bin"
    secret.write_bytes(np.arange(16, dtype=np.float32).tobytes())
    inner = folder / "models"
    inner.mkdir()
    model = small_cnn()
    tensor = next(t for t in model.graph.initializer if t.name == "W2")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../secret.bin"), ("offset", "0"), ("length", "64")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return _save(inner / "evil.onnx", model)


def test_unknown_target_is_refused(model_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.onnx"
    result = fuser("fuse", str(model_file), "-o", str(out), "--target", "ascend9999")
    assert result.returncode == 2
    assert "ascend9999" in result.stderr and "ascend910b" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("fixture", ["gpt2-ts14", "bert-ts13", "cnn-dynamo18", "mixtral-dynamo18"])
def test_exported_models_fuse_idempotently(fixture: str, tmp_path: Path) -> None:
    """Real exports are not always in the order a sort would pick: fusing twice must not move
    a single byte (a sort that reorders valid orders would)."""
    src = Path(__file__).parents[1] / "data" / "exported" / f"{fixture}.onnx"
    once, twice = tmp_path / "once.onnx", tmp_path / "twice.onnx"
    assert fuser("fuse", str(src), "-o", str(once)).returncode == 0
    assert fuser("fuse", str(once), "-o", str(twice)).returncode == 0
    assert twice.read_bytes() == once.read_bytes()


def test_tuning_cache_options(tmp_path: Path) -> None:
    static = small_cnn()
    for value in (*static.graph.input, *static.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = 2  # static shapes get a stored tiling
    model_file = tmp_path / "static.onnx"
    onnx.save(static, model_file)
    cache = tmp_path / "tuning.sqlite"
    out = tmp_path / "o.onnx"
    first = fuser("fuse", str(model_file), "-o", str(out), "--cache", str(cache), "--json")
    assert first.returncode == 0, first.stderr
    assert cache.exists() and cache.stat().st_size > 0
    tiling = json.loads(first.stdout)["fusions"][0]["attributes"]
    assert any(k.startswith("tile_") for k in tiling)  # static shapes: the pick is on the node
    again = fuser("fuse", str(model_file), "-o", str(tmp_path / "o2.onnx"), "--cache", str(cache))
    assert again.returncode == 0
    assert (tmp_path / "o2.onnx").read_bytes() == out.read_bytes()
    off = tmp_path / "off.sqlite"
    none = fuser("fuse", str(model_file), "-o", str(tmp_path / "o3.onnx"), "--no-cache")
    assert none.returncode == 0 and not off.exists()
    assert (tmp_path / "o3.onnx").read_bytes() == out.read_bytes()


def test_opset_onnxruntime_cannot_run_is_refused(tmp_path: Path) -> None:
    model = small_cnn()
    model.opset_import[0].version = 99
    path = _save(tmp_path / "future.onnx", model)
    before = digest(path)
    out = tmp_path / "o.onnx"
    result = fuser("fuse", str(path), "-o", str(out))
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "future.onnx" in lines[0] and "opset 99" in lines[0], lines
    assert not out.exists() and digest(path) == before


def test_checker_complaint_onnxruntime_ignores_is_one_warning_line(tmp_path: Path) -> None:
    """A graph output only onnxruntime can type: fused anyway, the checker's words on one line."""
    model = small_cnn()
    model.graph.node.append(
        helper.make_node("Gelu", ["y"], ["z"], name="gelu", domain="com.microsoft")
    )
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    path = _save(tmp_path / "ms.onnx", model)
    out = tmp_path / "o.onnx"
    result = fuser("fuse", str(path), "-o", str(out), "--json")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: graph output 'z'"), lines
    assert "Field 'shape' of 'type' is required but missing" in lines[0]
    assert json.loads(result.stdout)["summary"]["conv_bn_relu"] == 1
    assert out.exists()


def test_unknown_example_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / "o.onnx"
    result = fuser("fuse", "example:nope", "-o", str(out))
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown example model 'nope'" in lines[0] and "resnet" in lines[0]
    assert not out.exists()


def test_a_command_ends_with_all_it_said_and_wrote(tmp_path: Path) -> None:
    # The entry point ends the process without tearing the interpreter down (cli.exit_now):
    # what was printed (into a pipe: block-buffered), the output file and the tuning cache
    # must all be complete, and the exit code kept.
    src = _save(tmp_path / "in.onnx", small_cnn())
    cache = tmp_path / "tuning.sqlite"
    done = fuser(
        "fuse", str(src), "-o", str(tmp_path / "out.onnx"), "--json", "--cache", str(cache)
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # the whole JSON document, to its last brace
    assert report["summary"]["conv_bn_relu"] == 1
    onnx.checker.check_model(onnx.load(str(tmp_path / "out.onnx")))
    with sqlite3.connect(cache) as conn:  # every tiling the fuse priced is in the cache
        assert conn.execute("SELECT COUNT(*) FROM tilings").fetchone()[0] >= 1
    missing = fuser("fuse", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "o2.onnx"))
    assert missing.returncode == 2 and "missing.onnx" in missing.stderr
    usage = fuser("fuse", str(src))  # no -o: click's usage error, exit 2
    assert usage.returncode == 2 and "--output" in usage.stderr


def test_a_profiled_command_ends_normally(tmp_path: Path) -> None:
    # Under a profiler the process ends through Python's shutdown, where cProfile writes.
    src = _save(tmp_path / "in.onnx", small_cnn())
    stats = tmp_path / "fuse.prof"
    args = ["fuse", str(src), "-o", str(tmp_path / "out.onnx"), "-q", "--no-cache"]
    done = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(stats), "-m", "fuser.cli", *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).anchor,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out.onnx").stat().st_size > 0
    assert pstats.Stats(str(stats)).total_calls > 0
