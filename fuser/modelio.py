"""Loading and saving ONNX models, external data included, without ever losing the input.

Large models (over protobuf's 2 GB limit) keep their tensors in external files. fuser never
loads those tensors into the model proto: the proto keeps its external references, single
tensors are read on demand (`read_tensor`), and saving streams each tensor's bytes into a data
file next to the output. So the whole model is never serialized into one protobuf.

Every external location is checked before anything is read: an absolute path or one that
resolves outside the model's folder is refused (path traversal), as is a missing data file.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from .atomic import AtomicBatch
from .errors import ModelLoadError, OutputError, UnsafeExternalDataError

ModelSource = str | os.PathLike[str] | bytes | onnx.ModelProto

# Tensors at least this large go to the external data file when a model is saved with external
# data; smaller ones stay inline, as onnx's own converter does by default.
EXTERNAL_THRESHOLD_BYTES = 1024
# Above this size a model cannot be serialized as one protobuf; save switches to external data.
PROTOBUF_LIMIT_BYTES = 2_000_000_000


# What `too_large_for_one_protobuf` counts for each field's or element's tag and length: at
# most this many bytes.
KEY_BYTES = 16


def too_large_for_one_protobuf(model: onnx.ModelProto) -> bool:
    """Whether `model` serialized would pass `PROTOBUF_LIMIT_BYTES`. Summed a graph element at
    a time, stopping once past it: the model's own `ByteSize` serializes all of it into C
    memory that stays in the process (30-60 MB on the save peak of a 100k-node model)."""
    total = size_beside_elements(model)
    for gd, field in model.graph.ListFields():
        if gd.is_repeated and gd.message_type is not None:
            for element in field:
                total += KEY_BYTES + element.ByteSize()
                if total > PROTOBUF_LIMIT_BYTES:
                    return True
    return total > PROTOBUF_LIMIT_BYTES


def size_beside_elements(model: onnx.ModelProto) -> int:
    """`too_large_for_one_protobuf`'s count of all of `model` but its graph's repeated message
    elements (an inline save sums those as it serializes them: `save_model`)."""
    total = 0
    for fd, value in model.ListFields():
        if fd.name != "graph":
            repeated = fd.is_repeated and fd.message_type
            total += KEY_BYTES + (sum(v.ByteSize() for v in value) if repeated else len(str(value)))
            continue
        for gd, field in model.graph.ListFields():
            if not (gd.is_repeated and gd.message_type is not None):
                total += KEY_BYTES + len(str(field))
    return total


@dataclass(frozen=True)
class LoadedModel:
    """A model plus the folder its external-data locations are relative to (None if in memory)."""

    model: onnx.ModelProto
    base_dir: Path | None
    label: str  # how messages name the model: its path, or "<bytes>" / "<model>"
    external: bool = False  # whether any tensor lives in an external file (found at load)
    path: Path | None = None  # the file it was read from (resolved), None if in memory
    data_files: tuple[Path, ...] = ()  # its external data files (resolved), found at load
    # The file's (device, inode, size, mtime in ns) as it was read, if a regular file: whether
    # it still holds what was parsed (`unchanged_on_disk`).
    signature: tuple[int, int, int, int] | None = None


def load_model(source: ModelSource, *, label: str | None = None) -> LoadedModel:
    """Load a model from a path, serialized bytes or a ModelProto (copied, never modified).

    External tensors stay external; their locations are validated here.
    """
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        loaded = LoadedModel(model, None, label or "<model>")
    elif isinstance(source, bytes | bytearray):
        loaded = LoadedModel(_parse(bytes(source), label or "<bytes>"), None, label or "<bytes>")
    else:
        path = Path(source)
        name = label or str(path)
        if not path.exists():
            raise ModelLoadError(f"{name}: no such file")
        if path.is_dir():
            raise ModelLoadError(f"{name}: is a directory, not an ONNX file")
        try:
            with path.open("rb") as handle:
                signature = _signature(os.fstat(handle.fileno()))
                data = handle.read()
        except OSError as exc:
            raise ModelLoadError(f"{name}: cannot read ({exc.strerror})") from exc
        resolved = path.resolve()
        model = _parse(data, name)
        del data  # the parse is all that is kept
        loaded = LoadedModel(model, resolved.parent, name, path=resolved, signature=signature)
    data_files = external_files(loaded)
    return replace(loaded, external=bool(data_files), data_files=data_files)


def _signature(st: os.stat_result) -> tuple[int, int, int, int] | None:
    if not stat.S_ISREG(st.st_mode):
        return None  # a pipe or a device reads differently the second time
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def unchanged_on_disk(loaded: LoadedModel) -> bool:
    """Whether `loaded` came from a regular file that still is as it was read (same inode, size
    and modification time): onnx's C++ tools may then read that file instead of a new
    serialization of a model fuser has not changed."""
    if loaded.path is None or loaded.signature is None:
        return False
    try:
        return _signature(os.stat(loaded.path)) == loaded.signature
    except OSError:
        return False


def _parse(data: bytes, label: str) -> onnx.ModelProto:
    if not data:
        raise ModelLoadError(f"{label}: empty file, not an ONNX model")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(
            f"{label}: not a valid ONNX model (protobuf parse failed: {exc})"
        ) from exc
    if not model.HasField("graph") or not model.opset_import:
        raise ModelLoadError(f"{label}: not an ONNX model (no graph or no opset import)")
    return model


def iter_all_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto in a graph and its subgraphs: initializers and node attributes."""
    yield from graph.initializer
    for node in graph.node:
        yield from node_tensors(node)


