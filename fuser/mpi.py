"""The MPI transport of `fuser.collective.Communicator`: one rank per process, any number of hosts.

    from fuser import mpi, ort
    comm = mpi.communicator()                       # on every rank (it duplicates COMM_WORLD)
    sess = ort.session("shard.fused.onnx", rank=comm.local_ranks[0], communicator=comm)

Collectives are MPI's: AllGather is `Allgather` (of the raw bytes, so every dtype travels,
float16 included), AllReduce is `Allreduce(SUM)` for the dtypes MPI has (float32/64, int32/64)
and an `Allgather` summed in rank order for the others (float16). Each one first gathers a
small header (shape, dtype) so ranks that disagree get one error naming both, not garbage.

Failure, without hangs. Every wait is nonblocking (`Test` in a loop that sleeps, which also
keeps 4 ranks on 2 cores from spinning each other out) and listens on a side communicator for
"rank r failed: why" notices. A rank that fails sends one to every other rank (`abort`), so a
rank waiting for it in a collective raises `RankFailedError` with that reason at once; a wait
longer than the timeout raises `CollectiveTimeoutError`. After a failure the communicator is
spent: its collectives raise at once (the failed one can never complete).

`exchange` (agreement steps, gathering results) runs on a third communicator and does not
listen for notices: every rank reaches every exchange, failed or not, so it always completes.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .collective import (
    BARRIER_TIMEOUT_S,
    CollectiveTimeoutError,
    Communicator,
    RankFailedError,
    sum_in_rank_order,
)
from .errors import UsageError

if TYPE_CHECKING:
    from mpi4py import MPI

# What launchers put in each process's environment, so the CLI can tell `mpiexec -n 4 fuser ...`
# from a plain run without importing (or requiring) mpi4py: MPICH's Hydra (and srun with PMI),
# Open MPI. Not allocation-wide variables such as SLURM_NTASKS: a plain `fuser validate` inside
# an allocation is one process, not a rank.
WORLD_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
TIMEOUT_VARIABLE = "FUSER_COLLECTIVE_TIMEOUT"
MAX_DIMS = 16
_NOTICE_TAG = 17
_MAX_NOTICE_CHARS = 2000  # keeps a notice one small (eager) MPI message
_MPI_SUM_DTYPES = ("float32", "float64", "int32", "int64")
# MPICH's launcher forwards a rank's output asynchronously and kills the job on an abort: a line
# still in the pipe when the abort arrives is lost (the one-line reason vanished in about 1 of
# 60 runs). A moment before the abort lets it forward what this rank printed.
ABORT_GRACE_S = 0.5


def launched_world_size() -> int:
    """The number of processes the launcher started (1 when not under mpiexec)."""
    for name in WORLD_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def collective_timeout() -> float:
    """Seconds a collective waits for the other ranks (env FUSER_COLLECTIVE_TIMEOUT)."""
    value = os.environ.get(TIMEOUT_VARIABLE)
    if value is None:
        return BARRIER_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise UsageError(f"{TIMEOUT_VARIABLE}={value!r}: expected seconds") from None
    if seconds <= 0:
        raise UsageError(f"{TIMEOUT_VARIABLE}={value!r}: expected a positive number of seconds")
    return seconds


def mpi_module() -> Any:
    """`mpi4py.MPI`, or a UsageError saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise UsageError(
            f"MPI is not available ({exc}); install it with: pip install 'fuser[mpi]'"
        ) from exc
    return MPI


def communicator(comm: MPI.Comm | None = None, *, timeout: float | None = None) -> Communicator:
    """A communicator over `comm` (default COMM_WORLD): collective, call it on every rank."""
    transport = MPITransport(comm, timeout=timeout)
    return Communicator(transport.size, transport)


