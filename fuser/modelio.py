"""Loading and saving ONNX models, external data included, without ever losing the input.

Large models (over protobuf's 2 GB limit) keep their tensors in external files. fuser never
loads those tensors into the model proto: the proto keeps its external references, single
tensors are read on demand (`read_tensor`), and saving streams each tensor's bytes into a data
file next to the output. So the whole model is never serialized into one protobuf.

Every external location is checked before anything is read: an absolute path or one that
resolves outside the model's folder is refused (path traversal), as is a missing data file.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from .errors import ModelLoadError, UnsafeExternalDataError

ModelSource = str | os.PathLike[str] | bytes | onnx.ModelProto

# Tensors at least this large go to the external data file when a model is saved with external
# data; smaller ones stay inline, as onnx's own converter does by default.
EXTERNAL_THRESHOLD_BYTES = 1024
# Above this size a model cannot be serialized as one protobuf; save switches to external data.
PROTOBUF_LIMIT_BYTES = 2_000_000_000


@dataclass(frozen=True)
class LoadedModel:
    """A model plus the folder its external-data locations are relative to (None if in memory)."""

    model: onnx.ModelProto
    base_dir: Path | None
    label: str  # how messages name the model: its path, or "<bytes>" / "<model>"
    external: bool = False  # whether any tensor lives in an external file (found at load)


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
            data = path.read_bytes()
        except OSError as exc:
            raise ModelLoadError(f"{name}: cannot read ({exc.strerror})") from exc
        loaded = LoadedModel(_parse(data, name), path.resolve().parent, name)
    external = check_external_locations(loaded)
    return LoadedModel(loaded.model, loaded.base_dir, loaded.label, external)


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


def check_external_locations(loaded: LoadedModel) -> bool:
    """Refuse absolute, escaping or missing external-data locations before reading any.

    Returns whether the model has external tensors at all.
    """
    found = False
    for tensor in iter_all_tensors(loaded.model.graph):
        if _is_external(tensor):
            _safe_location(loaded, tensor)
            found = True
    return found


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


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike[str],
    *,
    source: LoadedModel | None = None,
    external: bool | None = None,
) -> list[Path]:
    """Write `model` atomically to `path`; returns the files written.

    With external data (forced by `external=True`, or needed because the model references
    external tensors or exceeds protobuf's limit) the tensors go to `<name>.data` beside the
    output, streamed one by one from wherever they live now. Files are written to temporary
    names and renamed, so a failure leaves no partial output.
    """
    out = Path(path)
    if external is None:
        external = has_external_data(model) or model.ByteSize() > PROTOBUF_LIMIT_BYTES
    out.parent.mkdir(parents=True, exist_ok=True)
    if not external:
        atomic_write(out, model.SerializeToString(deterministic=True))
        return [out]

    data_name = out.name + ".data"
    staged = onnx.ModelProto()
    staged.CopyFrom(model)
    data_tmp = _temp_path(out.parent, data_name)
    try:
        with data_tmp.open("wb") as data_file:
            for tensor in iter_all_tensors(staged.graph):
                _externalize(tensor, data_file, data_name, source)
            data_file.flush()
            os.fsync(data_file.fileno())
        atomic_write(out, staged.SerializeToString(deterministic=True))
        os.replace(data_tmp, out.parent / data_name)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            data_tmp.unlink()
        raise
    return [out, out.parent / data_name]


def _externalize(
    tensor: onnx.TensorProto,
    data_file: BinaryIO,
    data_name: str,
    source: LoadedModel | None,
) -> None:
    if _is_external(tensor):
        if source is None:
            raise ModelLoadError(f"tensor '{tensor.name}' has external data but no source folder")
        raw = read_external_bytes(source, tensor)
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


def _temp_path(folder: Path, name: str) -> Path:
    handle, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    os.close(handle)
    return Path(tmp)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = _temp_path(path.parent, path.name)
    try:
        with tmp.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
