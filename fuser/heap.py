"""Giving the C heap that onnx's C++ tools freed back to the system.

onnx's checker and shape inference parse the whole model into C++ messages (at 100k nodes
about 230 MB for the checker and 390 MB for inference) and free them on return. glibc's
allocator keeps most of those freed pages in the process (they are in the middle of its heap,
so the heap top cannot shrink), and everything fuse allocates afterwards comes on top of
them in the resident size. `malloc_trim(0)` returns every free page to the system.

Only glibc has `malloc_trim`; elsewhere (musl, macOS, Windows) `release_freed` does nothing.

Beside it, `collector_paused`: Python's cyclic collector off while a stage makes many objects.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Callable, Iterator


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none."""
    # looked up in the symbols already loaded (no library search, no subprocess; a few
    # microseconds, and a fuse asks about three times)
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed() -> bool:
    """Return the C heap's free pages to the system (after a C++ tool freed a large model).
    Returns whether anything could be asked: False where there is no glibc."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (on again after, where it was on): a stage
    that makes a few objects per node of a large graph makes collections of the oldest
    generation, and each walks every object the process holds (about a tenth of a large
    model's passes; 0.2 s of a 100k-node CNN's check and inference). Cycles made meanwhile
    are collected after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
