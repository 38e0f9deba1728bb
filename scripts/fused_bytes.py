"""Fuse every exported fixture (and any extra model files) and write the fused bytes' digests,
so two builds of fuser can be compared byte for byte: a pure speed or memory change must not
change one output byte.

    python scripts/fused_bytes.py OUT.json [EXTRA.onnx ...]      # with this build
    python scripts/fused_bytes.py --compare A.json B.json         # exit 1 if any digest differs

Each model is fused with a fresh, empty tuning cache (as `--cache NEW_FILE`), functions on, the
default target; the model file and any external data file are digested.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

EXPORTED = Path(__file__).resolve().parent.parent / "tests" / "data" / "exported"


def digests(models: list[Path]) -> dict[str, str]:
    from fuser.api import fuse

    found: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="fused-bytes-") as folder:
        work = Path(folder)
        for i, model in enumerate(models):
            out = work / f"{i}.onnx"
            result = fuse(str(model), cache=str(work / f"cache-{i}.json"))
            written = result.save(out)
            digest = hashlib.sha256()
            for path in written:
                digest.update(path.read_bytes())
            found[model.name] = f"{digest.hexdigest()} fusions={len(result.report.fusions)}"
    return found


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compare"]:
        a, b = (json.loads(Path(p).read_text()) for p in argv[1:3])
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        for name in differ:
            print(f"differs: {name}: {a.get(name)} vs {b.get(name)}")
        print(f"{len(a.keys() & b.keys()) - len(differ)} identical, {len(differ)} differ")
        return 1 if differ else 0
    models = sorted(EXPORTED.glob("*.onnx")) + [Path(p) for p in argv[1:]]
    Path(argv[0]).write_text(json.dumps(digests(models), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
