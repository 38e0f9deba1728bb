"""Proof that a fused model computes what the original computed, in onnxruntime.

Both models run on the same inputs: seeded random ones (symbolic dims given a size), or the
user's. Run 0 draws normal values, run 1 makes every row along the last axis constant (zero
variance: where a normalization that lost its epsilon shows), later runs draw wider values.
A model with com.microsoft AllGather runs as `group_size` ranks, one session per rank in its
own thread, each rank with distinct inputs, and every rank's outputs are compared.

Tolerance is relative to the output's scale (max(1, max|reference|)) and depends on the dtype;
integer and boolean outputs (TopK indices) must match exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from .errors import ValidationInputError
from .fusedop import DOMAIN
from .graph import _node_subgraphs
from .modelio import LoadedModel

# Max error relative to output scale, per dtype: fp32 1e-4 (the product's bar); fp16 keeps ~3
# decimal digits and accumulates over a reduction, so 1e-2.
DEFAULT_TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}
INT_RANGE = 4  # random integer inputs are drawn from [0, INT_RANGE): safe as small indices


@dataclass(frozen=True)
class OutputComparison:
    """Worst case over all runs and ranks for one output."""

    name: str
    dtype: str
    max_abs: float
    max_rel: float
    tolerance: float
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class ValidationResult:
    """Outcome of comparing two models output by output."""

    ok: bool
    outputs: tuple[OutputComparison, ...]
    runs: int
    ranks: int
    seed: int
    kernel: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "runs": self.runs,
            "ranks": self.ranks,
            "seed": self.seed,
            "kernel": self.kernel,
            "outputs": [
                {
                    "name": o.name,
                    "dtype": o.dtype,
                    "max_abs": o.max_abs,
                    "max_rel": o.max_rel,
                    "tolerance": o.tolerance,
                    "ok": o.ok,
                    "detail": o.detail,
                }
                for o in self.outputs
            ],
        }


def group_size(model: onnx.ModelProto) -> int:
    """Ranks a model needs: the group_size of its collectives (1 if it has none)."""
    sizes: set[int] = set()

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            if (node.domain, node.op_type) == ("com.microsoft", "AllGather") or (
                node.domain == DOMAIN and any(a.name == "group_size" for a in node.attribute)
            ):
                sizes.update(a.i for a in node.attribute if a.name == "group_size")
            for sub in _node_subgraphs(node):
                visit(sub)

    visit(model.graph)
    if len(sizes) > 1:
        raise ValidationInputError(f"collectives disagree on group_size: {sorted(sizes)}")
    return sizes.pop() if sizes else 1


def _runtime_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in inits]


def _concrete_shape(value: onnx.ValueInfoProto, dim_size: int) -> tuple[int, ...]:
    dims = value.type.tensor_type.shape.dim
    return tuple(d.dim_value if d.HasField("dim_value") else dim_size for d in dims)


def make_inputs(
    model: onnx.ModelProto,
    *,
    run: int,
    rank: int,
    seed: int,
    dim_size: int,
    given: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Inputs for one run on one rank: `given` ones as they are, the rest seeded random."""
    rng = np.random.default_rng([seed, run, rank])
    feeds: dict[str, np.ndarray] = {}
    for value in _runtime_inputs(model):
        if given and value.name in given:
            feeds[value.name] = np.asarray(given[value.name])
            continue
        if not value.type.HasField("tensor_type"):
            raise ValidationInputError(
                f"input '{value.name}' is not a tensor; pass it with --input"
            )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        shape = _concrete_shape(value, dim_size)
        feeds[value.name] = _random(rng, shape, dtype, run)
    if given:
        unknown = set(given) - {v.name for v in _runtime_inputs(model)}
        if unknown:
            raise ValidationInputError(f"no model input named '{sorted(unknown)[0]}'")
    return feeds


