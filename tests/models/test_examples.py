"""Every example model: valid, runnable, deterministic, fast, with the chains it claims."""

from __future__ import annotations

import time

import pytest
from fuser.models import EXAMPLES, get_example
from fuser.models.inventory import count_chains
from model_checks import check, run

# Models with com.microsoft AllGather: onnxruntime's CPU package has no kernel for it.
NEEDS_COLLECTIVES = {"tp-mlp", "tp-mlp-negaxis", "sp-mlp", "sp-mlp-bsh", "tp-attention", "tp-gemm",
                     "sp-reshape-gemm", "sp-reshape-matmul"}  # fmt: skip

# The chain counts each builder's docstring claims, per example (absent keys are 0).
EXPECTED: dict[str, dict[str, int]] = {
    "resnet": {"conv_bn_relu": 5, "conv_bn": 5},
    "mobilenet": {"conv_bn_relu": 7, "conv_bn": 3},
    "cnn-edge": {"conv_bn_relu": 4, "conv_bn": 1},
    "conv1d": {"conv_bn_relu": 3, "conv_bn": 2},
    "bert": {"layernorm": 5, "layernorm_matmul": 4, "layernorm_matmuls": 8},
    "bert17": {"layernorm": 5, "layernorm_matmul": 4, "layernorm_matmuls": 8},
    "bert18": {"layernorm": 5, "layernorm_matmul": 4, "layernorm_matmuls": 8},
    "gpt": {"layernorm": 5, "layernorm_matmul": 5, "layernorm_matmuls": 11},
    "gpt-noaffine": {"layernorm": 5, "layernorm_matmul": 5, "layernorm_matmuls": 11},
    "gpt2": {"layernorm": 5, "layernorm_matmul": 5, "layernorm_matmuls": 5},
    "gpt2-ln": {"layernorm": 5, "layernorm_matmul": 5, "layernorm_matmuls": 5},
    "llama": {"rmsnorm": 5, "rmsnorm_matmul": 5, "rmsnorm_matmuls": 11},
    "llama-fp16": {"rmsnorm": 5, "rmsnorm_matmul": 5, "rmsnorm_matmuls": 11},
    "llama-op": {"rmsnorm": 5, "rmsnorm_matmul": 5, "rmsnorm_matmuls": 11},
    "moe": {"softmax_topk": 1},
    "moe-fp16": {"softmax_topk": 1},
    "qwen-router": {"softmax_topk": 1},
    "topk-softmax-router": {"topk_softmax": 1},
    "tp-mlp": {"allgather_matmul": 1},
    "tp-mlp-negaxis": {"allgather_matmul": 1},
    "sp-mlp": {"layernorm": 1, "allgather_matmul": 1},
    "sp-mlp-bsh": {"layernorm": 1, "allgather_matmul": 1},
    "tp-attention": {"allgather_matmul": 3},
    "tp-gemm": {"allgather_matmul": 1},
    "sp-reshape-gemm": {"allgather_matmul": 1},
    "sp-reshape-matmul": {"allgather_matmul": 1},
}


def test_every_example_has_expected_counts() -> None:
    assert set(EXPECTED) == set(EXAMPLES)
    with_allgather = {n for n in EXAMPLES if EXPECTED[n].get("allgather_matmul")}
    assert with_allgather == NEEDS_COLLECTIVES


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_is_valid_and_has_its_chains(name: str) -> None:
    start = time.perf_counter()
    model = get_example(name)
    assert time.perf_counter() - start < 1.0
    check(model)
    counts = count_chains(model)
    assert {k: v for k, v in counts.items() if v} == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(set(EXAMPLES) - NEEDS_COLLECTIVES))
def test_example_runs_in_onnxruntime(name: str) -> None:
    start = time.perf_counter()
    run(get_example(name))
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_is_deterministic(name: str) -> None:
    assert get_example(name).SerializeToString() == get_example(name).SerializeToString()


def test_unknown_example_lists_known_names() -> None:
    with pytest.raises(KeyError, match="resnet") as info:
        get_example("nope")
    assert "nope" in str(info.value)
    assert all(name in str(info.value) for name in EXAMPLES)


def test_examples_mapping_is_read_only() -> None:
    with pytest.raises(TypeError):
        EXAMPLES["x"] = get_example  # type: ignore[index]
