"""Export small real models with PyTorch exporters into tests/data/exported/.

The fixtures show fuser the graphs exporters really write (Identity-wrapped or computed
parameters, Casts, Shape consumers, exporter-specific LayerNorm and attention forms), so the
tests need no torch: the .onnx files, a reference ``.npz`` per model (inputs and PyTorch's
outputs) and README.md are committed.

Needs ``torch==2.13.0`` (CPU wheel) and, for the Hugging Face models, ``transformers``; models are
built from configs with random weights (nothing is downloaded). Run from the repository root::

    python scripts/export_fixtures.py            # all fixtures
    python scripts/export_fixtures.py bert-ts13  # some of them

Each export is checked before it is written: ``onnx.checker`` (full), onnxruntime runs it and
matches PyTorch's outputs, and the file must stay under 1 MB.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: configs only

import numpy as np
import onnx
import onnxruntime as ort
import torch
from fuser.models.inventory import count_chains
from torch import nn

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "exported"
MAX_BYTES = 1_000_000


@dataclass(frozen=True)
class Fixture:
    """One exported model: how to build it, how to export it, what it shows."""

    name: str
    build: Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]
    exporter: Literal["torchscript", "dynamo"]
    opset: int
    notes: str
    dynamic: dict[str, dict[int, str]] = field(default_factory=dict)  # input -> axis -> name
    options: dict[str, Any] = field(default_factory=dict)
    library: str = "torch.nn"
    half: bool = False  # export in float16 (checked against PyTorch with fp16 tolerances)
    strip_metadata: bool = False  # drop the dynamo exporter's per-node stack traces (size)


# -- models ------------------------------------------------------------------------------------


def _randomize_batchnorm(model: nn.Module, gen: torch.Generator) -> None:
    """Fresh BN layers are identity (weight 1, bias 0, mean 0, var 1): the TorchScript exporter
    then de-duplicates them into Identity nodes and folding is trivial. Give them real stats."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
            c = m.num_features
            m.weight.data = torch.rand(c, generator=gen) + 0.5
            m.bias.data = torch.rand(c, generator=gen) - 0.5
            m.running_mean = torch.rand(c, generator=gen) * 0.4 - 0.2
            m.running_var = torch.rand(c, generator=gen) + 0.5


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class TinyResNet(nn.Module):
    """Stem Conv+BN+ReLU, two basic blocks (identity and projection shortcut), a depthwise
    Conv+BN+ReLU, a 1-D Conv+BN+ReLU over the flattened rows, and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU()
        )
        self.layer1 = _BasicBlock(8, 8, 1)
        self.layer2 = _BasicBlock(8, 12, 2)
        self.dw = nn.Sequential(
            nn.Conv2d(12, 12, 3, 1, 1, groups=12), nn.BatchNorm2d(12), nn.ReLU()
        )
        self.temporal = nn.Sequential(
            nn.Conv1d(12, 12, 3, padding=1), nn.BatchNorm1d(12), nn.ReLU()
        )
        self.head = nn.Linear(12, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        y = self.dw(self.layer2(self.layer1(self.stem(images))))
        y = self.temporal(y.flatten(2))
        return self.head(y.mean(2))


def build_cnn() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = TinyResNet()
    _randomize_batchnorm(model, gen)
    return model.eval(), {"images": torch.randn(2, 3, 16, 16, generator=gen)}


def _token_inputs(vocab: int, with_mask: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, vocab, (2, 8), generator=gen)}
    if with_mask:
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 6:] = 0  # one padded row, so the mask matters
        inputs["attention_mask"] = mask
    return inputs


class _HiddenStates(nn.Module):
    """Return only the first output (last hidden state or logits) as a plain tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out[0]


class _Encoder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask)[0]


def build_bert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    config._attn_implementation = "eager"  # sdpa has no TorchScript symbolic below opset 14
    return _Encoder(BertModel(config).eval()).eval(), _token_inputs(100)


def build_gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=32,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return _HiddenStates(GPT2LMHeadModel(config).eval()).eval(), _token_inputs(100)


def build_mixtral() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    config._attn_implementation = "eager"
    config._experts_implementation = "batched_mm"
    return _HiddenStates(MixtralForCausalLM(config).eval()).eval(), _token_inputs(100)


