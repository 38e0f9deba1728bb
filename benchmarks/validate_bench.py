"""Does `validate` catch broken fusions, and what does it cost on small and large models?

1. Mutation table: every models/ example and exported fixture is fused (every valid match), then
   broken at one fused node at a time (`fuser.mutants`: weight x1.02, bias +0.05, epsilon
   changed, a 0/1 switch flipped), and validated (reference kernel, 2 runs). Per family: mutants
   made, caught, and how many graph outputs alone would have caught (what validate compared
   before per-node proof).
2. Cost: time, CPU time and peak RSS of `fuser validate` (a whole process, import included)
   with both kernels on a small model (example:cnn-edge), a ResNet-50-sized CNN fused as
   `fuser fuse` writes it (tilings stored on the nodes) and fused with every match but no
   tilings (the NPU kernel then searches them at run time), and with --big a BERT of ~2.5 GB of
   weights (external data).
3. Where validate's time goes, per step of one run (`ValidationResult.seconds`, the plugin's
   share from `fuser.plugin_clock`): onnxruntime sessions, the original's runs, the fused model
   and the isolated fused nodes split into the fused ops' numeric compute (numpy `reference`, or
   the NPU program's tile arithmetic), the simulator scheduling the program, the run-time
   tiling search and the rest (session, float64 bridge), and the comparison.

    python benchmarks/validate_bench.py [--max-per-family N] [--big] [--skip-mutants]
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from fuser.models import EXAMPLES, get_example
from rich.console import Console
from rich.table import Table

from fuser import plugin_clock
from fuser.api import fuse, validate
from fuser.decide import AlwaysFuse
from fuser.modelio import load_model
from fuser.mutants import FAMILIES, mutants

ROOT = Path(__file__).resolve().parent.parent
console = Console(width=170)

# Run inside a child process: its own peak RSS and CPU time, the result's per-step seconds.
CHILD = """
import json, resource, sys, time
start = time.perf_counter()
from fuser.api import validate
result = validate(sys.argv[1], sys.argv[2], kernel=sys.argv[3], runs=int(sys.argv[4]),
                  dim_size=int(sys.argv[5]))
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"ok": result.ok, "wall": time.perf_counter() - start,
                  "cpu": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024,
                  "seconds": dict(result.seconds), "nodes": len({c.node for c in result.nodes})}))