def node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    """The tensors in one node's attributes (subgraphs' included), in `iter_all_tensors` order."""
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("g"):
            yield from iter_all_tensors(attr.g)
        for sub in attr.graphs:
            yield from iter_all_tensors(sub)


def _is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def _safe_location(loaded: LoadedModel, tensor: onnx.TensorProto) -> Path:
    info = _external_info(tensor)
    location = info.get("location", "")
    if loaded.base_dir is None:
        raise ModelLoadError(
            f"{loaded.label}: tensor '{tensor.name}' has external data '{location}' but the model "
            "was given in memory; pass a file path so its data can be found"
        )
    if not location or os.path.isabs(location):
        raise UnsafeExternalDataError(
            f"{loaded.label}: tensor '{tensor.name}' has external data location '{location}': "
            "must be a relative path inside the model's folder"
        )
    base = loaded.base_dir.resolve()
    target = (base / location).resolve()
    if target != base and base not in target.parents:
        raise UnsafeExternalDataError(
            f"{loaded.label}: tensor '{tensor.name}' has external data location '{location}' "
            "outside the model's folder; refusing to read it"
        )
    if not target.is_file():
        raise ModelLoadError(
            f"{loaded.label}: external data file '{location}' of tensor '{tensor.name}' not found"
        )
    return target


def external_files(loaded: LoadedModel) -> tuple[Path, ...]:
    """The model's external data files; absolute, escaping or missing locations are refused
    before any is read."""
    found: dict[Path, None] = {}
    for tensor in _external_tensors(loaded.model.graph):
        found[_safe_location(loaded, tensor)] = None
    return tuple(found)


# The standard ops whose schemas declare a tensor or graph attribute (at every opset of onnx
# 1.23; tests/unit/test_check_infer_direct.py checks it against onnx's schemas). onnx's checker
# refuses an attribute a schema does not declare, so a standard node of another type carries
# no tensor in a model fuser goes on with.
TENSOR_ATTRIBUTE_OPS = frozenset(
    {"Constant", "ConstantOfShape", "If", "Loop", "Scan", "SequenceMap"}
)


def _external_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """The external tensors of `iter_all_tensors`, reading the attributes only of nodes that
    may carry tensors (reading every node's attributes was most of a large model's load). A
    tensor this skips sits on a node the checker refuses, before anything is written; and
    every read of external data checks its location again (`read_external_bytes`)."""
    yield from (t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for node in graph.node:
        if node.op_type in TENSOR_ATTRIBUTE_OPS or node.domain not in ("", "ai.onnx"):
            yield from (t for t in node_tensors(node) if _is_external(t))


def read_external_bytes(loaded: LoadedModel, tensor: onnx.TensorProto) -> bytes:
    """The raw bytes of one external tensor, read from its (validated) data file."""
    path = _safe_location(loaded, tensor)
    info = _external_info(tensor)
    offset = int(info.get("offset", "0"))
    with path.open("rb") as handle:
        handle.seek(offset)
        if "length" in info:
            data = handle.read(int(info["length"]))
            if len(data) != int(info["length"]):
                raise ModelLoadError(
                    f"{loaded.label}: external data of tensor '{tensor.name}' is truncated"
                )
            return data
        return handle.read()


# Element types whose raw bytes numpy reads as they are (little-endian hosts, as onnx stores).
_RAW_DTYPES: dict[int, type[np.generic]] = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT8: np.uint8,
}


def read_tensor(loaded: LoadedModel, tensor: onnx.TensorProto) -> np.ndarray:
    """A tensor's value as numpy, reading external data on demand."""
    if not _is_external(tensor):
        dtype = _RAW_DTYPES.get(tensor.data_type)
        if dtype is not None and tensor.raw_data and sys.byteorder == "little":
            # numpy_helper.to_array's generality costs more than the fold it feeds.
            return np.frombuffer(tensor.raw_data, dtype=dtype).reshape(tuple(tensor.dims)).copy()
        return numpy_helper.to_array(tensor)
    inline = onnx.TensorProto()
    inline.CopyFrom(tensor)
    inline.ClearField("external_data")
    inline.data_location = onnx.TensorProto.DEFAULT
    inline.raw_data = read_external_bytes(loaded, tensor)
    return numpy_helper.to_array(inline)


def has_external_data(model: onnx.ModelProto) -> bool:
    return any(_is_external(t) for t in iter_all_tensors(model.graph))