def build_qwen2_moe() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=4, norm_topk_prob=False,
        max_position_embeddings=32,
    )  # fmt: skip
    config._attn_implementation = "eager"
    config._experts_implementation = "batched_mm"
    return _HiddenStates(Qwen2MoeForCausalLM(config).eval()).eval(), _token_inputs(100)


def build_llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    _randomize_rmsnorm(model)
    return _HiddenStates(model).eval(), _token_inputs(100)


def build_qwen3() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = Qwen3ForCausalLM(config).eval()
    _randomize_rmsnorm(model)
    return _HiddenStates(model).eval(), _token_inputs(100)


def _randomize_rmsnorm(model: nn.Module) -> None:
    """Fresh RMSNorm weights are all 1 (the exporter may then drop the Mul): give them values."""
    gen = torch.Generator().manual_seed(3)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data = torch.rand(p.shape, generator=gen) + 0.5


class LegacyRouter(nn.Module):
    """The transformers 4.x Mixtral router: ``F.softmax(logits, dim=1, dtype=torch.float)``,
    top-2, renormalize, cast back to the hidden dtype (the form facts.md describes)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(32, 8, bias=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(hidden.reshape(-1, 32))
        weights = torch.softmax(logits, dim=1, dtype=torch.float)
        weights, experts = torch.topk(weights, 2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(hidden.dtype), experts


def build_legacy_router() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    return LegacyRouter().eval(), {"hidden": torch.randn(2, 8, 32, generator=gen)}


TOKENS = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}

FIXTURES = [
    Fixture(
        "cnn-ts13",
        build_cnn,
        "torchscript",
        13,
        "BN kept with training=PRESERVE (eval mode); Conv+BN+Relu incl. depthwise and 1-D,"
        " Conv+BN before residual Adds, projection shortcut",
        dynamic={"images": {0: "N"}},
        options={"training": torch.onnx.TrainingMode.PRESERVE},
    ),
    Fixture(
        "cnn-dynamo18",
        build_cnn,
        "dynamo",
        18,
        "optimize=False keeps BN; bias-free Convs get a zero bias computed at run time"
        " (Shape -> Expand, CastLike -> Expand)",
        dynamic={"images": {0: "N"}},
        options={"optimize": False},
    ),
    Fixture(
        "bert-ts13",
        build_bert,
        "torchscript",
        13,
        "post-LN encoder, decomposed LayerNorm (ReduceMean, Sub, Pow, Sqrt, Div, Mul, Add)",
        dynamic=TOKENS,
        library="transformers",
    ),
    Fixture(
        "bert-fp16-ts13",
        build_bert,
        "torchscript",
        13,
        "float16 post-LN encoder: TorchScript's float16 LayerNorm decomposition, with Casts",
        dynamic=TOKENS,
        library="transformers",
        half=True,
    ),
    Fixture(
        "bert-dynamo18",
        build_bert,
        "dynamo",
        18,
        "post-LN encoder, LayerNormalization op",
        dynamic=TOKENS,
        library="transformers",
    ),
    Fixture(
        "gpt2-ts14",
        build_gpt2,
        "torchscript",
        14,
        "pre-LN decoder, decomposed LayerNorm read by 3 Shape nodes and a Reshape -> Gemm"
        " (Conv1D); ln_f -> Reshape -> MatMul lm_head (not counted)",
        dynamic=TOKENS,
        library="transformers",
    ),
    Fixture(
        "gpt2-dynamo18",
        build_gpt2,
        "dynamo",
        18,
        "pre-LN decoder, LayerNormalization op -> Reshape (constant shape) -> Gemm;"
        " ln_f -> Reshape -> MatMul lm_head (not counted)",
        dynamic=TOKENS,
        library="transformers",
    ),
    Fixture(
        "mixtral-dynamo18",
        build_mixtral,
        "dynamo",
        18,
        "sparse MoE: router Gemm -> Softmax -> TopK(2) -> ReduceSum/Div renormalize,"
        " batched_mm experts; RMSNorm (no centering: not a LayerNorm)",
        dynamic=TOKENS,
        library="transformers",
    ),
    Fixture(
        "mixtral-fp16-dynamo18",
        build_mixtral,
        "dynamo",
        18,
        "float16 Mixtral: router_logits.float() puts a Cast to float32 before the Softmax;"
        " TopK, renormalize in float32, Cast back to float16",
        dynamic=TOKENS,
        library="transformers",
        half=True,
    ),
    Fixture(
        "router-fp16-ts14",
        build_legacy_router,
        "torchscript",
        14,
        "float16 router with softmax(dtype=float) (transformers 4.x Mixtral): MatMul ->"
        " Softmax (fp16) -> Cast(float32) -> TopK(2) -> ReduceSum/Div -> Cast(float16)",
        dynamic={"hidden": {0: "batch", 1: "seq"}},
        half=True,
    ),
    Fixture(
        "router-fp16-dynamo18",
        build_legacy_router,
        "dynamo",
        18,
        "the same router through dynamo: Gemm -> Softmax (fp16) -> Cast(float32) -> TopK(2)"
        " -> ReduceSum/Div -> Cast(float16)",
        dynamic={"hidden": {0: "batch", 1: "seq"}},
        half=True,
    ),
    Fixture(
        "llama-ts14",
        build_llama,
        "torchscript",
        14,
        "Llama decoder: decomposed RMSNorm (Pow 2, ReduceMean, Add eps, Sqrt, Div(1, .), Mul x,"
        " Mul weight) -> QKV and gate/up MatMuls, final norm -> lm_head",
        dynamic=TOKENS,
        library="transformers",
    ),
    Fixture(
        "llama-fp16-dynamo18",
        build_llama,
        "dynamo",
        18,
        "float16 Llama: RMSNorm with Cast to float32 and back (Pow, ReduceMean, Add, Sqrt,"
        " Reciprocal, Mul, Cast, Mul weight) -> QKV and gate/up MatMuls",
        dynamic=TOKENS,
        library="transformers",
        half=True,
    ),
    Fixture(
        "qwen3-fp16-ts14",
        build_qwen3,
        "torchscript",
        14,
        "float16 Qwen3: RMSNorm Cast form -> QKV/gate/up MatMuls; per-head q_norm/k_norm"
        " RMSNorms feed rotary embeddings, not a Linear (not fused)",
        dynamic=TOKENS,
        library="transformers",
        half=True,
    ),
    Fixture(
        "qwen2moe-dynamo18",
        build_qwen2_moe,
        "dynamo",
        18,
        "sparse MoE: router Gemm -> Softmax -> TopK(4) without renormalization, shared"
        " expert with sigmoid gate; RMSNorm",
        dynamic=TOKENS,
        library="transformers",
    ),
]


# -- MobileNetV2 and EfficientNet-style CNNs (issue 8: Conv + BN + activation forms) ----------


class _InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand -> BN -> ReLU6, 3x3 depthwise -> BN -> ReLU6, 1x1
    project -> BN (linear bottleneck), residual when the shape allows."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(),
            nn.Conv2d(hidden, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        ]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


class MobileNetV2(nn.Module):
    """MobileNetV2's layout (t, c, n, s) at width 1/4 with 8-channel minimum, 10 classes."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1))  # fmt: skip

    def __init__(self, width: float = 0.25) -> None:
        super().__init__()

        def ch(c: int) -> int:
            return max(8, int(c * width + 4) // 8 * 8)

        c = ch(32)
        layers: list[nn.Module] = [nn.Conv2d(3, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c),
                                   nn.ReLU6()]  # fmt: skip
        for t, co, n, s in self.SETTINGS:
            for i in range(n):
                layers.append(_InvertedResidual(c, ch(co), s if i == 0 else 1, t))
                c = ch(co)
        layers += [nn.Conv2d(c, 128, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU6()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(128, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean((2, 3)))


def build_mobilenetv2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = MobileNetV2()
    _randomize_batchnorm(model, gen)
    return model.eval(), {"images": torch.randn(2, 3, 32, 32, generator=gen)}


class _MBConv(nn.Module):
    """EfficientNet's block: 1x1 expand -> BN -> SiLU, depthwise -> BN -> SiLU, squeeze-excite
    (mean -> 1x1 -> SiLU -> 1x1 -> Sigmoid gate), 1x1 project -> BN, residual."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        squeeze = max(2, c_in // 4)
        self.expand = nn.Sequential(
            nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.SiLU()
        )
        self.dw = nn.Sequential(
            nn.Conv2d(hidden, hidden, kernel, stride, kernel // 2, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.SiLU(),
        )
        self.se = nn.Sequential(
            nn.Conv2d(hidden, squeeze, 1), nn.SiLU(), nn.Conv2d(squeeze, hidden, 1), nn.Sigmoid()
        )
        self.project = nn.Sequential(nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(self.expand(x))
        y = y * self.se(y.mean((2, 3), keepdim=True))
        y = self.project(y)
        return x + y if self.residual else y


class EfficientNetStyle(nn.Module):
    """EfficientNet-B0's stages (kernel, stride, channels) at small widths (expansion 3) and
    depth x3:
    50 MBConv blocks, 3 Conv+BN chains each, plus stem and head (152 Conv+BN chains)."""

    STAGES = ((3, 1, 8, 3), (3, 2, 8, 6), (5, 2, 8, 6), (3, 2, 12, 9), (3, 1, 12, 9),
              (5, 2, 16, 12), (3, 1, 16, 5))  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(3, 8, 3, 2, 1, bias=False),
            nn.BatchNorm2d(8),
            nn.SiLU(),
        ]
        c = 8
        for kernel, stride, co, n in self.STAGES:
            for i in range(n):
                layers.append(_MBConv(c, co, kernel, stride if i == 0 else 1, 3))
                c = co
        layers += [nn.Conv2d(c, 64, 1, bias=False), nn.BatchNorm2d(64), nn.SiLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(64, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean((2, 3)))


def build_efficientnet() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = EfficientNetStyle()
    _randomize_batchnorm(model, gen)
    return model.eval(), {"images": torch.randn(2, 3, 32, 32, generator=gen)}


_CNN_NOTES = {
    "mobilenetv2": "MobileNetV2 (width 1/4): Conv+BN+ReLU6 (Clip) incl. depthwise, linear"
    " bottlenecks (Conv+BN, no activation), inverted residuals",
    "efficientnet": "EfficientNet-style (B0 stages, depth x3, small widths): Conv+BN+SiLU"
    " (x * Sigmoid(x)) incl. depthwise 3x3/5x5, squeeze-excite Conv+SiLU and Conv+Sigmoid"
    " gate without BN, 152 Conv+BN chains",
}
FIXTURES += [
    Fixture(
        f"{name}-ts13",
        build,
        "torchscript",
        13,
        _CNN_NOTES[name] + "; BN kept with training=PRESERVE",
        dynamic={"images": {0: "N"}},
        options={"training": torch.onnx.TrainingMode.PRESERVE},
    )
    for name, build in (("mobilenetv2", build_mobilenetv2), ("efficientnet", build_efficientnet))
] + [
    Fixture(
        f"{name}-dynamo18",
        build,
        "dynamo",
        18,
        _CNN_NOTES[name] + "; optimize=False keeps BN; node metadata (stack traces) dropped"
        " to stay under 1 MB",
        dynamic={"images": {0: "N"}},
        options={"optimize": False},
        strip_metadata=True,
    )
    for name, build in (("mobilenetv2", build_mobilenetv2), ("efficientnet", build_efficientnet))
]


# -- DeepSeek-V3 routers (gating lane) -----------------------------------------------------------


class DeepseekV3Router(nn.Module):
    """transformers' own DeepseekV3TopkRouter (sigmoid scores, e_score_correction_bias for the
    choice, n_group=4 / topk_group=2 group limit, top-4, renormalized with + 1e-20, times the
    routed scaling factor). Returns each token's weights scattered over the experts [B*S, E]
    (as the experts combine them): TopK(sorted=0) leaves the order of the k results open, and
    onnxruntime's order is not PyTorch's, while the scattered weights are the same."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        config = DeepseekV3Config(
            hidden_size=32, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
            routed_scaling_factor=2.5, norm_topk_prob=True,
        )  # fmt: skip
        self.gate = DeepseekV3TopkRouter(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        _, weights, indices = self.gate(hidden)
        dense = torch.zeros(weights.shape[0], 16, dtype=weights.dtype)
        return dense.scatter(1, indices, weights)


def build_deepseekv3_router() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(4)
    model = DeepseekV3Router().eval()
    model.gate.weight.data = torch.randn(16, 32, generator=gen) * 0.3
    # A real bias (fresh ones are zero): it moves the choice, not the weights.
    model.gate.e_score_correction_bias.data = torch.rand(16, generator=gen) * 0.2
    return model, {"hidden": torch.randn(2, 8, 32, generator=gen)}


_ROUTER_TOKENS = {"hidden": {0: "batch", 1: "seq"}}
FIXTURES += [
    Fixture(
        "deepseekv3-router-ts14",
        build_deepseekv3_router,
        "torchscript",
        14,
        "DeepSeek-V3 router (transformers DeepseekV3TopkRouter): Sigmoid -> Add(bias) ->"
        " group limit (Reshape, TopK(2), ReduceSum, TopK(2 groups), ScatterElements mask, Where"
        " -inf) -> TopK(4) -> GatherElements of the unbiased scores -> ReduceSum/Add(1e-20)/Div"
        " -> Mul(2.5)",
        dynamic=_ROUTER_TOKENS,
        library="transformers",
    ),
    Fixture(
        "deepseekv3-router-dynamo18",
        build_deepseekv3_router,
        "dynamo",
        18,
        "the same router through dynamo: Gemm, ConstantOfShape/Expand masks, Not -> Where;"
        " the + 1e-20 is dropped by the exporter (renormalized without epsilon)",
        dynamic=_ROUTER_TOKENS,
        library="transformers",
    ),
]
# -- lnpass: an autocast ViT (LayerNorm in float32, its Linears in float16) --------------------


class _VitBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor, mixed: bool) -> torch.Tensor:
        b, t, d = h.shape
        n = _ln(self.ln1, h, mixed)
        q, k, v = (
            f(n).reshape(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        a = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1) @ v
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(_ln(self.ln2, h, mixed))))


