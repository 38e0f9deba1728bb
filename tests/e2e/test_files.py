"""Files fuser writes: never over its input, nothing left by a kill, the umask honoured, the
model and its report written as one step, and the one-line exit-2 contract on bad paths."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fuser
from fuser.errors import OutputError

FUSER = [sys.executable, "-m", "fuser.cli"]


def run(*args: str, umask: int | None = None) -> subprocess.CompletedProcess[str]:
    preexec: Callable[[], object] | None = None
    if umask is not None:
        value = umask

        def preexec() -> object:
            return os.umask(value)

    return subprocess.run(
        [*FUSER, *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).anchor,
        timeout=300,
        preexec_fn=preexec,
    )


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def digests(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder` (hidden ones too), with its content's digest."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "folder"
        for p in sorted(folder.rglob("*"))
    }


def cnn(big: int = 0) -> onnx.ModelProto:
    """Conv -> BN -> Relu (fusable), plus an Add of a `big`-element weight if asked."""
    rng = np.random.default_rng(1)
    c = 3
    inits = [
        numpy_helper.from_array(rng.standard_normal((c, 2, 3, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), "s"),
        numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b"),
        numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "m"),
        numpy_helper.from_array(rng.uniform(0.1, 1, c).astype(np.float32), "v"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["y"], name="relu"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 5, 4])]
    if big:
        inits.append(numpy_helper.from_array(np.ones(big, np.float32), "big"))
        nodes.append(helper.make_node("Add", ["z", "big"], ["zb"], name="add_big"))
        outputs.append(helper.make_tensor_value_info("zb", TensorProto.FLOAT, [big]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 5, 4])]
    if big:
        inputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [big]))
    graph = helper.make_graph(nodes, "cnn", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def save_external(model: onnx.ModelProto, path: Path, location: str) -> None:
    onnx.save(model, path, save_as_external_data=True, location=location, size_threshold=0)


# -- 7: the input and its external data are never written -----------------------------------------


@pytest.mark.parametrize("output", ["b.onnx", "weights.bin"])
def test_output_over_the_inputs_external_data_is_refused(tmp_path: Path, output: str) -> None:
    """a.onnx keeps its tensors in b.onnx.data (or weights.bin): `-o b.onnx` would write
    b.onnx.data, `-o weights.bin` the data file itself. Refused, nothing touched."""
    location = "b.onnx.data" if output == "b.onnx" else "weights.bin"
    save_external(cnn(), tmp_path / "a.onnx", location)
    before = digests(tmp_path)
    result = run("fuse", str(tmp_path / "a.onnx"), "-o", str(tmp_path / output))
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert location in line and "a.onnx" in line and "overwrite" in line
    assert digests(tmp_path) == before
    fuser.validate(tmp_path / "a.onnx", tmp_path / "a.onnx", runs=1)  # input still loads


def test_api_save_refuses_the_inputs_files(tmp_path: Path) -> None:
    save_external(cnn(), tmp_path / "a.onnx", "b.onnx.data")
    before = digests(tmp_path)
    result = fuser.fuse(tmp_path / "a.onnx", cache=False)
    with pytest.raises(OutputError, match=r"b\.onnx\.data.*a\.onnx"):
        result.save(tmp_path / "b.onnx")
    with pytest.raises(OutputError, match="the input"):
        result.save(tmp_path / "a.onnx")
    assert digests(tmp_path) == before


def test_hard_link_to_the_input_is_refused(tmp_path: Path) -> None:
    onnx.save(cnn(), tmp_path / "a.onnx")
    os.link(tmp_path / "a.onnx", tmp_path / "alias.onnx")
    result = fuser.fuse(tmp_path / "a.onnx", cache=False)
    with pytest.raises(OutputError, match=r"alias\.onnx"):
        result.save(tmp_path / "alias.onnx")


# -- 10: bad output paths: one line, exit 2, nothing written ----------------------------------


def test_output_naming_a_folder(tmp_path: Path) -> None:
    onnx.save(cnn(), tmp_path / "a.onnx")
    (tmp_path / "out").mkdir()
    before = digests(tmp_path)
    result = run("fuse", str(tmp_path / "a.onnx"), "-o", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "out" in one_line(result.stderr) and "directory" in result.stderr
    assert digests(tmp_path) == before and list((tmp_path / "out").iterdir()) == []
    fused = fuser.fuse(tmp_path / "a.onnx", cache=False)
    with pytest.raises(OutputError, match=f"{tmp_path / 'out'}: is a directory"):
        fused.save(tmp_path / "out")


# -- 8: one step, the umask, nothing left by a kill ---------------------------------------------


def test_unwritable_report_writes_nothing(tmp_path: Path) -> None:
    onnx.save(cnn(), tmp_path / "a.onnx")
    (tmp_path / "file").write_text("a file, not a folder")
    before = digests(tmp_path)
    report = tmp_path / "file" / "report.json"
    result = run(
        "fuse", str(tmp_path / "a.onnx"), "-o", str(tmp_path / "b.onnx"), "--report", str(report)
    )
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "report.json" in line and "Traceback" not in result.stderr
    assert digests(tmp_path) == before  # no b.onnx, no temp file


def test_report_in_a_new_folder_and_the_model_appear_together(tmp_path: Path) -> None:
    onnx.save(cnn(), tmp_path / "a.onnx")
    report = tmp_path / "reports" / "r.json"
    result = run(
        "fuse", str(tmp_path / "a.onnx"), "-o", str(tmp_path / "b.onnx"), "--report", str(report)
    )
    assert result.returncode == 0, result.stderr
    assert report.is_file() and (tmp_path / "b.onnx").is_file()
    assert [p.name for p in tmp_path.rglob(".*")] == []


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_outputs_honour_the_umask(tmp_path: Path, umask: int) -> None:
    save_external(cnn(), tmp_path / "a.onnx", "a.bin")
    out, report = tmp_path / "o" / "b.onnx", tmp_path / "o" / "r.json"
    result = run(
        "fuse", str(tmp_path / "a.onnx"), "-o", str(out), "--report", str(report), umask=umask
    )
    assert result.returncode == 0, result.stderr
    for path in (out, out.with_name("b.onnx.data"), report):
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path: Path) -> None:
    from fuser.atomic import temp_name

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    target = tmp_path / "b.onnx"
    stale = temp_name(target).name.replace(f"-{os.getpid()}-", f"-{dead.stdout.strip()}-")
    (tmp_path / stale).write_bytes(b"x" * 1000)
    alive = temp_name(target)  # this process's: in use, kept
    alive.write_bytes(b"y")
    unrelated = tmp_path / ".b.onnx.other.tmp"
    unrelated.write_bytes(b"z")
    onnx.save(cnn(), tmp_path / "a.onnx")
    fuser.fuse(tmp_path / "a.onnx", cache=False).save(target)
    names = {p.name for p in tmp_path.iterdir()}
    assert stale not in names and alive.name in names and unrelated.name in names


def _writer_fds(pid: int, folder: Path) -> list[str]:
    """What the process's open file descriptors in `folder` point at (anonymous or named)."""
    found = []
    with_slash = str(folder) + os.sep
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith(with_slash) and os.path.basename(link) != "a.onnx":
            found.append(link)
    return found


