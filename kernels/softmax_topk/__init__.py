"""The fused SoftmaxTopK on the Vector unit: `kernel` (problem and row program), `cost` (tiling
space and analytical cost)."""

from .cost import MODELS
from .kernel import KERNELS, SoftmaxTopKKernel

__all__ = ["KERNELS", "MODELS", "SoftmaxTopKKernel"]