def _ln(ln: nn.LayerNorm, h: torch.Tensor, mixed: bool) -> torch.Tensor:
    """LayerNorm in float32 and back to the Linears' float16 (what mixed-precision exporters
    and autocast write: Cast up, LayerNorm, Cast down), or plain."""
    return ln(h.float()).to(h.dtype) if mixed else ln(h)


class TinyVit(nn.Module):
    """Patch-embed Conv, CLS token, pre-LN encoder, LayerNorm + Linear head on the CLS token.
    `mixed`: weights in float16 (after `half()`) except the LayerNorms, kept in float32."""

    def __init__(self, mixed: bool, dim: int = 32, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.mixed = mixed
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.blocks = nn.ModuleList(_VitBlock(dim, 2) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def half(self) -> TinyVit:
        super().half()
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                m.float()
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.patch(images).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1) + self.pos
        for block in self.blocks:
            h = block(h, self.mixed)
        return self.head(_ln(self.norm, h, self.mixed)[:, 0])


def _build_vit(mixed: bool) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyVit(mixed).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):  # non-trivial affine parameters
                m.weight.uniform_(0.8, 1.2)
                m.bias.uniform_(-0.1, 0.1)
    gen = torch.Generator().manual_seed(3)
    return model, {"images": torch.randn(2, 3, 16, 16, generator=gen)}


