"""The fused RmsNormMatMul: `plan` (problem, vector program), `kernel` (program), `cost`
(tiling space and analytical cost)."""

from .cost import MODELS
from .kernel import KERNELS, RmsNormMatMulKernel

__all__ = ["KERNELS", "MODELS", "RmsNormMatMulKernel"]
