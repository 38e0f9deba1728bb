"""The kernel API: how a kernel is called, tiled and registered.

A kernel runs one op on the simulated NPU (`fuser.kernels.npu`): it knows the op's inputs and
attributes (as ONNX or `docs/fused-ops.md` define them) and no ONNX graph.

    >>> import numpy as np
    >>> from fuser.kernels import registry
    >>> from fuser.kernels.npu.machine import load_target
    >>> k = registry.get_kernel("", "Relu")
    >>> run = k.run(load_target("ascend910b"), [np.ones((4, 5), np.float32)], {})
    >>> run.outputs[0].shape, run.stats.launches
    ((4, 5), 1)

Calling convention (`Kernel.run`):
- `inputs` are positional as in the op schema, `None` for an absent optional input. In
  functional mode they are numpy arrays; in timing-only mode (`functional=False`) they may be
  `TensorMeta` (shape and dtype only), and the run returns no outputs.
- `attrs` are plain Python values (int, float, str, list[int]); a missing attribute takes its
  ONNX default. Attributes named `tile_<field>` give the tiling (see below).
- The result is a `KernelRun(outputs, stats)`; `stats` is a `RunStats` with the timeline.

How to add a kernel (one file or folder, nothing else to edit):
1. Create `kernels/<name>.py` (or a folder `kernels/<name>/` whose `__init__` exports `KERNELS`
   and, with a cost model in `cost.py`, `MODELS`). Define a frozen dataclass tiling
   subclassing `Tiling` whose fields are all ints (booleans as 0/1, e.g. `double_buffer`),
   so that they round-trip as `tile_<field>` node attributes.
2. Subclass `Kernel`: set `op_type`, `domain` ("fuser" for fused ops, "" for ONNX ops,
   "com.microsoft" for contrib ops) and `tiling_type`; implement `infer` (output metas),
   `default_tiling`, `check_tiling` (raise `TilingError` with a reason when the tiling does
   not fit the buffers, counting both slots when double buffering) and `simulate` (the
   program: reserve queues in the core's buffers, then copy in, compute, copy out, and call
   `npu.launch.launch` to run it SPMD over the cores).
3. At module level: `KERNELS = (MyKernel(),)`. `registry` imports every module of this package
   (except those whose name starts with `_`) and registers what `KERNELS` lists. A fused
   kernel mixes in `search.Searched`, so its run-time tiling is the tiling search's pick.
Shared helpers for kernels live in modules whose names start with `_`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .npu.machine import Machine
from .npu.stats import RunStats


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor, enough for a timing-only run."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @classmethod
    def of(cls, array: np.ndarray) -> TensorMeta:
        """The meta of an array."""
        return cls(tuple(array.shape), array.dtype)

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.size * self.dtype.itemsize


Input = np.ndarray | TensorMeta | None


@dataclass(frozen=True)
class KernelRun:
    """Outputs of a run (empty in timing-only mode) and what it cost."""

    outputs: tuple[np.ndarray, ...]
    stats: RunStats


class KernelError(Exception):
    """A kernel cannot run these inputs or attributes (the message says why)."""


class TilingError(KernelError):
    """A tiling is malformed or does not fit the core's buffers (the message says which)."""


NO_FLOAT64_UNIT = "no float64 unit"


class MachineLimitError(KernelError):
    """Valid inputs that the machine has no unit for (float64: neither the Cube nor the Vector
    unit of the 910B computes in double). A limit of the hardware, never a fault of the node:
    `fuser validate` runs such a node on its reference instead and says so. `limit` is the
    short reason it reports ("no float64 unit")."""

    def __init__(self, message: str, limit: str = NO_FLOAT64_UNIT) -> None:
        super().__init__(message)
        self.limit = limit

    def __reduce__(self) -> tuple[type[MachineLimitError], tuple[str, str]]:
        return type(self), (str(self), self.limit)


@dataclass(frozen=True)
class Tiling:
    """Base of every kernel's tiling: a frozen dataclass of int fields."""


def meta_of(x: Input) -> TensorMeta | None:
    """`TensorMeta` of an input (None stays None)."""
    if x is None or isinstance(x, TensorMeta):
        return x
    return TensorMeta.of(np.asarray(x))


