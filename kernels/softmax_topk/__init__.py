"""The fused SoftmaxTopK on the Vector unit: `kernel` (problem and row program), `cost` (tiling
space and analytical cost)."""

from .cost import MODELS
from .kernel import KERNELS, SoftmaxTopKKernel, SoftmaxTopKTiling

__all__ = ["KERNELS", "MODELS", "SoftmaxTopKKernel", "SoftmaxTopKTiling"]
