"""NPU kernels of fuser: each op's tiling and its program on the simulated NPU.

- `npu/`: the simulated machine (target config, buffers, pipes, SPMD launch, timeline).
- `api`: how a kernel is called and tiled, and how to add one (one file with `KERNELS`).
- `registry`: `get_kernel(domain, op_type)`, and `estimate(...)` for ops without a kernel.
- One module per kernel family (`conv_bn_relu`, `matmul`, `elementwise`, ...); modules whose
  names start with `_` hold shared helpers.

Kernels know no ONNX graph: they take numpy arrays (or `TensorMeta` for timing-only runs) and
plain attribute values.
"""
