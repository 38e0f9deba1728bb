"""The grouped-gate spellings (fuzz_graphs.gate_forms) generated, fused and judged: nothing
wrong, invalid or crashed; the forms fuse and the traps are refused. Quick profile by default;
`FUSER_GATE_FORMS_N=500 pytest tests/fuzz/test_gate_forms_fuzz.py` for a long one."""

from __future__ import annotations

import os

from fuzz_check import check_case
from fuzz_graphs import make_gate_forms_case

N = int(os.environ.get("FUSER_GATE_FORMS_N", 40))
FIRST = 50_000  # away from the main fuzz's seeds


def test_gate_forms_fuse_correctly() -> None:
    results = [check_case(make_gate_forms_case(seed)) for seed in range(FIRST, FIRST + N)]
    bad = [f"seed {r.seed}: {r.outcome}: {r.detail}" for r in results
           if r.outcome in ("wrong", "invalid", "crash")]  # fmt: skip
    assert not bad, "\n".join(bad)
    outcomes = [r.outcome for r in results]
    fused = sum(bool(r.fused.get("softmax_topk")) for r in results)
    assert outcomes.count("discarded") <= 0.1 * N, outcomes
    assert fused >= N // 3, (fused, outcomes)  # the spellings fuse
    assert fused < N, outcomes  # and some traps are refused
