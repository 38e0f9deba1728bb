"""onnx's checker and shape inference on the model fuser reads and on the model it writes.

The input is checked as `checkview` presents it (what onnxruntime accepts beyond the spec is
seen as onnx's tools understand it), and its value types come from shape inference; the
rewritten model is checked again before anything is written (`verify`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import onnx
from google.protobuf.message import Message

from .checkview import NodeScan, checker_view, inference_view, scan_nodes
from .errors import FusionError, ModelLoadError
from .graph import TypeTable, may_hold_subgraphs
from .heap import collector_paused, release_freed
from .modelio import LoadedModel, unchanged_on_disk
from .pieces import (
    PieceRefusedError,
    check_pieces,
    graph_value_types,
    infer_checked_pieces,
    infer_pieces,
    plan,
)
from .registry import ensure_fused_ops_registered


def check_structure(loaded: LoadedModel) -> tuple[str, ...]:
    """onnx's checker on the model as `checkview` presents it (external tensors unread,
    onnxruntime's legacy ops typed); one line on failure. Returns what the checker would have
    refused but onnxruntime runs (warnings: fuser fuses such a model anyway)."""
    view = checker_view(loaded.model, loaded)
    try:
        onnx.checker.check_model(view.model, full_check=False)
    except onnx.checker.ValidationError as exc:
        raise ModelLoadError(f"{loaded.label}: invalid ONNX model: {_first_line(exc)}") from exc
    finally:
        release_freed()
    return view.warnings


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def infer_types(model: onnx.ModelProto) -> dict[str, TypeTable]:
    """Element types and shapes of every value, per graph path (shape inference on a copy)."""
    ensure_fused_ops_registered()
    scan = scan_nodes(model)
    types = _infer_view(inference_view(model, scan), model, scan.nested)
    release_freed()
    return types


def _infer_view(
    view: onnx.ModelProto | bytes | str, model: onnx.ModelProto, nested: bool
) -> dict[str, TypeTable]:
    """Types from shape inference on `view` (a model, its serialization, or the path of a file
    holding it); `model`'s own annotations where inference fails. `nested`: whether a node of
    the view may hold a subgraph (`NodeScan.nested`)."""
    if isinstance(view, str) and not nested:
        values = _inferred_values_by_path(view)
        if values is not None:
            table = TypeTable()
            for names, kinds in values:
                table.add_types(names, kinds)
            table.add_initializers(model.graph.initializer)
            return {"": table}
    inferred = _inferred_by_path(view) if isinstance(view, str) and nested else None
    if inferred is None:
        if isinstance(view, str):
            with open(view, "rb") as handle:
                view = handle.read()
        try:
            inferred = onnx.shape_inference.infer_shapes(view, check_type=False, strict_mode=False)
        except Exception:  # inference is best-effort here; patterns refuse what they cannot type
            inferred = model
    types: dict[str, TypeTable] = {}
    if inferred is model:
        return _annotated(model)
    if nested:
        _collect_types(inferred.graph, "", types)
        return types
    return {"": _values_table(inferred.graph, model)}


def _annotated(model: onnx.ModelProto) -> dict[str, TypeTable]:
    """The types `model` itself declares, per graph path (where inference failed)."""
    types: dict[str, TypeTable] = {}
    _collect_types(model.graph, "", types)
    return types


def _values_table(values: Message, model: onnx.ModelProto) -> TypeTable:
    """The main graph's types: the inferred graph's inputs, outputs and value infos (kept as
    bytes: nothing of the inferred copy stays alive), then the initializers' types from the
    model's own tensors."""
    table = TypeTable()
    for protos in (values.input, values.output, values.value_info):
        table.add_protos(protos)
    table.add_initializers(model.graph.initializer)
    return table


def _inferred_values_by_path(path: str) -> list[tuple[list[str], list[bytes | None]]] | None:
    """Shape inference from file to file, and of its result only the main graph's inputs,
    outputs and value infos read back, as names and types (`graph_value_types`: the nodes and
    tensors are not made into Python messages); None where that fails for any reason."""
    with _anonymous_file() as out:
        if out is None:
            return None
        try:
            onnx.shape_inference.infer_shapes_path(path, out, check_type=False, strict_mode=False)
            with open(out, "rb") as handle:
                data = handle.read()
            return graph_value_types(data)
        except Exception:
            return None


def _inferred_by_path(path: str) -> onnx.ModelProto | None:
    """Shape inference from file to file (the result never crosses into Python as bytes);
    None where that fails for any reason (then the caller infers from bytes)."""
    with _anonymous_file() as out:
        if out is None:
            return None
        try:
            onnx.shape_inference.infer_shapes_path(path, out, check_type=False, strict_mode=False)
            return onnx.load_model(out, load_external_data=False)
        except Exception:
            return None


@contextlib.contextmanager
def _anonymous_file() -> Iterator[str | None]:
    """A path to a new, empty file that has no name on disk (Linux's O_TMPFILE, reached through
    /proc/self/fd): onnx's C++ tools read and write it by path, and it vanishes with its handle
    however the process ends. None where the system has no such files."""
    flag = getattr(os, "O_TMPFILE", 0)
    fd = None
    if flag and os.path.isdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fd = os.open(tempfile.gettempdir(), flag | os.O_RDWR, 0o600)
    try:
        yield None if fd is None else f"/proc/self/fd/{fd}"
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def serialized(model: onnx.ModelProto) -> Iterator[str | bytes]:
    """`model` serialized for onnx's C++ tools: the path of an anonymous file holding it (see
    `_anonymous_file`), or the bytes where there is none. Given bytes, a tool holds them, and
    shape inference its result as bytes too, beside its own parse of the model: at a large
    model's check and inference, the peak of a fuse. Given a path, neither is in memory."""
    data = model.SerializeToString()
    del model  # the caller may let go of it (a view of the model) while the tools run
    with _anonymous_file() as path:
        if path is not None:
            try:
                with open(path, "wb") as handle:
                    handle.write(data)
            except OSError:
                path = None
        if path is None:
            yield data
            return
        del data
        yield path


