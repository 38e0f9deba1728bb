"""The tuning cache: chosen tilings keyed by (op, shapes, dtype, target, fuser version).

An embedded SQLite file under the user's cache directory (`$XDG_CACHE_HOME/fuser/tuning.sqlite`,
else `~/.cache/fuser/tuning.sqlite`), or any path given (`--cache PATH`). Concurrent runs share
it safely: the database is in WAL mode (readers never block the writer), every write is one
short `BEGIN IMMEDIATE` transaction, and a busy database is waited for (`timeout`), so two
processes writing at once serialize instead of corrupting the file. A cache that cannot be
opened or written (read-only folder, corrupt file) degrades to no cache: it never fails a run.

The key also holds a digest of the op's attributes (k, axis, epsilon change the kernel's work)
and the fuser version (a new cost model invalidates old entries). Fused ops are keyed by their
name (`ConvBnRelu`); the unfused nodes a decision prices against them by `domain::op_type`
(`ai.onnx::Conv`, the small constant inputs their kernel reads among the attributes), so a
warm-cache `fuse` searches neither side of a decision.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .digest import sha256_hex

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tilings (
    op TEXT NOT NULL,
    shapes TEXT NOT NULL,
    dtype TEXT NOT NULL,
    target TEXT NOT NULL,
    version TEXT NOT NULL,
    attrs TEXT NOT NULL,
    tiling TEXT NOT NULL,
    predicted_cycles REAL NOT NULL,
    source TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (op, shapes, dtype, target, version, attrs)
)
"""


def default_path() -> Path:
    """`$XDG_CACHE_HOME/fuser/tuning.sqlite`, else `~/.cache/fuser/tuning.sqlite`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fuser" / "tuning.sqlite"


@dataclass(frozen=True)
class CacheKey:
    """What a cached tiling depends on."""

    op: str
    shapes: tuple[tuple[int, ...] | None, ...]
    dtype: str
    target: str
    version: str
    attrs: str  # digest of the attributes

    @classmethod
    def make(
        cls,
        op: str,
        shapes: Sequence[tuple[int, ...] | None],
        dtype: str,
        target: str,
        attrs: Mapping[str, Any],
        version: str | None = None,
    ) -> CacheKey:
        """A key; `attrs` are digested (sorted JSON), `version` defaults to fuser's."""
        if version is None:
            from . import __version__

            version = __version__
        text = json.dumps({k: _plain(v) for k, v in sorted(attrs.items())}, sort_keys=True)
        digest = sha256_hex(text.encode())[:16]
        return cls(op, tuple(shapes), dtype, target, version, digest)

    def columns(self) -> tuple[str, str, str, str, str, str]:
        return (
            self.op,
            json.dumps([list(s) if s is not None else None for s in self.shapes]),
            self.dtype,
            self.target,
            self.version,
            self.attrs,
        )


@dataclass(frozen=True)
class CacheEntry:
    """A cached choice: the tiling (`tile_<field>` name -> int without the prefix), its
    predicted cycles and where it came from ("model" or "simulated")."""

    tiling: Mapping[str, int]
    predicted_cycles: float
    source: str


def _plain(v: Any) -> Any:
    if hasattr(v, "SerializeToString"):
        # A tensor or graph attribute (ConstantOfShape's value, an If branch): its bytes name it.
        return sha256_hex(v.SerializeToString(deterministic=True))
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if hasattr(v, "tolist"):
        return v.tolist()
    return v


class TuningCache:
    """The SQLite tuning cache at `path` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, timeout: float = 30.0) -> None:
        self.path = Path(path) if path is not None else default_path()
        self.timeout = timeout
        self._conn: sqlite3.Connection | None = None
        self.disabled_reason: str | None = None

    def _connect(self) -> sqlite3.Connection | None:
        if self._conn is not None or self.disabled_reason is not None:
            return self._conn
        deadline = time.monotonic() + self.timeout
        attempt = 0
        while True:
            try:
                conn = self._open()
                break
            except sqlite3.OperationalError as e:
                # Two processes creating the file at once: switching a new database to WAL
                # takes an exclusive lock, and SQLite reports "database is locked" at once
                # instead of calling the busy handler. Waiting and retrying is the remedy.
                attempt += 1
                if not _is_busy(e) or time.monotonic() >= deadline:
                    self.disabled_reason = f"tuning cache {self.path} unusable: {e}"
                    return None
                time.sleep(min(0.01 * attempt, 0.2))
            except (sqlite3.Error, OSError) as e:
                self.disabled_reason = f"tuning cache {self.path} unusable: {e}"
                return None
        self._conn = conn
        return conn

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode: transactions are opened explicitly (BEGIN IMMEDIATE) for writes.
        conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
        try:
            # Reading the mode takes no lock; only a database not yet in WAL is switched.
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                # A new (empty) file is switched and given its table without waiting for the
                # disk (~20 ms of fsyncs on every cold-cache run): a power cut then can only
                # lose an empty cache. An existing database is converted as before.
                fresh = conn.execute("PRAGMA page_count").fetchone()[0] == 0
                if fresh:
                    conn.execute("PRAGMA synchronous=OFF")
                conn.execute("PRAGMA journal_mode=WAL")
                if fresh:
                    conn.execute(_SCHEMA)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA busy_timeout={int(self.timeout * 1000)}")
            conn.execute(_SCHEMA)
        except BaseException:
            conn.close()
            raise
        return conn

    def get(self, key: CacheKey) -> CacheEntry | None:
        """The cached entry for `key`, or None."""
        conn = self._connect()
        if conn is None:
            return None
        try:
            row = conn.execute(
                "SELECT tiling, predicted_cycles, source FROM tilings WHERE op=? AND shapes=? "
                "AND dtype=? AND target=? AND version=? AND attrs=?",
                key.columns(),
            ).fetchone()
        except sqlite3.Error:
            return None
        if row is None:
            return None
        try:
            tiling = {str(k): int(v) for k, v in json.loads(row[0]).items()}
        except (ValueError, AttributeError, TypeError):
            return None
        return CacheEntry(tiling, float(row[1]), str(row[2]))

    def put(
        self,
        key: CacheKey,
        tiling: Mapping[str, int],
        predicted_cycles: float,
        source: str = "model",
    ) -> bool:
        """Store (or replace) an entry in one transaction; False if the cache is unusable."""
        conn = self._connect()
        if conn is None:
            return False
        payload = json.dumps({k: int(v) for k, v in tiling.items()}, sort_keys=True)
        for attempt in range(5):
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(
                    "INSERT OR REPLACE INTO tilings VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (*key.columns(), payload, float(predicted_cycles), source, time.time()),
                )
                conn.execute("COMMIT")
                return True
            except sqlite3.OperationalError:
                # Busy beyond the timeout (many writers): roll back and try again.
                _rollback(conn)
                time.sleep(0.05 * (attempt + 1))
            except sqlite3.Error:
                _rollback(conn)
                return False
        return False

    def __len__(self) -> int:
        conn = self._connect()
        if conn is None:
            return 0
        return int(conn.execute("SELECT COUNT(*) FROM tilings").fetchone()[0])

    def close(self) -> None:
        """Close the connection (it reopens on the next use)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _is_busy(error: sqlite3.OperationalError) -> bool:
    text = str(error).lower()
    return "locked" in text or "busy" in text


def _rollback(conn: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):
        conn.execute("ROLLBACK")
