"""Write tests/data/ort_optimized/: exported fixtures rewritten by onnxruntime's own transformer
optimizer, which writes RMSNorm as ONNX-domain `SimplifiedLayerNormalization` (issue 8).

`optimize_model(model_type="bert", opt_level=0)`: the optimizer's Python graph fusions alone
(opt_level 1+ also runs onnxruntime's session optimizer, whose version check imports torch).
Runs offline, needs only onnxruntime. Rerun to regenerate; do not edit the outputs by hand.

    python scripts/ort_optimized_fixtures.py
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnxruntime.transformers.fusion_options import FusionOptions
from onnxruntime.transformers.optimizer import optimize_model

ROOT = Path(__file__).resolve().parent.parent
EXPORTED = ROOT / "tests" / "data" / "exported"
OUT = ROOT / "tests" / "data" / "ort_optimized"


@dataclass(frozen=True)
class Fixture:
    """One optimized model: `name`.onnx from exported `source`.onnx."""

    name: str
    source: str
    skip_layer_norm: bool  # the optimizer's default: fold residual Adds into SkipSLN


FIXTURES = (
    # The optimizer's defaults: 4 com.microsoft SkipSimplifiedLayerNormalization (residual Add
    # folded in, not an RMSNorm -> Linear fuser matches) and the first norm as ONNX-domain SLN.
    Fixture("llama-ortopt-ts14", "llama-ts14", skip_layer_norm=True),
    # Skip fusion off: all 5 RMSNorms as ONNX-domain SLN, each read by MatMuls.
    Fixture("llama-ortopt-noskip-ts14", "llama-ts14", skip_layer_norm=False),
)


def build(fixture: Fixture) -> Path:
    options = FusionOptions("bert")
    options.enable_skip_layer_norm = fixture.skip_layer_norm
    optimized = optimize_model(
        str(EXPORTED / f"{fixture.source}.onnx"),
        model_type="bert",
        opt_level=0,
        use_gpu=False,
        optimization_options=options,
    )
    path = OUT / f"{fixture.name}.onnx"
    optimized.save_model_to_file(str(path))  # as the optimizer's users save (adds its opsets)
    return path


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for fixture in FIXTURES:
        path = build(fixture)
        model = onnx.load(path)
        norms = collections.Counter(
            f"{n.domain or 'ai.onnx'}.{n.op_type}"
            for n in model.graph.node
            if "LayerNormalization" in n.op_type
        )
        print(f"{path.name}: {path.stat().st_size // 1024} KB, {dict(norms)}")


if __name__ == "__main__":
    main()
