"""How long fusing a model file takes, and how much memory, next to the I/O floor and onnxruntime.

Builds CNN, transformer and mixed (both, side by side in one graph) models of about 10k and
100k nodes (fuser.models.synthetic), writes each to disk, then runs whole processes on the same
file, one after another:
  fuser   `fuser fuse IN -o OUT -q --cache FRESH` (import + load + match + decide + rewrite +
          verify + save), with a cold tuning cache: a new, empty cache file on every run
  floor   a bare `python -c "import onnx; m = onnx.load(IN); onnx.save(m, OUT)"`: what any tool
          that reads and writes the file pays
  ort     onnxruntime's optimizer: InferenceSession with ORT_ENABLE_EXTENDED writing
          optimized_model_filepath
Each cell is the median of --repeat runs of wall seconds; peak RSS is each process's own
(os.wait4's rusage of that child), and CPU seconds (user + sys) are shown beside the wall
time, since on a shared machine wall time also counts waiting for a core. Prints fuser/floor,
fuser/ort, the RSS ratio fuser/floor and the 100k/10k growth; the targets: fuser within 2x of
the floor, RSS within 1.5x, growth under 11.

fuser's own modules are byte-compiled before the first run (`compile_package`), as an installed
package's are and as onnx's are for the floor: where PYTHONDONTWRITEBYTECODE is set (or the
tree was never imported) every fuser process would otherwise compile its ~125 modules from
source, about 0.2 s of CPU that no installed fuser pays.

A real-CNN row runs the same three on an exported EfficientNet-style model (`--cnn-file`,
default tests/data/exported/efficientnet-dynamo18.onnx; where that file does not exist yet,
tests/data/exported/cnn-dynamo18.onnx, with a note).

`--bodies` adds what the function bodies cost (fuser writes one per fused op variant, so that
a plain onnxruntime runs the fused model): file size and stock `InferenceSession` load time of
the original, the fused model with bodies, and the fused model without (`--no-functions`,
which stock onnxruntime refuses; its load time through fuser's plugin is shown instead).
`--no-speed` skips the timing table; `--onnxscript` adds the onnxscript rewriter (default rules)
up to --onnxscript-max nodes.

    python benchmarks/fuse_speed.py [--sizes 10000,100000] [--families cnn,transformer,mixed]
                                    [--repeat 3] [--cnn-file PATH] [--bodies]
"""

from __future__ import annotations

import argparse
import compileall
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
from fuser.models.synthetic import cnn_graph, transformer_graph
from rich.console import Console
from rich.table import Table

ORT_SCRIPT = """
import sys, onnxruntime as ort
so = ort.SessionOptions()
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
so.optimized_model_filepath = sys.argv[2]
ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
"""
FLOOR_SCRIPT = """
import sys, onnx
model = onnx.load(sys.argv[1])
onnx.save(model, sys.argv[2])
"""
ONNXSCRIPT_SCRIPT = """
import sys, onnx
from onnxscript import rewriter
model = onnx.load(sys.argv[1])
onnx.save(rewriter.rewrite(model), sys.argv[2])
"""


