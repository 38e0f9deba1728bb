"""MatMul and Gemm on the Cube: `kernel` (tiling type, buffers, program), `cost` (tiling space
and analytical cost)."""

from .cost import MODELS
from .kernel import KERNELS, Gemm, GemmProblem, MatMul, MatMulTiling

__all__ = ["KERNELS", "MODELS", "Gemm", "GemmProblem", "MatMul", "MatMulTiling"]
