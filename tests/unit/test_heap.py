"""`release_freed` gives freed C heap back to the system: onnx's C++ checker and shape
inference free a large model's parse on return, and glibc keeps those pages (they sit below
memory still in use) unless asked.

`collector_paused` keeps Python's cyclic collector off through a stage, and as it was after."""

from __future__ import annotations

import ctypes
import gc
import platform

import pytest
from onnx import TensorProto, helper

from fuser import check_infer
from fuser.heap import collector_paused, release_freed
from fuser.modelio import load_model

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


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_inside_and_as_it_was_after(enabled):
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(KeyError), collector_paused():
            raise KeyError("inside")
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()


def test_check_and_infer_runs_with_the_collector_paused(monkeypatch):
    """The load side's tools make a few objects per value: no collection walks them all."""
    seen = []
    real = check_infer.checker_view

    def view(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(check_infer, "checker_view", view)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert gc.isenabled()
    assert check_infer.check_and_infer(load_model(model)) is not None
    assert seen == [False] and gc.isenabled()
