"""Helpers for tests of patterns and kernels: fuse, count, and compare in onnxruntime.

Public so that whoever adds a fusion family tests it the same way the built-in ones are.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .api import FusionResult, fuse
from .decide import AlwaysFuse
from .graph import GraphIndex
from .modelio import load_model
from .validation import ValidationResult, validate_models


def fuse_all(
    model: onnx.ModelProto, patterns: Sequence[str] | None = None, *, functions: bool = True
) -> FusionResult:
    """Fuse every valid match (no cost-model veto), so tests see the rewrite rules alone."""
    return fuse(model, patterns, decider=AlwaysFuse(), functions=functions)


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


def assert_runs_stock(
    original: onnx.ModelProto,
    fused: onnx.ModelProto,
    *,
    runs: int = 3,
    seed: int = 0,
    dim_size: int = 3,
) -> list[str]:
    """The fused model in a plain onnxruntime session (nothing registered: its fused ops run
    their function bodies) equals the original, run the same way, within dtype tolerance.
    Returns the fused op types that ran through bodies (so a test can assert it fused)."""
    import onnxruntime

    from .fusedop import DOMAIN
    from .validate_inputs import input_specs, make_feeds
    from .validation import compare, lowest_float_upstream

    def plain(model: onnx.ModelProto) -> onnxruntime.InferenceSession:
        return onnxruntime.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )

    expected_session, actual_session = plain(original), plain(fused)
    names = [o.name for o in expected_session.get_outputs()]
    precision = lowest_float_upstream(original, names)
    bad = []
    specs = input_specs(original, {}, dim_size)
    for run in range(runs):
        feeds = make_feeds(specs, run=run, rank=0, seed=seed)
        expected = expected_session.run(names, feeds)
        actual = actual_session.run(names, feeds)
        for name, e, a in zip(names, expected, actual, strict=True):
            result = compare(name, e, a, None, None, precision[name])
            if not result.ok:
                bad.append(result)
    assert not bad, f"stock onnxruntime: outputs differ: {bad}"
    return sorted({n.op_type for n in fused.graph.node if n.domain == DOMAIN})


def conv_bn_chain(
    prefix: str, x: str, out: str, rng: np.random.Generator, channels: int
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """A 1x1 Conv named `prefix` reading `x` (`channels` in and out) -> BatchNormalization
    writing `out`, its parameters as float32 initializers named `prefix`.w/.s/.b/.m/.v drawn
    from `rng` (weights, then scale, bias, mean, variance); returns (nodes, initializers)."""
    w = numpy_helper.from_array(
        rng.standard_normal((channels, channels, 1, 1)).astype(np.float32), f"{prefix}.w"
    )
    params = [
        numpy_helper.from_array(v.astype(np.float32), f"{prefix}.{n}")
        for n, v in (
            ("s", rng.uniform(0.5, 2, channels)),
            ("b", rng.standard_normal(channels)),
            ("m", rng.standard_normal(channels)),
            ("v", rng.uniform(0.5, 2, channels)),
        )
    ]
    nodes = [
        helper.make_node("Conv", [x, w.name], [f"{prefix}.y"], name=prefix),
        helper.make_node("BatchNormalization", [f"{prefix}.y", *(p.name for p in params)], [out]),
    ]
    return nodes, [w, *params]


def fusible_pair(
    index: GraphIndex, rng: random.Random
) -> tuple[tuple[int, int], list[str], list[str]] | None:
    """A random live node of `index` and its only reader, as a rewrite test fuses them:
    ((node, reader), the pair's inputs but the value between them, the reader's outputs);
    None where the draw cannot be fused (the value has other readers or is a graph output, or
    fusing would close a cycle through a node outside the pair). One `rng.choice` per call."""
    first = rng.choice(list(index.live_nodes()))
    out = index.node(first).output[0]
    readers = index.readers(out)
    if len(readers) != 1 or index.is_graph_output(out):
        return None
    second = readers[0]
    inputs = [i for m in (first, second) for i in index.node(m).input if i != out]
    if index.descendants_in_window({first, second}, set(inputs))[1] is not None:
        return None
    return (first, second), inputs, list(index.node(second).output)
