"""The Python API: `fuse`, `inspect`, `validate`. Nothing here prints or writes unless asked."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from . import engine
from . import functions as functions_mod
from .body_check import BodyCheckedDecider
from .checkview import scan_nodes
from .decide import Decider
from .errors import ModelLoadError, UsageError
from .finish import FuseOptions, finish
from .graph import TypeTable
from .heap import collector_paused
from .modelio import LoadedModel, ModelSource, load_model, save_model
from .normalize import fill_outputs, normalize, sort_nodes
from .registry import select
from .report import FusionRecord, FusionReport, RejectionRecord, fusion_dict, near_miss_dict

if TYPE_CHECKING:
    from .unfused import UnfuseResult
    from .validation import ValidationResult

DEFAULT_TARGET = "ascend910b"


@dataclass(frozen=True)
class FusionResult:
    """The fused model and what was done to it.

    `model` may reference external data relative to the input's folder; `save` streams those
    tensors next to the output.
    """

    model: onnx.ModelProto
    report: FusionReport
    source: LoadedModel
    # What onnx's checker said of an input that onnxruntime runs anyway (fused regardless).
    warnings: tuple[str, ...] = ()
    # The input as fuse read and normalized it, and its inferred types, when asked to keep
    # them (`fuse(..., keep_original=True)`): `validate(result.original, result)` then neither
    # loads the input again nor re-runs shape inference on it.
    original: LoadedModel | None = None
    original_types: Mapping[str, TypeTable] | None = None

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        external: bool | None = None,
        extra: Mapping[Path, bytes] | None = None,
    ) -> list[Path]:
        """Write the fused model (and the `extra` files, e.g. a report) as one step: all appear
        or none; returns the files written.

        Raises `OutputError` (naming the path) for a folder, an unwritable place, or a path
        that would overwrite the input or its external data.
        """
        # fuser writes every tensor it makes inline: only an input's may be external. Else
        # inline unless past protobuf's limit (the inline write counts as it goes).
        return save_model(
            self.model, path, source=self.source, external=external, extra=extra,
            holds_external=self.source.external,
        )  # fmt: skip


def fuse(
    model: ModelSource,
    patterns: str | Sequence[str] | None = None,
    disable: str | Sequence[str] = (),
    target: str = DEFAULT_TARGET,
    *,
    force: bool = False,
    cache: bool | str | os.PathLike[str] | None = None,
    decider: Decider | None = None,
    functions: bool = True,
    dims: Mapping[str, int] | None = None,
    keep_original: bool = False,
    progress: engine.Progress | None = None,
) -> FusionResult:
    """Fuse the operator chains of `model` (a path, bytes or ModelProto; never modified).

    With `functions` (the default) each fused op type gets a function body in the model, so
    a plain `onnxruntime.InferenceSession` runs it; `functions=False` writes the bare ops.
    `dims` gives named symbolic dims a size for pricing (as `--dim`); the cost model decides
    the others over a range of sizes. `keep_original` keeps a copy of the input as read (and
    normalized) in `result.original`, for `validate(result.original, result)`.
    `progress(stage, done, total)` is told each stage as it starts ("load", "match", "decide",
    "finish", "verify") and how far the passes are.

    >>> result = fuse("model.onnx")                      # doctest: +SKIP
    >>> result.report.summary                            # doctest: +SKIP
    {'conv_bn_relu': 53, ...}
    >>> result.save("model.fused.onnx")                  # doctest: +SKIP
    """
    clock = engine.timed()
    next(clock)
    report = progress or _no_progress
    report("load", 0, 1)
    chosen = select(pattern_names(patterns), pattern_names(disable) or ())
    check_target(target)
    loaded = load_model(model)
    # What onnxruntime tolerates, fixed in fuser's copy. Nodes out of order are sorted only
    # once the checker refuses the model (or before inference where it does not check first):
    # finding that they are in order is a walk over every node, which the checker makes anyway.
    # One walk over the nodes for both (normalizing changes none of them).
    scan = scan_nodes(loaded.model)
    normalized = normalize(loaded, sort=False, scan=scan)
    # One serialization for both tools, where it can; none when the file is the model as is.
    try:
        checked = engine.check_and_infer(loaded, as_read=not normalized, scan=scan)
    except ModelLoadError:
        if not (order := sort_nodes(loaded)):
            raise  # in order: refused for another reason
        normalized = [*order, *normalized]
        checked = engine.check_and_infer(loaded, as_read=False)
    del scan  # its lists hold node protos
    if checked is None:
        normalized = [*sort_nodes(loaded), *normalized]
    if checked is not None:
        types, warnings = checked
        del checked
    else:  # an untyped graph input or output: inference types outputs before the checker
        types = engine.infer_types(loaded.model)
        normalized += fill_outputs(loaded.model, types.get(""))
        warnings = engine.check_structure(loaded)
    original = _copy_of(loaded) if keep_original else None
    seconds = {"load": next(clock)}
    decider = decider or _default_decider(target, force, cache, dims)
    if functions:  # a fusion that could not carry its body is refused now, with its reason
        imports = {o.domain or "": o.version for o in loaded.model.opset_import}
        decider = BodyCheckedDecider(
            decider,
            imports.get("", imports.get("ai.onnx", 0)),
            {d: v for d, v in imports.items() if d},
            functions_mod.elem_types_from(types),
        )
    with collector_paused():  # the passes make a few objects per node
        log = engine.run_passes(loaded, chosen, decider, types, progress)
    seconds["match_rewrite"] = next(clock)
    report("finish", 0, 1)
    # -- finish the output: function bodies, producer, provenance (fuser/finish.py) --
    # Only a model that holds fused nodes is finished: one with nothing to fuse is written as
    # it was read (normalized at most), not re-stamped or moved to a newer IR version.
    if log.fusions or next(functions_mod.fused_nodes(loaded.model), None) is not None:
        finish(
            loaded.model,
            functions_mod.elem_types_from(types),
            FuseOptions(target, tuple(p.name for p in chosen), force, functions),
        )
    seconds["finish"] = next(clock)
    # The type tables (the inferred value infos: about a model's node count of protos) and
    # the decider are done with: let go of them before the checker serializes the output.
    kept_types = types if keep_original else None
    del types, decider
    report("verify", 0, 1)
    if log.fusions or normalized:
        engine.verify(loaded.model, loaded.label, loaded)
    seconds["verify"] = next(clock)
    summary = FusionReport(
        target=target,
        patterns=tuple(p.name for p in chosen),
        fusions=tuple(log.fusions),
        rejected=tuple(log.rejected),
        nodes_before=log.nodes_before,
        nodes_after=log.nodes_after,
        seconds=seconds,
        normalized=(*normalized, *warnings),
    )
    return FusionResult(loaded.model, summary, loaded, warnings, original, kept_types)


def _copy_of(loaded: LoadedModel) -> LoadedModel:
    """A copy of the loaded model (the passes rewrite `loaded.model` in place)."""
    model = onnx.ModelProto()
    model.CopyFrom(loaded.model)
    return replace(loaded, model=model)


def _no_progress(stage: str, done: int, total: int) -> None:
    return None


def pattern_names(names: str | Sequence[str] | None) -> list[str] | None:
    """Pattern names as a list: a string is one name or a comma-separated list of them (a bare
    string would otherwise be taken letter by letter)."""
    if names is None:
        return None
    if isinstance(names, str):
        return [n.strip() for n in names.split(",") if n.strip()]
    return list(names)


def check_target(target: str) -> None:
    """Fail early, with the known names, on a target that does not exist or does not load."""
    from .kernels.npu.machine import TargetError, load_target

    try:
        load_target(target)
    except TargetError as exc:
        raise UsageError(str(exc)) from exc


def _default_decider(
    target: str,
    force: bool,
    cache: bool | str | os.PathLike[str] | None,
    dims: Mapping[str, int] | None = None,
) -> Decider:
    """The target's cost model: prices each match and supplies its tiling.

    `cache`: None or True = the user's tuning cache, False = none, a path = that file.
    """
    from .costmodel import CostModelDecider

    decider: Decider = CostModelDecider.for_target(target, force=force, cache=cache, dims=dims)
    return decider


@dataclass(frozen=True)
class Inspection:
    """Every match and every near-miss of the enabled patterns, with reasons."""

    matches: tuple[FusionRecord, ...]
    near_misses: tuple[RejectionRecord, ...]

    def to_dict(self) -> dict[str, Any]:
        """In the JSON vocabulary of `fuse`: `fusions` (the matches) and `near_misses`."""
        return {
            "fusions": [fusion_dict(m) for m in self.matches],
            "near_misses": [near_miss_dict(r) for r in self.near_misses],
        }


def inspect(
    model: ModelSource,
    patterns: str | Sequence[str] | None = None,
    disable: str | Sequence[str] = (),
    target: str = DEFAULT_TARGET,
    *,
    dims: Mapping[str, int] | None = None,
) -> Inspection:
    """What `fuse` would do, without keeping the result: matches and near-misses (`dims`:
    sizes of named symbolic dims for the cost model, as in `fuse`)."""
    result = fuse(model, patterns, disable, target, dims=dims)
    return Inspection(result.report.fusions, result.report.rejected)


def validate(
    original: ModelSource | LoadedModel | FusionResult | UnfuseResult,
    fused: ModelSource | FusionResult | UnfuseResult,
    *,
    runs: int = 3,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
    inputs: Mapping[str, Any] | None = None,
    dim_size: int = 3,
    kernel: str = "npu",
    target: str = DEFAULT_TARGET,
    dims: Mapping[str, int] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ValidationResult:
    """Run both models in onnxruntime on the same inputs; compare every output and fused node.

    Symbolic dims take `dims[name]`, else `dim_size`. A `FusionResult` or `UnfuseResult` may be
    passed as is (its external tensors are found next to its input; a fusion report names the
    nodes each fused node replaced). `validate(result.original, result)` on a result fused with
    `keep_original=True` reuses the input fuse read and its types: nothing is loaded again.
    Raises only fuser's errors (`ValidationInputError`, `ValidationRunError`, `UsageError`,
    `ModelLoadError`), never a raw onnxruntime or numpy exception.

    >>> result = validate("model.onnx", "model.fused.onnx", kernel="reference")  # doctest: +SKIP
    >>> result.ok, [c.message() for c in result.failures]                       # doctest: +SKIP
    """
    from .validation import validate_models

    replaced = {
        f.node: f.replaced
        for r in (original, fused)
        if isinstance(r, FusionResult)
        for f in r.report.fusions
    }
    types = None  # the original's inferred types, when fuse kept them with the original
    if isinstance(fused, FusionResult) and fused.original is not None:
        types = fused.original_types if original is fused.original else None
    return validate_models(
        as_loaded(original),
        as_loaded(fused),
        runs=runs,
        seed=seed,
        rtol=rtol,
        atol=atol,
        inputs=inputs,
        dim_size=dim_size,
        dims=dims,
        kernel=kernel,
        target=target,
        replaced=replaced,
        types=types,
        progress=progress,
    )


def as_loaded(model: ModelSource | LoadedModel | FusionResult | UnfuseResult) -> LoadedModel:
    """The model as loaded; a result's external tensors are found next to its input."""
    from .unfused import UnfuseResult

    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, FusionResult | UnfuseResult):
        source = model.source
        return LoadedModel(model.model, source.base_dir, f"fused {source.label}", source.external)
    return load_model(model)
