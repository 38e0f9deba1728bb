"""The last step of `fuse`: make the output model self-describing and portable.

- function bodies (`fuser.functions`), unless asked for the bare ops;
- `producer_name`/`producer_version` = fuser and its version;
- one `metadata_props` entry, key `fuser`, a JSON object with the fuser version, target,
  options, and the producer the input came from (kept when a fused model is fused again, so
  fusing stays idempotent).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import onnx

from . import functions

PRODUCER = "fuser"
METADATA_KEY = "fuser"


@dataclass(frozen=True)
class FuseOptions:
    """What `fuse` was asked to do (recorded in the model's metadata)."""

    target: str
    patterns: tuple[str, ...]
    force: bool
    functions: bool


def finish(
    model: onnx.ModelProto,
    elem_types: functions.ElemTypes,
    options: FuseOptions,
) -> None:
    """Attach (or strip) function bodies and stamp provenance, in place."""
    if options.functions:
        functions.attach(model, elem_types)
    else:
        functions.strip(model)
    stamp(model, options)


def stamp(model: onnx.ModelProto, options: FuseOptions) -> None:
    """producer_name/producer_version and the `fuser` metadata entry (replacing an older one)."""
    from . import __version__

    previous = provenance(model)
    if previous is not None and model.producer_name == PRODUCER:
        source = previous.get("source_producer", "")
    else:
        source = " ".join(p for p in (model.producer_name, model.producer_version) if p)
    entry = {
        "version": __version__,
        "target": options.target,
        "options": {
            "patterns": list(options.patterns),
            "force": options.force,
            "functions": options.functions,
        },
        "source_producer": source,
    }
    model.producer_name, model.producer_version = PRODUCER, __version__
    kept = [p for p in model.metadata_props if p.key != METADATA_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=METADATA_KEY, value=json.dumps(entry, sort_keys=True))


def provenance(model: onnx.ModelProto) -> dict[str, object] | None:
    """The `fuser` metadata entry of a model, or None if it has none (or an unreadable one)."""
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            try:
                found = json.loads(prop.value)
            except ValueError:
                return None
            return found if isinstance(found, dict) else None
    return None


def describe(pattern: str, replaced: Sequence[str]) -> str:
    """A fused node's doc_string: the pattern and the nodes it replaced."""
    return f"fuser pattern '{pattern}' replaced: {', '.join(replaced)}"