def build_vit_autocast() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    return _build_vit(True)


def build_vit() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    return _build_vit(False)


_VIT_NOTES = (
    "float16 ViT with its LayerNorms in float32 (Cast up, LayerNorm, Cast(float16), q/k/v and"
    " fc1 MatMuls); CLS head: LayerNorm -> Cast -> Gather -> Gemm (a near miss)"
)
FIXTURES += [
    Fixture("vit-autocast-ts14", build_vit_autocast, "torchscript", 14, _VIT_NOTES,
            dynamic={"images": {0: "N"}}, half=True),
    Fixture("vit-autocast-dynamo18", build_vit_autocast, "dynamo", 18, _VIT_NOTES,
            dynamic={"images": {0: "N"}}, half=True),
    Fixture("vit-dynamo18", build_vit, "dynamo", 18,
            "float32 ViT: LayerNormalization -> q/k/v and fc1 MatMuls; CLS head near miss",
            dynamic={"images": {0: "N"}}),
]  # fmt: skip


# -- export ------------------------------------------------------------------------------------


# -- llama4: Llama-4's dense router (TopK -> ScatterElements into -inf -> Sigmoid) -------------


class Llama4Router(nn.Module):
    """transformers' own Llama4Router as Llama4TextMoe calls it: the tokens flattened to
    [B*S, H], logits = Linear, top-k of the logits scattered into a row of -inf, sigmoid of the
    whole row in float32 and back (`sigmoid(scores.float()).to(dtype)`); returns the dense
    scores transposed to [E, B*S] (as the MoE reads them) and the logits."""

    def __init__(self, top_k: int) -> None:
        super().__init__()
        from transformers import Llama4TextConfig
        from transformers.models.llama4.modeling_llama4 import Llama4Router as Router

        config = Llama4TextConfig(hidden_size=32, num_local_experts=16, num_experts_per_tok=top_k)
        self.router = Router(config)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, logits = self.router(hidden.reshape(-1, 32))
        return scores.transpose(0, 1), logits


