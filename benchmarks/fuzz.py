"""Generated trap graphs, fused and judged: how many come out ok, unfused, wrong, invalid or crash.

Each seed gives one small model (tests/fuzz/fuzz_graphs.py: every fusion family, in
surroundings with traps); each is fused with every match accepted and judged
(tests/fuzz/fuzz_check.py: full check, determinism, idempotence, input unchanged, and equality
with the original in onnxruntime on five input sets). Prints the outcomes, the fused instances
per family and every case that is not ok, with its seed (rerun one with --first SEED --n 1).

    python benchmarks/fuzz.py [--n 2000] [--first 0] [--kernel npu|reference] [--jobs J]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "fuzz"))

from fuzz_check import OUTCOMES, Result, check_case, tally
from fuzz_graphs import FAMILIES, make_case
from rich.console import Console
from rich.table import Table

BAD = ("wrong", "invalid", "crash")


def _run_seeds(seeds: list[int], kernel: str) -> list[tuple[Result, list[str]]]:
    """Each seed's result and the families its case planted (one worker's share)."""
    out = []
    for seed in seeds:
        case = make_case(seed)
        out.append((check_case(case, kernel=kernel), case.planted))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="number of graphs")
    parser.add_argument("--first", type=int, default=0, help="first seed")
    parser.add_argument("--kernel", default="npu", choices=("npu", "reference"))
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    args = parser.parse_args()
    console = Console()
    start = time.perf_counter()
    seeds = list(range(args.first, args.first + args.n))
    chunks = [seeds[i : i + 25] for i in range(0, len(seeds), 25)]
    work = partial(_run_seeds, kernel=args.kernel)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            done = list(pool.map(work, chunks))
    else:
        done = [work(chunk) for chunk in chunks]
    results = [r for chunk in done for r, _ in chunk]
    planted = Counter(f for chunk in done for _, families in chunk for f in families)
    elapsed = time.perf_counter() - start
    outcomes, fused = tally(results)

    table = Table(title=f"{args.n} graphs, seeds {args.first}..{args.first + args.n - 1}, "
                  f"kernel {args.kernel}, {elapsed:.0f} s")  # fmt: skip
    table.add_column("outcome")
    table.add_column("graphs", justify="right")
    for outcome in OUTCOMES:
        table.add_row(outcome, str(outcomes[outcome]))
    console.print(table)

    families = Table(title="planted chains per family")
    families.add_column("family")
    families.add_column("planted", justify="right")
    for family in FAMILIES:
        families.add_row(family, str(planted[family]))
    console.print(families)
    patterns = Table(title="fused instances per pattern")
    patterns.add_column("pattern")
    patterns.add_column("fused", justify="right")
    for pattern in sorted(fused):
        patterns.add_row(pattern, str(fused[pattern]))
    console.print(patterns)
    ties = sum(r.near_ties for r in results)
    console.print(f"TopK index differences judged near ties (fuzz_ties): {ties}")
    for r in results:
        if r.outcome in BAD or r.outcome == "discarded":
            console.print(f"seed {r.seed}: {r.outcome}: {r.detail}", markup=False)
    return 1 if any(outcomes[o] for o in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())
