"""Proof that a fused model computes what the original computed, in onnxruntime.

Both models run on the same inputs (seeded random ones a model accepts, see
`fuser.validate_inputs`, or the user's), both with onnxruntime's graph optimizations off, so
neither session rewrites the maths under comparison. What is compared, on every run and rank:

- every graph output;
- every fused node's outputs, against the original's values of the same names (exposed as extra
  outputs of the original): once as the fused model computed them ("in model"), and once with
  the fused node run alone on the original's own values of its inputs ("isolated"), so a broken
  node shows whatever lies downstream of it (a ReLU, an argmax) or upstream;
- with ONNX function bodies in the fused model (FunctionProtos in domain `fuser`), the same
  values from plain onnxruntime running the bodies ("stock"), nothing of fuser's registered
  (but the collectives onnxruntime's CPU package lacks).

Each value is judged against the original within the dtype tolerance plus the original's own
rounding noise on that input, measured by rerunning it on inputs moved by one unit in the last
place (`fuser.compare`).

A model with com.microsoft AllGather runs as `group_size` ranks, one session per rank in its own
thread, each rank with distinct inputs. `validate_rank` validates one rank given its sessions and
communicator, so another transport (MPI) can run the ranks in separate processes:

    plan = plan_validation(original, fused)                  # fuser.validate_plan
    sessions = open_sessions(plan, rank=r, communicator=c)   # this rank's sessions
    found = validate_rank(plan, sessions, rank=r)            # this rank's comparisons
    result = merge_ranks(plan, [found_0, found_1, ...], runs=3, seed=0, kernel="npu")

What was found is `fuser.validation_result`; inputs are drawn by `fuser.validate_inputs` and
compared by `fuser.compare`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx

from . import plugin_clock
from .compare import DEFAULT_TOLERANCE, compare_topk, compare_values
from .errors import FuserError, ValidationInputError, ValidationRunError
from .fusedop import DOMAIN
from .graph import node_subgraphs
from .modelio import LoadedModel, read_tensor
from .validate_inputs import make_feeds, symbolic_dims
from .validate_plan import (
    FusedNodeInfo,
    TopKPair,
    ValidationPlan,
    group_size,
    lowest_float_upstream,
    plan_validation,
)
from .validation_result import (
    OutputComparison,
    ValidationResult,
    as_output,
    compare,
    keep_worst,
)

__all__ = [
    "DEFAULT_TOLERANCE",
    "FusedNodeInfo",
    "OutputComparison",
    "RankSessions",
    "TopKPair",
    "ValidationPlan",
    "ValidationResult",
    "compare",
    "group_size",
    "keep_worst",
    "lowest_float_upstream",
    "merge_ranks",
    "open_sessions",
    "plan_validation",
    "validate_models",
    "validate_rank",
]

Progress = Callable[[int, int], None]  # (steps done, steps in all)
MAX_NARROWED = 6  # op types of the float64 copy that may fall back to float32 kernels


@dataclass
class RankSessions:
    """One rank's sessions: the original, the fused model through the plugin, and stock."""

    original: Any
    fused: Any
    stock: Any | None
    communicator: Any | None = None
    # The original in float64, made on first need (`float64_values`); None once known to be
    # unavailable (too large, or it does not load).
    truth: Any | None = None
    make_truth: Callable[[], Any | None] | None = None

    def float64_values(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The original's values in float64 on `feeds`; empty where that copy is unavailable."""
        if self.truth is None and self.make_truth is not None:
            self.truth, self.make_truth = self.make_truth(), None
        if self.truth is None:
            return {}
        try:
            return _run(self.truth, _as_float64(feeds))
        except Exception:  # a float64 kernel missing at run time: the spread serves alone
            self.truth = None
            return {}


def _needs_plugin(model: onnx.ModelProto) -> bool:
    def visit(graph: onnx.GraphProto) -> bool:
        return any(
            n.domain in (DOMAIN, "com.microsoft") or any(visit(g) for g in node_subgraphs(n))
            for n in graph.node
        )

    return visit(model.graph)


def _options() -> Any:
    import onnxruntime

    opts = onnxruntime.SessionOptions()
    # Compare like with like: onnxruntime's optimizer replaces a decomposed LayerNorm by its own
    # kernel in one session and not in the other; off, both compute what the graphs say.
    opts.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    return opts


@contextlib.contextmanager
def _exposed(loaded: LoadedModel, names: Sequence[str]) -> Iterator[LoadedModel]:
    """`loaded` with `names` as extra graph outputs, for as long as a session is being made."""
    graph = loaded.model.graph
    before = len(graph.output)
    graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    try:
        yield loaded
    finally:
        del graph.output[before:]


def _session(
    loaded: LoadedModel,
    names: Sequence[str],
    *,
    kernel: str,
    target: str,
    rank: int,
    communicator: Any | None,
    fused_ops: bool = True,
    fallback: bool = False,
) -> Any:
    from .modelio import has_external_data
    from .ort import session

    if not _needs_plugin(loaded.model) and not has_external_data(loaded.model):
        import onnxruntime

        with _exposed(loaded, names) as model:
            return onnxruntime.InferenceSession(
                model.model.SerializeToString(), _options(), providers=["CPUExecutionProvider"]
            )
    return session(
        loaded,
        kernel=kernel,
        target=target,
        rank=rank,
        communicator=communicator,
        options=_options(),
        fused_ops=fused_ops,
        extra_outputs=names,
        fallback=fallback,
    )


def open_sessions(
    plan: ValidationPlan,
    *,
    rank: int = 0,
    kernel: str = "npu",
    target: str = "ascend910b",
    communicator: Any | None = None,
) -> RankSessions:
    """The sessions `validate_rank` runs on one rank (one communicator serves all three)."""
    try:
        original = _session(
            plan.original,
            plan.expose_original,
            kernel="reference",
            target=target,
            rank=rank,
            communicator=communicator,
        )
    except FuserError:
        raise
    except Exception as exc:
        raise ValidationRunError(
            f"{plan.original.label}: onnxruntime cannot load the original: {_first_line(exc)}"
        ) from exc
    try:
        # A fused node the NPU has no unit for (float64) runs on its reference, reported per
        # node (`OutputComparison.fallback`) and compared like every other.
        fused = _session(
            plan.fused,
            plan.expose_fused,
            kernel=kernel,
            target=target,
            rank=rank,
            communicator=communicator,
            fallback=True,
        )
        stock = (
            _session(
                plan.fused,
                plan.expose_fused,
                kernel=kernel,
                target=target,
                rank=rank,
                communicator=communicator,
                fused_ops=False,
            )
            if plan.has_functions
            else None
        )
    except FuserError:
        raise
    except Exception as exc:
        raise ValidationRunError(
            f"{plan.fused.label}: onnxruntime cannot load the fused model: {_first_line(exc)}"
        ) from exc

    def make_truth() -> Any | None:
        return _truth_session(plan, rank, target, communicator)

    if plan.ranks > 1:  # every rank must run the same collectives: made now, on all of them
        return RankSessions(original, fused, stock, communicator, make_truth())
    return RankSessions(original, fused, stock, communicator, None, make_truth)


def _truth_session(
    plan: ValidationPlan, rank: int, target: str, communicator: Any | None
) -> Any | None:
    """The original in float64, or None where that copy is too large or does not load."""
    from .float64 import (
        MAX_BYTES,
        NO_FLOAT64_KERNEL,
        as_float64,
        float_bytes,
        in_float32,
        missing_kernel,
    )

    if float_bytes(plan.original.model) > MAX_BYTES:
        return None
    try:
        copy = as_float64(plan.original)
    except Exception:  # a tensor that does not convert: the last-bit spread serves alone
        return None
    loaded = LoadedModel(copy, plan.original.base_dir, plan.original.label)
    narrowed = {n.op_type for n in copy.graph.node if n.op_type in NO_FLOAT64_KERNEL}
    if narrowed:
        in_float32(copy, narrowed)
    for _ in range(MAX_NARROWED):
        try:
            return _session(
                loaded,
                plan.expose_original,
                kernel="reference",
                target=target,
                rank=rank,
                communicator=communicator,
            )
        except Exception as exc:
            op = missing_kernel(str(exc))
            if op is None or op in narrowed:
                return None
            in_float32(copy, {op})  # no float64 kernel: this op runs in float32
            narrowed.add(op)
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _run(sess: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, dict(feeds)), strict=True))