def _build_llama4_router(top_k: int, half: bool) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(8)
    model = Llama4Router(top_k).eval()
    model.router.weight.data = torch.randn(16, 32, generator=gen) * 0.3
    hidden = torch.randn(2, 8, 32, generator=gen)
    if half:
        model, hidden = model.half(), hidden.half()
    return model, {"hidden": hidden}


FIXTURES += [
    Fixture(
        "llama4-router-ts14",
        lambda: _build_llama4_router(1, False),
        "torchscript",
        14,
        "Llama-4 router (transformers Llama4Router, 16 experts, top-1): TopK -> ConstantOfShape"
        "(-inf) -> ScatterElements -> Cast -> Sigmoid -> Cast (no-op Casts in float32) ->"
        " Transpose",
        dynamic=_ROUTER_TOKENS,
        library="transformers",
    ),
    Fixture(
        "llama4-router-dynamo18",
        lambda: _build_llama4_router(2, False),
        "dynamo",
        18,
        "the same router through dynamo, top-2: Gemm, Expand(-inf) -> ScatterElements ->"
        " Sigmoid (the exporter drops the no-op Casts) -> Transpose",
        dynamic=_ROUTER_TOKENS,
        library="transformers",
    ),
    Fixture(
        "llama4-router-fp16-dynamo18",
        lambda: _build_llama4_router(1, True),
        "dynamo",
        18,
        "the router in float16 through dynamo: Expand(-inf) -> ScatterElements -> Cast(float32)"
        " -> Sigmoid -> Cast(float16) -> Transpose",
        dynamic=_ROUTER_TOKENS,
        library="transformers",
        half=True,
    ),
]