def input_files(loaded: LoadedModel) -> list[Path]:
    """The files a loaded model was read from: its own file and its external data files."""
    return [*([loaded.path] if loaded.path is not None else []), *loaded.data_files]


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (also through symlinks and hard links)."""
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output_paths(targets: Sequence[Path], source: LoadedModel | None) -> None:
    """Refuse, before anything is written, an output that is a folder or one of the input's
    files (the input and its external data are never modified)."""
    for target in targets:
        if target.is_dir():
            raise OutputError(
                f"{target}: is a directory, not a file fuser can write; choose another output path"
            )
    if source is None:
        return
    for used in input_files(source):
        for target in targets:
            if _same_file(target, used):
                what = "the input" if used == source.path else "external data of the input"
                raise OutputError(
                    f"{target}: writing it would overwrite {used.name}, {what} "
                    f"{source.label}; choose another output path"
                )


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike[str],
    *,
    source: LoadedModel | None = None,
    external: bool | None = None,
    extra: Mapping[Path, bytes] | None = None,
    holds_external: bool | None = None,
) -> list[Path]:
    """Write `model` to `path`, plus the `extra` files, as one step; returns the files written.

    With external data (forced by `external=True`, or needed because the model references
    external tensors or exceeds protobuf's limit) the tensors go to `<name>.data` beside the
    output, streamed one by one from wherever they live now. All files appear together or not
    at all (see `fuser.atomic`); none of them may be a file of `source` (OutputError).
    `holds_external`: whether the model references external tensors, where the caller knows
    (else, with `external=None`, its tensors are looked at).
    """
    from .stream_save import streamable as _streamable  # stream_save reads this module
    from .stream_save import write_external as _write_external
    from .stream_save import write_inline as _write_inline

    out = Path(path)
    streamable = _streamable(model)  # then no second copy of the model is held
    limited = False  # inline unless past protobuf's limit, found as the model is written
    if external is None:
        external = has_external_data(model) if holds_external is None else holds_external
        if not external and streamable:
            limited = True  # the inline write sums the sizes anyway: no pass of its own
        elif not external:
            external = too_large_for_one_protobuf(model)
    data_path = out.with_name(out.name + ".data")
    others = list(extra or {})
    check_output_paths([out, *([data_path] if external else []), *others], source)
    try:
        with AtomicBatch() as batch:
            model_file = batch.open(out)
            data_file = batch.open(data_path) if external else None
            extra_files = [(batch.open(p), data) for p, data in (extra or {}).items()]
            if data_file is None and streamable:
                limit = PROTOBUF_LIMIT_BYTES if limited else None
                if not _write_inline(model, model_file, out.parent, limit):
                    # past the limit, nothing written yet: with external data after all
                    external = True
                    check_output_paths([data_path], source)
                    data_file = batch.open(data_path)
            if data_file is None:
                if not streamable:  # (a streamable one is written inline above)
                    model_file.write(model.SerializeToString(deterministic=True))
            elif streamable:
                _write_external(
                    model, model_file, data_file, data_path.name,
                    lambda tensor: _external_source_bytes(source, tensor), out.parent,
                )  # fmt: skip
            else:
                staged = onnx.ModelProto()
                staged.CopyFrom(model)
                for tensor in iter_all_tensors(staged.graph):
                    _externalize(tensor, data_file, data_path.name, source)
                model_file.write(staged.SerializeToString(deterministic=True))
            for handle, data in extra_files:
                handle.write(data)
            batch.commit()
    except OSError as exc:
        failed = Path(exc.filename) if exc.filename else out
        raise OutputError(f"{failed}: cannot write ({exc.strerror or exc})") from exc
    return [out, *([data_path] if external else []), *others]


def atomic_write(path: Path, data: bytes) -> None:
    """Write one file as one step (a kill or an error leaves no file and no temp file)."""
    save_files({path: data})


def save_files(files: Mapping[Path, bytes]) -> None:
    """Write several files as one step; OutputError names the one that cannot be written."""
    try:
        with AtomicBatch() as batch:
            handles = [(batch.open(p), data) for p, data in files.items()]
            for handle, data in handles:
                handle.write(data)
            batch.commit()
    except OSError as exc:
        failed = exc.filename or next(iter(files), "")
        raise OutputError(f"{failed}: cannot write ({exc.strerror or exc})") from exc


def _external_source_bytes(source: LoadedModel | None, tensor: onnx.TensorProto) -> bytes:
    """The data of an external tensor of the model being saved, from its source's folder."""
    if source is None:
        raise ModelLoadError(f"tensor '{tensor.name}' has external data but no source folder")
    return read_external_bytes(source, tensor)


def _externalize(
    tensor: onnx.TensorProto,
    data_file: BinaryIO,
    data_name: str,
    source: LoadedModel | None,
) -> None:
    if _is_external(tensor):
        raw = _external_source_bytes(source, tensor)
    elif tensor.HasField("raw_data") and len(tensor.raw_data) >= EXTERNAL_THRESHOLD_BYTES:
        raw = tensor.raw_data
    else:
        return
    offset = data_file.tell()
    data_file.write(raw)
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(len(raw)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
