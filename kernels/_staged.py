"""Staged schedules: a fused kernel running its unfused chain's kernels one after the other.

Every fused kernel whose tiling has `staged=1` runs the very kernels of the chain it replaces,
each at its own run-time tiling, back to back in one launch (a barrier across the cores between
stages, charged as the launch head it replaces [G]). That schedule costs what the unfused chain
costs and computes the same numbers, so the tiling search can always fall back to it: a fusion
is never priced slower than its chain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .api import Kernel, KernelRun, TensorMeta
from .npu.machine import Machine
from .npu.stats import RunStats, sequence
from .registry import get_kernel
from .search import best, host_tiling, model_for, timed_cycles

Operand = np.ndarray | TensorMeta | None


def _kernel(domain: str, op: str) -> Kernel:
    k = get_kernel(domain, op)
    if k is None:
        raise RuntimeError(f"no kernel for {domain or 'ai.onnx'}::{op}")
    return k


def _metas(inputs: Sequence[Operand]) -> list[TensorMeta | None]:
    return [None if x is None else TensorMeta(tuple(x.shape), x.dtype) for x in inputs]


def stage(
    machine: Machine,
    op: str,
    inputs: Sequence[Operand],
    attrs: Mapping[str, Any],
    functional: bool,
    timeline: bool,
    domain: str = "",
) -> KernelRun:
    """Run one stage's kernel at its run-time tiling (the search's pick where it has a model)."""
    kernel = _kernel(domain, op)
    tiling = host_tiling(kernel, _metas(inputs), attrs, machine)
    return kernel.run(machine, inputs, attrs, tiling=tiling, functional=functional,
                      timeline=timeline)  # fmt: skip


def stage_cycles(
    machine: Machine,
    op: str,
    metas: Sequence[TensorMeta | None],
    attrs: Mapping[str, Any],
    domain: str = "",
) -> float:
    """A stage priced as `fuse` prices an unfused node: its cost model's best tiling where it
    has one, else a timing-only run of its kernel."""
    if model_for(domain, op) is not None:
        return best(domain, op, metas, attrs, machine).best.cycles
    return timed_cycles(_kernel(domain, op), metas, attrs, machine)  # `stage`'s run, memoized


def one_launch(runs: Sequence[RunStats]) -> RunStats:
    """Stages run back to back as one kernel: one launch, the others' heads as barriers."""
    return dataclasses.replace(sequence(runs), launches=1)
