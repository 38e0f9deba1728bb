"""The 80-column output of `fuse`, `inspect` and `profile` on built-in models, against snapshot
files in tests/report/snapshots/.

A change of the output is made deliberately: run with FUSER_UPDATE_SNAPSHOTS=1 to rewrite the
snapshots, and review their diff. What varies between runs is masked: the scratch folder (as
`<tmp>`) and the trailing spaces rich pads table cells with. Timings are not printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("FUSER_UPDATE_SNAPSHOTS") == "1"

CASES = {
    "fuse-resnet": ["fuse", "example:resnet", "-o", "{tmp}/resnet.fused.onnx", "--no-cache"],
    "fuse-cnn-edge": ["fuse", "example:cnn-edge", "-o", "{tmp}/edge.fused.onnx", "--no-cache"],
    "inspect-bert": ["inspect", "example:bert"],
    "inspect-moe": ["inspect", "example:moe"],
    "profile-moe": ["profile", "example:moe"],
    "profile-bert-fused": [
        "profile",
        "{tmp}/bert.fused.onnx",
        "--dim",
        "batch=1",
        "--dim",
        "seq=8",
    ],
}


def run(args: list[str], tmp: Path, columns: int = 80) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TERM")}
    env["COLUMNS"] = str(columns)
    done = subprocess.run(
        [sys.executable, "-m", "fuser.cli", *(a.format(tmp=tmp) for a in args)],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def masked(text: str, tmp: Path) -> str:
    return "\n".join(line.rstrip() for line in text.replace(str(tmp), "<tmp>").splitlines()) + "\n"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("snap")
    run(["fuse", "example:bert", "-o", "{tmp}/bert.fused.onnx", "--no-cache"], tmp)
    return tmp


@pytest.mark.parametrize("case", sorted(CASES))
def test_80_columns(case: str, scratch: Path) -> None:
    raw = run(CASES[case], scratch)
    text = masked(raw, scratch)
    assert "\x1b" not in raw  # piped: plain text, no colour codes
    too_wide = [line for line in raw.splitlines() if len(line) > 80 and str(scratch) not in line]
    assert too_wide == []  # only a line with a path in it may run on (a path is never split)
    snapshot = SNAPSHOTS / f"{case}.txt"
    if UPDATE:
        snapshot.parent.mkdir(exist_ok=True)
        snapshot.write_text(text)
    assert snapshot.exists(), f"no snapshot {snapshot.name}: run with FUSER_UPDATE_SNAPSHOTS=1"
    assert text == snapshot.read_text()


def test_columns_are_respected_when_wider(scratch: Path) -> None:
    narrow = run(CASES["profile-moe"], scratch, columns=80)
    wide = run(CASES["profile-moe"], scratch, columns=160)
    assert max(map(len, wide.splitlines())) > 80
    # Wide enough, the op gets its own column: one line per node instead of two.
    assert len(wide.splitlines()) < len(narrow.splitlines())
    assert "/experts/MatMul_1" in narrow and "/experts/MatMul_1" in wide
