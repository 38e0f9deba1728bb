"""fuser: graph-level operator fusion for ONNX models."""