# -- gateforms: grouped gates as other exports spell them ----------------------------------------


class DeepseekV4Router(DeepseekV3Router):
    """transformers' own DeepseekV4TopKRouter with sigmoid scores (16 experts, top-4, + 1e-20
    renormalization, scale 1.5) in float16, its `e_score_correction_bias` kept in float32 as
    `from_pretrained` keeps it (`_keep_in_fp32_modules_strict`): the float16 scores are cast up
    for the choice, the weights gathered from the float16 scores. The V3 router's forward: the
    weights scattered over the experts."""

    def __init__(self) -> None:
        nn.Module.__init__(self)  # not the V3 router's: a V4 router of its own
        from transformers import DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

        config = DeepseekV4Config(
            hidden_size=32, num_local_experts=16, n_routed_experts=16, num_experts_per_tok=4,
            scoring_func="sigmoid", routed_scaling_factor=1.5,
        )  # fmt: skip
        self.gate = DeepseekV4TopKRouter(config)

    def half(self) -> DeepseekV4Router:
        super().half()
        bias = self.gate.e_score_correction_bias
        bias.data = bias.data.float()  # kept in float32, as from_pretrained does
        return self


def build_deepseekv4_router() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(9)
    model = DeepseekV4Router().eval()
    model.gate.weight.data = torch.randn(16, 32, generator=gen) * 0.3
    model.gate.e_score_correction_bias.data = torch.rand(16, generator=gen) * 0.2
    return model, {"hidden": torch.randn(2, 8, 32, generator=gen)}


