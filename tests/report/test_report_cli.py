"""`fuser report` and `fuser fuse --html`, run as a user runs them."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import onnx
from report_models import two_chains


def fuser(*args: str) -> subprocess.CompletedProcess[str]:
    # Outside the repository, so that the install, not the source folder, is imported.
    return subprocess.run(
        [sys.executable, "-m", "fuser.cli", *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).anchor,
        timeout=300,
    )


def test_report_writes_one_page_and_nothing_else(tmp_path: Path) -> None:
    model = tmp_path / "in" / "m.onnx"
    model.parent.mkdir()
    onnx.save(two_chains(), model)
    before = hashlib.sha256(model.read_bytes()).hexdigest()
    page = tmp_path / "out" / "r.html"
    done = fuser("report", str(model), "-o", str(page), "--dim", "N=2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {page} (1 fusions, 1 near-misses)"
    text = page.read_text()
    assert '"input":"' + str(model) + '"' in text and "conv_bn_relu" in text
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["m.onnx", "r.html"]
    assert hashlib.sha256(model.read_bytes()).hexdigest() == before


def test_report_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    page = tmp_path / "r.html"
    missing = fuser("report", str(tmp_path / "nope.onnx"), "-o", str(page))
    assert missing.returncode == 2 and missing.stderr.strip().endswith("nope.onnx: no such file")
    bad_dim = fuser("report", "example:resnet", "-o", str(page), "--dim", "seq=4")
    assert bad_dim.returncode == 2
    assert "--dim seq: the model has no such symbolic dim (it has: N)" in bad_dim.stderr
    model = tmp_path / "m.onnx"
    onnx.save(two_chains(), model)
    over = fuser("report", str(model), "-o", str(model))
    assert over.returncode == 2 and "would overwrite the input" in over.stderr
    assert not page.exists() and [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def test_fuse_html_writes_the_model_and_the_page(tmp_path: Path) -> None:
    out, page = tmp_path / "m.fused.onnx", tmp_path / "m.html"
    done = fuser("fuse", "example:cnn-edge", "-o", str(out), "--html", str(page))
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}, {page}" in done.stdout
    assert onnx.load(out).graph.node and "internal value" in page.read_text()
