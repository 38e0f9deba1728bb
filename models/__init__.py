"""Builders of realistic test models for fuser: no downloads, seeded random weights.

``EXAMPLES`` maps the names accepted by ``fuser fuse example:NAME`` to zero-argument builders;
each builder module documents what its models contain (which fusable chains, how many, and the
exporter quirks they reproduce). The builders themselves take keyword arguments for sizes, seed,
opset, dtype (``"float32"``/``"float16"``) and symbolic dims.

>>> from fuser.models import get_example
>>> model = get_example("resnet")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType

import onnx

from ..errors import UnknownExampleError
from .cnn import cnn_edge, conv1d, mobilenet, resnet
from .llama import RmsNormStyle, llama
from .moe import moe, qwen_router
from .parallel import sp_mlp, tp_attention, tp_linear, tp_mlp
from .transformer import LayerNormStyle, bert, gpt, gpt2

_BERT18_LN = LayerNormStyle(divide="reciprocal", square="mul", noop_casts=True)

EXAMPLES: Mapping[str, Callable[[], onnx.ModelProto]] = MappingProxyType(
    {
        "resnet": resnet,
        "mobilenet": mobilenet,
        "cnn-edge": cnn_edge,
        "conv1d": conv1d,
        "bert": bert,
        "bert17": partial(bert, opset=17),
        "bert18": partial(bert, opset=18, ln=_BERT18_LN),
        "gpt": gpt,
        "gpt-noaffine": partial(gpt, opset=13, ln=LayerNormStyle(affine=False)),
        "gpt2": gpt2,
        "gpt2-ln": partial(gpt2, opset=17),
        "llama": llama,
        "llama-fp16": partial(
            llama, dtype="float16", opset=18, norm=RmsNormStyle(inverse="reciprocal")
        ),
        "llama-op": partial(llama, opset=23, norm=RmsNormStyle(kind="rms_op")),
        "moe": moe,
        "moe-fp16": partial(moe, dtype="float16", softmax_cast=True),
        "qwen-router": qwen_router,
        "topk-softmax-router": partial(moe, order="topk_softmax"),
        "tp-mlp": tp_mlp,
        "tp-mlp-negaxis": partial(tp_mlp, negative_axis=True),
        "sp-mlp": sp_mlp,
        "sp-mlp-bsh": partial(sp_mlp, layout="bsh", seq="seq"),
        "tp-attention": tp_attention,
        "tp-gemm": tp_linear,
        "sp-reshape-gemm": partial(tp_linear, form="reshape-gemm"),
        "sp-reshape-matmul": partial(tp_linear, form="reshape-matmul"),
    }
)


def get_example(name: str) -> onnx.ModelProto:
    """Build the example model ``name`` (see ``EXAMPLES``); an unknown name raises
    ``UnknownExampleError`` (a fuser ``UsageError`` and a ``KeyError``) listing the known ones."""
    try:
        builder = EXAMPLES[name]
    except KeyError:
        known = ", ".join(sorted(EXAMPLES))
        raise UnknownExampleError(f"unknown example model {name!r}; known: {known}") from None
    return builder()


__all__ = [
    "EXAMPLES",
    "LayerNormStyle",
    "bert",
    "cnn_edge",
    "conv1d",
    "get_example",
    "gpt",
    "gpt2",
    "mobilenet",
    "moe",
    "qwen_router",
    "resnet",
    "sp_mlp",
    "tp_attention",
    "tp_linear",
    "tp_mlp",
]
