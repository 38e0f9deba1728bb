"""What matching alone costs: each pattern's `match` plus the matcher's universal rules, per
anchor, on one model, without deciding or rewriting. Times are CPU seconds of this process
(on a shared machine wall time also counts waiting for a core).

Loads and types the model as `fuser fuse` does, indexes it once, then runs every pattern over
every anchor node of the untouched graph (so a Conv that a real pass would fuse is matched once
here too) and prints, per pattern: anchors visited, matches, rejections, total seconds (median
of --repeat passes) and microseconds per anchor. Use it with `python -m cProfile` to see where
a pattern spends its time; `benchmarks/fuse_speed.py` times the whole process.

    python benchmarks/match_speed.py MODEL.onnx [--repeat 3] [--patterns conv_bn_relu,...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from fuser import engine
from fuser.api import pattern_names
from fuser.graph import GraphIndex, TypeTable
from fuser.matcher import check_match
from fuser.modelio import load_model
from fuser.pattern import Match, Pattern, Rejection
from fuser.registry import select


@dataclass(frozen=True)
class PassCount:
    """One pattern's pass over the anchors: how many of each answer, and its seconds."""

    anchors: int
    matches: int
    rejections: int
    seconds: float


def one_pass(index: GraphIndex, pattern: Pattern) -> PassCount:
    anchors = set(pattern.anchors)
    visited = matches = rejections = 0
    start = time.process_time()
    for node_id in list(index.live_nodes()):
        node = index.nodes[node_id]
        if (node.domain or "", node.op_type) not in anchors:
            continue
        visited += 1
        found = pattern.match(index, node_id)
        if isinstance(found, Match):
            found = check_match(index, found)
        if isinstance(found, Match):
            matches += 1
        elif isinstance(found, Rejection):
            rejections += 1
    return PassCount(visited, matches, rejections, time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--patterns", default=None, help="comma-separated (default: all)")
    args = parser.parse_args()
    loaded = load_model(args.model)
    checked = engine.check_and_infer(loaded)
    types = checked[0] if checked is not None else engine.infer_types(loaded.model)
    opsets = engine.opset_map(loaded.model)
    table = Table(title=f"matching alone: {args.model}", title_justify="left")
    columns = ("pattern", "anchors", "matches", "rejections", "CPU s (median)", "CPU us/anchor")
    for column in columns:
        table.add_column(column, justify="left" if column == "pattern" else "right")
    total = 0.0
    for pattern in select(pattern_names(args.patterns)):
        runs = []
        for _ in range(args.repeat):
            # a fresh index each time: constants and types are cached per index
            index = GraphIndex.build(
                loaded.model.graph, loaded, opsets, types.get("") or TypeTable()
            )
            runs.append(one_pass(index, pattern))
        seconds = statistics.median(r.seconds for r in runs)
        total += seconds
        r = runs[0]
        per = 1e6 * seconds / r.anchors if r.anchors else 0.0
        table.add_row(
            pattern.name,
            str(r.anchors),
            str(r.matches),
            str(r.rejections),
            f"{seconds:.3f}",
            f"{per:.1f}",
        )
    table.add_row("all", "", "", "", f"{total:.3f}", "")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
