"""The stage bar of `fuser fuse`, seen as a user sees it: drawn on a terminal (a pseudo-terminal
here), naming each stage; nothing in a pipe; nothing with --quiet or before the delay."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STAGES = ("load", "match", "decide", "finish", "verify", "save")


def cnn_file(folder: Path) -> Path:
    """Two Conv -> BN -> Relu chains on a [1,3,9,11] input: something to match and decide."""
    rng = np.random.default_rng(5)
    inits, nodes, x = [], [], "X"
    for i, (cin, cout) in enumerate(((3, 6), (6, 5))):
        names = [f"W{i}", f"s{i}", f"b{i}", f"m{i}", f"v{i}"]
        values = [
            rng.standard_normal([cout, cin, 3, 3]),
            rng.uniform(0.5, 1.5, [cout]),
            rng.standard_normal([cout]),
            rng.standard_normal([cout]),
            rng.uniform(0.5, 2.0, [cout]),
        ]
        inits += [
            numpy_helper.from_array(v.astype(np.float32), n)
            for n, v in zip(names, values, strict=True)
        ]
        nodes += [
            helper.make_node("Conv", [x, names[0]], [f"c{i}"], name=f"conv{i}", pads=[1] * 4),
            helper.make_node("BatchNormalization", [f"c{i}", *names[1:]], [f"n{i}"], name=f"bn{i}"),
            helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        x = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 3, 9, 11])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 5, 9, 11])],
        inits,
    )
    path = folder / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def fuse_cmd(folder: Path, *extra: str) -> list[str]:
    src = cnn_file(folder)
    return [sys.executable, "-m", "fuser.cli", "fuse", str(src), "-o", str(folder / "o.onnx"),
            "--no-cache", *extra]  # fmt: skip


def env(delay: str) -> dict[str, str]:
    return {**os.environ, "FUSER_PROGRESS_AFTER_S": delay, "TERM": "xterm", "COLUMNS": "100"}


def run_on_terminal(cmd: list[str], delay: str) -> tuple[int, str]:
    """Run `cmd` with stderr on a pseudo-terminal; its exit code and what the terminal got."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=slave, env=env(delay), cwd=Path(__file__).anchor
    )
    os.close(slave)
    chunks: list[bytes] = []
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its side
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    code = proc.wait(timeout=60)
    return code, ANSI.sub("", b"".join(chunks).decode(errors="replace"))


def drawn_stages(text: str) -> list[str]:
    return [s for s in STAGES if re.search(rf"(^|[\r\n]){s}\b", text)]


def test_a_terminal_sees_every_stage(tmp_path: Path) -> None:
    code, text = run_on_terminal(fuse_cmd(tmp_path), delay="0")
    assert code == 0, text
    assert drawn_stages(text) == list(STAGES)


def test_validate_is_a_stage_with_validate(tmp_path: Path) -> None:
    cmd = fuse_cmd(tmp_path, "--validate", "--kernel", "reference", "--runs", "2")
    code, text = run_on_terminal(cmd, delay="0")
    assert code == 0, text
    assert re.search(r"(^|[\r\n])validate\b", text)


@pytest.mark.parametrize(("extra", "delay"), [(("--quiet",), "0"), ((), "3600")])
def test_quiet_or_a_quick_run_draws_nothing(tmp_path: Path, extra: tuple[str, ...],
                                            delay: str) -> None:  # fmt: skip
    code, text = run_on_terminal(fuse_cmd(tmp_path, *extra), delay=delay)
    assert code == 0, text
    assert drawn_stages(text) == []


def test_a_pipe_gets_no_bar(tmp_path: Path) -> None:
    done = subprocess.run(
        fuse_cmd(tmp_path), capture_output=True, text=True, env=env("0"),
        cwd=Path(__file__).anchor, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "conv_bn_relu" in done.stdout  # the report still prints
    assert drawn_stages(ANSI.sub("", done.stderr)) == []
    assert done.stderr.strip() == ""
