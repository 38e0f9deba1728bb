"""`RmsNormMatMul` (domain fuser): RMSNorm on the Vector unit, its Linears on the Cube.

    N = X / sqrt(mean(X^2) + eps) * gamma   (last axis),   Y_i = N @ W_i (+ b_i)

The program is LayerNormMatMul's (`layernorm_matmul.program`, run with this op's `NormStep`:
the RMSNorm instructions `plan.rms_steps`, gamma its one parameter): M = prod(X.shape[:-1])
rows of K = D; a work item is a row block of `rows` rows times one of `n_split` parts of every
W_i's columns, on a group of one cube core and its vector cores. Vector cores (sub-blocks of
`vec_rows` rows, alternating): copy X in, x*x, its sum, 1/sqrt(ms + eps), x * that (* gamma),
hand the rows to the Cube (through the GM/L2 workspace on 910B, UB -> L1 on a combined core).
Cube core: the block resident in L1 (`a_resident`) or `rows` x `tile_k` panels streamed from
the workspace; per W tile one GM -> L1 copy, per `tile_k0` step L0A/L0B loads and a Cube
multiply into L0C (float32); FixPipe writes Y with b_i added, rounded as MatMul then Add round.
With `staged=1` the kernel runs the unfused chain's kernels instead (`staged.py`), so the
search can always fall back to them.

GM (HBM) traffic: `|X| * n_split + |W| * row-blocks + |Y|` (plus gamma and biases); the
unfused chain pays `|X|` per elementwise op of the decomposition, `2|N|` and `|W| + |Y|`.
`normalized` is copied out only with attribute `emit_normalized=1`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
from fuser.patterns.rmsnorm_matmul import WEIGHTS_AT

from .._budget import check_flag, check_positive, require_fits
from .._groups import launch_groups
from ..api import Kernel, KernelRun, TensorMeta, Tiling, TilingError
from ..layernorm import flat_param
from ..layernorm_matmul.plan import (
    Item,
    LayerNormMatMulTiling,
    Problem,
    effective,
    n_blocks,
    specs,
)
from ..layernorm_matmul.program import NormData, NormStep, norm_data, norm_matmul_program
from ..npu.machine import Machine
from ..search import Searched
from .plan import problem, rms_rows, rms_steps, round_before_scale
from .staged import run_staged


class RmsNormMatMulKernel(Searched, Kernel):
    """Fused RMSNorm + n MatMuls (+ bias); see the module docstring. The tiling is the
    norm-then-matmul family's (`LayerNormMatMulTiling`: same buffers, same fields)."""

    op_type = "RmsNormMatMul"
    domain = "fuser"
    tiling_type = LayerNormMatMulTiling

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        p = problem(inputs_meta, attrs)
        lead = p.ln.shape[:-1]
        outs = [TensorMeta(p.ln.shape, p.ln.dtype)]  # N in X's dtype, Y_i in the Cube's
        for lin in p.linears:
            shape = (math.prod(lead), lin.n) if lin.flatten else (*lead, lin.n)
            outs.append(TensorMeta(shape, p.dtype))
        return tuple(outs)

    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        assert isinstance(tiling, LayerNormMatMulTiling)
        t, op = tiling, self.op_type
        check_positive(
            op, rows=t.rows, n_split=t.n_split, vec_rows=t.vec_rows, tile_n=t.tile_n,
            tile_k=t.tile_k, tile_k0=t.tile_k0, cores=t.cores,
        )  # fmt: skip
        if t.tile_k0 > t.tile_k:
            raise TilingError(f"{op}: tile_k0 {t.tile_k0} exceeds tile_k {t.tile_k}")
        check_flag(op, a_resident=t.a_resident, double_buffer=t.double_buffer, staged=t.staged)
        if t.cores > machine.cube_cores:
            raise TilingError(
                f"{op}: tiling uses {t.cores} cores, {machine.name} has {machine.cube_cores} "
                "cube cores"
            )
        if not t.staged:  # the staged stages check their own tilings
            require_fits(op, machine, specs(problem(inputs_meta, attrs), t))

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> LayerNormMatMulTiling:
        from ..layernorm_matmul.space import default_tiling_fast  # plan's, in numpy

        return default_tiling_fast(problem(inputs_meta, attrs), machine)

    def simulate(
        self,
        machine: Machine,
        inputs: Sequence[np.ndarray | None],
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        functional: bool,
        timeline: bool,
    ) -> KernelRun:
        assert isinstance(tiling, LayerNormMatMulTiling)
        p = problem(inputs_meta, attrs)
        if tiling.staged:
            metas = self.infer(inputs_meta, attrs)
            rounded = round_before_scale(attrs)
            return run_staged(machine, p, rounded, inputs, inputs_meta, metas, functional, timeline)
        tm = effective(p, tiling)[0]
        work = [
            Item(m0, min(m0 + tm, p.m), part)
            for m0 in range(0, p.m, tm)
            for part in range(min(tiling.n_split, n_blocks(p)))
        ]
        data = _data(p, inputs) if functional else None
        rounded = round_before_scale(attrs)
        norm = NormStep(
            tuple(p.handoff(rms_steps(p.ln, rounded))),
            partial(_rms_tile, p, rounded),
            (("scale", "scale"),),
        )
        program = partial(norm_matmul_program, p, tiling, norm, data)
        # The GM tensors the program names: their re-reads hit the L2, as LayerNormMatMul's.
        isz, xsz = p.dtype.itemsize, p.x_size
        sizes = {"X": p.ln.rows * p.ln.width * xsz, "scale": p.ln.width * xsz}
        for i, lin in enumerate(p.linears):
            sizes[f"W{i}"], sizes[f"b{i}"] = p.k * lin.n * isz, lin.n * isz
        stats = launch_groups(
            machine, self.op_type, work, program, max_groups=tiling.cores,
            functional=functional, timeline=timeline, gm_sizes=sizes,
        )  # fmt: skip
        if data is None:
            return KernelRun((), stats)
        metas = self.infer(inputs_meta, attrs)
        outs = [data.normalized.reshape(metas[0].shape)]
        outs += [y.reshape(m.shape) for y, m in zip(data.ys, metas[1:], strict=True)]
        return KernelRun(tuple(outs), stats)


def _data(p: Problem, inputs: Sequence[np.ndarray | None]) -> NormData:
    ins = [*inputs, None, None]
    x = ins[0]
    assert x is not None
    return norm_data(p, x, (flat_param(ins[1], p.ln),), inputs, WEIGHTS_AT)


def _rms_tile(p: Problem, rounded: bool, x: np.ndarray, *gamma: np.ndarray) -> np.ndarray:
    return rms_rows(p.ln, rounded, x, gamma[0] if gamma else None)


KERNELS = (RmsNormMatMulKernel(),)
