"""Helpers for tests of patterns and kernels: fuse, count, and compare in onnxruntime.

Public so that whoever adds a fusion family tests it the same way the built-in ones are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from .api import FusionResult, fuse
from .decide import AlwaysFuse
from .modelio import load_model
from .validation import ValidationResult, validate_models


def fuse_all(model: onnx.ModelProto, patterns: Sequence[str] | None = None) -> FusionResult:
    """Fuse every valid match (no cost-model veto), so tests see the rewrite rules alone."""
    return fuse(model, patterns, decider=AlwaysFuse())


def count_ops(model: onnx.ModelProto, op_type: str, domain: str | None = None) -> int:
    """Nodes of `op_type` in the main graph (and `domain`, if given)."""
    return sum(
        1
        for n in model.graph.node
        if n.op_type == op_type and (domain is None or n.domain == domain)
    )


def reasons(result: FusionResult, pattern: str | None = None) -> list[str]:
    """The rejection reasons of a fusion run (optionally of one pattern)."""
    return [r.reason for r in result.report.rejected if pattern is None or r.pattern == pattern]


def assert_equivalent(
    original: onnx.ModelProto,
    fused: onnx.ModelProto,
    *,
    runs: int = 3,
    seed: int = 0,
    dim_size: int = 3,
    inputs: Mapping[str, np.ndarray] | None = None,
    kernel: str = "reference",
) -> ValidationResult:
    """Run both in onnxruntime (fused ops through the plugin); fail with the worst output."""
    result = validate_models(
        load_model(original),
        load_model(fused),
        runs=runs,
        seed=seed,
        dim_size=dim_size,
        inputs=inputs,
        kernel=kernel,
    )
    bad = [c.message() for c in result.failures]  # graph outputs and every fused node
    assert not bad, "differs: " + "; ".join(bad[:5])
    return result
