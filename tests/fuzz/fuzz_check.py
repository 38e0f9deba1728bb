"""Fuse one generated case and judge the result: ok, nothing fused, wrong, invalid or crash.

For a case (fuzz_graphs.make_case) the checks are, in order:
1. the original is a valid model that onnxruntime runs (else the case is "discarded": the
   generator's fault, counted apart);
2. fusing it (every match accepted, no cost-model veto) raises nothing ("crash" otherwise) and
   leaves the input model unchanged ("wrong");
3. the fused model passes `onnx.checker.check_model(full_check=True)`, fusing the original again
   gives the same bytes (deterministic) and fusing the fused model changes nothing
   (idempotent); any failure is "invalid";
4. the fused model runs in onnxruntime through `fuser.ort.session` ("invalid" if not) and
   equals the original on five input sets (normal, constant rows, large, ties, tiny) within the
   dtype's tolerance ("wrong" if not). A difference the original itself shows between
   onnxruntime's optimized and unoptimized runs is the original's own rounding noise: the
   fused result may sit on either side of it, or equal the original computed in float64.
   TopK indices (an expert, an expert group) may differ only on a near tie: when the fused
   outputs are what the original computes in float64 for a choice within the rounding noise
   of its own (`fuzz_ties`);
5. the fused model runs in stock onnxruntime (`STOCK_ONNXRUNTIME_CHECK`: fused ops through
   their ONNX function bodies, nothing of fuser registered) and equals the original too,
   judged the same way.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import onnx
import onnxruntime
from fuzz_graphs import Case, InputSpec
from fuzz_ties import has_topk, replays
from onnx import numpy_helper

from fuser import functions
from fuser.api import FusionResult
from fuser.collective import Communicator
from fuser.ort import session
from fuser.testing import fuse_all

OUTCOMES = ("ok", "nothing fused", "wrong", "invalid", "crash", "discarded")
INPUT_SETS = ("normal", "constant rows", "large", "ties", "tiny")
# (rtol, atol relative to the output's largest magnitude) per dtype
TOLERANCE = {
    np.dtype(np.float16): (2e-2, 2e-2),
    np.dtype(np.float32): (1e-4, 1e-4),
    np.dtype(np.float64): (1e-9, 1e-9),
}
LARGE = {np.dtype(np.float16): 8.0, np.dtype(np.float32): 100.0, np.dtype(np.float64): 100.0}

Feeds = list[dict[str, np.ndarray]]  # one feed dict per rank
Runner = Callable[[onnx.ModelProto, Feeds], list[dict[str, np.ndarray]]]


def stock_run(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], optimize: bool = True
) -> dict[str, np.ndarray]:
    """The fused model in a plain onnxruntime session, nothing of fuser's registered: its
    fused ops run their ONNX function bodies. Unoptimized when the original had to be (see
    `check_case`): onnxruntime's optimizer breaks what fuser leaves of such a model too."""
    options = onnxruntime.SessionOptions()
    if not optimize:
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


# Called with (fused model, feeds of one rank, optimize); returns the outputs by name, or
# raises. None turns the stock-onnxruntime check off.
STOCK_ONNXRUNTIME_CHECK: Callable[[onnx.ModelProto, dict[str, np.ndarray], bool], dict] | None = (
    stock_run
)

onnxruntime.set_default_logger_severity(3)


@dataclass(frozen=True)
class Result:
    """What happened to one case."""

    seed: int
    outcome: str
    fused: Mapping[str, int] = field(default_factory=dict)
    detail: str = ""
    near_ties: int = 0  # TopK index differences judged near ties (fuzz_ties)


def make_feeds(case: Case, kind: str, rng: np.random.Generator) -> Feeds:
    """Inputs of one input set for every rank."""
    position = INPUT_SETS.index(kind)
    return [
        {spec.name: _array(spec, kind, position, rng) for spec in case.inputs}
        for _ in range(case.group_size)
    ]