def load_seconds(path: Path, repeat: int, plugin: bool = False) -> float | str:
    """Median seconds to create an InferenceSession on `path` (in this process), or why not."""
    import onnxruntime

    from fuser.ort import session

    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            if plugin:
                session(str(path), kernel="reference")
            else:
                onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as exc:  # stock onnxruntime has no kernel for a bare fused op
            reason = str(exc).split(":")[-1].strip()
            return "refused (" + (reason.split(" is not")[0] + " unknown)" if reason else ")")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bodies_table(families: list[str], sizes: list[int], repeat: int) -> Table:
    """Size and load time: original, fused with bodies, fused without."""
    table = Table(
        title="function bodies: file size and onnxruntime load time (median)",
        title_justify="left",
    )
    for column in ("model", "nodes", "file", "bytes", "vs original", "stock load s", "plugin s"):
        table.add_column(column, justify="left" if column in ("model", "file") else "right")
    fuser_cmd = [sys.executable, "-m", "fuser.cli", "fuse"]
    with tempfile.TemporaryDirectory(prefix="fuse-bodies-") as folder:
        work = Path(folder)
        for family in families:
            for size in sizes:
                model = BUILDERS[family](size)
                original = work / f"{family}_{size}.onnx"
                onnx.save(model, original)
                files = {"original": original}
                for label, extra in (
                    ("fused + bodies", []),
                    ("fused, --no-functions", ["--no-functions"]),
                ):
                    files[label] = work / f"{family}_{size}_{len(extra)}.fused.onnx"
                    subprocess.run(
                        [*fuser_cmd, str(original), "-o", str(files[label]), *extra],
                        check=True,
                        capture_output=True,
                        cwd=work,
                    )
                base = original.stat().st_size
                for label, path in files.items():
                    stock = load_seconds(path, repeat)
                    plugin = load_seconds(path, repeat, plugin=True) if label != "original" else "-"
                    table.add_row(
                        family,
                        str(len(model.graph.node)),
                        label,
                        str(path.stat().st_size),
                        f"{path.stat().st_size / base:.3f}",
                        stock if isinstance(stock, str) else f"{stock:.3f}",
                        plugin if isinstance(plugin, str) else f"{plugin:.3f}",
                    )
    return table


@dataclass(frozen=True)
class Run:
    """One whole process: wall and CPU seconds, peak RSS in MB (medians over repeats)."""

    wall: float
    cpu: float
    rss_mb: float


