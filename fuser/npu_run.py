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

from collections.abc import Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from . import fusedop
from .errors import FuserError, UsageError

if TYPE_CHECKING:
    from .kernels.api import Kernel
    from .kernels.npu.machine import Machine
    from .ort import RunContext


class NpuKernelError(FuserError):
    """A fused node cannot run on its NPU kernel (no kernel, bad tiling, unsupported inputs)."""


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
    from .kernels.api import KernelError
    from .kernels.npu.errors import NpuError

    op = fusedop.get(op_name)
    kernel = fused_kernel(op_name)
    target = machine(ctx.target)
    given = kernel_attrs(op, attrs)
    try:
        run = kernel.run(target, list(inputs), given, functional=True, timeline=False)
    except (KernelError, NpuError) as exc:
        raise NpuKernelError(f"{op_name} on {target.name}: {exc}") from exc
    fixed = sum(1 for p in op.outputs if p.option != "variadic")
    if len(run.outputs) < fixed:
        raise NpuKernelError(
            f"{op_name}: kernel returned {len(run.outputs)} outputs, the op declares {fixed}"
        )
    return run.outputs