def abort_job(code: int) -> None:
    """End every process of the job with `code` (for a rank that cannot report: the others may
    be stuck where no notice reaches them, e.g. a rank that hangs). What this rank printed
    reaches the launcher first (`ABORT_GRACE_S`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    mpi_module().COMM_WORLD.Abort(code)


class MPITransport:
    """One rank per MPI process; see the module docstring for how failures travel."""

    name = "mpi"

    def __init__(self, comm: MPI.Comm | None = None, *, timeout: float | None = None) -> None:
        MPI = mpi_module()
        base = comm if comm is not None else MPI.COMM_WORLD
        self.rank: int = base.Get_rank()
        self.size: int = base.Get_size()
        self.host: str = MPI.Get_processor_name()
        self.timeout = timeout if timeout is not None else collective_timeout()
        # Three private communicators, so fuser's traffic never matches the user's own.
        self._data = base.Dup()
        self._control = base.Dup()
        self._alarm = base.Dup()
        self._failure = ""
        self._notices: list[Any] = []

    def local_ranks(self, group_size: int) -> tuple[int, ...]:
        return (self.rank,)

    # -- waiting -------------------------------------------------------------------------------

    def _wait(self, request: Any, what: str, *, listen: bool = True) -> None:
        """Wait for `request`; raise as soon as another rank says it failed, or on timeout."""
        MPI = mpi_module()
        start = time.monotonic()
        delay = 1e-5
        status = MPI.Status()
        while not request.Test():
            if listen and self._alarm.Iprobe(MPI.ANY_SOURCE, _NOTICE_TAG, status):
                self._failure = self._alarm.recv(source=status.Get_source(), tag=_NOTICE_TAG)
                raise RankFailedError(self._failure)
            waited = time.monotonic() - start
            if waited > self.timeout:
                message = (
                    f"rank {self.rank} ({self.host}): {what} waited {self.timeout:g} s for the "
                    f"other ranks ({TIMEOUT_VARIABLE} sets the limit)"
                )
                if listen:
                    self.abort(message)
                raise CollectiveTimeoutError(message)
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def _refuse_if_failed(self) -> None:
        if self._failure:
            raise RankFailedError(self._failure)

    def _agree_on(self, array: np.ndarray, what: str) -> None:
        """Every rank's (shape, dtype), checked equal, before the data moves."""
        MPI = mpi_module()
        if array.ndim > MAX_DIMS:
            raise ValueError(f"{what}: tensors of rank {array.ndim} > {MAX_DIMS} are not supported")
        header = np.full(MAX_DIMS + 3, -1, np.int64)
        header[0], header[1], header[2] = array.ndim, ord(array.dtype.kind), array.dtype.itemsize
        header[3 : 3 + array.ndim] = array.shape
        headers = np.empty((self.size, header.size), np.int64)
        self._wait(self._data.Iallgather([header, MPI.INT64_T], [headers, MPI.INT64_T]), what)
        for other, theirs in enumerate(headers):
            if not np.array_equal(theirs, header):
                raise RuntimeError(
                    f"{what}: rank {self.rank} holds {_describe(header)} but rank {other} "
                    f"holds {_describe(theirs)}"
                )

    # -- collectives ---------------------------------------------------------------------------

    def all_gather(self, rank: int, array: np.ndarray) -> list[np.ndarray]:
        MPI = mpi_module()
        self._refuse_if_failed()
        self._agree_on(array, "AllGather")
        gathered = np.empty((self.size, *array.shape), array.dtype)
        send = [array, array.nbytes, MPI.BYTE]
        self._wait(self._data.Iallgather(send, [gathered, array.nbytes, MPI.BYTE]), "AllGather")
        return list(gathered)

    def all_reduce(self, rank: int, array: np.ndarray) -> np.ndarray:
        MPI = mpi_module()
        self._refuse_if_failed()
        if array.dtype.name not in _MPI_SUM_DTYPES:
            return sum_in_rank_order(self.all_gather(rank, array))
        self._agree_on(array, "AllReduce")
        total = np.empty_like(array)
        self._wait(self._data.Iallreduce(array, total, MPI.SUM), "AllReduce")
        return total

    def exchange(self, rank: int, value: Any) -> list[Any]:
        MPI = mpi_module()
        payload = np.frombuffer(pickle.dumps(value), np.uint8)
        sizes = np.empty(self.size, np.int64)
        size = np.array([payload.size], np.int64)
        self._wait(
            self._control.Iallgather([size, MPI.INT64_T], [sizes, MPI.INT64_T]),
            "exchange",
            listen=False,
        )
        received = np.empty(int(sizes.sum()), np.uint8)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self._wait(
            self._control.Iallgatherv(
                [payload, MPI.BYTE], [received, sizes.tolist(), offsets.tolist(), MPI.BYTE]
            ),
            "exchange",
            listen=False,
        )
        return [
            pickle.loads(received[o : o + s].tobytes())
            for o, s in zip(offsets.tolist(), sizes.tolist(), strict=True)
        ]

    def abort(self, reason: str) -> None:
        # Once: a rank released by another's notice only repeats it, and a notice is sent once.
        if self._failure:
            return
        self._failure = reason[:_MAX_NOTICE_CHARS]
        for other in range(self.size):
            if other != self.rank:
                self._notices.append(self._alarm.isend(self._failure, dest=other, tag=_NOTICE_TAG))


def _describe(header: np.ndarray) -> str:
    ndim, kind, itemsize = int(header[0]), chr(int(header[1])), int(header[2])
    dtype = np.dtype(f"{kind}{itemsize}") if kind != "b" else np.dtype(bool)
    return f"{dtype.name}{[int(d) for d in header[3 : 3 + ndim]]}"
