"""`LayerNormMatMul` (domain fuser): LayerNorm on the Vector unit, its Linears on the Cube.

    N = LayerNorm(X; scale, bias, axis, epsilon, stash_type),   Y_i = N @ W_i (+ b_i)

The matmul view: M = prod(X.shape[:-1]) rows of K = X.shape[-1]; a normalized slice (axis ..
last) spans q = D / K matmul rows. A work item is a row block of `rows` matmul rows times one
of `n_split` parts of every W_i's columns; items are split over groups of one cube core and its
vector cores (`_groups`), and a group whose next item has the same row block reuses it. Per
item:

- Vector cores (sub-blocks of `vec_rows` normalized rows, alternating between the group's
  vector cores): copy X in, statistics and normalization (`layernorm`), then hand the rows to
  the Cube. On 910B (separate cores) that hop crosses a GM/L2 workspace (MTE3 out of UB, MTE2
  into L1, both at L2 rate); on a combined core it is a direct UB -> L1 move.
- Cube core: with `a_resident=1` the normalized block stays in L1 for every weight; with 0
  (big K, where a whole block cannot fit L1) it stays in the GM/L2 workspace and a
  `rows` x `tile_k` panel of it is copied to L1 at L2 rate per step. Per `tile_n` columns of
  W_i, per `tile_k` of K, W's tile is copied GM -> L1; per `tile_k0` step both operands go to
  L0A/L0B and the Cube accumulates in L0C (float32); FixPipe writes the block with b_i
  added, rounded to T as MatMul then Add round.

GM (HBM) traffic is then npu-model.md's fused `|X| + |W| * row-blocks + |Y|` (plus biases)
with `n_split=1`, and `|X| * n_split + |W| * row-blocks + |Y|` in general (few rows, as in
decoding, are better served by splitting N than by re-reading W); the unfused chain pays
`|X| + 2|N| + |W| + |Y|`. Workspace traffic stays in L2 and is charged in time at L2 rate,
not counted as HBM bytes. With `double_buffer` the X/N queues in UB and the block (or A
panels), W tiles, L0A/L0B and L0C have two slots, so the vector cores normalize block b+1
while the Cube multiplies block b.

The optional `normalized` output is copied out (the workspace write becomes an HBM write)
only with attribute `emit_normalized=1`; the array is returned in functional mode either way,
as the op's contract returns every output.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from .._budget import check_flag, check_positive, require_fits
from .._groups import launch_groups
from ..api import Kernel, KernelRun, TensorMeta, Tiling, TilingError
from ..layernorm import LayerNormSpec, flat_param, layernorm_rows
from ..npu.machine import Machine
from ..search import Searched
from .plan import (
    Item,
    LayerNormMatMulTiling,
    Problem,
    effective,
    n_blocks,
    problem,
    specs,
)
from .program import NormData, NormStep, norm_data, norm_matmul_program
from .staged import run_staged


class LayerNormMatMulKernel(Searched, Kernel):
    """Fused LayerNorm + n MatMuls (+ bias); see the module docstring."""

    op_type = "LayerNormMatMul"
    domain = "fuser"
    tiling_type = LayerNormMatMulTiling

    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        p = problem(inputs_meta, attrs)
        lead = p.ln.shape[:-1]
        outs = [TensorMeta(p.ln.shape, p.ln.dtype)]
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
        t = tiling
        op = self.op_type
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
        p = problem(inputs_meta, attrs)
        if t.rows % p.q:
            raise TilingError(
                f"{op}: rows {t.rows} must be a multiple of {p.q} (matmul rows per normalized "
                "slice)"
            )
        if not t.staged:  # the staged stages check their own tilings
            require_fits(op, machine, specs(p, t))

    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> LayerNormMatMulTiling:
        from .space import default_tiling_fast  # plan's, in numpy

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
            return run_staged(machine, p, inputs, inputs_meta, attrs, metas, functional, timeline)
        tm = effective(p, tiling)[0]
        work = [
            Item(m0, min(m0 + tm, p.m), part)
            for m0 in range(0, p.m, tm)
            for part in range(min(tiling.n_split, n_blocks(p)))
        ]
        data = _data(p, inputs) if functional else None
        norm = NormStep(
            tuple(p.steps), partial(_ln_tile, p.ln), (("scale", "ln_scale"), ("bias", "ln_bias"))
        )
        program = partial(norm_matmul_program, p, tiling, norm, data)
        isz = p.dtype.itemsize
        xsz = p.x_size
        sizes = {"X": p.ln.rows * p.ln.width * xsz, "ln_scale": p.ln.width * xsz}
        sizes["ln_bias"] = p.ln.width * xsz
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
    ins = [*inputs, None, None, None]
    x = ins[0]
    assert x is not None
    params = (flat_param(ins[1], p.ln), flat_param(ins[2], p.ln))
    return norm_data(p, x, params, inputs, 3)


def _ln_tile(s: LayerNormSpec, x: np.ndarray, *params: np.ndarray) -> np.ndarray:
    it = iter(params)
    scale = next(it) if s.has_scale else None
    bias = next(it) if s.has_bias else None
    return layernorm_rows(s, x, scale, bias)[0]


KERNELS = (LayerNormMatMulKernel(),)