def _array(spec: InputSpec, kind: str, position: int, rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(spec.dtype)
    if spec.role == "bool":
        return np.array(position % 2 == 0)
    if spec.role == "positive":
        return rng.uniform(0.5, 2, spec.shape).astype(dtype)
    normal = rng.standard_normal(spec.shape)
    if spec.role != "activation" or kind == "normal":
        return normal.astype(dtype)
    if kind == "constant rows":
        if not spec.shape:
            return normal.astype(dtype)
        rows = rng.standard_normal((*spec.shape[:-1], 1))
        return np.broadcast_to(rows, spec.shape).astype(dtype)
    if kind == "large":
        return (normal * LARGE[dtype]).astype(dtype)
    if kind == "ties":
        return (np.round(normal * 1.5) / 2).astype(dtype)
    return (normal * 1e-3).astype(dtype)


Outputs = dict[str, np.ndarray]


def _options(optimize: bool) -> onnxruntime.SessionOptions:
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    if not optimize:
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    return options


def run_plain(
    model: onnx.ModelProto, sets: list[Feeds], optimize: bool = True
) -> list[list[Outputs]]:
    """A single-rank model without fused ops in stock onnxruntime: outputs per input set."""
    sess = onnxruntime.InferenceSession(
        model.SerializeToString(), _options(optimize), providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in sess.get_outputs()]
    return [[dict(zip(names, sess.run(None, feeds[0]), strict=True))] for feeds in sets]


def run_fuser(
    model: onnx.ModelProto, sets: list[Feeds], kernel: str = "npu", optimize: bool = True
) -> list[list[Outputs]]:
    """A model through fuser's plugin (fused ops, collectives), one session and one thread per
    rank (sessions are made once: making one costs far more than running these models)."""
    ranks = len(sets[0])
    communicator = Communicator(ranks) if ranks > 1 else None
    sessions = [
        session(model, kernel=kernel, rank=r, communicator=communicator, options=_options(optimize))
        for r in range(ranks)
    ]
    names = [o.name for o in sessions[0].get_outputs()]
    results: list[list[Outputs]] = []
    for feeds in sets:
        outs: list[Outputs] = [{} for _ in range(ranks)]
        errors: list[BaseException] = []

        def work(
            rank: int,
            feeds: Feeds = feeds,
            outs: list[Outputs] = outs,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                values = sessions[rank].run(None, feeds[rank])
                outs[rank] = dict(zip(names, values, strict=True))
            except BaseException as exc:  # re-raised in the caller's thread
                if communicator is not None:
                    communicator.abort()
                errors.append(exc)

        if ranks == 1:
            work(0)
        else:
            threads = [threading.Thread(target=work, args=(r,)) for r in range(ranks)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if errors:
            raise errors[0]
        results.append(outs)
    return results


def _run_original(case: Case, sets: list[Feeds], optimize: bool = True) -> list[list[Outputs]]:
    if case.group_size == 1:
        return run_plain(case.model, sets, optimize)
    return run_fuser(case.model, sets, optimize=optimize)


@dataclass(frozen=True)
class _Diff:
    output: str
    why: str


def compare(
    expected: dict[str, np.ndarray],
    actual: dict[str, np.ndarray],
    exact_indices: bool,
    unordered: frozenset[str] = frozenset(),
) -> tuple[_Diff | None, int]:
    """The first output that differs (None if all agree), and how many TopK index differences
    were near ties (see `differences`)."""
    diffs, ties = differences(expected, actual, exact_indices, unordered)
    return (diffs[0] if diffs else None), ties


def differences(
    expected: dict[str, np.ndarray],
    actual: dict[str, np.ndarray],
    exact_indices: bool,
    unordered: frozenset[str] = frozenset(),
) -> tuple[list[_Diff], int]:
    """Every output that differs, and how many TopK index differences may be near ties
    (left out when every float output agrees and ties need not be exact; `check_case` then
    asks `fuzz_ties` whether the competing values are). Outputs in `unordered` are compared
    sorted along their last axis."""
    if list(expected) != list(actual):
        return [_Diff("", f"outputs {list(actual)} instead of {list(expected)}")], 0
    diffs: list[_Diff] = []
    int_diffs: list[str] = []
    for name, want in expected.items():
        got = actual[name]
        if got.dtype != want.dtype or got.shape != want.shape:
            why = f"{got.dtype}{list(got.shape)} instead of {want.dtype}{list(want.shape)}"
            diffs.append(_Diff(name, why))
            continue
        if name in unordered and want.ndim:
            want, got = np.sort(want, axis=-1), np.sort(got, axis=-1)
        if want.dtype.kind == "f":
            rtol, atol = TOLERANCE[want.dtype]
            w, g = want.astype(np.float64), got.astype(np.float64)
            finite = np.isfinite(w)
            scale = float(np.abs(w[finite]).max()) if finite.any() else 1.0
            same_nonfinite = np.array_equal(np.isnan(w), np.isnan(g)) and np.array_equal(
                w[np.isinf(w)], g[np.isinf(w)]
            )
            with np.errstate(invalid="ignore"):  # inf - inf where both are inf: judged above
                gap = np.abs(g - w)
            close = gap <= rtol * np.abs(w) + atol * max(1.0, scale)
            if not same_nonfinite or not bool(np.all(close | ~finite)):
                err = float(gap[~np.isnan(gap)].max()) if (~np.isnan(gap)).any() else np.nan
                diffs.append(_Diff(name, f"max abs diff {err:.3g} (scale {scale:.3g})"))
        elif not np.array_equal(got, want):
            int_diffs.append(name)
    if int_diffs and exact_indices:
        diffs += [_Diff(n, "integer output differs on exact ties") for n in int_diffs]
    elif int_diffs and (diffs or not any(v.dtype.kind == "f" for v in expected.values())):
        diffs += [_Diff(n, "integer output differs") for n in int_diffs]
    return diffs, (0 if diffs else len(int_diffs))


def _double_fused(model: onnx.ModelProto) -> bool:
    """Whether a fused node of `model`, in its graph or a subgraph (If, Loop), computes in
    float64 (its X is double)."""
    typed = onnx.shape_inference.infer_shapes(model)
    types: dict[str, int] = {}
    for graph in functions.graphs(typed.graph):
        values = (*graph.input, *graph.value_info, *graph.output)
        types |= {v.name: v.type.tensor_type.elem_type for v in values}
        types |= {t.name: t.data_type for t in graph.initializer}
    return any(
        n.input and types.get(n.input[0]) == onnx.TensorProto.DOUBLE
        for n in functions.fused_nodes(typed)
    )


Fuse = Callable[[onnx.ModelProto], FusionResult]


def check_case(
    case: Case, kernel: str = "npu", fuse: Fuse = fuse_all, kinds: Sequence[str] = INPUT_SETS
) -> Result:
    """Fuse `case` (with `fuse`: the judge's own tests pass a wrong rewrite) and judge it
    on the input sets `kinds` (see the module docstring)."""
    seed = case.seed
    rng = np.random.default_rng(seed)
    sets = [make_feeds(case, kind, rng) for kind in INPUT_SETS]
    try:
        onnx.checker.check_model(case.model, full_check=True)
    except Exception as exc:
        return Result(seed, "discarded", detail=f"original: {_line(exc)}")
    optimize = True
    try:
        originals = _run_original(case, sets)
    except Exception as exc:
        # onnxruntime's own optimizer can break a valid model (its SimplifiedLayerNormFusion
        # on a gamma that broadcasts up): then both models run unoptimized
        optimize = False
        try:
            originals = _run_original(case, sets, optimize=False)
        except Exception:
            return Result(seed, "discarded", detail=f"original: {_line(exc)}")
    before = case.model.SerializeToString()
    try:
        result = fuse(case.model)
    except Exception as exc:
        return Result(seed, "crash", detail=f"fuse: {type(exc).__name__}: {_line(exc)}")
    fused = {k: v for k, v in result.report.summary.items() if v}
    if case.model.SerializeToString() != before:
        return Result(seed, "wrong", fused, "the input model was modified")
    model = result.model
    problem = _structure_problem(case.model, model, fuse)
    if problem:
        return Result(seed, "invalid", fused, problem)
    if kernel == "npu" and _double_fused(model):
        kernel = "reference"  # the NPU has no float64 unit: float64 norms fuse unpriced (issue 8)
    try:
        actual = run_fuser(model, sets, kernel, optimize=optimize)
    except Exception as exc:
        return Result(seed, "invalid", fused, f"fused model does not run: {_line(exc)}")
    near_ties = 0
    plain: list[list[Outputs]] | None = None
    exact: list[list[Outputs]] | None = None

    def beyond_noise(i: int, rank: int, got: Outputs) -> tuple[list[_Diff], int]:
        """The outputs of `got` that differ from the original on input set i beyond the
        original's own rounding: an output may equal the original's unoptimized run instead,
        or be closer to exact, i.e. equal the original computed in float64."""
        nonlocal plain, exact
        want = originals[i][rank]
        judge = partial(
            differences, exact_indices=INPUT_SETS[i] == "ties", unordered=case.unordered
        )
        diffs, ties = judge(want, got)
        replayable = case.group_size == 1 and has_topk(case.model.graph)
        if not diffs:
            # TopK indices that differ where every float output agrees: a near tie only if
            # the competing values are (fuzz_ties), not merely the values they select
            indices = [n for n, v in want.items() if v.dtype.kind != "f" and n in got
                       and not np.array_equal(v, got[n])]  # fmt: skip
            if not ties or not replayable or near_tie(i, got, want, set(indices), judge):
                return [], ties
            return [_Diff(n, "integer output differs beyond a near tie") for n in indices], 0
        plain = plain or _run_original(case, sets, optimize=False)
        exact = exact or run_exact(case, sets)
        others = [plain[i][rank], *([_rounded(exact[i][rank], want)] if exact else [])]
        for other in others:
            left = {d.output for d in judge(other, got)[0]}
            diffs = [d for d in diffs if d.output in left]
        if diffs and replayable and near_tie(i, got, want, {d.output for d in diffs}, judge):
            return [], ties + 1
        return diffs, ties

    def near_tie(i: int, got: Outputs, want: Outputs, names: set[str], judge: Callable) -> bool:
        """Whether `names` of `got` are what the original computes, in float64, for a choice
        its TopKs make on near ties (fuzz_ties): the fused model's choice, where it shows."""
        for replay in replays(case.model, float64_twin(case.model), sets[i][0], got):
            if not names & {d.output for d in judge(_rounded(replay, want), got)[0]}:
                return True
        return False

    for i, (kind, got_ranks) in enumerate(zip(INPUT_SETS, actual, strict=True)):
        for rank, got in enumerate(got_ranks if kind in kinds else []):
            diffs, ties = beyond_noise(i, rank, got)
            near_ties += ties
            if diffs:
                where = f" (rank {rank})" if case.group_size > 1 else ""
                first = diffs[0]
                return Result(seed, "wrong", fused, f"{kind}{where}: '{first.output}' {first.why}")
    if STOCK_ONNXRUNTIME_CHECK is not None and fused and case.group_size == 1:
        for i, (kind, feeds) in enumerate(zip(INPUT_SETS, sets, strict=True)):
            if kind not in kinds:
                continue
            try:
                stock = STOCK_ONNXRUNTIME_CHECK(model, feeds[0], optimize)
            except Exception as exc:
                return Result(seed, "invalid", fused, f"stock onnxruntime: {_line(exc)}")
            diffs, _ = beyond_noise(i, 0, stock)
            if diffs:
                why = f"'{diffs[0].output}' {diffs[0].why}"
                return Result(seed, "wrong", fused, f"stock onnxruntime, {kind}: {why}")
    return Result(seed, "ok" if fused else "nothing fused", fused, near_ties=near_ties)


def run_exact(case: Case, sets: list[Feeds]) -> list[list[Outputs]]:
    """The original computed in float64 (`float64_twin`), or [] if that twin cannot run.
    An op onnxruntime has no double kernel for (Conv, Erf) runs in float32 in the twin."""
    wide = [[{k: _widened(v) for k, v in feeds.items()} for feeds in ranks] for ranks in sets]
    narrow = set(_NO_DOUBLE)
    while True:
        twin = float64_twin(case.model, frozenset(narrow))
        try:
            if case.group_size == 1:
                return run_plain(twin, wide)
            return run_fuser(twin, wide)
        except Exception as exc:
            missing = re.search(r"Could not find an implementation for (\w+)\(", str(exc))
            if missing is None or missing.group(1) in narrow:
                return []
            narrow.add(missing.group(1))


def _widened(value: np.ndarray) -> np.ndarray:
    return value.astype(np.float64) if value.dtype.kind == "f" else value


def _rounded(exact: Outputs, like: Outputs) -> Outputs:
    """Float64 outputs rounded to the dtypes the original's outputs have."""
    return {k: v.astype(like[k].dtype) if k in like else v for k, v in exact.items()}


_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def float64_twin(model: onnx.ModelProto, narrow: frozenset[str] | None = None) -> onnx.ModelProto:
    """The same model with every float16/float32 tensor, type and Cast in float64: what the
    original computes with (nearly) exact arithmetic, the judge of an ill-conditioned input.
    Ops in `narrow` (default `_NO_DOUBLE`) run in float32 between Casts."""
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    _widen_graph(twin.graph, _NO_DOUBLE if narrow is None else narrow)
    return twin


# onnxruntime's CPU provider has no double kernel for these: the twin runs them in float32
_NO_DOUBLE = frozenset({"Conv"})


def _widen_graph(graph: onnx.GraphProto, narrow_ops: frozenset[str]) -> None:
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type not in narrow_ops:
            nodes.append(node)
            continue
        narrow = onnx.NodeProto()
        narrow.CopyFrom(node)
        for i, name in enumerate(node.input):
            if name:
                narrow.input[i] = f"{name}__f32_{node.name}"
                nodes.append(onnx.helper.make_node("Cast", [name], [narrow.input[i]], to=1))
        for i, name in enumerate(node.output):
            narrow.output[i] = f"{name}__f32"
        nodes.append(narrow)
        nodes += [
            onnx.helper.make_node("Cast", [f"{o}__f32"], [o], to=onnx.TensorProto.DOUBLE)
            for o in node.output
        ]
    del graph.node[:]
    graph.node.extend(nodes)
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.type.tensor_type.elem_type in _FLOATS:
            value.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    for i, tensor in enumerate(graph.initializer):
        if tensor.data_type in _FLOATS:
            wide = numpy_helper.from_array(
                numpy_helper.to_array(tensor).astype(np.float64), tensor.name
            )
            graph.initializer[i].CopyFrom(wide)
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and not any(a.name == "value" for a in node.attribute):
            # its default value is a float32 zero: in the twin, a double one
            zero = numpy_helper.from_array(np.zeros(1, np.float64))
            node.attribute.append(onnx.helper.make_attribute("value", zero))
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in _FLOATS:
                attr.t.CopyFrom(
                    numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float64))
                )
            elif (
                attr.name == "to"
                and node.op_type == "Cast"
                and attr.i in _FLOATS
                and not node.output[0].endswith("__f32")
                and "__f32_" not in node.output[0]
            ):
                attr.i = onnx.TensorProto.DOUBLE
            elif attr.type == onnx.AttributeProto.GRAPH:
                _widen_graph(attr.g, narrow_ops)


def _structure_problem(original: onnx.ModelProto, fused: onnx.ModelProto, fuse: Fuse) -> str:
    """Why the fused model is not a valid, deterministic, idempotent rewrite ('' if it is)."""
    try:
        onnx.checker.check_model(fused, full_check=True)
    except Exception as exc:
        return f"full check: {_line(exc)}"
    data = fused.SerializeToString()
    if fuse(original).model.SerializeToString() != data:
        return "not deterministic: fusing the original twice gave different bytes"
    again = fuse(fused)
    if any(again.report.summary.values()) or again.model.SerializeToString() != data:
        return f"not idempotent: fusing the fused model fused {dict(again.report.summary)}"
    return ""


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def tally(results: Sequence[Result]) -> tuple[dict[str, int], dict[str, int]]:
    """(cases per outcome, fused instances per pattern) of a run."""
    outcomes = dict.fromkeys(OUTCOMES, 0)
    families: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome] += 1
        for pattern, count in r.fused.items():
            families[pattern] = families.get(pattern, 0) + count
    return outcomes, families