class DeepseekV3HubGate(nn.Module):
    """The gate of the DeepSeek-V3 checkpoint's own modeling code (`trust_remote_code`'s
    MoEGate, written here from its math): the same router as transformers' port, but its views
    are by `bsz * seq_len` and -1 (`view(bsz * seq_len, n_group, -1)`, `reshape(bsz * seq_len,
    -1)`, `expand(bsz * seq_len, ...)`), and the dropped groups' choice is 0.0, not -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(16, 32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(16), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, h = hidden.shape
        tokens, n_group, experts = bsz * seq_len, 4, 16
        logits = nn.functional.linear(hidden.view(-1, h).float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores.view(tokens, -1) + self.e_score_correction_bias.unsqueeze(0)
        groups = choice.view(tokens, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        kept = torch.topk(groups, k=2, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(groups).scatter_(1, kept, 1)
        mask = mask.unsqueeze(-1).expand(tokens, n_group, experts // n_group).reshape(tokens, -1)
        masked = choice.masked_fill(~mask.bool(), 0.0)
        indices = torch.topk(masked, k=4, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * 2.5
        return torch.zeros(tokens, experts, dtype=weights.dtype).scatter(1, indices, weights)


def build_deepseekv3_hub_gate() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(10)
    model = DeepseekV3HubGate().eval()
    model.weight.data = torch.randn(16, 32, generator=gen) * 0.3
    model.e_score_correction_bias.data = torch.rand(16, generator=gen) * 0.2
    return model, {"hidden": torch.randn(2, 8, 32, generator=gen)}


FIXTURES += [
    Fixture(
        "deepseekv4-router-fp16-ts14",
        build_deepseekv4_router,
        "torchscript",
        14,
        "DeepSeek-V4 router (transformers DeepseekV4TopKRouter, sigmoid) in float16 with its"
        " bias kept in float32: Sigmoid (fp16) -> Cast(float32) -> Add(bias) -> TopK(4) ->"
        " GatherElements of the float16 scores -> ReduceSum/Add/Div -> Mul(1.5)",
        dynamic=_ROUTER_TOKENS,
        library="transformers",
        half=True,
    ),
    Fixture(
        "deepseekv4-router-fp16-dynamo18",
        build_deepseekv4_router,
        "dynamo",
        18,
        "the same float16 router through dynamo",
        dynamic=_ROUTER_TOKENS,
        library="transformers",
        half=True,
    ),
    Fixture(
        "deepseekv3-hub-gate-ts14",
        build_deepseekv3_hub_gate,
        "torchscript",
        14,
        "DeepSeek-V3's own MoEGate math (views by bsz * seq_len and -1, fill 0.0): the view of"
        " the scores, the group split, the Expand and the flatten all to shapes computed from"
        " Shape(hidden) at run time, untyped (a near-miss: nothing shows the view keeps the rows)",
        dynamic=_ROUTER_TOKENS,
    ),
    Fixture(
        "deepseekv3-hub-gate-dynamo18",
        build_deepseekv3_hub_gate,
        "dynamo",
        18,
        "the same gate through dynamo: Reshape(scores, [-1, 16]) before the bias, split"
        " [-1, 4, 4], Expand to Concat(bsz * seq_len, 4, 4) computed at run time (typed"
        " [batch*seq, 4, 4]), flatten [-1, 16], fill 0.0",
        dynamic=_ROUTER_TOKENS,
    ),
]


def export(fx: Fixture, path: Path) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Export ``fx`` to ``path``; return the example inputs and PyTorch's outputs."""
    model, inputs = fx.build()
    if fx.half:
        model = model.half()
        inputs = {k: v.half() if v.is_floating_point() else v for k, v in inputs.items()}
    names = list(inputs)
    args = tuple(inputs.values())
    with torch.no_grad():
        expected = model(*args)
    outputs = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    output_names = ["output"] if len(outputs) == 1 else [f"output_{i}" for i in range(len(outputs))]
    quiet = contextlib.redirect_stdout(io.StringIO())
    with warnings.catch_warnings(), quiet:
        warnings.simplefilter("ignore")
        if fx.exporter == "torchscript":
            torch.onnx.export(
                model, args, str(path), dynamo=False, opset_version=fx.opset,
                input_names=names, output_names=output_names, dynamic_axes=fx.dynamic,
                **fx.options,
            )  # fmt: skip
        else:
            dims = {n: torch.export.Dim(n, min=2, max=32) for a in fx.dynamic.values()
                    for n in a.values()}  # fmt: skip
            shapes = {n: {axis: dims[d] for axis, d in fx.dynamic.get(n, {}).items()}
                      for n in names}  # fmt: skip
            program = torch.onnx.export(
                model, kwargs=inputs, dynamo=True, opset_version=fx.opset,
                input_names=names, output_names=output_names, dynamic_shapes=shapes,
                **fx.options,
            )  # fmt: skip
            assert program is not None
            if fx.strip_metadata:
                for node in program.model.graph.all_nodes():
                    node.metadata_props.clear()
            program.save(str(path))
    feeds = {k: v.numpy() for k, v in inputs.items()}
    return feeds, [o.detach().numpy() for o in outputs]


