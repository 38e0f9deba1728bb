"""Registry of kernels, found by discovery, and the roofline estimate for every other op.

Every module or kernel package of `fuser.kernels` whose name does not start with `_` (and is
not `api`, `registry`, `search`, `npu` or `targets`) is imported once; each lists its kernels in
a module-level `KERNELS` tuple, and a kernel with a cost model lists it in `MODELS`. So adding a
kernel is adding one file or one folder (see `fuser.kernels.api`).

Looking one kernel or model up (`get_kernel`, `get_model`) imports only the module that holds
it, found in the generated `fuser.kernels.manifest` (importing every kernel module costs about
0.2 s of CPU, a tenth of a whole 10k-node fuse; a transformer needs half of them). Regenerate
it with `python -m fuser.kernels.registry --write-manifest` after adding a kernel;
tests/kernels/test_kernel_manifest.py fails while it differs from discovery.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

from ._cost_base import CostModel
from .api import Kernel, TensorMeta
from .manifest import KERNEL_MODULES, MODEL_MODULES, TILING_FIELDS
from .npu.machine import Machine
from .npu.stats import RunStats

_NOT_KERNEL_MODULES = frozenset({"api", "manifest", "registry", "search", "npu", "targets"})
MANIFEST_PATH = Path(__file__).with_name("manifest.py")


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


@cache
def get_kernel(domain: str, op_type: str) -> Kernel | None:
    """The kernel for `op_type` in `domain` ("" or "ai.onnx" for ONNX ops), or None. Imports
    only the kernel module that holds it (`fuser.kernels.manifest`)."""
    found = _listed(KERNEL_MODULES, "KERNELS", domain, op_type)
    assert found is None or isinstance(found, Kernel)
    return found


@cache
def get_model(domain: str, op_type: str) -> CostModel | None:
    """The cost model of `op_type` in `domain` ("" or "ai.onnx" for ONNX ops), or None; imports
    only its module, as `get_kernel` does."""
    found: CostModel | None = _listed(MODEL_MODULES, "MODELS", domain, op_type)
    return found


def _listed(modules: Mapping[tuple[str, str], str], listing: str, domain: str, op: str) -> Any:
    """The entry for (domain, op) of the `listing` tuple (KERNELS, MODELS) of the module the
    manifest names for it, or None."""
    key = ("" if domain == "ai.onnx" else domain, op)
    module = modules.get(key)
    if module is None:
        return None
    found = importlib.import_module(f"{__package__}.{module}")
    return next((x for x in getattr(found, listing, ()) if (x.domain, x.op_type) == key), None)


def tiling_fields(domain: str, op_type: str) -> tuple[str, ...] | None:
    """The field names of the kernel's tiling (what its `tile_<field>` attributes are named),
    or None without a kernel; read from the manifest, importing no kernel module (the fused
    ops' schemas declare these attributes on every run)."""
    return TILING_FIELDS.get(("" if domain == "ai.onnx" else domain, op_type))


Manifest = tuple[
    dict[tuple[str, str], str], dict[tuple[str, str], str], dict[tuple[str, str], tuple[str, ...]]
]


def discovered_modules() -> Manifest:
    """(kernels, models, tilings): the module (its name under `fuser.kernels`) of every kernel
    and cost model by (domain, op_type), and each kernel's tiling fields, found by importing
    every kernel module: what the manifest says."""
    kernels: dict[tuple[str, str], str] = {}
    models: dict[tuple[str, str], str] = {}
    tilings: dict[tuple[str, str], tuple[str, ...]] = {}
    for module in _kernel_modules():
        short = module.__name__.rsplit(".", 1)[-1]
        for kernel in getattr(module, "KERNELS", ()):
            kernels[(kernel.domain, kernel.op_type)] = short
            fields = dataclasses.fields(kernel.tiling_type)
            tilings[(kernel.domain, kernel.op_type)] = tuple(f.name for f in fields)
        for model in getattr(module, "MODELS", ()):
            models[(model.domain, model.op_type)] = short
    return kernels, models, tilings


def render_manifest() -> str:
    """The source of `fuser/kernels/manifest.py` for the kernels discovery finds (one entry a
    line, sorted, as `ruff format` lays it out)."""
    kernels, models, tilings = discovered_modules()
    lines = [
        '"""Which module of `fuser.kernels` holds each kernel and cost model, by (domain,',
        "op_type), and the field names of each kernel's tiling: `registry.get_kernel` and",
        "`registry.get_model` import only that one module, `registry.tiling_fields` none.",
        "",
        "Generated by `python -m fuser.kernels.registry --write-manifest`;",
        "tests/kernels/test_kernel_manifest.py fails when it no longer equals discovery.",
        '"""',
        "",
    ]
    for name, found in (("KERNEL_MODULES", kernels), ("MODEL_MODULES", models)):
        lines.append(f"{name}: dict[tuple[str, str], str] = {{")
        lines += [f'    ("{d}", "{o}"): "{m}",' for (d, o), m in sorted(found.items())]
        lines += ["}", ""]
    lines.append("TILING_FIELDS: dict[tuple[str, str], tuple[str, ...]] = {")
    for (d, o), names in sorted(tilings.items()):
        quoted = [f'"{n}"' for n in names]
        inside = quoted[0] + "," if len(quoted) == 1 else ", ".join(quoted)
        entry = f'    ("{d}", "{o}"): ({inside}),'
        if len(entry) <= 100:
            lines.append(entry)
        else:
            lines += [f'    ("{d}", "{o}"): (', *(f'        "{n}",' for n in names), "    ),"]
    lines += ["}", ""]
    return "\n".join(lines)


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


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write-manifest"]:
        sys.exit("usage: python -m fuser.kernels.registry --write-manifest")
    MANIFEST_PATH.write_text(render_manifest())
    print(f"wrote {MANIFEST_PATH}")
