"""An in-process communicator, so tensor-parallel models run and validate on one machine.

Each rank runs its own onnxruntime session in its own thread (`InferenceSession.run` releases
the GIL); collectives meet at a barrier. onnxruntime's CPU package has no com.microsoft
AllGather, so the plugin runs those nodes here, with ONNX Runtime's semantics: shards are
concatenated along `axis` in rank order.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .ort import RunContext, register_handler

# A rank that never arrives would hang the others forever; fail loudly instead.
BARRIER_TIMEOUT_S = 120.0


class Communicator:
    """`group_size` ranks exchanging tensors through shared memory, one call at a time."""

    def __init__(self, group_size: int) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self.group_size = group_size
        self._slots: list[np.ndarray | None] = [None] * group_size
        self._barrier = threading.Barrier(group_size, timeout=BARRIER_TIMEOUT_S)

    def abort(self) -> None:
        """Release every rank waiting in a collective: one of them has failed."""
        self._barrier.abort()

    def all_gather(self, rank: int, array: np.ndarray) -> list[np.ndarray]:
        """Every rank's `array`, in rank order (blocks until all ranks have called)."""
        if not 0 <= rank < self.group_size:
            raise ValueError(f"rank {rank} outside group of {self.group_size}")
        self._slots[rank] = array
        self._barrier.wait()
        shards = [s for s in self._slots if s is not None]
        # Second barrier: nobody overwrites a slot before every rank has read them all.
        self._barrier.wait()
        return shards


def normalize_axis(axis: int, rank: int, where: str) -> int:
    """ONNX Runtime's AllGather accepts no negative axis; fuser normalizes it against the rank."""
    if not -rank <= axis < rank:
        raise ValueError(f"{where}: AllGather axis {axis} out of range for rank {rank}")
    return axis % rank


def gather(inputs_x: np.ndarray, attrs: Mapping[str, Any], ctx: RunContext) -> list[np.ndarray]:
    """This rank's shard exchanged with the group: all shards in rank order."""
    group_size = int(attrs.get("group_size", 1))
    if group_size == 1:
        return [inputs_x]
    if ctx.communicator is None or ctx.communicator.group_size != group_size:
        have = "none" if ctx.communicator is None else f"{ctx.communicator.group_size} ranks"
        raise RuntimeError(
            f"node '{attrs.get('__name__', '')}' gathers over {group_size} ranks but the session "
            f"has communicator: {have}; run it with fuser.validate or session(communicator=...)"
        )
    return ctx.communicator.all_gather(ctx.rank, inputs_x)


def _all_gather_handler(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any], ctx: RunContext
) -> Sequence[np.ndarray]:
    x = inputs[0]
    assert x is not None
    # The schema's default axis is 1 but onnxruntime's kernel uses 0; follow the runtime.
    axis = normalize_axis(int(attrs.get("axis", 0)), x.ndim, str(attrs.get("__name__", "")))
    return (np.concatenate(gather(x, attrs, ctx), axis=axis),)


register_handler("com.microsoft", "AllGather", _all_gather_handler)
