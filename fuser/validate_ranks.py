"""Validation one rank at a time: what `mpiexec -n P fuser validate ORIGINAL FUSED` runs.

Every rank runs the same steps, on whichever transport its communicator has (one MPI process
per rank, or one thread per rank in this process), so the two transports are one code path:

1. load its ORIGINAL and FUSED (`{rank}` in a path or an `--input` file names this rank's own
   shard) and build both sessions; check the world size against the models' `group_size`;
2. agree (`exchange`): if any rank failed to load, every rank stops here with that error;
3. run both models on this rank's inputs (the same seeded inputs `fuser validate` draws for
   this rank in threads), collectives over the communicator, and compare its own outputs;
   a rank that fails aborts the communicator, so no other rank waits for it;
4. exchange every rank's outcome: each rank then knows the whole result, so every rank exits
   with the same status (0 only if every rank matched), and rank 0 prints the table or JSON.
"""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .collective import Communicator, RankFailedError
from .errors import ValidationInputError
from .validation import OutputComparison, compare, group_size, lowest_float_upstream, make_inputs

RANK_FIELD = "{rank}"
EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2


@dataclass(frozen=True)
class RankOptions:
    """What every rank validates, and how (the `fuser validate` options)."""

    original: str
    fused: str
    runs: int = 3
    seed: int = 0
    rtol: float | None = None
    atol: float | None = None
    inputs: tuple[str, ...] = ()  # name=file.npy specs, `{rank}` allowed in the file
    dim_size: int = 3
    kernel: str = "npu"
    target: str = "ascend910b"


@dataclass(frozen=True)
class RankOutcome:
    """One rank's result: its worst comparison per output, or the one-line error that stopped it.

    `stopped_by` is set when this rank gave up because another rank failed (not its own fault).
    """

    rank: int
    host: str
    ok: bool
    outputs: tuple[OutputComparison, ...] = ()
    error: str = ""
    stopped_by: str = ""
    seconds: float = 0.0
    peak_rss_mb: float = 0.0


@dataclass(frozen=True)
class RanksResult:
    """Every rank's outcome, as every rank knows it after the final exchange."""

    transport: str
    options: RankOptions
    per_rank: tuple[RankOutcome, ...] = field(default_factory=tuple)

    @property
    def ranks(self) -> int:
        return len(self.per_rank)

    @property
    def error(self) -> str:
        """The first rank's own error, as one line naming the rank ("" if none failed)."""
        for o in self.per_rank:
            if o.error and not o.stopped_by:
                return f"rank {o.rank} ({o.host}): {o.error}"
        for o in self.per_rank:  # only knock-on failures: report the first
            if o.error:
                return f"rank {o.rank} ({o.host}): {o.error}"
        return ""

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.per_rank) and not self.error

    @property
    def exit_code(self) -> int:
        """The same on every rank: 2 if any rank failed, 1 if any mismatched, else 0."""
        if self.error:
            return EXIT_ERROR
        return EXIT_OK if self.ok else EXIT_MISMATCH

    @property
    def outputs(self) -> tuple[OutputComparison, ...]:
        """Per output, the worst comparison over every rank."""
        worst: dict[str, OutputComparison] = {}
        for outcome in self.per_rank:
            for o in outcome.outputs:
                worst[o.name] = _worse(worst.get(o.name), o)
        return tuple(worst.values())

    def to_dict(self) -> dict[str, Any]:
        opts = self.options
        return {
            "ok": self.ok,
            "transport": self.transport,
            "ranks": self.ranks,
            "runs": opts.runs,
            "seed": opts.seed,
            "kernel": opts.kernel,
            "error": self.error,
            "outputs": [asdict(o) for o in self.outputs],
            "per_rank": [
                {
                    "rank": o.rank,
                    "host": o.host,
                    "ok": o.ok,
                    "error": o.error,
                    "stopped_by": o.stopped_by,
                    "seconds": round(o.seconds, 4),
                    "peak_rss_mb": round(o.peak_rss_mb, 1),
                    "outputs": [asdict(c) for c in o.outputs],
                }
                for o in self.per_rank
            ],
        }


def _worse(previous: OutputComparison | None, result: OutputComparison) -> OutputComparison:
    if previous is None or (previous.ok and not result.ok):
        return result
    if previous.ok == result.ok and result.max_rel > previous.max_rel:
        return result
    return previous


def for_rank(spec: str, rank: int) -> str:
    """`spec` with `{rank}` replaced by this rank's number (plain replace: paths keep braces)."""
    return spec.replace(RANK_FIELD, str(rank))


def one_line(exc: BaseException) -> str:
    """An exception as one line: its message's first line, or its type."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _stopped_by(exc: BaseException) -> str:
    """The reason of the other rank whose failure made this one give up, else ""."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RankFailedError):
            return str(seen)
        seen = seen.__cause__
    return ""


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


InputLoader = Callable[[list[str]], Mapping[str, Any]]
ModelResolver = Callable[[str], Any]


