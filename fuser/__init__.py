"""fuser: graph-level operator fusion for ONNX models, on a simulated Ascend-style NPU.

>>> import fuser
>>> result = fuser.fuse("model.onnx")            # doctest: +SKIP
>>> result.save("model.fused.onnx")             # doctest: +SKIP
>>> fuser.validate("model.onnx", result.model).ok  # doctest: +SKIP
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import FusionResult, Inspection, fuse, inspect, validate
    from .errors import FuserError
    from .unfused import UnfuseResult, unfuse

__all__ = [
    "FuserError",
    "FusionResult",
    "Inspection",
    "UnfuseResult",
    "fuse",
    "inspect",
    "unfuse",
    "validate",
]
__version__ = "0.1.0"

# Where each public name lives. They load on first use (PEP 562), so `import fuser` and
# `fuser --help` do not pay for onnx, numpy and onnxruntime until a command needs them.
_PUBLIC = {
    "FusionResult": "api",
    "Inspection": "api",
    "fuse": "api",
    "inspect": "api",
    "validate": "api",
    "FuserError": "errors",
    "UnfuseResult": "unfused",
    "unfuse": "unfused",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'fuser' has no attribute '{name}'")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, "__version__"})
