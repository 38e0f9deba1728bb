"""Registry of kernels, found by discovery, and the roofline estimate for every other op.

Every module or kernel package of `fuser.kernels` whose name does not start with `_` (and is
not `api`, `registry`, `search`, `npu` or `targets`) is imported once; each lists its kernels in
a module-level `KERNELS` tuple, and a kernel with a cost model lists it in `MODELS`. So adding a
kernel is adding one file or one folder (see `fuser.kernels.api`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping, Sequence
from functools import cache
from types import MappingProxyType, ModuleType

from ._cost_base import CostModel
from .api import Kernel, TensorMeta
from .npu.machine import Machine
from .npu.stats import RunStats

_NOT_KERNEL_MODULES = frozenset({"api", "registry", "search", "npu", "targets"})


def _kernel_modules() -> list[ModuleType]:
    package = importlib.import_module(__package__ or "fuser.kernels")
    return [
        importlib.import_module(f"{package.__name__}.{info.name}")
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name)
        if not info.name.startswith("_") and info.name not in _NOT_KERNEL_MODULES
    ]


@cache
def all_kernels() -> Mapping[tuple[str, str], Kernel]:
    """Every registered kernel keyed by (domain, op_type)."""
    found: dict[tuple[str, str], Kernel] = {}
    for module in _kernel_modules():
        for kernel in getattr(module, "KERNELS", ()):
            key = (kernel.domain, kernel.op_type)
            if key in found:
                raise RuntimeError(
                    f"kernel {key} registered twice ({type(found[key]).__name__} and "
                    f"{type(kernel).__name__} in {module.__name__})"
                )
            found[key] = kernel
    return MappingProxyType(found)


@cache
def all_models() -> Mapping[tuple[str, str], CostModel]:
    """Every kernel's cost model keyed by (domain, op_type)."""
    found: dict[tuple[str, str], CostModel] = {}
    for module in _kernel_modules():
        for model in getattr(module, "MODELS", ()):
            found[(model.domain, model.op_type)] = model
    return MappingProxyType(found)


def get_kernel(domain: str, op_type: str) -> Kernel | None:
    """The kernel for `op_type` in `domain` ("" or "ai.onnx" for ONNX ops), or None."""
    if domain == "ai.onnx":
        domain = ""
    return all_kernels().get((domain, op_type))


def estimate(
    op_type: str,
    inputs_meta: Sequence[TensorMeta | None],
    outputs_meta: Sequence[TensorMeta | None],
    machine: Machine,
) -> RunStats:
    """Roofline estimate for an op without a kernel: launch + max(GM bytes / HBM bandwidth,
    bytes touched / vector throughput of all vector cores). Marked `estimated=True`.
    """
    ins = [m for m in inputs_meta if m is not None]
    outs = [m for m in outputs_meta if m is not None]
    read = sum(m.nbytes for m in ins)
    write = sum(m.nbytes for m in outs)
    t_mem = (read + write) / machine.hbm_bytes_per_cycle
    # Each output element is produced by at least one vector pass over its bytes.
    t_vec = sum(m.nbytes for m in outs) / (machine.vector_bytes_per_cycle * machine.vector_cores)
    core_cycles = max(t_mem, t_vec)
    cycles = machine.kernel_launch_cycles + core_cycles
    busy = {"MTE2": t_mem, "VECTOR": t_vec}
    util = {p: (b / core_cycles if core_cycles else 0.0) for p, b in busy.items()}
    return RunStats(
        cycles=cycles,
        us=machine.cycles_to_us(cycles),
        core_cycles=core_cycles,
        pipe_busy=MappingProxyType(busy),
        pipe_utilization=MappingProxyType(util),
        gm_read=read,
        gm_write=write,
        ub=read + write,
        l1=0,
        l0a=0,
        l0b=0,
        l0c=0,
        launches=1,
        cores=machine.vector_cores,
        bound="memory" if t_mem >= t_vec else "compute",
        estimated=True,
        timeline=None,
        hbm_bytes=read + write,
    )
