"""The fused AllGatherMatMul: `kernel` (problem, tiling type, buffers, program), `cost` (tiling
space and analytical cost)."""

from .cost import MODELS
from .kernel import KERNELS, AllGatherMatMulKernel, AllGatherMatMulTiling

__all__ = ["KERNELS", "MODELS", "AllGatherMatMulKernel", "AllGatherMatMulTiling"]