def _as_float64(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        k: v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v
        for k, v in feeds.items()
    }


def _perturbed(feeds: Mapping[str, np.ndarray], seed: int, run: int, rank: int) -> dict[str, Any]:
    """Float inputs moved by one unit in the last place, each element up or down at random."""
    rng = np.random.default_rng([seed, run, rank, 1])
    moved: dict[str, np.ndarray] = {}
    for name, x in feeds.items():
        if np.issubdtype(x.dtype, np.floating) and x.size:
            step = np.where(rng.integers(0, 2, x.shape) == 1, np.inf, -np.inf).astype(x.dtype)
            moved[name] = np.asarray(np.nextafter(x, step), dtype=x.dtype)
        else:
            moved[name] = x
    return moved


def validate_rank(
    plan: ValidationPlan,
    sessions: RankSessions,
    *,
    rank: int = 0,
    runs: int = 3,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
    kernel: str = "npu",
    target: str = "ascend910b",
    progress: Progress | None = None,
    seconds: dict[str, float] | None = None,
) -> tuple[OutputComparison, ...]:
    """Every comparison of one rank over `runs` input sets, worst case per compared value.

    Every rank of a group must call this with the same plan and runs at the same time: the
    models' collectives (and isolated runs of gathering fused nodes) meet in `sessions`'
    communicator.
    """
    from .ort import fallbacks, held_constants, run_node

    worst: dict[tuple[str, str, str], OutputComparison] = {}
    init_f = {t.name: t for t in plan.fused.model.graph.initializer}
    steps = runs * (3 + len(plan.nodes) + (1 if sessions.stock is not None else 0))
    done = 0
    clock = {"at": time.perf_counter()}
    spent = seconds if seconds is not None else {}
    work = {"at": plugin_clock.snapshot()}

    def tick(what: str = "") -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, steps)
        if what:
            now = time.perf_counter()
            spent[what] = spent.get(what, 0.0) + now - clock["at"]
            clock["at"] = now
            # what the fused ops' own work took of it ("fused: simulate"...)
            for kind, s in plugin_clock.since(work["at"]).items():
                spent[f"{what}: {kind}"] = spent.get(f"{what}: {kind}", 0.0) + s
            work["at"] = plugin_clock.snapshot()

    def keep(c: OutputComparison) -> None:
        keep_worst(worst, c)

    for run in range(runs):
        feeds = make_feeds(list(plan.specs), run=run, rank=rank, seed=seed, given=plan.given)
        try:
            clock["at"] = time.perf_counter()
            expected = _run(sessions.original, feeds)
            tick("original")
            moved = _run(sessions.original, _perturbed(feeds, seed, run, rank))
            tick("original perturbed")
        except FuserError:
            raise
        except Exception as exc:
            raise _original_failed(plan, feeds, exc) from exc
        with np.errstate(invalid="ignore"):  # inf - inf in an output that holds inf
            noise = {
                k: np.abs(moved[k].astype(np.float64) - v.astype(np.float64))
                for k, v in expected.items()
                if np.issubdtype(v.dtype, np.floating) and moved[k].shape == v.shape
            }
        clock["at"] = time.perf_counter()
        work["at"] = plugin_clock.snapshot()
        actual = _run_fused(plan, sessions.fused, feeds)
        tick("fused")
        values = {**held_constants(sessions.fused), **feeds, **expected}
        alone: dict[str, dict[str, np.ndarray]] = {}
        alone_limits: dict[str, str] = {}  # nodes run alone on their reference, and why
        for info in plan.nodes:
            args = [
                None
                if not n
                else values[n]
                if n in values
                else read_tensor(plan.fused, init_f[n])
                if n in init_f
                else actual.get(n)
                for n in info.node.input
            ]
            try:
                outs = run_node(
                    info.node,
                    args,
                    kernel=kernel,
                    target=target,
                    rank=rank,
                    communicator=sessions.communicator,
                    fallbacks=alone_limits,
                )
            except FuserError:
                raise
            except Exception as exc:
                raise ValidationRunError(
                    f"{plan.fused.label}: fused node '{info.name}' ({info.op}) failed on the "
                    f"original's values: {_first_line(exc)}"
                ) from exc
            alone[info.name] = {
                n: o.astype(expected[n].dtype, copy=False)
                for n, o in zip(info.node.output, outs, strict=True)
                if n and o is not None and n in expected
            }
            tick("isolated nodes")
        stock = _run_fused(plan, sessions.stock, feeds) if sessions.stock is not None else None
        if stock is not None:
            tick("stock")

        run_values = (expected, moved, noise)
        computed = (actual, stock, alone)

        # Ranks run their collectives together: with several, every rank asks every run.
        together = plan.ranks > 1
        truth = sessions.float64_values(feeds) if together else {}
        judging = time.perf_counter()
        limits = {"model": fallbacks(sessions.fused), "isolated": alone_limits}
        judge = _Judge(plan, *run_values, truth, rtol, atol, run, rank, kernel, limits)
        found = _judge_run(plan, judge, *computed)
        clock["at"] = time.perf_counter()
        spent["compare"] = spent.get("compare", 0.0) + clock["at"] - judging
        if not together and any(not c.ok for c in found):
            # Something differs beyond tolerance and last-bit spread: is the original itself
            # far from real arithmetic there? Ask its float64 copy (made on first need).
            truth = sessions.float64_values(feeds)
            if truth:
                judge = _Judge(plan, *run_values, truth, rtol, atol, run, rank, kernel, limits)
                found = _judge_run(plan, judge, *computed)
            tick("original float64")
        for c in found:
            keep(c)
    return tuple(worst.values())


