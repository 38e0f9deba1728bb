"""Validation one rank at a time: what `mpiexec -n P fuser validate ORIGINAL FUSED` runs.

Every rank runs the same steps, on whichever transport its communicator has (one MPI process
per rank, or one thread per rank in this process), so the two transports are one code path:

1. load its ORIGINAL and FUSED (`{rank}` in a path or an `--input` file names this rank's own
   shard) and build both sessions; check the world size against the models' `group_size`;
2. agree (`exchange`): if any rank failed to load, every rank stops here with that error;
3. validate its own rank (`fuser.validation.validate_rank`: graph outputs and every fused
   node, on the same seeded inputs the threads validation draws for this rank), collectives
   over the communicator; a rank that fails aborts the communicator, so no other rank waits;
4. exchange every rank's outcome: each rank then knows the whole result, so every rank exits
   with the same status (0 only if every rank matched), and rank 0 prints the table or JSON.
"""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .collective import Communicator, RankFailedError
from .errors import ValidationInputError
from .validation import (
    OutputComparison,
    ValidationResult,
    merge_ranks,
    open_sessions,
    plan_validation,
    validate_rank,
)

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
    dims: tuple[tuple[str, int], ...] = ()  # symbolic dim sizes by name


@dataclass(frozen=True)
class RankOutcome:
    """One rank's result: its comparisons (worst case per compared value over its runs), or
    the one-line error that stopped it. `stopped_by` is set when this rank gave up because
    another rank failed (not its own fault)."""

    rank: int
    host: str
    ok: bool
    comparisons: tuple[OutputComparison, ...] = ()
    error: str = ""
    stopped_by: str = ""
    seconds: float = 0.0
    peak_rss_mb: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "ok": self.ok,
            "error": self.error,
            "stopped_by": self.stopped_by,
            "seconds": round(self.seconds, 4),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            # as in ValidationResult: graph outputs of the fused model, then the stock run's
            "outputs": [
                c.to_dict() for c in self.comparisons if c.where == "output" and c.mode != "stock"
            ],
            "stock_outputs": [
                c.to_dict() for c in self.comparisons if c.where == "output" and c.mode == "stock"
            ],
            "failures": [c.message() for c in self.comparisons if not c.ok],
        }


@dataclass(frozen=True)
class RanksResult:
    """Every rank's outcome, as every rank knows it after the final exchange.

    `merged` is the one `ValidationResult` over every rank (`fuser.validation.merge_ranks`, as
    the threads validation makes it); None when a rank failed before comparing.
    """

    transport: str
    options: RankOptions
    per_rank: tuple[RankOutcome, ...]
    merged: ValidationResult | None = None

    @property
    def ranks(self) -> int:
        return len(self.per_rank)

    @property
    def error(self) -> str:
        """The first rank's own error, as one line naming the rank ("" if none failed)."""
        failed = [o for o in self.per_rank if o.error]
        own = [o for o in failed if not o.stopped_by] or failed  # else knock-on failures only
        return f"rank {own[0].rank} ({own[0].host}): {own[0].error}" if own else ""

    @property
    def ok(self) -> bool:
        return not self.error and all(o.ok for o in self.per_rank)

    @property
    def exit_code(self) -> int:
        """The same on every rank: 2 if any rank failed, 1 if any mismatched, else 0."""
        if self.error:
            return EXIT_ERROR
        return EXIT_OK if self.ok else EXIT_MISMATCH

    def to_dict(self) -> dict[str, Any]:
        """The threads validation's JSON (when every rank compared), plus `transport`,
        `error` and `per_rank`."""
        opts = self.options
        base: dict[str, Any] = (
            self.merged.to_dict()
            if self.merged is not None
            else {"runs": opts.runs, "seed": opts.seed, "kernel": opts.kernel}
        )
        return base | {
            "ok": self.ok,
            "transport": self.transport,
            "ranks": self.ranks,
            "error": self.error,
            "per_rank": [o.to_dict() for o in self.per_rank],
        }


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


def run_rank(
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
    comparisons: tuple[OutputComparison, ...] = ()
    if built is not None and not any(loaded):
        try:  # step 3
            comparisons = validate_rank(
                built.plan,
                built.sessions,
                rank=rank,
                runs=options.runs,
                seed=options.seed,
                rtol=options.rtol,
                atol=options.atol,
                kernel=options.kernel,
                target=options.target,
            )
        except Exception as exc:
            problem = exc
            communicator.abort(one_line(exc), rank=rank)
    elif problem is None:
        first = next(r for r, why in enumerate(loaded) if why)
        problem = RankFailedError(f"rank {first}: {loaded[first]}")
    outcome = RankOutcome(
        rank=rank,
        host=host,
        ok=problem is None and all(c.ok for c in comparisons),
        comparisons=comparisons,
        error=one_line(problem) if problem else "",
        stopped_by=_stopped_by(problem) if problem else "",
        seconds=time.perf_counter() - start,
        peak_rss_mb=_peak_rss_mb(),
    )
    every: list[RankOutcome] = communicator.exchange(rank, outcome)  # step 4
    merged = None
    if built is not None and not any(o.error for o in every):
        merged = merge_ranks(
            built.plan,
            [o.comparisons for o in every],
            runs=options.runs,
            seed=options.seed,
            kernel=options.kernel,
        )
    return RanksResult(communicator.transport_name, options, tuple(every), merged)


@dataclass(frozen=True)
class _Built:
    """What step 1 made for one rank."""

    plan: Any  # fuser.validation.ValidationPlan
    sessions: Any  # fuser.validation.RankSessions


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
    """Step 1: this rank's models and inputs, checked against the group, and its sessions."""
    from .modelio import load_model

    if options.runs < 1:
        raise ValidationInputError("runs must be at least 1")
    original = load_model(resolve(for_rank(options.original, rank)))
    fused = load_model(resolve(for_rank(options.fused, rank)))
    specs = [for_rank(s, rank) for s in options.inputs]
    given = dict(load_inputs(specs)) if load_inputs and specs else {}
    plan = plan_validation(
        original, fused, inputs=given, dims=dict(options.dims), dim_size=options.dim_size
    )
    if plan.ranks not in (1, communicator.group_size):
        raise ValidationInputError(
            f"{original.label}: its collectives need group_size={plan.ranks} ranks but the "
            f"world size is {communicator.group_size} ({communicator.transport_name})"
        )
    sessions = open_sessions(
        plan,
        rank=rank,
        kernel=options.kernel,
        target=options.target,
        communicator=communicator,
    )
    return _Built(plan, sessions)


def validate_local_ranks(
    communicator: Communicator,
    options: RankOptions,
    *,
    resolve: ModelResolver | None = None,
    load_inputs: InputLoader | None = None,
) -> RanksResult:
    """`run_rank` for every rank of `communicator` that lives in this process, one thread
    each: all of them for the threads transport, this process's one rank for MPI."""
    ranks = communicator.local_ranks
    results: list[RanksResult | BaseException | None] = [None] * len(ranks)

    def work(i: int) -> None:
        try:
            results[i] = run_rank(
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
