"""Fingerprints of what `fuse` makes of some models, to show a change kept behaviour exactly.

For each model: the sha256 of the fused model's deterministic serialization, the number of
fusions, every rejection (pattern, nodes, reason, value) and every fusion's notes. Run it on the
tree before a change (writing a JSON file), then after with `--against` that file: it prints
each model whose fingerprint changed and exits 1, or says all are identical. No tuning cache is
read or written (`cache=False`), so both runs price from scratch.

    python scripts/fused_digests.py before.json tests/data/exported/*.onnx
    python scripts/fused_digests.py after.json tests/data/exported/*.onnx --against before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from fuser.api import fuse


def digest(path: str) -> dict[str, Any]:
    """The fingerprint of fusing the model at `path`."""
    result = fuse(path, cache=False)
    data = result.model.SerializeToString(deterministic=True)
    report = result.report
    return {
        "sha256": hashlib.sha256(data).hexdigest(),
        "fusions": len(report.fusions),
        "rejected": [[r.pattern, list(r.nodes), r.reason, r.value] for r in report.rejected],
        "notes": [list(f.notes) for f in report.fusions],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write the fingerprints to")
    parser.add_argument("models", nargs="+")
    parser.add_argument("--against", type=Path, help="fingerprints to compare with")
    args = parser.parse_args()
    found = {}
    for model in args.models:
        found[Path(model).name] = entry = digest(model)
        print(f"{model}: {entry['sha256'][:12]} {entry['fusions']} fusions, "
              f"{len(entry['rejected'])} rejections", flush=True)  # fmt: skip
    args.out.write_text(json.dumps(found, indent=1, sort_keys=True))
    if args.against is None:
        return 0
    before = json.loads(args.against.read_text())
    changed = [name for name in found if before.get(name) != found[name]]
    missing = [name for name in found if name not in before]
    for name in changed:
        print(f"changed: {name}" + (" (not in the earlier file)" if name in missing else ""))
    if not changed:
        print(f"all {len(found)} identical to {args.against}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
