"""The machine: a frozen description of one NPU target, loaded from a JSON data file.

A target file holds every number of the machine with its source tag in `"_sources"`
([P] vendor code or docs, [S] third-party notes, [D] derived arithmetic, [G] guess; see
`shared/docs/npu-model.md`). Shipped targets live in `fuser.kernels.targets`:

    >>> m = load_target("ascend910b")
    >>> m.cube_cores, m.clock_hz
    (24, 1800000000.0)

`load_target` also takes a path to a user's own file with the same keys.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ...digest import sha256_hex
from .errors import TargetError

SHIPPED_TARGETS: tuple[str, ...] = ("ascend910b", "ascend910", "ascend310p")
_META_KEYS = frozenset({"_sources", "_comment"})


@dataclass(frozen=True)
class Machine:
    """One NPU target. Units are in the field names; cycles are core clock cycles."""

    name: str
    # Cores. On 910B cube and vector cores are separate (1 cube : 2 vector); on 910/310P a
    # combined AI core has both units, so the two counts are equal.
    cube_cores: int
    vector_cores: int
    clock_hz: float
    # Cube: one m x k x n block per cycle; k of a block holds `cube_k_bytes` bytes of the input
    # dtype (fp16: 16, int8: 32, fp32: 8), the fractal C0 of the Ascend data formats.
    cube_m: int
    cube_n: int
    cube_k_bytes: int
    vector_bytes_per_cycle: int
    # Per-core buffers.
    ub_bytes: int
    l1_bytes: int
    l0a_bytes: int
    l0b_bytes: int
    l0c_bytes: int
    l2_bytes: int
    # Bandwidths. Every GM access of a core goes through the L2 at the core's L2 port rate
    # (read / write); HBM is one resource of the chip, shared by all cores, reads and writes:
    # the first touch of a byte and every write cost HBM time (see `npu.launch`).
    l2_read_bytes_per_cycle: float
    l2_write_bytes_per_cycle: float
    hbm_bytes_per_s: float
    l1_to_l0a_bytes_per_cycle: float
    l1_to_l0b_bytes_per_cycle: float
    l0c_to_gm_bytes_per_cycle: float
    ub_to_l1_bytes_per_cycle: float
    l1_to_l0_startup_cycles: float
    # Fixed costs. A DMA pipe (MTE2; MTE3 and FixPipe) pays its start-up head once per kernel
    # on each core, at its first instruction; then every copy pays its per-transfer cost.
    kernel_launch_cycles: float
    copy_in_small_limit_bytes: int
    copy_in_head_small_cycles: float
    copy_in_head_small_per_core_cycles: float
    copy_in_head_large_cycles: float
    copy_in_head_large_per_core_cycles: float
    copy_out_head_cycles: float
    copy_in_transfer_cycles: float
    l1_load_transfer_cycles: float
    copy_out_transfer_cycles: float
    scalar_op_cycles: float
    # A vector result headed for the Cube crosses GM/L2 (910B: separate cores) or goes
    # UB -> L1 directly (combined cores).
    vector_to_cube_via_gm: bool
    # Chip-to-chip links and the fitted AllGather time.
    link_peers: int
    link_bytes_per_s: float
    link_latency_s: float
    allgather_fixed_us: float
    allgather_us_per_mb: float
    # Vector instruction cost k * N + b cycles for N elements: op -> dtype -> (k, b).
    vector_ops: Mapping[str, Mapping[str, tuple[float, float]]] = field(
        default_factory=lambda: MappingProxyType({}), compare=False
    )
    sources: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({}), compare=False, repr=False
    )

    @property
    def hbm_bytes_per_cycle(self) -> float:
        """Whole-chip HBM bandwidth in bytes per core cycle."""
        return self.hbm_bytes_per_s / self.clock_hz

    def cube_k_block(self, dtype: np.dtype) -> int:
        """Elements of `dtype` along k in one Cube block (fp16: 16, fp32: 8)."""
        return max(1, self.cube_k_bytes // np.dtype(dtype).itemsize)

    def cycles_to_us(self, cycles: float) -> float:
        """Convert core cycles to microseconds at this machine's clock."""
        return cycles / self.clock_hz * 1e6

    @property
    def fingerprint(self) -> str:
        """A short digest of every number of the target: tilings and prices cached for one
        version of a target are not reused for another of the same name."""
        text = repr(dataclasses.replace(self, sources=MappingProxyType({})))
        return sha256_hex(text.encode())[:12]

    @property
    def read_bytes_per_cycle(self) -> float:
        """One core's GM read bandwidth: its L2 port (HBM time is charged chip-wide)."""
        return self.l2_read_bytes_per_cycle

    @property
    def write_bytes_per_cycle(self) -> float:
        """One core's GM write bandwidth: its L2 port (HBM time is charged chip-wide)."""
        return self.l2_write_bytes_per_cycle

    def copy_in_head(self, nbytes: int, active_cores: int) -> float:
        """Start-up of a core's MTE2 pipe, once per kernel, sized by its first copy (fitted:
        small and large copies differ, and the head grows with the cores started)."""
        if nbytes < self.copy_in_small_limit_bytes:
            return self.copy_in_head_small_cycles + self.copy_in_head_small_per_core_cycles * (
                active_cores
            )
        return self.copy_in_head_large_cycles + self.copy_in_head_large_per_core_cycles * (
            active_cores
        )

    def copy_in_transfer(self, to_l1: bool) -> float:
        """Fixed cycles of one copy-in once its pipe has started: GM -> L1 (a cube core's
        panel load) or GM -> UB."""
        return self.l1_load_transfer_cycles if to_l1 else self.copy_in_transfer_cycles

    def hbm_cycles(self, nbytes: float) -> float:
        """Cycles the chip's HBM needs for `nbytes` of traffic (reads and writes alike)."""
        return nbytes / self.hbm_bytes_per_cycle

    def vector_cost(self, op: str, dtype: np.dtype) -> tuple[float, float]:
        """(k, b) of the vector instruction `op` on `dtype`.

        A dtype without its own row takes the float16 row with k scaled by itemsize / 2: the
        unit streams bytes, so wider elements take proportionally longer [D].
        """
        try:
            per_dtype = self.vector_ops[op]
        except KeyError:
            raise TargetError(
                f"{self.name}: no vector cost for op '{op}' in 'vector_ops'"
            ) from None
        name = dtype_name(dtype)
        if name in per_dtype:
            return per_dtype[name]
        if "float16" not in per_dtype:
            raise TargetError(f"{self.name}: no vector cost for '{op}' on {name} in 'vector_ops'")
        k, b = per_dtype["float16"]
        return k * np.dtype(dtype).itemsize / 2, b


