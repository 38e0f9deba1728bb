"""`release_freed` gives freed C heap back to the system: onnx's C++ checker and shape
inference free a large model's parse on return, and glibc keeps those pages (they sit below
memory still in use) unless asked."""

from __future__ import annotations

import ctypes
import platform

import pytest

from fuser.heap import release_freed

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")


def _resident_mb() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@glibc
def test_freed_heap_below_a_live_block_goes_back_to_the_system():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(2048) for _ in range(40_000)]  # ~80 MB, below the mmap threshold
    for block in blocks:
        ctypes.memset(block, 1, 2048)  # touched: resident
    pin = libc.malloc(2048)  # above them: the heap's top cannot shrink past it
    for block in blocks:
        libc.free(block)
    kept = _resident_mb()
    assert release_freed()
    returned = kept - _resident_mb()
    libc.free(pin)
    assert returned > 40, f"only {returned:.0f} MB of ~80 MB freed went back"


def test_without_malloc_trim_nothing_is_asked(monkeypatch):
    class NoTrim:
        def __getattr__(self, name: str) -> object:
            raise AttributeError(name)

    from fuser import heap

    monkeypatch.setattr(heap.ctypes, "CDLL", lambda name: NoTrim())
    assert release_freed() is False