KILL_MODES = [
    pytest.param(signal.SIGKILL, True, id="sigkill"),
    pytest.param(signal.SIGTERM, True, id="sigterm"),
    pytest.param(signal.SIGTERM, False, id="sigterm-named-temp"),
]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to watch the writer")
@pytest.mark.parametrize(("sig", "anonymous"), KILL_MODES)
def test_a_killed_write_leaves_nothing(tmp_path: Path, sig: int, anonymous: bool) -> None:
    """A fuse killed while it writes a 96 MB model leaves the output folder as it was."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    save_external(cnn(big=24_000_000), src / "a.onnx", "a.bin")
    (out / "keep.txt").write_text("already here")
    before_src, before_out = digests(src), digests(out)
    code = (
        "import sys, importlib\n"
        "atomic = importlib.import_module('fuser.atomic')\n"
        f"atomic.ANONYMOUS_FILES = {anonymous}\n"
        "from fuser.cli import main\n"
        f"sys.argv = ['fuser', 'fuse', {str(src / 'a.onnx')!r}, '-o', {str(out / 'b.onnx')!r},"
        f" '--report', {str(out / 'r.json')!r}, '--no-cache']\n"
        "main()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=Path(__file__).anchor,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    seen: list[str] = []
    deadline = time.monotonic() + 240
    while child.poll() is None and time.monotonic() < deadline:
        seen = _writer_fds(child.pid, out)
        if seen:
            break
        time.sleep(0.002)
    assert seen, f"never saw the write start (exit {child.returncode})"
    child.send_signal(sig)
    child.wait(timeout=60)
    assert child.returncode == -sig
    assert digests(out) == before_out  # no output, no report, no temp file
    assert digests(src) == before_src
    if anonymous:  # what was being written had no name in the folder
        assert all("(deleted)" in link or "/#" in link for link in seen), seen
