"""`fuser patterns` lists a static manifest so it starts without onnx: the manifest must equal
what the real registry says, and the commands that only list must not import the heavy
libraries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fuser import pattern_manifest, registry

REGENERATE = "regenerate it: python -m fuser.registry --write-manifest"


def test_the_manifest_lists_exactly_the_registered_patterns() -> None:
    assert registry.manifest_rows() == pattern_manifest.PATTERNS, REGENERATE


def test_the_manifest_lists_exactly_the_built_in_examples() -> None:
    assert registry.example_names() == pattern_manifest.EXAMPLES, REGENERATE


def test_the_manifest_file_is_what_the_generator_writes() -> None:
    assert registry.MANIFEST_PATH.read_text() == registry.render_manifest(), REGENERATE


HEAVY = ("onnx", "numpy", "onnxruntime", "onnxruntime_extensions", "fuser.kernels")

PROBE = """
import sys
from fuser.cli import app
try:
    app(sys.argv[1:])
except SystemExit:
    pass
print("LOADED", *sorted(m for m in {heavy} if m in sys.modules))
"""


@pytest.mark.parametrize("args", [["--help"], ["patterns"], ["patterns", "--json"]])
def test_listing_commands_import_no_heavy_library(args: list[str]) -> None:
    probe = PROBE.format(heavy=repr(HEAVY))
    done = subprocess.run(
        [sys.executable, "-c", probe, *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).anchor,  # the installed package, not the repo's fuser/ folder
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.strip().splitlines()[-1].split()
    assert loaded == ["LOADED"], f"{' '.join(args)} imported {loaded[1:]}"
    if args[0] == "patterns":
        assert "conv_bn_relu" in done.stdout


def test_a_fuse_does_not_import_pydantic(tmp_path: Path) -> None:
    # typer 0.29 coerces each CLI parameter through a pydantic TypeAdapter: pydantic's import
    # cost every command about 0.1 s and 7 MB (pyproject.toml keeps typer below 0.29)
    probe = PROBE.format(heavy=repr(("pydantic",)))
    args = ["fuse", "example:resnet", "-o", str(tmp_path / "out.onnx"), "-q", "--no-cache"]
    done = subprocess.run(
        [sys.executable, "-c", probe, *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).anchor,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out.onnx").stat().st_size > 0
    assert done.stdout.strip().splitlines()[-1].split() == ["LOADED"], "fuse imported pydantic"
