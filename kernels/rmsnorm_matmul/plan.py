"""RmsNormMatMul's problem and its Vector-unit program.

The buffers, the tiling and the work split are LayerNormMatMul's (`layernorm_matmul.plan`): a
row block of X normalized on the vector cores, handed to the cube core, multiplied by every
W_i. An RMSNorm row needs the same queues (X in, N out, one row of statistics-dtype scratch,
gamma resident), so the problem is that plan's `Problem` with no beta, and only the vector
instructions differ (`rms_steps`): no centering, one reduction instead of two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from fuser.patterns.rmsnorm_matmul import WEIGHTS_AT, rms_norm

from .._rows import VecStep
from ..api import KernelError, TensorMeta
from ..layernorm import LayerNormSpec
from ..layernorm_matmul.plan import Problem
from ..layernorm_matmul.plan import problem as norm_matmul_problem

OP = "RmsNormMatMul"


def problem(inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> Problem:
    """Check the op's inputs and attributes (`KernelError` says what is wrong): the
    LayerNormMatMul problem of X, gamma, no beta, the weights, over the last axis."""
    metas = [*inputs_meta, None, None]
    as_norm = [metas[0], metas[1], None, *inputs_meta[WEIGHTS_AT:]]
    try:
        return norm_matmul_problem(as_norm, {**attrs, "axis": -1})
    except KernelError as exc:
        # the same refusal (its class too: a machine limit stays one), named after this op
        exc.args = (str(exc).replace("LayerNormMatMul", OP), *exc.args[1:])
        raise


def round_before_scale(attrs: Mapping[str, Any]) -> bool:
    """The op's `round_before_scale` attribute (default 1)."""
    return bool(int(attrs.get("round_before_scale", 1)))


def rms_steps(s: LayerNormSpec, rounded: bool) -> list[VecStep]:
    """Vector instructions per row: x*x and its sum in `s.stats`, per row / D, + eps, sqrt and
    the reciprocal, then x * (1/rms) over the row; gamma in the statistics dtype before the
    Cast back (`rounded` False) or in the dtype after it."""
    d, up = s.width, s.stats != s.dtype
    steps = [VecStep(("Cast",), d, s.dtype)] if up else []
    steps.append(VecStep(("Mul", "ReduceSum"), d, s.stats))
    steps.append(VecStep(("Muls", "Adds", "Sqrt", "Reciprocal"), 1, s.stats))
    steps.append(VecStep(("Mul",) * (1 + (s.has_scale and not rounded)), d, s.stats))
    if up:
        steps.append(VecStep(("Cast",), d, s.stats))
    if s.has_scale and rounded:
        steps.append(VecStep(("Mul",), d, s.dtype))
    return steps


def rms_rows(
    s: LayerNormSpec, rounded: bool, x: np.ndarray, scale: np.ndarray | None
) -> np.ndarray:
    """Normalized rows [t, D] of a tile, rounded as the fused op's reference rounds."""
    return rms_norm(x, scale, s.epsilon, int(s.stats != s.dtype), int(rounded))