def _judge_run(
    plan: ValidationPlan,
    judge: _Judge,
    actual: Mapping[str, np.ndarray],
    stock: Mapping[str, np.ndarray] | None,
    alone: Mapping[str, Mapping[str, np.ndarray]],
) -> list[OutputComparison]:
    """Every comparison of one run: outputs and fused nodes, in model, stock and isolated."""
    found: list[OutputComparison] = []
    for mode, computed in (("model", actual), ("stock", stock)):
        if computed is None:
            continue
        for name in plan.outputs:
            found.extend(judge.value(name, computed, mode=mode))
        for info in plan.nodes:
            found.extend(judge.node(info, computed, mode=mode))
    for info in plan.nodes:
        found.extend(judge.node(info, alone[info.name], mode="isolated"))
    return found


def _run_fused(
    plan: ValidationPlan, sess: Any, feeds: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    from .ort import NodeFailedError

    try:
        return _run(sess, feeds)
    except NodeFailedError as exc:  # names the node and what it said
        raise ValidationRunError(f"{plan.fused.label}: {exc}") from exc
    except FuserError:
        raise
    except Exception as exc:
        raise ValidationRunError(
            f"{plan.fused.label}: onnxruntime failed running the fused model on inputs the "
            f"original accepts: {_first_line(exc)}"
        ) from exc


def _original_failed(
    plan: ValidationPlan, feeds: Mapping[str, np.ndarray], exc: BaseException
) -> ValidationInputError:
    drawn = ", ".join(
        f"{s.name}{list(s.shape)} {s.dtype.name}" + (f" in [0, {s.high})" if s.high else "")
        for s in plan.specs
    )
    dims = symbolic_dims(plan.original.model)
    hint = "give its inputs with --input NAME=FILE.npy"
    hint += f" or sizes with --dim NAME=SIZE (symbolic dims: {', '.join(dims)})" if dims else ""
    return ValidationInputError(
        f"{plan.original.label}: the original model fails on the generated inputs "
        f"({drawn}): {_first_line(exc)}; {hint}"
    )


class _Judge:
    """Compares values of one run against the original's, noise and TopK pairs included."""

    def __init__(
        self,
        plan: ValidationPlan,
        expected: Mapping[str, np.ndarray],
        moved: Mapping[str, np.ndarray],
        noise: Mapping[str, np.ndarray],
        truth: Mapping[str, np.ndarray],
        rtol: float | None,
        atol: float | None,
        run: int,
        rank: int,
        kernel: str = "",
        limits: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.plan, self.expected, self.moved, self.noise = plan, expected, moved, noise
        self.truth = truth
        self.rtol, self.atol, self.run, self.rank = rtol, atol, run, rank
        # how the fused side of a node was computed: the kernel asked for, or per mode the
        # nodes that ran on their reference instead (node -> the machine's limit)
        self.kernel, self.limits = kernel, limits or {}

    def value(
        self, name: str, actual: Mapping[str, np.ndarray], *, mode: str, **where: Any
    ) -> list[OutputComparison]:
        if name not in self.expected:
            return []
        if name not in actual:
            return [
                OutputComparison(
                    name, "", float("inf"), float("inf"), 0.0, False, "not computed",
                    mode=mode, run=self.run, rank=self.rank, **where,
                )
            ]  # fmt: skip
        base = dict(mode=mode, run=self.run, rank=self.rank, **where)
        pair = self.plan.topk.get(name)
        if pair is not None and all(
            n in self.expected and n in actual for n in (pair.values, pair.indices)
        ):
            values, indices = compare_topk(
                (self.expected[pair.values], actual[pair.values]),
                (self.expected[pair.indices], actual[pair.indices]),
                axis=pair.axis,
                is_sorted=pair.is_sorted,
                rtol=self.rtol,
                atol=self.atol,
                precision=self.plan.precision.get(pair.values),
                noise=self.noise.get(pair.values),
                perturbed_indices=self.moved.get(pair.indices),
            )
            return [as_output(name, values if name == pair.values else indices, **base)]
        found = compare_values(
            self.expected[name],
            actual[name],
            rtol=self.rtol,
            atol=self.atol,
            precision=self.plan.precision.get(name),
            noise=self.noise.get(name),
            truth=self.truth.get(name),
        )
        return [as_output(name, found, **base)]

    def node(
        self, info: FusedNodeInfo, actual: Mapping[str, np.ndarray], *, mode: str
    ) -> list[OutputComparison]:
        found: list[OutputComparison] = []
        limit = self.limits.get(mode, {}).get(info.name, "")
        kernel = "" if mode == "stock" else "reference" if limit else self.kernel
        for name in info.node.output:
            if name:
                found.extend(
                    self.value(
                        name,
                        actual,
                        mode=mode,
                        where="node",
                        node=info.name,
                        op=info.op,
                        pattern=info.pattern,
                        replaced=info.replaced,
                        kernel=kernel,
                        fallback=limit,
                    )
                )
        return found


def merge_ranks(
    plan: ValidationPlan,
    per_rank: Sequence[Sequence[OutputComparison]],
    *,
    runs: int,
    seed: int,
    kernel: str,
) -> ValidationResult:
    """One result from every rank's comparisons: the worst case per compared value."""
    worst: dict[tuple[str, str, str], OutputComparison] = {}
    labels: dict[str, set[str]] = {}  # fused node -> what computed it, on any rank and mode
    for comparisons in per_rank:
        for c in comparisons:
            keep_worst(worst, c)
            if c.where == "node" and c.kernel:
                labels.setdefault(c.node, set()).add(c.kernel_label)
    node_kernels = {
        info.name: " / ".join(sorted(labels[info.name]))
        for info in plan.nodes
        if info.name in labels
    }
    every = list(worst.values())
    outputs = tuple(worst[("model", "", n)] for n in plan.outputs if ("model", "", n) in worst)
    nodes = tuple(c for c in every if c.where == "node" and c.mode != "stock")
    stock_outputs = tuple(c for c in every if c.mode == "stock")
    if not plan.has_functions:
        stock = "not applicable: the fused model has no function bodies"
    else:
        stock = "ok" if all(c.ok for c in stock_outputs) else "failed"
    ok = all(c.ok for c in every)
    return ValidationResult(
        ok,
        outputs,
        runs,
        plan.ranks,
        seed,
        kernel,
        nodes,
        stock,
        stock_outputs,
        node_kernels=node_kernels,
    )


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
    dims: Mapping[str, int] | None = None,
    kernel: str = "reference",
    target: str = "ascend910b",
    replaced: Mapping[str, Sequence[str]] | None = None,
    types: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> ValidationResult:
    """Run both models on the same inputs; compare outputs and fused nodes on every run and rank.

    Raises only fuser's errors: ValidationInputError (inputs or sizes the models do not accept,
    the original failing on them), ValidationRunError (the fused model failing to run),
    UsageError (an unknown kernel or target).
    """
    from .ort import KERNELS

    if runs < 1:
        raise ValidationInputError("runs must be at least 1")
    if kernel not in KERNELS:
        raise ValidationInputError(f"unknown kernel '{kernel}'; choose one of {', '.join(KERNELS)}")
    start = time.perf_counter()
    plan = plan_validation(
        original, fused, inputs=inputs, dims=dims, dim_size=dim_size, replaced=replaced, types=types
    )
    planned = time.perf_counter()
    if plan.ranks == 1:
        sessions = open_sessions(plan, kernel=kernel, target=target)
        seconds = {"plan": planned - start, "sessions": time.perf_counter() - planned}
        found = validate_rank(
            plan,
            sessions,
            runs=runs,
            seed=seed,
            rtol=rtol,
            atol=atol,
            kernel=kernel,
            target=target,
            progress=progress,
            seconds=seconds,
        )
        merged = merge_ranks(plan, [found], runs=runs, seed=seed, kernel=kernel)
        return replace(merged, seconds=seconds)
    return _validate_threads(plan, runs, seed, rtol, atol, kernel, target, progress)


def _validate_threads(
    plan: ValidationPlan,
    runs: int,
    seed: int,
    rtol: float | None,
    atol: float | None,
    kernel: str,
    target: str,
    progress: Progress | None,
) -> ValidationResult:
    """Every rank in its own thread of this process, on the in-process communicator."""
    from .collective import Communicator

    communicator = Communicator(plan.ranks)
    sessions = [
        open_sessions(plan, rank=r, kernel=kernel, target=target, communicator=communicator)
        for r in range(plan.ranks)
    ]
    results: list[tuple[OutputComparison, ...] | None] = [None] * plan.ranks
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            results[rank] = validate_rank(
                plan,
                sessions[rank],
                rank=rank,
                runs=runs,
                seed=seed,
                rtol=rtol,
                atol=atol,
                kernel=kernel,
                target=target,
                progress=progress if rank == 0 else None,
            )
        except BaseException as exc:
            errors.append(exc)
            communicator.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(plan.ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        fuser_errors = [e for e in errors if isinstance(e, FuserError)]
        if fuser_errors:
            raise fuser_errors[0]
        raise ValidationRunError(f"{plan.fused.label}: {_first_line(errors[0])}") from errors[0]
    return merge_ranks(
        plan, [r for r in results if r is not None], runs=runs, seed=seed, kernel=kernel
    )
