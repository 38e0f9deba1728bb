"""fuser.atomic: files of a batch appear together at commit, or not at all, in both modes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fuser import atomic


@pytest.fixture(params=[True, False], ids=["anonymous", "named-temp"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param and not atomic.ANONYMOUS_FILES:
        pytest.skip("no O_TMPFILE on this system")  # the named mode still runs
    monkeypatch.setattr(atomic, "ANONYMOUS_FILES", request.param)
    return bool(request.param)


def test_commit_writes_all_and_replaces_existing(tmp_path: Path, mode: bool) -> None:
    (tmp_path / "a.bin").write_bytes(b"old")
    with atomic.AtomicBatch() as batch:
        batch.open(tmp_path / "a.bin").write(b"new a")
        batch.open(tmp_path / "sub" / "deeper" / "b.json").write(b"{}")
        hidden = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
        assert len(hidden) == (0 if mode else 1)  # anonymous files have no name at all
        assert (tmp_path / "a.bin").read_bytes() == b"old"  # nothing visible before commit
        assert not (tmp_path / "sub" / "deeper" / "b.json").exists()
        batch.commit()
    assert (tmp_path / "a.bin").read_bytes() == b"new a"
    assert (tmp_path / "sub" / "deeper" / "b.json").read_bytes() == b"{}"
    assert list(atomic.iter_temp_files(tmp_path)) == []


def test_failure_before_commit_leaves_nothing(tmp_path: Path, mode: bool) -> None:
    (tmp_path / "keep").write_bytes(b"keep")

    def write_then_fail() -> None:
        with atomic.AtomicBatch() as batch:
            batch.open(tmp_path / "a.bin").write(b"x" * 100_000)
            batch.open(tmp_path / "new" / "b.bin").write(b"y")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_then_fail()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]  # no file, temp or folder


def test_unwritable_second_file_fails_before_any_name_is_given(tmp_path: Path, mode: bool) -> None:
    (tmp_path / "plain").write_text("a file, not a folder")

    def write() -> None:
        with atomic.AtomicBatch() as batch:
            batch.open(tmp_path / "model.onnx").write(b"model")
            batch.open(tmp_path / "plain" / "report.json")
            batch.commit()

    with pytest.raises(OSError, match=r"report\.json") as caught:
        write()
    assert caught.value.filename == str(tmp_path / "plain" / "report.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


def test_files_get_the_umask(tmp_path: Path, mode: bool) -> None:
    old = os.umask(0o027)
    try:
        with atomic.AtomicBatch() as batch:
            batch.open(tmp_path / "m.onnx").write(b"m")
            batch.commit()
    finally:
        os.umask(old)
    assert (tmp_path / "m.onnx").stat().st_mode & 0o777 == 0o640
