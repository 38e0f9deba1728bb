"""The communicator tensor-parallel models run on: one interface, two transports.

A `Communicator` is what a session's collectives (com.microsoft AllGather and AllReduce, and
fused ops that gather) talk to. Where the ranks live is its transport's business:

- `ThreadTransport` (the default, `Communicator(group_size)`): every rank in this process, each
  rank's onnxruntime session in its own thread (`InferenceSession.run` releases the GIL);
  collectives meet at a barrier.
- `fuser.mpi.MPITransport` (`fuser.mpi.communicator()`): one rank per MPI process, on as many
  hosts as the job has; collectives are MPI `Allgather` / `Allreduce`.

Both keep ONNX Runtime's semantics: AllGather concatenates the shards along `axis` in rank order,
AllReduce sums. A rank that fails calls `abort(reason)`; every other rank waiting in (or later
entering) a collective then raises `RankFailedError` naming it, instead of waiting forever.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .ort import RunContext, register_handler

# A rank that never arrives would hang the others forever; fail loudly instead.
BARRIER_TIMEOUT_S = 120.0


class RankFailedError(RuntimeError):
    """Another rank of the group failed (its reason is the message); this rank gave up."""


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than its timeout for the other ranks."""


class Transport(Protocol):
    """How ranks exchange data: the part of a communicator that differs between transports."""

    name: str
    """The transport's name, "threads" or "mpi" (what `validate --json` reports as `transport`)."""

    def local_ranks(self, group_size: int) -> tuple[int, ...]:
        """The ranks that run in this process."""
        ...

    def all_gather(self, rank: int, array: np.ndarray) -> list[np.ndarray]:
        """Every rank's `array`, in rank order."""
        ...

    def all_reduce(self, rank: int, array: np.ndarray) -> np.ndarray:
        """The element-wise sum of every rank's `array` (the same bits on every rank)."""
        ...

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's picklable `value`, in rank order: agreement steps and result gathering."""
        ...

    def abort(self, reason: str) -> None:
        """Make every other rank's current and next collective raise `RankFailedError(reason)`."""
        ...


class Communicator:
    """`group_size` ranks exchanging tensors; `transport` says where the ranks run.

    >>> comm = Communicator(4)  # four ranks, as threads of this process
    >>> from fuser import mpi  # or one rank per MPI process:
    >>> comm = mpi.communicator()  # doctest: +SKIP
    """

    def __init__(self, group_size: int, transport: Transport | None = None) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self.group_size = group_size
        self.transport: Transport = transport or ThreadTransport(group_size)

    @property
    def transport_name(self) -> str:
        """The transport's name: "threads" or "mpi"."""
        return self.transport.name

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks this process runs (all of them for threads, one for MPI)."""
        return self.transport.local_ranks(self.group_size)

    def _check(self, rank: int) -> None:
        if rank not in self.local_ranks:
            raise ValueError(
                f"rank {rank} does not run in this process (it runs ranks "
                f"{', '.join(map(str, self.local_ranks))} of {self.group_size}); build the "
                f"session with rank=<this process's rank>"
            )

    def all_gather(self, rank: int, array: np.ndarray) -> list[np.ndarray]:
        """Every rank's `array`, in rank order (blocks until all ranks have called)."""
        self._check(rank)
        return self.transport.all_gather(rank, np.ascontiguousarray(array))

    def all_reduce(self, rank: int, array: np.ndarray) -> np.ndarray:
        """The sum over ranks of `array` (blocks until all ranks have called)."""
        self._check(rank)
        return self.transport.all_reduce(rank, np.ascontiguousarray(array))

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's `value` (small, picklable), in rank order."""
        self._check(rank)
        return self.transport.exchange(rank, value)

    def abort(self, reason: str = "", rank: int | None = None) -> None:
        """One rank has failed: release every rank waiting in a collective, with the reason."""
        if rank is None and len(self.local_ranks) == 1:
            rank = self.local_ranks[0]
        where = f"rank {rank}" if rank is not None else "a rank"
        self.transport.abort(f"{where}: {reason}" if reason else f"{where} failed")


def sum_in_rank_order(shards: Sequence[np.ndarray]) -> np.ndarray:
    """AllReduce's sum, added in rank order so every rank computes the same bits."""
    total = shards[0].copy()
    for shard in shards[1:]:
        total += shard
    return total