def _random(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, run: int
) -> np.ndarray:
    if np.issubdtype(dtype, np.floating):
        x = rng.standard_normal(shape) * (1.0 if run != 2 else 4.0)
        if run == 1 and len(shape) >= 1 and shape[-1] > 0:
            x = np.broadcast_to(x[..., :1], shape).copy()
        return x.astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    return rng.integers(0, INT_RANGE, shape).astype(dtype)


def _needs_plugin(model: onnx.ModelProto) -> bool:
    def visit(graph: onnx.GraphProto) -> bool:
        return any(
            n.domain in (DOMAIN, "com.microsoft") or any(visit(g) for g in _node_subgraphs(n))
            for n in graph.node
        )

    return visit(model.graph)


def _sessions(loaded: LoadedModel, ranks: int, kernel: str, target: str) -> list[Any]:
    from .collective import Communicator
    from .ort import session

    if not _needs_plugin(loaded.model):
        import onnxruntime

        if ranks == 1:
            return [
                onnxruntime.InferenceSession(
                    loaded.model.SerializeToString(), providers=["CPUExecutionProvider"]
                )
                if not _has_external(loaded)
                else session(loaded)
            ]
    communicator = Communicator(ranks) if ranks > 1 else None
    return [
        session(loaded, kernel=kernel, target=target, rank=r, communicator=communicator)
        for r in range(ranks)
    ]


def _has_external(loaded: LoadedModel) -> bool:
    from .modelio import has_external_data

    return has_external_data(loaded.model)


