"""Writing several files as one step, so that nothing of a failed or killed write survives.

Every file of a batch is opened before any byte is written (an unwritable place fails first),
filled while still invisible, and only then linked into place, all together:

- On Linux each file is an anonymous ``O_TMPFILE`` inode in the target's folder: a SIGKILL
  while writing leaves nothing, since the kernel frees an unlinked inode with its last handle.
  At commit it gets its name with ``linkat`` through ``/proc/self/fd`` (straight onto the target
  when that does not exist yet; through a short-lived temp name and a rename when it does).
- Elsewhere (or on a filesystem without ``O_TMPFILE``) each file is a named temp file
  ``.<name>.fuser-<pid>-<random>.tmp``; those of dead processes are removed whenever a batch
  writes into that folder, and SIGTERM during a batch removes the batch's own before dying.

Files are created with mode 0666 minus the umask, as any other program's output would be.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import BinaryIO

# The name of a named temp file: the pid lets a later run tell a dead writer's leftovers apart.
TEMP_PATTERN = r"\.{name}\.fuser-(?P<pid>\d+)-[0-9a-f]+\.tmp"
_O_TMPFILE = getattr(os, "O_TMPFILE", 0)
_PROC_FD = Path("/proc/self/fd")
# Whether to write anonymous O_TMPFILE inodes (Linux) rather than named temp files; set it to
# False to use the portable path everywhere (the tests do, to check that path too).
ANONYMOUS_FILES = bool(_O_TMPFILE) and _PROC_FD.is_dir()


def temp_name(target: Path) -> Path:
    """A fresh named temp path beside `target`, of the form `TEMP_PATTERN` describes."""
    # os.urandom, not `secrets`: secrets imports hmac and so hashlib, which loads OpenSSL
    # (3.5 MB resident, fuser/digest.py) for six random bytes.
    return target.with_name(f".{target.name}.fuser-{os.getpid()}-{os.urandom(6).hex()}.tmp")


def remove_stale_temps(target: Path) -> list[Path]:
    """Remove temp files of `target` left by fuser processes that no longer run."""
    pattern = re.compile(TEMP_PATTERN.format(name=re.escape(target.name)))
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(target.parent):
            found = pattern.fullmatch(entry.name)
            if found is None or _alive(int(found["pid"])):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class Terminated(BaseException):
    """SIGTERM arrived during a batch; raised so that the batch's cleanup runs first."""


@dataclass
class _Pending:
    target: Path
    handle: BinaryIO | None = None
    anonymous: bool = False  # an O_TMPFILE inode (no name yet) or a named temp file
    temp: Path | None = None  # the named temp file, if any (fallback, or staged for a rename)
    linked: Path | None = None  # the target itself, if linked there in this batch


@dataclass
class AtomicBatch:
    """Files that appear together at `commit`, or not at all.

    >>> with AtomicBatch() as batch:                      # doctest: +SKIP
    ...     batch.open(Path("model.onnx")).write(data)
    ...     batch.open(Path("report.json")).write(report)
    ...     batch.commit()
    """

    files: list[_Pending] = field(default_factory=list)
    _created_dirs: list[Path] = field(default_factory=list)
    _old_handler: object = None
    _committed: bool = False
    _committing: bool = False  # giving names: a SIGTERM is held until that is done
    _terminate: bool = False  # a SIGTERM arrived while committing

    def __enter__(self) -> AtomicBatch:
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: object, tb: object) -> None:
        if not self._committed:
            self.discard()
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)  # type: ignore[arg-type]
            self._old_handler = None
        if kind is Terminated:
            # Cleaned up: now die of the signal as if no handler had been installed.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._committing:
            self._terminate = True
            return
        raise Terminated

    def open(self, target: Path) -> BinaryIO:
        """An invisible file that becomes `target` at commit (its folder is made if missing).

        An OSError names `target` itself, whatever part of its path was at fault.
        """
        pending = _Pending(target)
        self.files.append(pending)  # registered before any file exists: cleanup finds it
        try:
            self._make_parent(target.parent)
            remove_stale_temps(target)
            _open_hidden(pending)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(target)) from exc
        assert pending.handle is not None
        return pending.handle

    def _make_parent(self, folder: Path) -> None:
        missing = []
        while not folder.exists() and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        for made in reversed(missing):
            made.mkdir()
            self._created_dirs.append(made)

    def commit(self) -> None:
        """Flush every file to disk, then give them their names, all or none."""
        for pending in self.files:
            assert pending.handle is not None
            pending.handle.flush()
            os.fsync(pending.handle.fileno())
        # Quick, and all or nothing: a SIGTERM now waits until every name is given.
        self._committing = True
        try:
            try:
                for pending in self.files:
                    _stage(pending)
            except BaseException:
                self.discard()  # no name given yet but new ones: take those back
                raise
            for pending in self.files:  # renames in one folder: these do not fail in practice
                if pending.temp is not None:
                    os.replace(pending.temp, pending.target)
                    pending.temp = None
            self._committed = True
        finally:
            self._committing = False
        self._close_all()
        for folder in {p.target.parent for p in self.files}:
            _fsync_dir(folder)
        if self._terminate:
            raise Terminated

    def discard(self) -> None:
        """Remove everything this batch made (temp files, new links, new folders)."""
        self._close_all()
        for pending in self.files:
            for path in (pending.temp, pending.linked):
                if path is not None:
                    with contextlib.suppress(OSError):  # never made, or its folder is not one
                        path.unlink()
            pending.temp = pending.linked = None
        for folder in reversed(self._created_dirs):
            with contextlib.suppress(OSError):
                folder.rmdir()
        self._created_dirs.clear()

    def _close_all(self) -> None:
        for pending in self.files:
            if pending.handle is not None:
                with contextlib.suppress(OSError):
                    pending.handle.close()


def _open_hidden(pending: _Pending) -> None:
    """Open `pending`'s file: anonymous if possible; a named temp is recorded before it exists."""
    target = pending.target
    if ANONYMOUS_FILES:
        try:
            fd = os.open(target.parent, _O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            # No O_TMPFILE support in this filesystem: fall back to a named temp file.
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOTSUP):
                raise
        else:
            pending.handle, pending.anonymous = os.fdopen(fd, "wb"), True
            return
    pending.temp = temp_name(target)
    fd = os.open(pending.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    pending.handle = os.fdopen(fd, "wb")


def _stage(pending: _Pending) -> None:
    """Give an anonymous file a name: the target itself if free, else a temp to rename."""
    if not pending.anonymous:
        return
    assert pending.handle is not None
    if not pending.target.exists():
        pending.linked = pending.target
        try:
            _link_anonymous(pending.handle, pending.target)
        except FileExistsError:
            pending.linked = None  # created meanwhile by someone else: replace it instead
        else:
            return
    pending.temp = temp_name(pending.target)  # recorded first: cleanup finds it
    _link_anonymous(pending.handle, pending.temp)


def _link_anonymous(handle: BinaryIO, name: Path) -> None:
    # linkat(/proc/self/fd, "<fd>", name, AT_SYMLINK_FOLLOW): os.link only uses linkat (and so
    # follows the magic link) when given a dir_fd; plain link() would fail with EXDEV.
    proc = os.open(_PROC_FD, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(str(handle.fileno()), name, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def iter_temp_files(folder: Path) -> Iterator[Path]:
    """fuser's named temp files in `folder` (any target): what a test checks is gone."""
    pattern = re.compile(TEMP_PATTERN.format(name=".+"))
    for entry in folder.iterdir():
        if pattern.fullmatch(entry.name):
            yield entry