def validate_rank(
    rank: int,
    communicator: Communicator,
    options: RankOptions,
    *,
    resolve: ModelResolver | None = None,
    load_inputs: InputLoader | None = None,
) -> RanksResult:
    """Run steps 1-4 of the module docstring for `rank`; every rank returns the same result.

    `resolve` turns a model spec into something `load_model` takes (the CLI passes one that
    knows `example:NAME`); `load_inputs` reads `name=file.npy` specs.
    """
    start = time.perf_counter()
    host = socket.gethostname()
    resolve = resolve or (lambda spec: spec)
    built: _Built | None = None
    problem: BaseException | None = None
    try:  # step 1
        with _BUILD_LOCK:
            built = _load_and_build(rank, communicator, options, resolve, load_inputs)
    except Exception as exc:
        problem = exc
    # step 2: nobody runs unless everybody loaded (a collective would wait for the others)
    loaded = communicator.exchange(rank, one_line(problem) if problem else "")
    outputs: tuple[OutputComparison, ...] = ()
    if built is not None and not any(loaded):
        try:  # step 3
            outputs = _compare_runs(rank, built, options)
        except Exception as exc:
            problem = exc
            communicator.abort(one_line(exc), rank=rank)
    elif problem is None:
        first = next(r for r, why in enumerate(loaded) if why)
        problem = RankFailedError(f"rank {first}: {loaded[first]}")
    outcome = RankOutcome(
        rank=rank,
        host=host,
        ok=problem is None and all(o.ok for o in outputs),
        outputs=outputs,
        error=one_line(problem) if problem else "",
        stopped_by=_stopped_by(problem) if problem else "",
        seconds=time.perf_counter() - start,
        peak_rss_mb=_peak_rss_mb(),
    )
    every = communicator.exchange(rank, outcome)  # step 4
    return RanksResult(communicator.transport_name, options, tuple(every))


@dataclass(frozen=True)
class _Built:
    """What step 1 made for one rank."""

    original: Any  # onnx.ModelProto
    out_names: tuple[str, ...]
    given: Mapping[str, np.ndarray]
    sessions: tuple[Any, Any]  # original (reference kernels), fused


# Session building registers fused-op schemas and plugin ops process-wide, which is not
# thread-safe: ranks running as threads build one at a time (they still run concurrently).
_BUILD_LOCK = threading.Lock()


def _load_and_build(
    rank: int,
    communicator: Communicator,
    options: RankOptions,
    resolve: ModelResolver,
    load_inputs: InputLoader | None,
) -> _Built:
    """Step 1: this rank's models, checked against the group, its inputs, both sessions."""
    from .modelio import load_model
    from .ort import session

    original = load_model(resolve(for_rank(options.original, rank)))
    fused = load_model(resolve(for_rank(options.fused, rank)))
    needed = max(group_size(original.model), group_size(fused.model))
    if needed not in (1, communicator.group_size):
        raise ValidationInputError(
            f"{original.label}: its collectives need group_size={needed} ranks but the "
            f"world size is {communicator.group_size} ({communicator.transport_name})"
        )
    out_names = [o.name for o in original.model.graph.output]
    missing = [n for n in out_names if n not in {o.name for o in fused.model.graph.output}]
    if missing:
        raise ValidationInputError(
            f"{fused.label}: lacks output '{missing[0]}' of {original.label}"
        )
    specs = [for_rank(s, rank) for s in options.inputs]
    given = dict(load_inputs(specs)) if load_inputs and specs else {}
    sessions = tuple(
        session(
            model,
            kernel=kernel,
            target=options.target,
            rank=rank,
            communicator=communicator,
            options=_quiet(),
        )
        for model, kernel in ((original, "reference"), (fused, options.kernel))
    )
    return _Built(original.model, tuple(out_names), given, (sessions[0], sessions[1]))


def _quiet() -> Any:
    """Session options that keep onnxruntime's own error log off stderr: after a rank fails,
    its placeholder outputs make later nodes fail too, and those lines would bury the one
    error that matters (which the result reports)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4  # fatal only
    return options


def _compare_runs(rank: int, built: _Built, options: RankOptions) -> tuple[OutputComparison, ...]:
    """This rank's worst comparison per output over `options.runs` input sets."""
    original_model, out_names, sessions = built.original, list(built.out_names), built.sessions
    precision = lowest_float_upstream(original_model, out_names)
    worst: dict[str, OutputComparison] = {}
    for run in range(options.runs):
        feeds = make_inputs(
            original_model,
            run=run,
            rank=rank,
            seed=options.seed,
            dim_size=options.dim_size,
            given=built.given,
        )
        expected = dict(zip(out_names, sessions[0].run(out_names, feeds), strict=True))
        actual = dict(zip(out_names, sessions[1].run(out_names, feeds), strict=True))
        for name in out_names:
            result = compare(
                name, expected[name], actual[name], options.rtol, options.atol, precision[name]
            )
            worst[name] = _worse(worst.get(name), result)
    return tuple(worst[n] for n in out_names)


def validate_in_threads(
    communicator: Communicator,
    options: RankOptions,
    *,
    resolve: ModelResolver | None = None,
    load_inputs: InputLoader | None = None,
) -> RanksResult:
    """Every rank of `communicator` that runs in this process, one thread each (same steps)."""
    ranks = communicator.local_ranks
    results: list[RanksResult | BaseException | None] = [None] * len(ranks)

    def work(i: int) -> None:
        try:
            results[i] = validate_rank(
                ranks[i], communicator, options, resolve=resolve, load_inputs=load_inputs
            )
        except BaseException as exc:  # a bug in fuser: surface it, do not leave a None
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    first = results[0]
    assert isinstance(first, RanksResult)
    return first