def check_and_infer(
    loaded: LoadedModel, *, as_read: bool = False, scan: NodeScan | None = None
) -> tuple[dict[str, TypeTable], tuple[str, ...]] | None:
    """`check_structure` and `infer_types` on one serialization of the model's view, when
    both tools see the same view: every graph input and output typed (then the checker needs
    no placeholder and there is no output for inference to fill in). None otherwise: call
    them one by one. Serializing a large model costs about as much as either tool's work.

    `as_read`: the caller has not changed `loaded.model` since it was parsed. Then, where the
    view is the model itself, no tensor is external and its file is as it was read, the tools
    read that file: the same model, not serialized again. `scan`: `scan_nodes` of
    `loaded.model` as it is now, if made already."""
    with collector_paused():  # a few objects per value of the graph, no cycles
        return _check_and_infer(loaded, as_read, scan)


def _check_and_infer(
    loaded: LoadedModel, as_read: bool, scan: NodeScan | None
) -> tuple[dict[str, TypeTable], tuple[str, ...]] | None:
    view = checker_view(loaded.model, loaded, scan)
    if view.warnings:
        return None
    ensure_fused_ops_registered()
    # Large: a piece at a time, each element serialized on its own (not cut from the file's
    # bytes: holding them and their parse raised the save peak of a 100k-node transformer
    # by 8 MB, for no measurable time).
    if (steps := plan(view.model, view.nested)) is not None:
        try:
            try:
                table = infer_pieces(view.model, loaded.model, steps)
            except PieceRefusedError:  # the whole graph's check has the verdict and the message
                _check_whole(view.model, loaded.label)
                table = infer_checked_pieces(view.model, loaded.model, steps)
        finally:
            del view, steps  # the plan holds the graph's bytes: let go before the trim
            release_freed()
        return ({"": table} if table is not None else _annotated(loaded.model)), ()
    nested = view.nested
    # Not with external data: the checker resolves it against the folder of the file it reads.
    direct = as_read and not loaded.external and view.model is loaded.model
    direct = direct and _utf8(loaded.path) and unchanged_on_disk(loaded)
    source = contextlib.nullcontext(str(loaded.path)) if direct else serialized(view.model)
    with source as data:
        del view  # a copy of the model when it hides heavy tensors: no longer needed
        try:
            onnx.checker.check_model(data, full_check=False)
        except onnx.checker.ValidationError as exc:
            raise ModelLoadError(f"{loaded.label}: invalid ONNX model: {_first_line(exc)}") from exc
        types = _infer_view(data, loaded.model, nested)
    release_freed()  # the C++ tools' copies of the model, freed but kept by the allocator
    return types, ()


def _check_whole(model: onnx.ModelProto, label: str | None = None) -> None:
    """onnx's checker on the whole of `model`; its ValidationError, or with `label` (the
    input's) a ModelLoadError naming it."""
    with serialized(model) as data:
        try:
            onnx.checker.check_model(data, full_check=False)
        except onnx.checker.ValidationError as exc:
            if label is None:
                raise
            raise ModelLoadError(f"{label}: invalid ONNX model: {_first_line(exc)}") from exc


def _utf8(path: os.PathLike[str] | None) -> bool:
    """Whether onnx's C++ tools can be given `path` (a name with bytes that are not UTF-8 is
    refused by their bindings)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return path is not None


def _collect_types(graph: onnx.GraphProto, path: str, out: dict[str, TypeTable]) -> None:
    table = TypeTable()
    for values in (graph.input, graph.output, graph.value_info, graph.initializer):
        table.add_protos(values)
    out[path] = table
    for node in graph.node:
        if not may_hold_subgraphs(node):
            continue
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for i, sub in enumerate(subs):
                _collect_types(sub, sub_path(path, node, attr.name, i, len(subs)), out)


def sub_path(path: str, node: onnx.NodeProto, attr: str, i: int, n: int) -> str:
    """How type tables name a subgraph (the engine and the plugin walk them too)."""
    name = node.name or node.op_type
    suffix = f"{attr}[{i}]" if n > 1 else attr
    return f"{path}/{name}.{suffix}" if path else f"{name}.{suffix}"


def verify(model: onnx.ModelProto, label: str, source: LoadedModel | None = None) -> None:
    """The checker on the rewritten model, seen as the input was (`checkview`; `source`: the
    input, whose folder holds the external data it still refers to): the output is never less
    valid than the input. Each fused node's shape inference was checked against the
    original graph when it was made; a failure here is fuser's bug, so say so."""
    try:
        _check_output(model, source)
    except Exception as exc:
        raise FusionError(
            f"{label}: the fused model failed verification ({_first_line(exc)}); nothing was "
            "written. This is a bug in fuser: please report it with the model"
        ) from exc
    finally:
        release_freed()


def _check_output(model: onnx.ModelProto, source: LoadedModel | None) -> None:
    """`verify`'s check (its view and plan let go of on return, before the trim)."""
    view = checker_view(model, source)
    steps = plan(view.model, view.nested, check_only=True)
    if steps is not None:  # large: a piece at a time
        try:
            check_pieces(view.model, steps)
        except PieceRefusedError:  # the whole graph's check has the verdict and the message
            del steps
            _check_whole(view.model)
    else:
        _check_whole(view.model)
