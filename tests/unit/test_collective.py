"""The communicator's threads transport: AllReduce sums, failures name the rank that failed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest

from fuser.collective import Communicator, RankFailedError, ThreadTransport
from fuser.ort import session

ALL_REDUCE = """
<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (float[2,3] x, float[5] z) => (float[2,3] y, float[5] w) <float[2,3] s> {
    s = com.microsoft.AllReduce <group_size = 3> (x)
    y = Neg(s)
    w = com.microsoft.AllReduce <group_size = 3> (z)
}
"""


def _in_threads(ranks: int, work: Callable[[int], Any]) -> list[Any]:
    results: list[Any] = [None] * ranks

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def test_all_reduce_sums_over_the_ranks_identically_on_every_rank() -> None:
    model = onnx.parser.parse_model(ALL_REDUCE)
    comm = Communicator(3)
    sessions = [session(model, rank=r, communicator=comm) for r in range(3)]
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(3)]
    zs = [rng.standard_normal(5).astype(np.float32) for _ in range(3)]
    results = _in_threads(3, lambda r: sessions[r].run(None, {"x": xs[r], "z": zs[r]}))
    expected_y = -(xs[0] + xs[1] + xs[2])
    for y, w in results:
        np.testing.assert_allclose(y, expected_y, rtol=1e-6)
        np.testing.assert_allclose(w, zs[0] + zs[1] + zs[2], rtol=1e-6)
    assert all(np.array_equal(results[0][0], r[0]) for r in results)  # same bits everywhere


def test_all_reduce_without_enough_ranks_names_the_node_and_both_sizes() -> None:
    model = onnx.parser.parse_model(ALL_REDUCE)
    sess = session(model, communicator=Communicator(2))
    with pytest.raises(RuntimeError, match=r"reduces over 3 ranks .* communicator: 2 ranks"):
        sess.run(None, {"x": np.ones((2, 3), np.float32), "z": np.ones(5, np.float32)})


def test_an_aborted_rank_releases_the_others_with_its_reason() -> None:
    comm = Communicator(3)

    def work(rank: int) -> Any:
        if rank == 2:
            comm.abort("input file x.npy is missing", rank=2)
            return None
        return comm.all_gather(rank, np.zeros(2))

    results = _in_threads(3, work)
    for rank in (0, 1):
        assert isinstance(results[rank], RankFailedError)
        assert str(results[rank]) == "rank 2: input file x.npy is missing"


def test_a_timeout_fails_every_waiting_rank() -> None:
    comm = Communicator(2, ThreadTransport(2, timeout=0.2))
    with pytest.raises(RuntimeError, match=r"waited 0.2 s for the other ranks"):
        comm.all_gather(0, np.zeros(2))  # rank 1 never comes


def test_a_rank_outside_the_process_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank 4 does not run in this process"):
        Communicator(4).all_gather(4, np.zeros(1))
