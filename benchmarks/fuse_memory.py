"""Where a fuse's memory goes: resident memory stage by stage, in a fresh process per file.

Runs `fuser.api.fuse` and `FusionResult.save` (what `fuser fuse IN -o OUT -q` does, with a
cold tuning cache) and, at the end of each stage, reads /proc/self/status: VmRSS (resident
now) and VmHWM (the highest resident size since the stage began: the high-water mark is reset
by writing 5 to /proc/self/clear_refs as each stage starts). Stages:
  imports       import fuser, onnx, numpy (before the model is read)
  load          read the file (onnx.load)
  check+infer   normalize, onnx's checker and shape inference on the input, the type tables
  index         GraphIndex.build of the main graph (and the decider's set-up before it)
  pass NAME     each pattern pass (match, decide, rewrite), in the order fuse runs them
  write_back    the rewritten nodes written back into the graph proto
  finish        function bodies and provenance (fuser.finish)
  verify        the checker on the output
  save          writing the file (the result's model kept until then, as the CLI does)
Beside it, a `floor` row: a bare `onnx.load` + `onnx.save` process on the same file, its RSS
after load and its peak. The stage boundaries are found by wrapping the public functions fuse
calls (`load_model`, `check_and_infer`, `GraphIndex.build`, each pattern's `anchors`, `finish`,
`verify`): the process is otherwise the CLI's.

    python benchmarks/fuse_memory.py [FILE ...]      (default: the /tmp/ab graphs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_FILES = [
    f"/tmp/ab/{family}_{size}.onnx"
    for size in (10000, 100000)
    for family in ("cnn", "transformer", "mixed")
]

FLOOR_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[3])
from fuse_memory import Stages
stages = Stages()
import onnx
stages.mark("imports")
model = onnx.load(sys.argv[1])
stages.mark("load")
onnx.save(model, sys.argv[2])
stages.mark("save")
print(json.dumps(stages.rows))
"""


def _status() -> tuple[int, int]:
    """(VmRSS, VmHWM) in MB."""
    found: dict[str, int] = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) // 1024
    return found["VmRSS"], found["VmHWM"]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


class Stages:
    """Rows of (stage, RSS at its end, peak during it), in MB."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, int]] = []

    def mark(self, stage: str) -> None:
        rss, peak = _status()
        self.rows.append((stage, rss, peak))
        _reset_peak()


def _after(stages: Stages, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        stages.mark(name)
        return result

    return wrapped


class _MarkedPattern:
    """A pattern that marks the end of the stage before its pass when the pass begins."""

    def __init__(self, pattern: Any, stages: Stages, names: list[str]) -> None:
        self._pattern, self._stages, self._names = pattern, stages, names

    @property
    def anchors(self) -> Any:
        # the engine reads `anchors` once, as a pass starts: the previous stage ends here
        self._stages.mark(self._names[-1])
        self._names.append(f"pass {self._pattern.name}")
        return self._pattern.anchors

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pattern, name)


def run_one(path: str, out_dir: str) -> list[tuple[str, int, int]]:
    """Fuse and save `path` in this process, marking each stage."""
    _reset_peak()
    stages = Stages()
    from fuser import api, engine
    from fuser.graph import GraphIndex

    stages.mark("imports")
    names = ["before passes"]  # the stage a pass's start ends
    api.load_model = _after(stages, "load", api.load_model)  # type: ignore[attr-defined]
    engine.check_and_infer = _after(stages, "check+infer", engine.check_and_infer)
    build = GraphIndex.build.__func__  # type: ignore[attr-defined]

    def marked_build(cls: type[GraphIndex], *args: Any, **kwargs: Any) -> GraphIndex:
        index = build(cls, *args, **kwargs)
        if kwargs.get("outer") is None:
            stages.mark("index")
        return index

    GraphIndex.build = classmethod(marked_build)  # type: ignore[method-assign, assignment]
    select = api.select  # type: ignore[attr-defined]
    api.select = lambda *a, **k: [  # type: ignore[attr-defined]
        _MarkedPattern(p, stages, names) for p in select(*a, **k)
    ]
    write_back = GraphIndex.write_back

    def marked_write_back(index: GraphIndex) -> None:
        stages.mark(names[-1])  # the last pass over this graph ends here
        names.append("after write_back")
        write_back(index)
        stages.mark("write_back")

    GraphIndex.write_back = marked_write_back  # type: ignore[method-assign]
    finish = api.finish  # type: ignore[attr-defined]

    def marked_finish(*args: Any, **kwargs: Any) -> None:
        stages.mark("after write_back")
        finish(*args, **kwargs)
        stages.mark("finish")

    api.finish = marked_finish  # type: ignore[attr-defined]
    engine.verify = _after(stages, "verify", engine.verify)
    cache = os.path.join(out_dir, "cache.sqlite")
    result = api.fuse(path, cache=cache)
    out = os.path.join(out_dir, "out.onnx")
    result.save(out)
    stages.mark("save")
    return stages.rows


def _rows_of(command: list[str]) -> Rows:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
    return [tuple(r) for r in json.loads(done.stdout.strip().splitlines()[-1])]  # type: ignore[misc]


Rows = list[tuple[str, int, int]]


def _table(path: str, fuse_rows: Rows, floor: Rows) -> None:
    print(f"\n{Path(path).name}")
    print(f"  {'stage':<28} {'RSS after':>10} {'peak in stage':>14}")
    for stage, rss, peak in fuse_rows:
        print(f"  {stage:<28} {rss:>7} MB {peak:>11} MB")
    fuse_peak = max(p for _, _, p in fuse_rows)
    floor_peak = max(p for _, _, p in floor)
    floor_load = next(r for s, r, _ in floor if s == "load")
    print(
        f"  fuse peak {fuse_peak} MB | floor (load+save) peak {floor_peak} MB, after load "
        f"{floor_load} MB | ratio {fuse_peak / floor_peak:.2f} (target 1.5)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", default=DEFAULT_FILES)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one file, print JSON
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.out)))
        return
    here = str(Path(__file__).resolve().parent)
    for path in args.files:
        if not os.path.exists(path):
            print(f"\n{path}: missing (benchmarks/fuse_speed.py builds the /tmp/ab graphs)")
            continue
        with tempfile.TemporaryDirectory(prefix="fuse_memory-") as tmp:
            rows = _rows_of([sys.executable, __file__, "--one", path, "--out", tmp])
            floor = _rows_of(
                [sys.executable, "-c", FLOOR_SCRIPT, path, os.path.join(tmp, "floor.onnx"), here]
            )
        _table(path, rows, floor)


if __name__ == "__main__":
    main()