def _run_ranks(
    sessions: Sequence[Any], feeds: Sequence[dict[str, np.ndarray]]
) -> list[dict[str, np.ndarray]]:
    """Run every rank's session at once (collectives meet at a barrier)."""
    results: list[dict[str, np.ndarray] | None] = [None] * len(sessions)
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            names = [o.name for o in sessions[rank].get_outputs()]
            results[rank] = dict(zip(names, sessions[rank].run(None, feeds[rank]), strict=True))
        except BaseException as exc:
            errors.append(exc)

    if len(sessions) == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(r,)) for r in range(len(sessions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def compare(
    name: str,
    expected: np.ndarray,
    actual: np.ndarray,
    rtol: float | None,
    atol: float | None,
    precision: str | None = None,
) -> OutputComparison:
    """Compare one output; `rtol`/`atol` (numpy allclose) override the dtype's default."""
    dtype = expected.dtype.name
    if expected.shape != actual.shape:
        return OutputComparison(
            name,
            dtype,
            float("inf"),
            float("inf"),
            0.0,
            False,
            f"shape {list(actual.shape)} != {list(expected.shape)}",
        )
    if actual.dtype != expected.dtype:
        return OutputComparison(
            name,
            dtype,
            float("inf"),
            float("inf"),
            0.0,
            False,
            f"dtype {actual.dtype.name} != {dtype}",
        )
    if not np.issubdtype(expected.dtype, np.floating):
        mismatches = int(np.count_nonzero(expected != actual))
        diff = (
            float(np.max(np.abs(expected.astype(np.int64) - actual.astype(np.int64))))
            if expected.size
            else 0.0
        )
        return OutputComparison(
            name,
            dtype,
            diff,
            diff,
            0.0,
            mismatches == 0,
            f"{mismatches} elements differ" if mismatches else "",
        )
    e, a = expected.astype(np.float64), actual.astype(np.float64)
    same_nan = np.isnan(e) == np.isnan(a)
    finite = ~np.isnan(e) & ~np.isnan(a)
    err = np.where(finite, np.abs(e - a), 0.0)
    err = np.where(np.isinf(e) & (e == a), 0.0, err)
    max_abs = float(err.max()) if err.size else 0.0
    finite_e = np.abs(e[np.isfinite(e)])
    scale = max(1.0, float(finite_e.max()) if finite_e.size else 1.0)
    max_rel = max_abs / scale
    if rtol is not None or atol is not None:
        r, t = rtol or 0.0, atol or 0.0
        ok = bool(np.all(err <= t + r * np.abs(np.where(finite, e, 0.0)))) and bool(same_nan.all())
        tolerance = r
    else:
        tolerance = max(
            DEFAULT_TOLERANCE.get(dtype, 1e-4), DEFAULT_TOLERANCE.get(precision or dtype, 1e-4)
        )
        ok = max_rel <= tolerance and bool(same_nan.all())
    detail = "" if same_nan.all() else "NaN positions differ"
    return OutputComparison(name, dtype, max_abs, max_rel, tolerance, ok, detail)


def lowest_float_upstream(model: onnx.ModelProto, outputs: Sequence[str]) -> dict[str, str | None]:
    """Per output, the least precise float dtype among the values it is computed from.

    A float32 output computed from float16 values carries float16 error (onnxruntime's CPU
    provider even computes some float16 ops in float32 and drops roundings the fused op
    keeps), so its tolerance comes from there, not from its own dtype.
    """
    from .engine import infer_types
    from .graph import TypeTable

    types = infer_types(model).get("") or TypeTable()
    producer = {out: node for node in model.graph.node for out in node.output if out}
    rank = {"float64": 0, "float32": 1, "float16": 2, "bfloat16": 3}  # bfloat16: 8-bit mantissa
    result: dict[str, str | None] = {}
    for output in outputs:
        lowest: str | None = None
        seen: set[str] = set()
        stack = [output]
        while stack:
            value = stack.pop()
            if value in seen:
                continue
            seen.add(value)
            vt = types.get(value)
            if vt is not None and vt.elem_type:
                name = onnx.helper.tensor_dtype_to_np_dtype(vt.elem_type).name
                if name in rank and (lowest is None or rank[name] > rank[lowest]):
                    lowest = name
            node = producer.get(value)
            if node is not None:
                stack.extend(i for i in node.input if i)
        result[output] = lowest
    return result


def validate_models(
    original: LoadedModel,
    fused: LoadedModel,
    *,
    runs: int = 3,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
    inputs: Mapping[str, Any] | None = None,
    dim_size: int = 3,
    kernel: str = "reference",
    target: str = "ascend910b",
) -> ValidationResult:
    """Run both models on the same inputs; compare every output of every run and rank."""
    if runs < 1:
        raise ValidationInputError("runs must be at least 1")
    ranks = max(group_size(original.model), group_size(fused.model))
    out_names = [o.name for o in original.model.graph.output]
    precision = lowest_float_upstream(original.model, out_names)
    fused_names = {o.name for o in fused.model.graph.output}
    missing = [n for n in out_names if n not in fused_names]
    if missing:
        raise ValidationInputError(
            f"{fused.label}: lacks output '{missing[0]}' of {original.label}"
        )
    given = {k: np.asarray(v) for k, v in (inputs or {}).items()}
    sessions_a = _sessions(original, ranks, "reference", target)
    sessions_b = _sessions(fused, ranks, kernel, target)
    worst: dict[str, OutputComparison] = {}
    for run in range(runs):
        feeds = [
            make_inputs(original.model, run=run, rank=r, seed=seed, dim_size=dim_size, given=given)
            for r in range(ranks)
        ]
        expected = _run_ranks(sessions_a, feeds)
        actual = _run_ranks(sessions_b, feeds)
        for rank in range(ranks):
            for name in out_names:
                result = compare(
                    name, expected[rank][name], actual[rank][name], rtol, atol, precision[name]
                )
                previous = worst.get(name)
                if (
                    previous is None
                    or (previous.ok and not result.ok)
                    or (previous.ok == result.ok and result.max_rel > previous.max_rel)
                ):
                    worst[name] = result
    outputs = tuple(worst[n] for n in out_names)
    return ValidationResult(all(o.ok for o in outputs), outputs, runs, ranks, seed, kernel)
