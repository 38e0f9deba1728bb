"""`unfuse` (module `unfused`: a module named `unfuse` would shadow `fuser.unfuse`, the function,
once imported): a fused model back to plain ONNX, each fused node replaced by its function body.

The result has no `fuser` node, function or opset import, and computes what the original did
(folded weights stay folded: it is equal to the original, not identical). A fused model written
without bodies (`--no-functions`) gets them first, so it unfuses the same way.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from . import engine, functions
from .modelio import LoadedModel, ModelSource, save_model, too_large_for_one_protobuf

if TYPE_CHECKING:
    from .api import FusionResult


@dataclass(frozen=True)
class UnfuseResult:
    """The plain model and what was inlined (`inlined`: fused op type -> nodes replaced)."""

    model: onnx.ModelProto
    source: LoadedModel
    inlined: dict[str, int]

    def save(self, path: str | os.PathLike[str], *, external: bool | None = None) -> list[Path]:
        """Write the model atomically (external tensors streamed next to it); the files."""
        if external is None:
            external = self.source.external or too_large_for_one_protobuf(self.model)
        return save_model(self.model, path, source=self.source, external=external)


def unfuse(model: ModelSource | FusionResult) -> UnfuseResult:
    """Replace every fused node of `model` (path, bytes, ModelProto or FusionResult; never
    modified) by its body.

    >>> plain = unfuse("model.fused.onnx")                # doctest: +SKIP
    >>> plain.save("model.plain.onnx")                    # doctest: +SKIP
    """
    from .api import as_loaded

    loaded = as_loaded(model)
    engine.check_structure(loaded)
    counts = Counter(n.op_type for n in functions.fused_nodes(loaded.model))
    types = engine.infer_types(loaded.model)
    plain = functions.inline(loaded.model, types)
    engine.verify(plain, loaded.label, loaded)
    return UnfuseResult(plain, loaded, dict(sorted(counts.items())))
