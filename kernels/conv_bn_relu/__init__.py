"""Conv and the fused ConvBnRelu on the Cube: `geometry` (output size, halo), `tiling` (tiling
type, buffers, default tiling), `kernel` (program), `cost` (tiling space and analytical cost)."""

from .cost import MODELS
from .kernel import KERNELS, Conv, ConvBnRelu, ConvTranspose
from .tiling import ConvTiling

__all__ = ["KERNELS", "MODELS", "Conv", "ConvBnRelu", "ConvTiling", "ConvTranspose"]
