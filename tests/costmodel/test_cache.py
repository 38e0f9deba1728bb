"""The tuning cache: same key, same tiling; concurrent writers from two processes."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from fuser.models import get_example

from fuser.api import fuse
from fuser.costmodel import CostModelDecider
from fuser.tuning_cache import CacheKey, TuningCache, default_path


def key(i: int) -> CacheKey:
    return CacheKey.make("MatMul", [(i, 64), (64, 32)], "float16", "ascend910b", {"k": i})


def test_default_path_follows_xdg(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_path() == tmp_path / "fuser" / "tuning.sqlite"


def test_put_get_round_trip_and_replace(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path / "t.sqlite")
    assert cache.get(key(1)) is None
    assert cache.put(key(1), {"tile_m": 64, "cores": 24}, 1234.5)
    hit = cache.get(key(1))
    assert hit is not None and dict(hit.tiling) == {"tile_m": 64, "cores": 24}
    assert hit.predicted_cycles == 1234.5 and hit.source == "model"
    cache.put(key(1), {"tile_m": 128, "cores": 24}, 99.0, "simulated")
    again = TuningCache(tmp_path / "t.sqlite").get(key(1))  # another connection sees it
    assert again is not None and again.tiling["tile_m"] == 128 and again.source == "simulated"
    # Another fuser version is another key.
    other = CacheKey.make("MatMul", [(1, 64), (64, 32)], "float16", "ascend910b", {"k": 1}, "9.9")
    assert cache.get(other) is None


def test_an_unusable_cache_degrades_to_none(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = TuningCache(blocker / "sub" / "t.sqlite")
    assert cache.get(key(1)) is None
    assert not cache.put(key(1), {"tile_m": 1}, 1.0)
    assert cache.disabled_reason


# Writer processes run this script: the test module itself is not importable from a child
# (pytest's importlib mode), and a separate interpreter is what concurrent users are anyway.
WRITER = """
import sys
import time
from fuser.tuning_cache import CacheKey, TuningCache
path, start, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cache = TuningCache(path)
for i in range(start, start + n):
    key = CacheKey.make("MatMul", [(i, 64), (64, 32)], "float16", "ascend910b", {"k": i})
    assert cache.put(key, {"tile_m": i, "cores": 24}, float(i))
    prev = CacheKey.make("MatMul", [(i - 1, 64), (64, 32)], "float16", "ascend910b", {"k": i - 1})
    cache.get(prev)
"""


def test_two_processes_writing_at_once_do_not_corrupt_it(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.sqlite")
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, path, str(s), "150"], cwd=tmp_path)
        for s in (0, 100)  # overlapping keys
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    cache = TuningCache(path)
    assert len(cache) == 250
    for i in range(250):
        hit = cache.get(key(i))
        assert hit is not None and hit.tiling["tile_m"] == i
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_fuse_twice_gets_the_same_tiling_from_the_cache(tmp_path: Path) -> None:
    model = get_example("cnn-edge")
    cache_path = tmp_path / "c.sqlite"

    def tilings(cache: object) -> list[dict[str, int]]:
        decider = CostModelDecider.for_target("ascend910b", cache=cache)  # type: ignore[arg-type]
        report = fuse(model, decider=decider).report
        assert report.fusions
        return [dict(f.prediction.tiling) for f in report.fusions if f.prediction]

    first = tilings(cache_path)
    assert len(TuningCache(cache_path)) >= 1
    second = tilings(cache_path)
    assert first == second
    assert tilings(False) == first  # no cache: the same search, the same answer


# Each opener waits for the same moment, then opens a new file and writes one entry.
OPENER = """
import sys, time
from fuser.tuning_cache import CacheKey, TuningCache
path, at, i = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
while time.time() < at:
    pass
cache = TuningCache(path)
key = CacheKey.make("MatMul", [(i, 64), (64, 32)], "float16", "ascend910b", {"k": i})
if not cache.put(key, {"tile_m": i}, float(i)):
    sys.exit(cache.disabled_reason)
"""


def test_processes_creating_the_file_at_once_all_use_it(tmp_path: Path) -> None:
    # What a CI run hit: two processes opening a new file in the same instant; the one that
    # lost the race to switch it to WAL got "database is locked" at once (no busy wait in
    # that path) and ran without a cache. Before the fix about a quarter of openers lost.
    for round_ in range(6):
        path = str(tmp_path / f"new{round_}.sqlite")
        at = time.time() + 1.5  # after every interpreter has started
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", OPENER, path, str(at), str(i)],
                cwd=tmp_path,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(4)
        ]
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
        assert len(TuningCache(path)) == 4


def test_opening_gives_up_after_the_timeout(tmp_path: Path) -> None:
    path = tmp_path / "held.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN")
    holder.execute("SELECT * FROM t").fetchall()
    try:
        start = time.monotonic()
        cache = TuningCache(path, timeout=0.3)
        assert not cache.put(key(1), {"tile_m": 1}, 1.0)
        assert cache.disabled_reason is not None and "locked" in cache.disabled_reason
        assert 0.3 <= time.monotonic() - start < 25.0  # its own timeout, not the default 30 s
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def traced_open(monkeypatch, path: Path) -> tuple[TuningCache, list[str]]:  # type: ignore[no-untyped-def]
    """A cache at `path`, opened, and the statements its connection ran."""
    import fuser.tuning_cache as tuning_cache

    statements: list[str] = []
    connect = sqlite3.connect

    def traced(*args, **kwargs):  # type: ignore[no-untyped-def]
        conn = connect(*args, **kwargs)
        conn.set_trace_callback(statements.append)
        return conn

    monkeypatch.setattr(tuning_cache.sqlite3, "connect", traced)
    cache = TuningCache(path)
    assert cache.put(key(7), {"tile_m": 7}, 7.0)
    return cache, statements


def test_a_new_file_is_created_without_waiting_for_the_disk(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The WAL switch and the table of a new, empty file run with synchronous=OFF (nothing but
    # an empty cache to lose); every write after it at NORMAL, as before.
    cache, statements = traced_open(monkeypatch, tmp_path / "new.sqlite")
    off = statements.index("PRAGMA synchronous=OFF")
    assert (
        off
        < statements.index("PRAGMA journal_mode=WAL")
        < statements.index("PRAGMA synchronous=NORMAL")
        < statements.index("BEGIN IMMEDIATE")
    )
    conn = cache._connect()
    assert conn is not None and conn.execute("PRAGMA synchronous").fetchone()[0] == 1
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert cache.get(key(7)) is not None


def test_an_existing_database_is_converted_to_wal_durably(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A database with entries in rollback-journal mode (an older fuser's) keeps synchronous
    # writes while it is switched to WAL, and its entries.
    path = tmp_path / "old.sqlite"
    first = TuningCache(path)
    assert first.put(key(1), {"tile_m": 1}, 1.0)
    first.close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode=DELETE")
    cache, statements = traced_open(monkeypatch, path)
    assert "PRAGMA synchronous=OFF" not in statements
    assert "PRAGMA journal_mode=WAL" in statements
    assert cache.get(key(1)) is not None and len(cache) == 2
