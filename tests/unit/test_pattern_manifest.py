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


# What a fuse must not load, and why (issue 10: each is start-up time and resident memory):
# typer 0.29 coerces each CLI parameter through a pydantic TypeAdapter (about 0.1 s and 7 MB;
# pyproject.toml keeps typer below 0.29); hashlib loads OpenSSL (3.5 MB; fuser/digest.py);
# rich.progress is only `tune`'s (1.1 MB; fuse draws its bar with fuser/cli_progress.py).
NOT_FOR_A_FUSE = ("pydantic", "_hashlib", "rich.progress")


def test_a_fuse_with_a_tuning_cache_does_not_import_what_it_does_not_need(
    tmp_path: Path,
) -> None:
    probe = PROBE.format(heavy=repr(NOT_FOR_A_FUSE))
    cache = tmp_path / "cache.sqlite"  # a cache written: its keys are SHA-256 digests
    # A file, not a built-in example: those draw their weights with numpy.random, which
    # imports hashlib itself.
    model = Path(__file__).parents[1] / "data" / "exported" / "cnn-ts13.onnx"
    args = ["fuse", str(model), "-o", str(tmp_path / "out.onnx"), "-q", "--cache", str(cache)]
    done = subprocess.run(
        [sys.executable, "-c", probe, *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).anchor,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out.onnx").stat().st_size > 0
    assert cache.stat().st_size > 0
    loaded = done.stdout.strip().splitlines()[-1].split()
    assert loaded == ["LOADED"], f"fuse imported {loaded[1:]}"