class ThreadTransport:
    """All ranks in this process, each in its own thread, meeting at a barrier.

    Collectives and `exchange` meet at different barriers: `abort` breaks the collectives'
    barrier (a failed collective can never complete) but every rank still reaches, and
    completes, the exchanges that report what happened.
    """

    name = "threads"

    def __init__(self, group_size: int, timeout: float = BARRIER_TIMEOUT_S) -> None:
        self.group_size = group_size
        self._timeout = timeout
        self._data = _Meeting(group_size, timeout)
        self._control = _Meeting(group_size, timeout)
        self._reason = ""

    def local_ranks(self, group_size: int) -> tuple[int, ...]:
        return tuple(range(group_size))

    def _meet(self, meeting: _Meeting, rank: int, value: Any) -> list[Any]:
        try:
            return meeting.meet(rank, value)
        except threading.BrokenBarrierError:
            if self._reason:
                raise RankFailedError(self._reason) from None
            raise CollectiveTimeoutError(
                f"a collective waited {self._timeout:g} s for the other ranks"
            ) from None

    def exchange(self, rank: int, value: Any) -> list[Any]:
        return self._meet(self._control, rank, value)

    def all_gather(self, rank: int, array: np.ndarray) -> list[np.ndarray]:
        return self._meet(self._data, rank, array)

    def all_reduce(self, rank: int, array: np.ndarray) -> np.ndarray:
        return sum_in_rank_order(self._meet(self._data, rank, array))

    def abort(self, reason: str) -> None:
        if not self._reason:
            self._reason = reason
        self._data.barrier.abort()


class _Meeting:
    """Slots and a barrier: every rank leaves its value, then every rank reads all of them."""

    def __init__(self, group_size: int, timeout: float) -> None:
        self.slots: list[Any] = [None] * group_size
        self.barrier = threading.Barrier(group_size, timeout=timeout)

    def meet(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        # Second wait: nobody overwrites a slot before every rank has read them all.
        self.barrier.wait()
        return values


def normalize_axis(axis: int, rank: int, where: str) -> int:
    """ONNX Runtime's AllGather accepts no negative axis; fuser normalizes it against the rank."""
    if not -rank <= axis < rank:
        raise ValueError(f"{where}: AllGather axis {axis} out of range for rank {rank}")
    return axis % rank


def _communicator(attrs: Mapping[str, Any], ctx: RunContext, what: str) -> Communicator | None:
    """The session's communicator, checked against the node's group_size (None: a group of 1)."""
    group_size = int(attrs.get("group_size", 1))
    if group_size == 1:
        return None
    if ctx.communicator is None or ctx.communicator.group_size != group_size:
        have = "none" if ctx.communicator is None else f"{ctx.communicator.group_size} ranks"
        raise RuntimeError(
            f"node '{attrs.get('__name__', '')}' {what} over {group_size} ranks but the session "
            f"has communicator: {have}; run it with fuser.validate or session(communicator=...)"
        )
    return ctx.communicator


def gather(inputs_x: np.ndarray, attrs: Mapping[str, Any], ctx: RunContext) -> list[np.ndarray]:
    """This rank's shard exchanged with the group: all shards in rank order."""
    communicator = _communicator(attrs, ctx, "gathers")
    if communicator is None:
        return [inputs_x]
    return communicator.all_gather(ctx.rank, inputs_x)


def _all_gather_handler(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any], ctx: RunContext
) -> Sequence[np.ndarray]:
    x = inputs[0]
    assert x is not None
    # The schema's default axis is 1 but onnxruntime's kernel uses 0; follow the runtime.
    axis = normalize_axis(int(attrs.get("axis", 0)), x.ndim, str(attrs.get("__name__", "")))
    return (np.concatenate(gather(x, attrs, ctx), axis=axis),)


def _all_reduce_handler(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any], ctx: RunContext
) -> Sequence[np.ndarray]:
    """com.microsoft AllReduce: every input (the op is variadic) summed over the ranks."""
    communicator = _communicator(attrs, ctx, "reduces")
    present = [x for x in inputs if x is not None]
    if communicator is None:
        return [x.copy() for x in present]
    return [communicator.all_reduce(ctx.rank, x) for x in present]


register_handler("com.microsoft", "AllGather", _all_gather_handler)
register_handler("com.microsoft", "AllReduce", _all_reduce_handler)
