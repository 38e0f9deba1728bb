"""The communicator's threads transport: AllReduce sums, failures name the rank that failed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from fuser.collective import Communicator, RankFailedError, ThreadTransport
from fuser.ort import session
from fuser.validate_ranks import RankOptions, validate_local_ranks

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


def _shards(folder: Path, ranks: int) -> RankOptions:
    from fuser.models import tp_mlp

    from fuser.api import fuse

    for rank in range(ranks):
        model = tp_mlp(group_size=ranks, hidden=8 * ranks, intermediate=8 * ranks, seed=rank)
        onnx.save(model, folder / f"orig{rank}.onnx")
        fuse(model, force=True, cache=False).save(folder / f"fused{rank}.onnx")
    return RankOptions(str(folder / "orig{rank}.onnx"), str(folder / "fused{rank}.onnx"), runs=1)


def test_per_rank_validation_on_threads_matches_and_names_every_rank(tmp_path: Path) -> None:
    result = validate_local_ranks(Communicator(3), _shards(tmp_path, 3))
    assert result.transport == "threads" and result.exit_code == 0 and result.merged is not None
    assert [o.rank for o in result.per_rank] == [0, 1, 2] and all(o.ok for o in result.per_rank)


def test_per_rank_validation_on_threads_stops_every_rank_on_one_failure(tmp_path: Path) -> None:
    options = _shards(tmp_path, 3)
    broken = onnx.load(tmp_path / "fused2.onnx")
    (node,) = [n for n in broken.graph.node if n.op_type == "AllGatherMatMul"]
    node.attribute.append(onnx.helper.make_attribute("tile_tile_m", 8))  # the kernel refuses it
    onnx.save(broken, tmp_path / "fused2.onnx")
    result = validate_local_ranks(Communicator(3), options)
    assert result.exit_code == 2 and result.merged is None
    assert result.error.startswith("rank 2 (") and "tiling attributes missing" in result.error
    for other in result.per_rank[:2]:
        assert other.stopped_by.startswith("rank 2: ") and not other.ok


def test_the_cli_sees_an_mpi_launch_only_from_per_process_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fuser import mpi

    for name in (*mpi.WORLD_SIZE_VARIABLES, "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert mpi.launched_world_size() == 1
    monkeypatch.setenv("SLURM_NTASKS", "4")  # an allocation, not a launched rank
    assert mpi.launched_world_size() == 1
    monkeypatch.setenv("PMI_SIZE", "4")  # MPICH's mpiexec -n 4
    assert mpi.launched_world_size() == 4


def test_a_bad_collective_timeout_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from fuser import mpi
    from fuser.errors import UsageError

    monkeypatch.setenv(mpi.TIMEOUT_VARIABLE, "soon")
    with pytest.raises(UsageError, match=r"FUSER_COLLECTIVE_TIMEOUT='soon': expected seconds"):
        mpi.collective_timeout()
    monkeypatch.setenv(mpi.TIMEOUT_VARIABLE, "2.5")
    assert mpi.collective_timeout() == 2.5