"""


def models() -> list[tuple[str, onnx.ModelProto]]:
    found = [(f"example:{name}", get_example(name)) for name in EXAMPLES]
    for path in sorted(glob.glob(str(ROOT / "tests/data/exported/*.onnx"))):
        found.append((Path(path).name, onnx.load(path)))
    return found


def mutation_table(max_per_family: int) -> None:
    made: Counter[str] = Counter()
    caught: Counter[str] = Counter()
    by_outputs: Counter[str] = Counter()
    missed: list[str] = []
    start = time.perf_counter()
    for label, original in models():
        fused = fuse(original, decider=AlwaysFuse())
        per_family: Counter[str] = Counter()
        for mutant in mutants(load_model(fused.model)):
            if per_family[mutant.family] >= max_per_family:
                continue
            per_family[mutant.family] += 1
            made[mutant.family] += 1
            result = validate(original, mutant.model, kernel="reference", runs=2)
            if not result.ok:
                caught[mutant.family] += 1
            else:
                missed.append(f"{label}: {mutant.node} {mutant.change}")
            if any(not c.ok for c in result.outputs):
                by_outputs[mutant.family] += 1
    table = Table(
        title=f"mutants caught ({len(models())} models, at most {max_per_family} per family "
        f"and model, {time.perf_counter() - start:.0f} s)",
        title_justify="left",
    )
    for column in ("family", "mutants", "caught", "%", "by graph outputs alone", "%"):
        table.add_column(column, justify="left" if column == "family" else "right")
    for family in [*FAMILIES, "all"]:
        n = sum(made.values()) if family == "all" else made[family]
        c = sum(caught.values()) if family == "all" else caught[family]
        o = sum(by_outputs.values()) if family == "all" else by_outputs[family]
        if n:
            table.add_row(
                family, str(n), str(c), f"{100 * c / n:.0f}", str(o), f"{100 * o / n:.0f}"
            )
    console.print(table)
    for line in missed:
        console.print(f"missed: {line}", highlight=False)


def resnet50_sized() -> onnx.ModelProto:
    from fuser.models.cnn import BlockSpec, resnet

    blocks: list[BlockSpec] = []
    for count, width, stride in ((3, 256, 1), (4, 512, 2), (6, 1024, 2), (3, 2048, 2)):
        for i in range(count):
            blocks.append(BlockSpec("bottleneck", width, stride=stride if i == 0 else 1))
    return resnet(batch=1, image_size=224, stem_channels=64, blocks=tuple(blocks), num_classes=1000)


def big_bert() -> onnx.ModelProto:
    from fuser.models.transformer import bert

    return bert(layers=12, hidden=2048, heads=16, intermediate=8192, vocab=64, max_positions=8)


def cost_table(big: bool, runs: int, only: list[str], repeat: int) -> None:
    cases: list[tuple[str, Callable[[], onnx.ModelProto], int, bool]] = [
        ("cnn-edge", lambda: get_example("cnn-edge"), 3, True),
        ("resnet50-sized", resnet50_sized, 1, False),
        ("resnet50 no tilings", resnet50_sized, 1, True),
    ]
    if big:
        cases.append(("bert 2.5 GB", big_bert, 2, True))
    if only:
        cases = [c for c in cases if c[0] in only]
    table = Table(
        title=f"fuser validate, whole process ({runs} runs; quickest of {repeat})",
        title_justify="left",
    )
    for column in ("model", "MB", "fused nodes", "kernel", "ok", "wall s", "cpu s",
                   "peak RSS MB", "RSS / size", "npu / reference wall"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("model", "kernel") else "right")
    steps = Table(
        title=f"where validate's time goes (s, {runs} runs). fused (f) and isolated nodes (i): "
        "numeric = numpy reference or the NPU program's tile arithmetic, simulate = scheduling "
        "the program, search = run-time tiling search, rest = onnxruntime session and bridge",
        title_justify="left",
    )
    for column in STEP_COLUMNS:
        steps.add_column(column, justify="left" if column in ("model", "kernel") else "right")
    with tempfile.TemporaryDirectory(prefix="validate-bench-") as folder:
        for name, build, dim_size, every_match in cases:
            original = Path(folder) / f"{name.replace(' ', '_').replace(',', '')}.onnx"
            fused_path = original.with_suffix(".fused.onnx")
            model = build()
            weights = sum(int(np.prod(t.dims)) * 4 for t in model.graph.initializer)
            external = weights > 1_500_000_000  # protobuf's 2 GB limit: ByteSize fails past it
            onnx.save(model, original, save_as_external_data=external,
                      location=original.name + ".data" if external else None)  # fmt: skip
            del model
            # Every match fused, no pricing: no tile_* attributes (the NPU kernel searches its
            # tilings at run time). Priced (as the CLI fuses): the chosen tilings are stored.
            fuse(str(original), decider=AlwaysFuse() if every_match else None).save(fused_path)
            size_mb = sum(p.stat().st_size for p in Path(folder).glob(original.name + "*")) / 2**20
            shown_mb = f"{size_mb:.0f}" if size_mb >= 1 else f"{size_mb:.2f}"
            walls: dict[str, float] = {}
            for kernel in ("reference", "npu"):
                found = [child(original, fused_path, kernel, runs, dim_size) for _ in range(repeat)]
                failed = [f for f in found if isinstance(f, str)]
                if failed:
                    table.add_row(name, shown_mb, "", kernel, f"failed: {failed[0]}")
                    continue
                # the quickest of the repeats: the machine's other load only ever adds time
                data = min((f for f in found if isinstance(f, dict)), key=lambda f: f["wall"])
                walls[kernel] = data["wall"]
                ratio = walls["npu"] / walls["reference"] if len(walls) == 2 else None
                table.add_row(
                    name, shown_mb, str(data["nodes"]), kernel,
                    "yes" if data["ok"] else "NO", f"{data['wall']:.1f}", f"{data['cpu']:.1f}",
                    f"{data['rss_mb']:.0f}",
                    f"{data['rss_mb'] / size_mb:.1f}" if size_mb >= 10 else "-",
                    f"{ratio:.2f}" if ratio is not None else "",
                )  # fmt: skip
                steps.add_row(name, kernel, *step_cells(data["seconds"]))
            for path in Path(folder).iterdir():
                path.unlink()
    console.print(table)
    console.print(steps)


def child(
    original: Path, fused: Path, kernel: str, runs: int, dim_size: int
) -> dict[str, Any] | str:
    """One `validate` in its own process: its measurements, or the last line of its error."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(original), str(fused), kernel, str(runs), str(dim_size)],
        capture_output=True, text=True, cwd=original.parent,
    )  # fmt: skip
    if done.returncode != 0:
        return " ".join(done.stderr.strip().splitlines()[-1:])
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


STEP_COLUMNS = (
    "model", "kernel", "plan", "sessions", "original x2", "fused", "f numeric", "f simulate",
    "f search", "f rest", "isolated", "i numeric", "i simulate", "i search", "stock", "compare",
)  # fmt: skip


def step_cells(seconds: Mapping[str, float]) -> list[str]:
    """The cells of STEP_COLUMNS after model and kernel, from `ValidationResult.seconds`."""

    def get(key: str) -> float:
        return seconds.get(key, 0.0)

    def split(step: str) -> list[float]:
        numeric = get(f"{step}: {plugin_clock.REFERENCE}")
        numeric += get(f"{step}: {plugin_clock.ARITHMETIC}")
        simulate = get(f"{step}: {plugin_clock.SIMULATE}")
        search = get(f"{step}: {plugin_clock.SEARCH}")
        return [get(step), numeric, simulate, search, get(step) - numeric - simulate - search]

    fused = split("fused")
    isolated = split("isolated nodes")[:4]
    values = [
        get("plan"), get("sessions"), get("original") + get("original perturbed"), *fused,
        *isolated, get("stock"), get("compare"),
    ]  # fmt: skip
    return [f"{v:.2f}" for v in values]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-per-family", type=int, default=1000, help="cap (default: all)")
    parser.add_argument("--runs", type=int, default=1, help="runs per validate in the cost table")
    parser.add_argument("--big", action="store_true", help="also a 2.5 GB model (external data)")
    parser.add_argument("--skip-mutants", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--only", action="append", default=[], help="cost table: this model")
    parser.add_argument("--repeat", type=int, default=1, help="cost table: quickest of N")
    args = parser.parse_args()
    if not args.skip_mutants:
        mutation_table(args.max_per_family)
    if not args.skip_cost:
        cost_table(args.big, args.runs, args.only, args.repeat)


if __name__ == "__main__":
    main()