def run_process(cmd: list[str], cwd: Path, limit: float | None = None) -> Run | None:
    """Run `cmd` to its end; its own wall time, CPU time and peak RSS (os.wait4 reports that
    child's rusage alone). None if it ran past `limit` seconds (then it is killed)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = None if limit is None else start + limit
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if deadline is not None and time.perf_counter() > deadline:
            proc.kill()
            os.wait4(proc.pid, 0)
            return None
        time.sleep(0.01)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed: {stderr.strip().splitlines()[-1:]}")
    # ru_maxrss is in kilobytes on Linux
    return Run(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)


def median_run(
    make_cmd: Callable[[int], list[str]], cwd: Path, repeat: int, limit: float | None = None
) -> Run | None:
    """Medians of `repeat` runs (`make_cmd(i)` gives run i's command); None as soon as one
    runs past `limit`, or when `repeat` is 0 (not measured)."""
    if repeat == 0:
        return None
    runs = []
    for i in range(repeat):
        found = run_process(make_cmd(i), cwd, limit)
        if found is None:
            return None
        runs.append(found)
    return Run(
        statistics.median(r.wall for r in runs),
        statistics.median(r.cpu for r in runs),
        statistics.median(r.rss_mb for r in runs),
    )


def compile_package() -> list[str]:
    """Byte-compile fuser's package folders (patterns, kernels and models are folders of their
    own in the tree): `py_compile` writes `__pycache__` even under PYTHONDONTWRITEBYTECODE,
    which only stops the import system from writing it. Returns the folders compiled."""
    names = ("fuser", "fuser.kernels", "fuser.models", "fuser.patterns")
    folders = sorted({p for name in names for p in importlib.import_module(name).__path__})
    for folder in folders:
        compileall.compile_dir(folder, quiet=1)
    return folders


def mixed_graph(n_nodes: int) -> onnx.ModelProto:
    """A CNN and a transformer stack of n_nodes/2 each, side by side in one graph (two inputs,
    two outputs): a model whose fusions come from every family at once."""
    cnn = cnn_graph(n_nodes // 2, opset=17)
    stack = transformer_graph(n_nodes - n_nodes // 2)
    graph = cnn.graph
    names = {o for n in graph.node for o in n.output} | {t.name for t in graph.initializer}
    clash = names & ({o for n in stack.graph.node for o in n.output}
                     | {t.name for t in stack.graph.initializer})  # fmt: skip
    if clash:
        raise ValueError(f"mixed graph: value names in both halves, e.g. {sorted(clash)[:3]}")
    graph.name = "synthetic_mixed"
    for field in ("node", "input", "output", "initializer", "value_info"):
        getattr(graph, field).extend(getattr(stack.graph, field))
    return cnn


BUILDERS: dict[str, Callable[[int], onnx.ModelProto]] = {
    "cnn": cnn_graph,
    "transformer": transformer_graph,
    "mixed": mixed_graph,
}
EXPORTED = Path(__file__).resolve().parent.parent / "tests" / "data" / "exported"
REAL_CNN = EXPORTED / "efficientnet-dynamo18.onnx"
REAL_CNN_FALLBACK = EXPORTED / "cnn-dynamo18.onnx"


# Models are built and read in child processes: a child's peak RSS starts from what its parent
# held when it forked, so a parent that once held a 100k-node model would inflate every
# measurement after it.
BUILD_SCRIPT = """
import sys, onnx
sys.path.insert(0, sys.argv[4])
from fuse_speed import BUILDERS
onnx.save(BUILDERS[sys.argv[1]](int(sys.argv[2])), sys.argv[3])
"""
COUNT_SCRIPT = """
import sys, onnx
print(len(onnx.load(sys.argv[1], load_external_data=False).graph.node))
"""


def build_in_child(family: str, size: int, path: Path) -> None:
    here = str(Path(__file__).resolve().parent)
    subprocess.run(
        [sys.executable, "-c", BUILD_SCRIPT, family, str(size), str(path), here], check=True
    )


def node_count(path: Path) -> int:
    done = subprocess.run(
        [sys.executable, "-c", COUNT_SCRIPT, str(path)], check=True, capture_output=True, text=True
    )
    return int(done.stdout.strip())


def cell(run: Run | None, limit: float, measured: bool = True) -> str:
    if not measured:
        return "-"
    return f"> {limit:.0f}" if run is None else f"{run.wall:.2f} ({run.cpu:.2f})"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}"


@dataclass(frozen=True)
class Row:
    label: str
    nodes: int
    fused_nodes: int
    fuser: Run
    floor: Run
    ort: Run | None
    onnxscript: Run | None = None


def measure(label: str, path: Path, work: Path, args: argparse.Namespace, onnxscript: bool) -> Row:
    out = work / "out.onnx"
    fuser_cmd = [sys.executable, "-m", "fuser.cli", "fuse", str(path), "-o", str(out), "-q"]

    def fuser_run(i: int) -> list[str]:  # a cold tuning cache: a fresh file per run
        return [*fuser_cmd, "--cache", str(work / f"cache-{label}-{i}-{time.time_ns()}.json")]

    fuser = median_run(fuser_run, work, args.repeat)
    assert fuser is not None
    fused_nodes = node_count(out)
    floor = median_run(
        lambda i: [sys.executable, "-c", FLOOR_SCRIPT, str(path), str(work / "floor.onnx")],
        work,
        args.repeat,
    )
    assert floor is not None
    ort = median_run(
        lambda i: [sys.executable, "-c", ORT_SCRIPT, str(path), str(work / "ort.onnx")],
        work,
        args.ort_repeat,
        args.limit,
    )
    script = None
    if onnxscript:
        cmd = [sys.executable, "-c", ONNXSCRIPT_SCRIPT, str(path), str(work / "os.onnx")]
        script = median_run(lambda i: cmd, work, 1, args.limit)
    nodes = node_count(path)
    return Row(label, nodes, fused_nodes, fuser, floor, ort, script)


def speed_table(
    rows: list[Row], limit: float, onnxscript: bool, ort_measured: bool = True
) -> Table:
    table = Table(
        title="fuse a model file: whole processes, median wall s (CPU s), peak RSS MB",
        title_justify="left",
    )
    columns = ["model", "nodes", "nodes after", "fuser s", "floor s", "ort s", "fuser/floor",
               "fuser/ort", "cpu fuser/floor", "fuser MB", "floor MB", "ort MB",
               "RSS fuser/floor"]  # fmt: skip
    if onnxscript:
        columns.append("onnxscript s")
    for column in columns:
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        cells = [
            r.label,
            str(r.nodes),
            str(r.fused_nodes),
            cell(r.fuser, limit),
            cell(r.floor, limit),
            cell(r.ort, limit, ort_measured),
            ratio(r.fuser.wall, r.floor.wall),
            ratio(r.fuser.wall, r.ort.wall if r.ort else None),
            ratio(r.fuser.cpu, r.floor.cpu),
            f"{r.fuser.rss_mb:.0f}",
            f"{r.floor.rss_mb:.0f}",
            f"{r.ort.rss_mb:.0f}" if r.ort else "-",
            ratio(r.fuser.rss_mb, r.floor.rss_mb),
        ]
        if onnxscript:
            cells.append(cell(r.onnxscript, limit))
        table.add_row(*cells)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--ort-repeat", type=int, default=1, help="runs of onnxruntime's optimizer (0: not run)"
    )
    parser.add_argument("--families", default="cnn,transformer,mixed")
    parser.add_argument("--cnn-file", type=Path, default=REAL_CNN, help="the real-CNN row's model")
    parser.add_argument("--no-real-cnn", action="store_true", help="skip the real-CNN row")
    parser.add_argument("--onnxscript", action="store_true", help="add the onnxscript rewriter")
    parser.add_argument("--onnxscript-max", type=int, default=10000)
    parser.add_argument(
        "--limit",
        type=float,
        default=600.0,
        help="seconds an anchor may take before it is reported as '> limit'",
    )
    parser.add_argument("--bodies", action="store_true", help="add the function-body cost table")
    parser.add_argument("--no-speed", action="store_true", help="skip the fuse-time table")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    families = args.families.split(",")
    console = Console(width=200)
    if args.bodies:
        console.print(bodies_table([f for f in families if f != "mixed"], sizes, args.repeat))
    if args.no_speed:
        return
    compiled = compile_package()
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        console.print(f"[dim]PYTHONDONTWRITEBYTECODE is set: byte-compiled {len(compiled)} "
                      "fuser folders first, as an installed fuser has them[/]")  # fmt: skip
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="fuse-speed-") as folder:
        work = Path(folder)
        for family in families:
            for size in sizes:
                path = work / f"{family}_{size}.onnx"
                build_in_child(family, size, path)
                row = measure(f"{family} {size // 1000}k", path, work, args,
                              args.onnxscript and size <= args.onnxscript_max)  # fmt: skip
                rows.append(row)
                fuser, floor = cell(row.fuser, args.limit), cell(row.floor, args.limit)
                ort = cell(row.ort, args.limit, args.ort_repeat > 0)
                console.print(f"[dim]{row.label}: fuser {fuser} floor {floor} ort {ort}[/]")
        if not args.no_real_cnn:
            real = args.cnn_file
            if not real.exists() and real == REAL_CNN:
                console.print(f"note: {REAL_CNN.name} is not in this tree yet; the real-CNN row "
                              f"uses {REAL_CNN_FALLBACK.name} instead")  # fmt: skip
                real = REAL_CNN_FALLBACK
            rows.append(measure(f"real: {real.name}", real, work, args, False))
    console.print(speed_table(rows, args.limit, args.onnxscript, args.ort_repeat > 0))
    by_label = {r.label: r for r in rows}
    for family in families:
        small, large = by_label.get(f"{family} 10k"), by_label.get(f"{family} 100k")
        if small and large:
            console.print(
                f"{family}: 100k/10k growth: fuser wall {large.fuser.wall / small.fuser.wall:.1f}"
                f" (CPU {large.fuser.cpu / small.fuser.cpu:.1f}), floor wall "
                f"{large.floor.wall / small.floor.wall:.1f}"
            )
    console.print(
        "targets: fuser/floor <= 2 (cold tuning cache), RSS fuser/floor <= 1.5, growth < 11"
    )


if __name__ == "__main__":
    main()
