"""What `fuser patterns` prints, as data: listing the patterns imports neither onnx nor
numpy nor the kernels (importing the real registry takes most of a second).

Generated from the registry by `python -m fuser.registry --write-manifest`;
tests/unit/test_pattern_manifest.py fails when it no longer equals the registry.
"""

PATTERNS: list[dict[str, str | list[str]]] = [
    {
        "name": "conv_bn_relu",
        "ops": ["ConvBnRelu"],
        "description": (
            "Conv -> BatchNormalization (inference) -> activation (Relu, Clip, LeakyRelu, "
            "HardSigmoid, HardSwish, SiLU, GELU, Sigmoid, Tanh), each optional => ConvBnRelu"
        ),
    },
    {
        "name": "layernorm_matmul",
        "ops": ["LayerNormMatMul"],
        "description": (
            "LayerNormalization (op or decomposed) -> MatMul (+ Add bias) / Reshape -> Gemm, "
            "all on one normalized value => LayerNormMatMul"
        ),
    },
    {
        "name": "rmsnorm_matmul",
        "ops": ["RmsNormMatMul"],
        "description": (
            "SimplifiedLayerNormalization / RMSNormalization / decomposed RMSNorm (incl. the "
            "fp16 Cast form) -> MatMul (+ Add bias) / Gemm / Reshape -> Gemm|MatMul => "
            "RmsNormMatMul"
        ),
    },
    {
        "name": "allgather_matmul",
        "ops": ["AllGatherMatMul"],
        "description": (
            "com.microsoft AllGather -> [Reshape ->] MatMul (-> Add bias) / Gemm, one or "
            "several (QKV) => AllGatherMatMul"
        ),
    },
    {
        "name": "softmax_topk",
        "ops": ["SoftmaxTopK"],
        "description": (
            "Softmax/Sigmoid/LogSoftmax -> [bias, expert groups] -> TopK (-> renormalize "
            "[+eps], scale), TopK -> Softmax/Sigmoid, or TopK -> ScatterElements(-inf) -> "
            "Sigmoid => SoftmaxTopK"
        ),
    },
]

EXAMPLES: list[str] = [
    "resnet",
    "mobilenet",
    "cnn-edge",
    "conv1d",
    "bert",
    "bert17",
    "bert18",
    "gpt",
    "gpt-noaffine",
    "gpt2",
    "gpt2-ln",
    "llama",
    "llama-fp16",
    "llama-op",
    "moe",
    "moe-fp16",
    "qwen-router",
    "topk-softmax-router",
    "tp-mlp",
    "tp-mlp-negaxis",
    "sp-mlp",
    "sp-mlp-bsh",
    "tp-attention",
    "tp-gemm",
    "sp-reshape-gemm",
    "sp-reshape-matmul",
]
