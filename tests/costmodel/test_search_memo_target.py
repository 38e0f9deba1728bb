"""`search.best` memoizes per target by the target's numbers, not by `Machine` equality: two
machines equal but for their vector costs (`vector_ops` takes no part in equality) price the
same fused node differently, and neither gets the other's memoized result."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from fuser.kernels import search as kernel_search
from fuser.kernels.npu.machine import Machine, load_target
from fuser.models import get_example

from fuser.api import fuse
from fuser.costmodel import CostModelDecider
from fuser.tune import fused_nodes, node_metas


def slower_vector(factor: float) -> Machine:
    machine = load_target("ascend910b")
    ops = {
        op: MappingProxyType({dtype: (k * factor, b * factor) for dtype, (k, b) in per.items()})
        for op, per in machine.vector_ops.items()
    }
    return dataclasses.replace(machine, vector_ops=MappingProxyType(ops))


def test_machines_equal_but_for_their_vector_costs_are_searched_apart() -> None:
    model = fuse(
        get_example("moe"), decider=CostModelDecider.for_target("ascend910b", cache=False)
    ).model
    node = fused_nodes(model)[0]
    metas, attrs = node_metas(model, node)
    machine, slow = load_target("ascend910b"), slower_vector(40.0)
    assert slow == machine  # what made the memo hand one machine's result to the other
    kernel_search.clear_memo()
    fast_first = kernel_search.best(node.domain, node.op_type, metas, attrs, machine)
    slow_after = kernel_search.best(node.domain, node.op_type, metas, attrs, slow)
    kernel_search.clear_memo()
    slow_alone = kernel_search.best(node.domain, node.op_type, metas, attrs, slow)
    assert slow_after.best.cycles == slow_alone.best.cycles
    assert slow_alone.best.cycles > fast_first.best.cycles  # a Vector-unit op
