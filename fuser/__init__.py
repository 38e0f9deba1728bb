"""fuser: graph-level operator fusion for ONNX models, on a simulated Ascend-style NPU.

>>> import fuser
>>> result = fuser.fuse("model.onnx")            # doctest: +SKIP
>>> result.save("model.fused.onnx")             # doctest: +SKIP
>>> fuser.validate("model.onnx", result.model).ok  # doctest: +SKIP
True
"""

from .api import FusionResult, Inspection, fuse, inspect, validate
from .errors import FuserError
from .unfuse import UnfuseResult, unfuse

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
