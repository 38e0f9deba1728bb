"""The fused LayerNormMatMul: `plan` (problem, tiling type, buffers, default tiling), `kernel`
and `program` (the norm-then-Linears program, shared with RmsNormMatMul), `cost` (tiling space
and analytical cost)."""

from .cost import MODELS
from .kernel import KERNELS, LayerNormMatMulKernel
from .plan import LayerNormMatMulTiling

__all__ = ["KERNELS", "MODELS", "LayerNormMatMulKernel", "LayerNormMatMulTiling"]
