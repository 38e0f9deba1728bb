"""Chip-to-chip links: the ring AllGather schedule, and its track in a run's timeline.

A ring AllGather over p ranks takes p - 1 steps; at step j (1-based) rank r receives the shard
of rank (r - j) mod p from its predecessor, one shard of S bytes: `alpha + S / beta`. The step
is the target's fitted HCCL AllGather time (`allgather_fixed_us + allgather_us_per_mb * MB`
gathered, fitted on 8 chips) spread over the 8-chip ring's 7 steps [D]: alpha is the fixed time
over 7, beta the bandwidth at which 8 shards gather in 7 steps. (HCCL drives several links of
the full mesh at once: the fit's beta is ~2.4 links of 56 GB/s; all the peer links together
bound it.) A step split into pieces pays `link_latency_s` per extra piece. Steps run back to
back; an 8-rank AllGather then takes exactly the fitted time. Both the unfused AllGather and
the fused AllGatherMatMul use this one model, so comparing them compares the overlap and
nothing else. A target without a fit (`allgather_us_per_mb` 0) uses one link per step.

The simulator's cores have no link pipe, so the link transfers are added to a run's stats
after the fact: one pseudo-core after the real ones, pipe "LINK" (`with_link`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import MappingProxyType

from .api import KernelError, MachineLimitError
from .npu.machine import Machine
from .npu.stats import RunStats
from .npu.timeline import Interval, Timeline

LINK_PIPE = "LINK"


def check_group(op: str, machine: Machine, group_size: int) -> None:
    """Refuse a group the target's links cannot connect."""
    if group_size < 1:
        raise KernelError(f"{op}: group_size must be at least 1, got {group_size}")
    if group_size == 1:
        return
    # the machine cannot host the group: a limit of the target, not a fault of the node
    if machine.link_peers < 1 or machine.link_bytes_per_s <= 0:
        raise MachineLimitError(
            f"{op}: {machine.name} has no chip-to-chip links for a group", "no chip-to-chip links"
        )
    if group_size > machine.link_peers + 1:
        raise MachineLimitError(
            f"{op}: group of {group_size} ranks but {machine.name} links {machine.link_peers + 1} "
            "chips",
            f"links {machine.link_peers + 1} chips, not {group_size}",
        )


#: Chips of the target's fitted HCCL AllGather time.
FIT_CHIPS = 8


def step_cycles(machine: Machine, nbytes: int, pieces: int = 1) -> float:
    """Cycles of one ring step moving `nbytes` in `pieces` transfers (see the module docstring)."""
    extra = (pieces - 1) * machine.link_latency_s
    if machine.allgather_us_per_mb <= 0:
        seconds = machine.link_latency_s + extra + nbytes / machine.link_bytes_per_s
        return seconds * machine.clock_hz
    steps = FIT_CHIPS - 1
    alpha = machine.allgather_fixed_us * 1e-6 / steps
    fit_beta = 2**20 * steps / (machine.allgather_us_per_mb * 1e-6 * FIT_CHIPS)
    beta = min(fit_beta, machine.link_peers * machine.link_bytes_per_s)
    return (alpha + extra + nbytes / beta) * machine.clock_hz


def ring_arrivals(
    machine: Machine, group_size: int, shard_bytes: int, pieces: int = 1
) -> list[tuple[float, float]]:
    """(start, end) of each of the p - 1 ring steps, in core cycles from the kernel's start."""
    step = step_cycles(machine, shard_bytes, pieces)
    return [(j * step, (j + 1) * step) for j in range(group_size - 1)]


def arrival_order(rank: int, group_size: int) -> list[int]:
    """Shards in the order a rank has them: its own, then one per ring step."""
    return [(rank - j) % group_size for j in range(group_size)]


def allgather_fit_us(machine: Machine, gathered_bytes: int) -> float:
    """The target's fitted HCCL AllGather time (8 chips) for `gathered_bytes` in total."""
    return machine.allgather_fixed_us + machine.allgather_us_per_mb * gathered_bytes / 2**20


def with_link(
    stats: RunStats,
    machine: Machine,
    steps: Sequence[tuple[float, float]],
    labels: Sequence[str],
    link_core: int,
) -> RunStats:
    """`stats` with the link transfers (core cycles from the kernel start) on a LINK track of
    pseudo-core `link_core`; the run lasts at least until the last transfer ends."""
    head = machine.kernel_launch_cycles
    busy = dict(stats.pipe_busy)
    busy[LINK_PIPE] = sum(e - s for s, e in steps)
    end = max((e for _, e in steps), default=0.0)
    core_cycles = max(stats.core_cycles, end)
    cycles = head + core_cycles
    timeline = stats.timeline
    if timeline is not None:
        link = tuple(
            Interval(link_core, LINK_PIPE, s + head, e + head, label)
            for (s, e), label in zip(steps, labels, strict=True)
        )
        kernels = tuple((s, max(e, cycles), n) for s, e, n in timeline.kernels)
        timeline = Timeline(timeline.clock_hz, timeline.intervals + link, kernels)
    return dataclasses.replace(
        stats,
        cycles=cycles,
        us=machine.cycles_to_us(cycles),
        core_cycles=core_cycles,
        pipe_busy=MappingProxyType(busy),
        timeline=timeline,
    )