@functools.lru_cache(maxsize=64)
def dtype_name(dtype: Any) -> str:
    """`np.dtype(dtype).name`, remembered: cost models ask it per vector instruction priced,
    and numpy computes it in Python each time."""
    return np.dtype(dtype).name


def load_target(name_or_path: str | Path) -> Machine:
    """Load a shipped target by name (`ascend910b`, ...) or a user's JSON file by path.

    Raises `TargetError` whose message names the file and the offending key.
    """
    text, where = _read_target_text(str(name_or_path))
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise TargetError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise TargetError(f"{where}: top level must be a JSON object")
    return _machine_from_dict(raw, where)


def _read_target_text(name_or_path: str) -> tuple[str, str]:
    if name_or_path in SHIPPED_TARGETS:
        res = resources.files("fuser.kernels.targets").joinpath(f"{name_or_path}.json")
        return res.read_text(encoding="utf-8"), f"{name_or_path}.json"
    path = Path(name_or_path)
    if not path.is_file():
        raise TargetError(
            f"{name_or_path}: no such target file; shipped targets are {', '.join(SHIPPED_TARGETS)}"
        )
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError) as e:
        raise TargetError(f"{path}: cannot read ({e})") from None


def _machine_from_dict(raw: dict[str, Any], where: str) -> Machine:
    fields = {f.name: f for f in dataclasses.fields(Machine) if f.name != "sources"}
    for key in raw:
        if key not in fields and key not in _META_KEYS:
            raise TargetError(f"{where}: unknown key '{key}'")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            raise TargetError(f"{where}: missing key '{name}'")
        value = raw[name]
        if name == "vector_ops":
            values[name] = _vector_ops(value, where)
        else:
            values[name] = _scalar(name, value, str(f.type), where)
    sources = raw.get("_sources", {})
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        raise TargetError(f"{where}: key '_sources' must map keys to strings")
    values["sources"] = MappingProxyType(dict(sources))
    return Machine(**values)


def _scalar(name: str, value: Any, type_name: str, where: str) -> Any:
    if type_name == "str":
        if not isinstance(value, str):
            raise TargetError(f"{where}: key '{name}' must be a string, got {value!r}")
        return value
    if type_name == "bool":
        if not isinstance(value, bool):
            raise TargetError(f"{where}: key '{name}' must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TargetError(f"{where}: key '{name}' must be a number, got {value!r}")
    if type_name == "int" and not isinstance(value, int):
        raise TargetError(f"{where}: key '{name}' must be an integer, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise TargetError(f"{where}: key '{name}' must be finite and non-negative, got {value}")
    if type_name == "int":
        return int(value)
    return float(value)


def _vector_ops(value: Any, where: str) -> Mapping[str, Mapping[str, tuple[float, float]]]:
    if not isinstance(value, dict):
        raise TargetError(f"{where}: key 'vector_ops' must be an object op -> dtype -> [k, b]")
    table: dict[str, Mapping[str, tuple[float, float]]] = {}
    for op, per_dtype in value.items():
        if not isinstance(per_dtype, dict):
            raise TargetError(f"{where}: key 'vector_ops.{op}' must be an object dtype -> [k, b]")
        row: dict[str, tuple[float, float]] = {}
        for dtype, kb in per_dtype.items():
            key = f"vector_ops.{op}.{dtype}"
            ok = (
                isinstance(kb, list)
                and len(kb) == 2
                and all(isinstance(x, int | float) and not isinstance(x, bool) for x in kb)
            )
            if not ok:
                raise TargetError(f"{where}: key '{key}' must be [k, b], got {kb!r}")
            if kb[0] < 0 or kb[1] < 0:
                raise TargetError(f"{where}: key '{key}' must be non-negative, got {kb!r}")
            try:
                np.dtype(dtype)
            except TypeError:
                raise TargetError(f"{where}: key '{key}' names no numpy dtype") from None
            row[dtype] = (float(kb[0]), float(kb[1]))
        table[op] = MappingProxyType(row)
    return MappingProxyType(table)
