"""The event-level simulator: buffers, queues, schedules, SPMD splits, stats and traces."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from fuser.kernels import registry
from fuser.kernels._stream import VectorTiling
from fuser.kernels.api import TensorMeta
from fuser.kernels.conv_bn_relu import ConvTiling
from fuser.kernels.npu.core import Core
from fuser.kernels.npu.errors import CapacityError
from fuser.kernels.npu.launch import hbm_bytes, launch, split_balanced
from fuser.kernels.npu.pipes import Level, Pipe
from fuser.kernels.npu.stats import RunStats, sequence
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_oracle import MACHINE


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 64))
def test_balanced_split_first_blocks_get_the_ceiling(n: int, parts: int) -> None:
    ranges = split_balanced(n, parts)
    sizes = [len(r) for r in ranges]
    assert sum(sizes) == n
    assert sizes == sorted(sizes, reverse=True)
    assert max(sizes) - min(sizes) <= 1
    assert sizes.count(-(-n // parts)) == (n % parts or parts)
    assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))


def test_allocating_past_capacity_raises_with_asked_and_free() -> None:
    core = Core(MACHINE, 0, 1, functional=False)
    core.ub.queue("x", 100_000, depth=1)
    with pytest.raises(CapacityError) as e:
        core.ub.queue("y", 60_000, depth=2)
    err = e.value
    assert err.level == "UB"
    assert err.asked == 120_000
    assert err.free == MACHINE.ub_bytes - 100_000
    assert "'y' asks 120000 bytes" in str(err)


def test_instruction_waits_for_pipe_and_operands() -> None:
    core = Core(MACHINE, 0, 1, functional=False)
    q = core.ub.queue("t", 4096, depth=1)
    t = q.alloc()
    core.copy_in(t, 4096)
    end_in = core.pipe_free[Pipe.MTE2]
    core.vector("Add", np.dtype(np.float16), 2048, (t,), (t,))
    (vec,) = [(s, e) for p, s, e, _ in core.intervals if p is Pipe.VECTOR]
    assert vec[0] == end_in  # waited for its operand
    k, b = MACHINE.vector_cost("Add", np.float16)
    assert vec[1] - vec[0] == pytest.approx(k * 2048 + b)
    # The first copy of the kernel starts the MTE2 pipe: head + per-transfer cost + bytes.
    head = MACHINE.copy_in_head(4096, 1) + MACHINE.copy_in_transfer(False)
    assert end_in == pytest.approx(head + 4096 / MACHINE.read_bytes_per_cycle)
    # A second copy pays the per-transfer cost only.
    u = core.ub.queue("u", 4096, depth=1).alloc()
    core.copy_in(u, 4096)
    second = [(s, e) for p, s, e, _ in core.intervals if p is Pipe.MTE2][-1]
    transfer = MACHINE.copy_in_transfer(False) + 4096 / MACHINE.read_bytes_per_cycle
    assert second[1] - second[0] == pytest.approx(transfer)
    assert MACHINE.copy_in_transfer(False) < MACHINE.copy_in_head(4096, 1)


def test_producer_blocks_when_both_slots_are_full() -> None:
    core = Core(MACHINE, 0, 1, functional=False)
    q = core.ub.queue("t", 1024, depth=2)
    slots = [q.alloc() for _ in range(3)]
    assert slots[0] is slots[2]
    core.copy_in(slots[0], 1024)
    core.copy_in(slots[1], 1024)
    # A long vector op reads slot 0; the third copy into slot 0 must wait for it.
    core.vector("Exp", np.dtype(np.float32), 200_000, (slots[0],), ())
    vec_end = core.pipe_free[Pipe.VECTOR]
    core.copy_in(slots[2], 1024)
    last_in = [iv for iv in core.intervals if iv[0] is Pipe.MTE2][-1]
    assert last_in[1] == vec_end


def _overlaps(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


@pytest.mark.parametrize("op", ["Relu", "Add"])
def test_double_buffering_overlaps_copy_in_with_compute(op: str) -> None:
    x = np.random.default_rng(0).standard_normal(64 * 1024).astype(np.float32)
    inputs = [x] if op == "Relu" else [x, x]
    k = registry.get_kernel("", op)
    assert k is not None
    runs = {
        db: k.run(MACHINE, inputs, {}, tiling=VectorTiling(elems=4096, double_buffer=db, cores=1))
        for db in (0, 1)
    }
    overlap = {}
    for db, run in runs.items():
        tl = run.stats.timeline
        assert tl is not None
        overlap[db] = _overlaps(tl.on(0, "MTE2"), tl.on(0, "VECTOR"))
        np.testing.assert_array_equal(run.outputs[0], np.maximum(x, 0) if op == "Relu" else x + x)
    assert overlap[1] > 0
    assert overlap[0] == 0
    # The same bytes move either way; only the schedule differs.
    assert runs[0].stats.gm_read == runs[1].stats.gm_read


def test_double_buffering_overlaps_copy_in_with_the_cube() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64, 16, 16)).astype(np.float16)
    w = rng.standard_normal((64, 64, 3, 3)).astype(np.float16)
    k = registry.get_kernel("", "Conv")
    assert k is not None
    overlap = {}
    for db in (0, 1):
        t = ConvTiling(tile_h=2, tile_w=16, tile_co=64, tile_ci=16, double_buffer=db, cores=1)
        run = k.run(MACHINE, [x, w], {"pads": [1, 1, 1, 1]}, tiling=t)
        tl = run.stats.timeline
        assert tl is not None
        overlap[db] = _overlaps(tl.on(0, "MTE2"), tl.on(0, "CUBE"))
    # Single-buffered L1 still frees its slot once MTE1 has moved the data to L0, so the next
    # copy-in may overlap the last taps on the Cube; two slots let it overlap much more.
    assert overlap[1] > overlap[0]


def test_kernel_time_is_launch_plus_slowest_core_with_a_tail() -> None:
    x = np.ones(48 * 256 + 37, np.float32)
    run = registry.get_kernel("", "Relu").run(MACHINE, [x], {})  # type: ignore[union-attr]
    tl = run.stats.timeline
    assert tl is not None
    ends = {}
    for iv in tl.intervals:
        ends[iv.core] = max(ends.get(iv.core, 0.0), iv.end)
    assert run.stats.cycles == pytest.approx(max(ends.values()))
    assert min(iv.start for iv in tl.intervals) >= MACHINE.kernel_launch_cycles
    # The tail: cores do not all finish together.
    assert len(set(ends.values())) > 1
    assert run.stats.cores == 48


def _read_body(tensor: str | None, nbytes: int) -> Callable[[Core, Sequence[int]], None]:
    def body(core: Core, items: Sequence[int]) -> None:
        q = core.ub.queue("t", 8192, depth=2)
        for _ in items:
            for off in range(0, nbytes, 8192):
                core.copy_in(q.alloc(), min(8192, nbytes - off), gm=tensor)

    return body


def test_l2_hits_cost_no_hbm_time_and_first_touches_do() -> None:
    # 24 cores each read the same 2 MiB tensor: named, it comes from HBM once and the other
    # reads hit the L2; unnamed, every read is a first touch.
    size, n = 2 << 20, 24
    shared = launch(MACHINE, "r", range(n), _read_body("w", size), max_cores=n,
                    functional=True, gm_sizes={"w": size})  # fmt: skip
    unique = launch(MACHINE, "r", range(n), _read_body(None, size), max_cores=n, functional=True)
    assert shared.gm_read == unique.gm_read == n * size
    assert shared.hbm_bytes == size
    assert unique.hbm_bytes == n * size
    # Hits run at the cores' L2 port rate; 24 first touches at once wait for the one HBM.
    port = size / MACHINE.read_bytes_per_cycle
    assert port < shared.core_cycles < 1.5 * port  # + the pipe head and per-copy costs
    assert unique.core_cycles == pytest.approx(n * size / MACHINE.hbm_bytes_per_cycle)
    assert unique.core_cycles > 2 * shared.core_cycles
    # Read twice by one core (a reuse distance within the L2) it is still one first touch.
    twice = launch(MACHINE, "r", range(2), _read_body("w", size), max_cores=1,
                   functional=True, gm_sizes={"w": size})  # fmt: skip
    assert twice.hbm_bytes == size


def test_l2_capacity_limits_hits() -> None:
    # A named tensor larger than the L2, read twice: the second pass misses in proportion.
    size = 2 * MACHINE.l2_bytes
    core = Core(MACHINE, 0, 1, functional=False)
    core.gm_reads["big"] = 2 * size
    core.moved["gm_read"] = 2 * size
    hbm = hbm_bytes(MACHINE, [core], {"big": size})
    assert hbm == pytest.approx(size + size * (1 - MACHINE.l2_bytes / size), rel=1e-9)
    assert size < hbm < 2 * size


def test_hbm_is_one_resource_for_reads_and_writes() -> None:
    # An elementwise op reads and writes every byte once: no run is faster than
    # (read + write) / HBM, however many cores stream, and the run is memory-bound.
    x = TensorMeta((64, 1024, 1024), np.float16)
    run = registry.get_kernel("", "Relu").run(MACHINE, [x], {}, functional=False)  # type: ignore[union-attr]
    st = run.stats
    assert st.hbm_bytes == st.gm_read + st.gm_write == 2 * x.nbytes
    floor = MACHINE.kernel_launch_cycles + 2 * x.nbytes / MACHINE.hbm_bytes_per_cycle
    assert st.cycles >= floor
    assert st.cycles == pytest.approx(floor, rel=0.02)
    assert st.bound == "memory"
    # The cores' own ports would allow far more: the limit is the one shared HBM.
    ports = st.cores * min(MACHINE.read_bytes_per_cycle, MACHINE.write_bytes_per_cycle)
    assert ports > 2 * MACHINE.hbm_bytes_per_cycle
    achieved = 2 * x.nbytes / MACHINE.cycles_to_us(st.cycles) * 1e6
    assert achieved <= MACHINE.hbm_bytes_per_s


def test_timing_only_gives_the_same_cycles_as_functional() -> None:
    rng = np.random.default_rng(3)
    cases = [
        ("", "Add", [rng.standard_normal((7, 300)), rng.standard_normal((300,))], {}),
        ("", "MatMul", [rng.standard_normal((3, 70, 90)), rng.standard_normal((90, 33))], {}),
        ("fuser", "ConvBnRelu", [rng.standard_normal((2, 8, 13, 11)),
                                 rng.standard_normal((16, 8, 3, 3)), None,
                                 *(rng.random(16) + 0.5 for _ in range(4))],
         {"pads": [1, 1, 1, 1], "relu": 1}),
    ]  # fmt: skip
    for domain, op, xs, attrs in cases:
        arrays = [None if a is None else a.astype(np.float32) for a in xs]
        k = registry.get_kernel(domain, op)
        assert k is not None
        f = k.run(MACHINE, arrays, attrs)
        t = k.run(MACHINE, [None if a is None else _meta(a) for a in arrays], attrs,
                  functional=False)  # fmt: skip
        assert t.outputs == ()
        assert t.stats == f.stats, op
        assert t.stats.timeline is not None
        assert f.stats.timeline is not None
        assert sorted(t.stats.timeline.intervals) == sorted(f.stats.timeline.intervals)


def _meta(a: np.ndarray) -> TensorMeta:
    return TensorMeta.of(a)


def test_run_stats_and_chrome_trace() -> None:
    x = np.ones((4, 1000), np.float16)
    run = registry.get_kernel("", "Relu").run(MACHINE, [x], {})  # type: ignore[union-attr]
    s = run.stats
    assert isinstance(s, RunStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.cycles = 0  # type: ignore[misc]
    assert s.gm_read == x.nbytes
    assert s.gm_write == x.nbytes
    assert s.launches == 1
    assert s.estimated is False
    assert s.bound in ("memory", "compute")
    assert s.us == pytest.approx(s.cycles / MACHINE.clock_hz * 1e6)
    assert 0 < s.pipe_utilization["MTE2"] <= 1
    trace = json.loads(json.dumps(s.to_chrome_trace()))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] > 0]
    assert s.timeline is not None
    assert len(complete) == len(s.timeline.intervals)
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"]
             if e.get("name") == "thread_name"}  # fmt: skip
    assert (1, "MTE2") in names
    assert (1, "VECTOR") in names


def test_sequence_adds_up_launches_bytes_and_time() -> None:
    k = registry.get_kernel("", "Relu")
    assert k is not None
    a = k.run(MACHINE, [np.ones(5000, np.float32)], {}).stats
    b = k.run(MACHINE, [np.ones(9000, np.float32)], {}).stats
    s = sequence([a, b])
    assert s.launches == 2
    assert s.cycles == a.cycles + b.cycles
    assert s.gm_bytes == a.gm_bytes + b.gm_bytes
    assert s.timeline is not None
    assert max(iv.end for iv in s.timeline.intervals) <= s.cycles
    assert Level.UB.value == "ub"


def _mm_timeline(l1: int, l0: int, l0c: int) -> list[tuple[str, float, float, str]]:
    from fuser.kernels.matmul import MatMulTiling

    a, b = TensorMeta((256, 512), np.float16), TensorMeta((512, 128), np.float16)
    t = MatMulTiling(128, 128, 256, 64, l1, l0, l0c, 1)
    run = registry.get_kernel("", "MatMul").run(  # type: ignore[union-attr]
        MACHINE, [a, b], {}, tiling=t, functional=False
    )
    tl = run.stats.timeline
    assert tl is not None
    return sorted(((i.pipe, i.start, i.end, i.label) for i in tl.intervals), key=lambda i: i[1])


def test_double_buffering_per_level_shows_in_the_timeline() -> None:
    # One core, two 128 x 128 blocks of two K chunks each, four L0 steps per chunk.
    def first(ivs: list[tuple[str, float, float, str]], pipe: str, n: int) -> tuple[float, float]:
        return [(s, e) for p, s, e, _ in ivs if p == pipe][n][:2]

    # L0C single: block 2's first multiply waits for block 1's FixPipe; double: it does not.
    single, double = _mm_timeline(1, 1, 0), _mm_timeline(1, 1, 1)
    fix_end = first(single, "FIXP", 0)[1]
    assert first(single, "CUBE", 8)[0] >= fix_end
    assert first(double, "CUBE", 8)[0] < first(double, "FIXP", 0)[1]
    # L1 double: chunk 2's A panel is copied while chunk 1's is still being loaded to L0A;
    # single: only once its last L0A load (MTE1 instruction 6 of a, b, a, b...) is done.
    l1_single, l1_double = _mm_timeline(0, 1, 1), _mm_timeline(1, 1, 1)
    assert first(l1_double, "MTE2", 2)[0] < first(l1_double, "MTE1", 6)[1]
    assert first(l1_single, "MTE2", 2)[0] >= first(l1_single, "MTE1", 6)[1]
    # L0A/B double: the next step's L0 loads run under the current multiply; single: after.
    l0_single = _mm_timeline(1, 0, 1)
    assert first(l1_double, "MTE1", 2)[0] < first(l1_double, "CUBE", 0)[1]
    assert first(l0_single, "MTE1", 2)[0] >= first(l0_single, "CUBE", 0)[1]
    # (Whether the run gets faster depends on which pipe is the bottleneck: not asserted.)
