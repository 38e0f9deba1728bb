"""The fast search of LayerNormMatMul, RmsNormMatMul and AllGatherMatMul against the scalar
path, on the shapes `benchmarks/search_speed.py` times.

The fast path builds each space as numpy columns (`TilingColumns`: a tiling is made only for
a row that is read), bounds it in numpy, prices the few tilings the bound cannot rule out, and
finds the norm kernels' default tiling with `plan.estimate` over columns. The oracle is the
scalar path kept beside it: the walked spaces (`lnmm_space`, `agmm_space`, the unbounded
models' `space`), the scalar `plan.default_tiling`, the rule of thumb, every tiling priced by
`cost` and ranked as `search` ranks them. `best` must give the same best tiling, the same
predicted cycles, and the same runner-up's cycles.

The script's shapes are 26 per kernel; `FUSER_SEARCH_SHAPES` (default 4, spread over the
list) says how many are checked per kernel, 26 or more checks all of them (the closing note
quotes such a run).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fuser.kernels import search as ks
from fuser.kernels._columns import TilingColumns
from fuser.kernels.allgather_matmul.cost import _AgmmModel
from fuser.kernels.api import Tiling, TilingError
from fuser.kernels.layernorm_matmul.cost import _LnmmModel
from fuser.kernels.layernorm_matmul.plan import default_tiling
from fuser.kernels.layernorm_matmul.plan import problem as lnmm_problem
from fuser.kernels.npu.machine import load_target
from fuser.kernels.registry import get_kernel
from fuser.kernels.rmsnorm_matmul.cost import _RmsnmmModel
from fuser.kernels.rmsnorm_matmul.plan import problem as rms_problem

SHAPES = int(os.environ.get("FUSER_SEARCH_SHAPES", "4"))
B910 = load_target("ascend910b")
OPS = ["LayerNormMatMul", "RmsNormMatMul", "AllGatherMatMul"]
SCALAR = {"LayerNormMatMul": _LnmmModel, "RmsNormMatMul": _RmsnmmModel,
          "AllGatherMatMul": _AgmmModel}  # fmt: skip


def script_cases(op: str) -> list[tuple[str, str, tuple[Any, ...], dict[str, Any]]]:
    """The shapes `benchmarks/search_speed.py` times for `op`, `SHAPES` of them spread over
    the list (all of them from 26)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "search_speed.py"
    spec = importlib.util.spec_from_file_location("search_speed", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    mine = [(d, o, metas, attrs) for d, o, _, metas, attrs in script.cases() if o == op]
    assert len(mine) == 26, op
    if len(mine) <= SHAPES:
        return mine
    return [mine[int(i)] for i in np.linspace(0, len(mine) - 1, SHAPES).round()]


def scalar_default(op: str, metas: Any, attrs: dict[str, Any]) -> Tiling:
    """The kernel's default tiling by the scalar path (`plan.default_tiling`'s `fit` loops and
    scalar `estimate` for the norm kernels; AllGatherMatMul's is scalar already)."""
    if op == "AllGatherMatMul":
        kernel = get_kernel("fuser", op)
        assert kernel is not None
        return kernel.default_tiling(metas, attrs, B910)
    make = lnmm_problem if op == "LayerNormMatMul" else rms_problem
    return default_tiling(make(metas, attrs), B910)


def scalar_ranking(op: str, metas: Any, attrs: dict[str, Any]) -> list[ks.Priced]:
    """What `search` would rank with the scalar path: the walked space, the rule of thumb and
    the scalar default where they fit, every tiling priced."""
    model = SCALAR[op]()
    kernel = get_kernel("fuser", op)
    assert kernel is not None
    space = list(model.space(metas, attrs, B910))
    for t in (model.rule_of_thumb(metas, attrs, B910), scalar_default(op, metas, attrs)):
        if t is None or t in space:
            continue
        with contextlib.suppress(TilingError):
            kernel.check_tiling(metas, attrs, t, B910)
            space.append(t)
    return ks.ranked([ks.Priced(t, model.cost(metas, attrs, t, B910)) for t in space])


@pytest.mark.parametrize("op", OPS)
def test_fast_search_equals_the_scalar_path_on_the_benchmark_shapes(op: str) -> None:
    for domain, op_type, metas, attrs in script_cases(op):
        label = (op, [None if x is None else x.shape for x in metas])
        model, space = ks.candidate_space(domain, op_type, metas, attrs, B910)
        assert isinstance(space, TilingColumns), label  # one column representation
        assert ks.bound_of(model, space) is model, label
        want = scalar_ranking(op, metas, attrs)
        assert len(space) == len(want), label  # the same candidates, counted
        ks.clear_memo()
        fast = ks.best(domain, op_type, metas, attrs, B910)
        assert fast.best.tiling == want[0].tiling, label
        assert fast.best.cycles == want[0].cycles, label
        assert fast.runner_up is not None
        assert fast.runner_up.cycles == want[1].cycles, label
        assert len(fast.candidates) < len(space), label  # the bound pruned


@pytest.mark.parametrize("op", ["LayerNormMatMul", "RmsNormMatMul"])
def test_the_columns_default_tiling_is_the_scalar_one_on_the_benchmark_shapes(op: str) -> None:
    kernel = get_kernel("fuser", op)
    assert kernel is not None
    for _, _, metas, attrs in script_cases(op):
        assert kernel.default_tiling(metas, attrs, B910) == scalar_default(op, metas, attrs)