def verify(
    path: Path, feeds: dict[str, np.ndarray], expected: list[np.ndarray], tol: float
) -> None:
    """Full checker, size limit, and onnxruntime equal to PyTorch."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{path.name}: {size} bytes, over the {MAX_BYTES} limit")
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=tol, atol=tol, err_msg=path.name)


def readme_rows(rows: list[tuple[Fixture, onnx.ModelProto, int]]) -> str:
    import transformers

    versions = {
        "torch.nn": f"torch {torch.__version__}",
        "transformers": f"torch {torch.__version__}, transformers {transformers.__version__}",
    }
    lines = [
        "# Exported ONNX fixtures",
        "",
        "Small real models exported by PyTorch exporters, with random weights, written by",
        "`scripts/export_fixtures.py` (rerun it to regenerate; do not edit by hand). Each `X.onnx`",
        "has an `X.npz` with the example inputs (`in_<name>`) and PyTorch's outputs (`out_<i>`);",
        "onnxruntime matched them within 1e-4 (2e-2 for float16) at export. Chain counts are from",
        "`fuser.models.inventory.count_chains` (structural, see its docstring).",
        "",
        "| file | model | exporter | opset | nodes | KB | chains | what it shows |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fx, model, size in rows:
        exporter = "TorchScript (`dynamo=False`)" if fx.exporter == "torchscript" else "dynamo"
        counts = ", ".join(f"{k} {v}" for k, v in count_chains(model).items() if v) or "none"
        lines.append(
            f"| `{fx.name}.onnx` | {fx.library} ({versions[fx.library]}) | {exporter} | "
            f"{fx.opset} | {len(model.graph.node)} | {size // 1024} | {counts} | {fx.notes} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="fixtures to export (default: all)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    chosen = [f for f in FIXTURES if not args.names or f.name in args.names]
    if unknown := set(args.names) - {f.name for f in FIXTURES}:
        parser.error(f"unknown fixtures {sorted(unknown)}; known: {[f.name for f in FIXTURES]}")
    args.out.mkdir(parents=True, exist_ok=True)
    for fx in chosen:
        path = args.out / f"{fx.name}.onnx"
        feeds, expected = export(fx, path)
        verify(path, feeds, expected, 2e-2 if fx.half else 1e-4)
        arrays = {f"in_{k}": v for k, v in feeds.items()}
        arrays.update({f"out_{i}": v for i, v in enumerate(expected)})
        np.savez(args.out / f"{fx.name}.npz", **arrays)  # type: ignore[arg-type]
        print(f"{path.name}: {path.stat().st_size // 1024} KB, ok", file=sys.stderr)
    rows = []
    for fx in FIXTURES:
        path = args.out / f"{fx.name}.onnx"
        if path.exists():
            rows.append((fx, onnx.load(str(path)), path.stat().st_size))
    (args.out / "README.md").write_text(readme_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