class Kernel(ABC):
    """A simulated NPU kernel for one op type. Subclasses are stateless singletons."""

    op_type: ClassVar[str]
    domain: ClassVar[str]
    tiling_type: ClassVar[type[Tiling]]
    #: The inputs whose values (not only shapes) a timing-only run reads, e.g. TopK's k; None:
    #: any of them may be (the safe default). The cost model times a node once per distinct
    #: values of these and shapes of the others (`fuser.costmodel`).
    value_inputs: ClassVar[frozenset[int] | None] = None

    def run(
        self,
        machine: Machine,
        inputs: Sequence[Input],
        attrs: Mapping[str, Any],
        *,
        tiling: Tiling | None = None,
        functional: bool = True,
        timeline: bool = True,
    ) -> KernelRun:
        """Run the op on `machine`; see the module docstring for the calling convention.

        The tiling is, in order: `tiling`, the `tile_*` attributes, `host_tiling`. It is
        checked first, so a tiling that does not fit raises `TilingError` before any work.
        """
        metas = tuple(meta_of(x) for x in inputs)
        if functional:
            for i, x in enumerate(inputs):
                if isinstance(x, TensorMeta):
                    raise KernelError(
                        f"{self.op_type}: input {i} is a TensorMeta; a functional run needs arrays"
                    )
        if tiling is None:
            tiling = self.tiling_from_attrs(attrs)
        if tiling is None:
            tiling = self.host_tiling(metas, attrs, machine)
        if not isinstance(tiling, self.tiling_type):
            raise TilingError(
                f"{self.op_type}: expects a {self.tiling_type.__name__}, "
                f"got {type(tiling).__name__}"
            )
        self.check_tiling(metas, attrs, tiling, machine)
        arrays = tuple(
            None if (x is None or isinstance(x, TensorMeta)) else np.asarray(x) for x in inputs
        )
        return self.simulate(machine, arrays, metas, attrs, tiling, functional, timeline)

    def timing_key(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> Hashable | None:
        """What a timing-only run at the run-time tiling depends on, besides the machine, where
        that is less than the inputs' shapes and every attribute (None: all of them, the safe
        default). Runs with equal keys take the same cycles, so `search.timed_cycles` runs one
        of them: e.g. LayerNormalization's plan, which `stash_type` leaves alone for float32."""
        return None

    def host_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Tiling:
        """The run-time tiling when a node carries no `tile_*` attributes: `default_tiling`.
        Fused kernels mix in `search.Searched`, whose pick is the tiling search's."""
        return self.default_tiling(inputs_meta, attrs, machine)

    @abstractmethod
    def infer(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
    ) -> tuple[TensorMeta, ...]:
        """Output shapes and dtypes; raises `KernelError` for inputs the op cannot take."""

    @abstractmethod
    def default_tiling(
        self, inputs_meta: Sequence[TensorMeta | None], attrs: Mapping[str, Any], machine: Machine
    ) -> Tiling:
        """A tiling that fits `machine` for these shapes (host-side tiling at run time)."""

    @abstractmethod
    def check_tiling(
        self,
        inputs_meta: Sequence[TensorMeta | None],
        attrs: Mapping[str, Any],
        tiling: Tiling,
        machine: Machine,
    ) -> None:
        """Raise `TilingError` with a reason if `tiling` is malformed or does not fit."""

    @abstractmethod
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
        """Run the checked `tiling`; in functional mode `inputs` holds the arrays."""

    def tiling_from_attrs(self, attrs: Mapping[str, Any]) -> Tiling | None:
        """The tiling stored as `tile_<field>` int attributes, or None if there is none."""
        fields = dataclasses.fields(self.tiling_type)
        names = [f.name for f in fields]
        present = [n for n in names if f"tile_{n}" in attrs]
        if not present:
            return None
        # A field with a default (added later, e.g. `staged`) may be absent: it takes it.
        missing = [
            f"tile_{f.name}"
            for f in fields
            if f.name not in present and f.default is dataclasses.MISSING
        ]
        if missing:
            raise TilingError(f"{self.op_type}: tiling attributes missing: {', '.join(missing)}")
        values: dict[str, int] = {}
        for n in present:
            v = attrs[f"tile_{n}"]
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise TilingError(f"{self.op_type}: attribute tile_{n} must be an int, got {v!r}")
            values[n] = int(v)
        return self.tiling_type(**values)

    def tiling_to_attrs(self, tiling: Tiling) -> dict[str, int]:
        """`tile_<field>` int attributes for `tiling`."""
        return {f"tile_{f.name}": int(getattr(tiling, f.name)) for f in dataclasses.fields(tiling)}
