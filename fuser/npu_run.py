"""Run a fused node on its simulated NPU kernel (the onnxruntime plugin's `kernel="npu"`).

The plugin hands over the node's inputs (absent optional ones as None; for a gathering op the
gathered input stacked `[group_size, *shard]` with `rank` in the attributes, see
`FusedOp.collective_input`) and its attributes with declared defaults filled in. The kernel
computes on real tiles with numpy, so a tiling bug shows up as a wrong answer in `validate`,
and a tiling that does not fit the machine is refused with the kernel's reason.

The tiling is the node's `tile_*` attributes when it has them (chosen at fuse time), else the
kernel's run-time tiling for these shapes on the target. Every output of the op is returned in
schema order, optional ones included, as `FusedOp.reference` does; the plugin picks the ones
the node uses.

    >>> ys = run_fused_on_npu("SoftmaxTopK", [x], {"k": 2, ...}, ctx)   # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from . import fusedop, plugin_clock
from .errors import FuserError, UsageError

if TYPE_CHECKING:
    from .kernels.api import Kernel
    from .kernels.npu.machine import Machine
    from .ort import RunContext


class NpuKernelError(FuserError):
    """A fused node cannot run on its NPU kernel (no kernel, bad tiling, unsupported inputs)."""


class NpuLimitError(NpuKernelError):
    """The kernel refused valid inputs the machine has no unit for (float64): `limit` names the
    limit ("no float64 unit"). Not a fault of the node: validation may run its reference."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit

    def __reduce__(self) -> tuple[type[NpuLimitError], tuple[str, str]]:
        return type(self), (str(self), self.limit)


@cache
def machine(target: str) -> Machine:
    """The target's machine, loaded once per process (`target` is a name or a JSON path)."""
    from .kernels.npu.errors import TargetError
    from .kernels.npu.machine import load_target

    try:
        return load_target(target)
    except TargetError as exc:
        raise UsageError(str(exc)) from exc


def fused_kernel(op_name: str) -> Kernel:
    """The NPU kernel of fused op `op_name`; `NpuKernelError` if it has none."""
    from .kernels import registry

    kernel = registry.get_kernel(fusedop.DOMAIN, op_name)
    if kernel is None:
        raise NpuKernelError(
            f"fused op {op_name} has no NPU kernel; run it with --kernel reference"
        )
    return kernel


def kernel_attrs(op: fusedop.FusedOp, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """`attrs` without the values that only stand for "not given": None (a required attribute
    the node lacks) and the empty list of an optional list attribute (`dilations`, `pads`...),
    so the kernel applies the ONNX default, as the op's `reference` does."""
    unset_lists = {a.name for a in op.attributes if a.kind in ("ints", "floats") and not a.default}
    return {
        k: v
        for k, v in attrs.items()
        if v is not None and not (k in unset_lists and isinstance(v, list | tuple) and not v)
    }


def run_fused_on_npu(
    op_name: str,
    inputs: Sequence[np.ndarray | None],
    attrs: Mapping[str, Any],
    ctx: RunContext,
) -> Sequence[np.ndarray]:
    """All outputs of fused op `op_name` computed by its kernel on `ctx.target` (functional run).

    Raises `NpuKernelError` naming the op, the target and the kernel's reason when the node's
    tiling or inputs cannot run.
    """
    from .kernels.api import KernelError, MachineLimitError, meta_of
    from .kernels.npu.clock import ARITHMETIC
    from .kernels.npu.errors import NpuError

    op = fusedop.get(op_name)
    kernel = fused_kernel(op_name)
    target = machine(ctx.target)
    given = kernel_attrs(op, attrs)
    try:
        # The tiling as `Kernel.run` would pick it, resolved here to time the search apart.
        start = time.perf_counter()
        tiling = kernel.tiling_from_attrs(given)
        if tiling is None:
            metas = tuple(meta_of(x) for x in inputs)
            tiling = kernel.host_tiling(metas, given, target)
        searched = time.perf_counter()
        arithmetic = ARITHMETIC.seconds
        run = kernel.run(target, list(inputs), given, tiling=tiling, timeline=False)
        tile_seconds = ARITHMETIC.seconds - arithmetic
        plugin_clock.add(plugin_clock.SEARCH, searched - start)
        plugin_clock.add(plugin_clock.ARITHMETIC, tile_seconds)
        plugin_clock.add(plugin_clock.SIMULATE, time.perf_counter() - searched - tile_seconds)
    except MachineLimitError as exc:
        raise NpuLimitError(f"{op_name} on {target.name}: {exc}", exc.limit) from exc
    except (KernelError, NpuError) as exc:
        raise NpuKernelError(f"{op_name} on {target.name}: {exc}") from exc
    fixed = sum(1 for p in op.outputs if p.option != "variadic")
    if len(run.outputs) < fixed:
        raise NpuKernelError(
            f"{op_name}: kernel returned {len(run.outputs)} outputs, the op declares {fixed}"
        )
    return run.outputs


def check_tilings(model: onnx.ModelProto, target: str) -> None:
    """Check every fused node's stored tiling (`tile_*` attributes) before anything runs.

    A tiling that is malformed, or (for static shapes) does not fit `target`'s buffers or cores,
    raises `NpuKernelError` naming the node and the kernel's reason, without running anything:
    a session would refuse the same tiling only when the node runs. Symbolic shapes are left to
    the kernel at run time.
    """
    from .engine import infer_types
    from .kernels.api import KernelError, TensorMeta
    from .kernels.npu.errors import NpuError

    npu = machine(target)
    types = infer_types(model)
    outer: dict[str, Any] = {}
    for table in types.values():
        for name in table:
            outer.setdefault(name, table[name])

    def meta(name: str) -> TensorMeta | None:
        vt = outer.get(name)
        if vt is None or vt.shape is None or not vt.elem_type:
            return None
        if not all(isinstance(d, int) for d in vt.shape):
            return None
        return TensorMeta(tuple(vt.shape), helper.tensor_dtype_to_np_dtype(vt.elem_type))

    for node in _fused_nodes(model.graph):
        op = fusedop.get(node.op_type)
        kernel = fused_kernel(node.op_type)
        attrs = kernel_attrs(op, op.attribute_values(node))
        where = f"node '{node.name}' ({node.op_type}) on {npu.name}"
        try:
            tiling = kernel.tiling_from_attrs(attrs)
            if tiling is None:
                continue
            metas = [meta(n) if n else None for n in node.input]
            if any(m is None for m, n in zip(metas, node.input, strict=True) if n):
                continue  # symbolic shapes: the kernel checks the tiling when it runs
            if op.collective_input is not None:
                local = metas[op.collective_input]
                assert local is not None
                group = int(attrs.get("group_size", 1))
                metas[op.collective_input] = TensorMeta((group, *local.shape), local.dtype)
                attrs["rank"] = 0
            kernel.check_tiling(metas, attrs, tiling, npu)
        except (KernelError, NpuError) as exc:
            raise NpuKernelError(f"{where}: {exc}") from exc


def _fused_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        if node.domain == fusedop.DOMAIN:
            yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                yield from _fused_nodes(sub)
