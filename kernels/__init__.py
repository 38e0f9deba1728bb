"""NPU kernels of fuser: each op's tiling and its program on the simulated NPU.

- `npu/`: the simulated machine (target config, buffers, pipes, SPMD launch, timeline).
- `api`: how a kernel is called and tiled, and how to add one (one file with `KERNELS`).
- `registry`: `get_kernel(domain, op_type)`, the cost models, and `estimate(...)` for ops
  without a kernel.
- `search`: the tiling search over a kernel's space, priced by its cost model.
- One folder per kernel with a cost model (`matmul/`, `conv_bn_relu/`, `layernorm_matmul/`,
  `allgather_matmul/`, `softmax_topk/`): `kernel.py` (tiling and simulated program) and
  `cost.py` (tiling space and analytical cost) side by side. One module per simple kernel
  family (`elementwise`, `reduce`, ...). Modules whose names start with `_` hold shared helpers.

Kernels know no ONNX graph: they take numpy arrays (or `TensorMeta` for timing-only runs) and
plain attribute values.
"""
