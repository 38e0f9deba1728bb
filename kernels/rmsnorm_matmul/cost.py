"""Cost model of `RmsNormMatMul`: LayerNormMatMul's model (`layernorm_matmul.cost`) with the
RMSNorm's vector instructions.

The kernel runs LayerNormMatMul's program with other vector instructions, so its cycles are
that model's with the vector side priced from `plan.rms_steps` instead of the LayerNorm's:
`lnmm_cycles` takes the instruction list, and the tiling space is the same (`lnmm_space`),
plus the staged schedule (`staged.py`), priced as `fuse` prices the unfused chain's nodes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._cost_base import LastProblem, fitting
from .._groups import vector_cores_per_group
from ..api import TensorMeta, Tiling
from ..layernorm_matmul.cost import lnmm_cycles, lnmm_space
from ..layernorm_matmul.plan import LayerNormMatMulTiling, Problem, default_tiling, specs
from ..npu.machine import Machine
from .plan import problem, rms_steps, round_before_scale
from .staged import staged_cycles


class _RmsnmmModel:
    domain = "fuser"
    op_type = "RmsNormMatMul"

    def __init__(self) -> None:
        self._staged: dict[Any, float] = {}
        self._last = LastProblem()

    def _problem(self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> Problem:
        return self._last.get(metas, attrs, lambda: problem(metas, attrs))

    def space(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Sequence[Tiling]:
        p = problem(metas, attrs)
        space: list[Tiling] = list(lnmm_space(machine, p))
        # The unfused chain's schedule is always a candidate: fused is never priced slower.
        base = space[0] if space else default_tiling(p, machine)
        assert isinstance(base, LayerNormMatMulTiling)
        space.append(dataclasses.replace(base, staged=1))
        return space

    def cost(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> float:
        assert isinstance(tiling, LayerNormMatMulTiling)
        p = self._problem(metas, attrs)
        rounded = round_before_scale(attrs)
        if tiling.staged:
            key = (tuple(metas), repr(sorted(attrs.items())), machine)
            if key not in self._staged:  # one entry: the search prices one problem at a time
                self._staged = {key: staged_cycles(machine, p, rounded, metas)}
            return self._staged[key]
        return lnmm_cycles(machine, p, tiling, p.handoff(rms_steps(p.ln, rounded)))

    def rule_of_thumb(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Tiling | None:
        """The MatMul rule: 128-row blocks, 128-column W tiles, tile_k 256, L0 steps of 128,
        the block resident in L1, no N split, double-buffered on every core; vec_rows halved
        until UB fits."""
        p = self._problem(metas, attrs)
        vr = max(1, math.ceil(128 / max(1, vector_cores_per_group(machine))))
        while True:
            t = LayerNormMatMulTiling(128, 1, vr, 128, 256, 128, 1, 1, machine.cube_cores)
            if fitting(machine, specs(p, t)):
                return t
            if vr == 1:
                return None
            vr //= 2


MODELS = (_RmsnmmModel(),)


# The numpy-built space and the lower bound of the exact search (`search.Bounded`):
# LayerNormMatMul's (`layernorm_matmul.space`, `layernorm_matmul.bounds`) with the RMSNorm's
# vector instructions.
import numpy as np  # noqa: E402

from .._columns import TilingColumns  # noqa: E402
from ..layernorm_matmul.bounds import lnmm_lower_bounds  # noqa: E402
from ..layernorm_matmul.space import lnmm_space_fast  # noqa: E402


class _BoundedRmsnmmModel(_RmsnmmModel):
    """`_RmsnmmModel` with its space built in numpy and a lower bound over it."""

    #: The tiling fields `lower_bounds` understands (`search.Bounded`).
    bound_fields = frozenset(f.name for f in dataclasses.fields(LayerNormMatMulTiling))

    def space(
        self, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> TilingColumns:
        """`_RmsnmmModel.space`, the fused tilings from `lnmm_space_fast` (numpy columns: a
        tiling is made only where read)."""
        p = self._problem(metas, attrs)
        fused = lnmm_space_fast(machine, p)
        base = fused[0] if fused else default_tiling(p, machine)
        assert isinstance(base, LayerNormMatMulTiling)
        return fused.extended([dataclasses.replace(base, staged=1)])

    def lower_bounds(
        self,
        metas: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tilings: Sequence[Tiling],
        machine: Machine,
    ) -> np.ndarray:
        """Cycles each tiling's `cost` never goes below (`lnmm_lower_bounds`, RMSNorm's steps)."""
        p = self._problem(metas, attrs)
        steps = rms_steps(p.ln, round_before_scale(attrs))
        return lnmm_lower_bounds(machine, p, tilings, steps)


MODELS = (_BoundedRmsnmmModel(),)
