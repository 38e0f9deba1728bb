"""How long fusing takes, next to onnxruntime's optimizer and the onnxscript rewriter.

Builds CNN and transformer-style graphs of about 1k, 10k and 100k nodes (fuser.models.synthetic),
writes each to disk, then times whole processes on the same file, in the same run:
  fuser       `fuser fuse IN -o OUT` (load + match + rewrite + verify + save, import included)
  ort         onnxruntime InferenceSession with ORT_ENABLE_EXTENDED and optimized_model_filepath
  onnxscript  onnx.load + onnxscript.rewriter.rewrite (default rules) + onnx.save
Each cell is the median of --repeat runs (onnxscript: one run, and only up to --onnxscript-max
nodes, because it takes minutes beyond that). Prints a table and the targets.

`--bodies` adds what the function bodies cost (fuser writes one per fused op variant, so that
a plain onnxruntime runs the fused model): file size and stock `InferenceSession` load time of
the original, the fused model with bodies, and the fused model without (`--no-functions`,
which stock onnxruntime refuses; its load time through fuser's plugin is shown instead).
`--no-speed` skips the timing table.

    python benchmarks/fuse_speed.py [--sizes 1000,10000,100000] [--repeat 3] [--bodies]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
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
ONNXSCRIPT_SCRIPT = """
import sys, onnx
from onnxscript import rewriter
model = onnx.load(sys.argv[1])
onnx.save(rewriter.rewrite(model), sys.argv[2])
"""


def timed(cmd: list[str], cwd: Path, limit: float | None = None) -> float | None:
    """Wall seconds of a whole process; None if it ran past `limit` (then it is stopped)."""
    start = time.perf_counter()
    try:
        result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return None
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed: {result.stderr.strip().splitlines()[-1:]}")
    return elapsed


def median_of(cmd: list[str], cwd: Path, repeat: int, limit: float | None = None) -> float | None:
    """Median of `repeat` runs; None (not waited for) as soon as one runs past `limit`."""
    times = []
    for _ in range(repeat):
        t = timed(cmd, cwd, limit)
        if t is None:
            return None
        times.append(t)
    return statistics.median(times)


def show(seconds: float | None, limit: float) -> str:
    return f"> {limit:.0f}" if seconds is None else f"{seconds:.2f}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    return f"{a / b:.2f}"


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
    builders = {"cnn": cnn_graph, "transformer": transformer_graph}
    fuser_cmd = [sys.executable, "-m", "fuser.cli", "fuse"]
    with tempfile.TemporaryDirectory(prefix="fuse-bodies-") as folder:
        work = Path(folder)
        for family in families:
            for size in sizes:
                model = builders[family](size)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--families", default="cnn,transformer")
    parser.add_argument("--onnxscript-max", type=int, default=10000)
    parser.add_argument(
        "--limit",
        type=float,
        default=300.0,
        help="seconds an anchor may take before it is reported as '> limit'",
    )
    parser.add_argument("--bodies", action="store_true", help="add the function-body cost table")
    parser.add_argument("--no-speed", action="store_true", help="skip the fuse-time table")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    console = Console(width=160)
    if args.bodies:
        console.print(bodies_table(args.families.split(","), sizes, args.repeat))
    if args.no_speed:
        return
    fuser_cmd = [sys.executable, "-m", "fuser.cli", "fuse"]
    table = Table(title="time to fuse a model file (whole process, median)", title_justify="left")
    for column in (
        "model",
        "nodes",
        "fused",
        "fuser s",
        "ort s",
        "onnxscript s",
        "fuser/ort",
        "onnxscript/fuser",
    ):
        table.add_column(column, justify="left" if column == "model" else "right")
    fuser_times: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="fuse-speed-") as folder:
        work = Path(folder)
        builders = {"cnn": cnn_graph, "transformer": transformer_graph}
        for family in args.families.split(","):
            build = builders[family]
            for size in sizes:
                model = build(size)
                path = work / f"{family}_{size}.onnx"
                onnx.save(model, path)
                nodes = len(model.graph.node)
                t_fuser = median_of(
                    [*fuser_cmd, str(path), "-o", str(work / "out.onnx")], work, args.repeat
                )
                assert t_fuser is not None
                fused_nodes = len(onnx.load(work / "out.onnx").graph.node)
                ort_cmd = [sys.executable, "-c", ORT_SCRIPT, str(path), str(work / "ort.onnx")]
                t_ort = median_of(ort_cmd, work, args.repeat, args.limit)
                t_os = None
                ran_os = size <= args.onnxscript_max
                if ran_os:
                    os_cmd = [
                        sys.executable,
                        "-c",
                        ONNXSCRIPT_SCRIPT,
                        str(path),
                        str(work / "os.onnx"),
                    ]
                    t_os = timed(os_cmd, work, args.limit)
                fuser_times[(family, size)] = t_fuser
                table.add_row(
                    family,
                    str(nodes),
                    f"{nodes} -> {fused_nodes}",
                    f"{t_fuser:.2f}",
                    show(t_ort, args.limit),
                    show(t_os, args.limit) if ran_os else "not run",
                    ratio(t_fuser, t_ort),
                    ratio(t_os, t_fuser)
                    if t_os is not None
                    else (f"> {args.limit / t_fuser:.0f}" if ran_os else "-"),
                )
                console.print(
                    f"[dim]{family} {size}: fuser {t_fuser:.2f}s ort {show(t_ort, args.limit)}s[/]"
                )
    console.print(table)
    for family in ("cnn", "transformer"):
        if (family, 10000) in fuser_times and (family, 100000) in fuser_times:
            growth = fuser_times[(family, 100000)] / fuser_times[(family, 10000)]
            console.print(f"{family}: 100k/10k fuser time ratio {growth:.1f} (target < 12: linear)")
    console.print("targets at 10k nodes: fuser/ort <= 1.0; onnxscript/fuser >= 10")


if __name__ == "__main__":
    main()
