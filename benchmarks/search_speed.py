"""Tiling-search speed: milliseconds per decision, per kernel, exhaustive against the fast search.

For every kernel with a cost model and the shapes of `cost_model_accuracy.py` (ConvBnRelu,
LayerNormMatMul, SoftmaxTopK, AllGatherMatMul; RmsNormMatMul at LayerNormMatMul's shapes, the
norm without its beta; the unfused Conv, MatMul and Gemm with its bias at the same shapes),
each search runs on a cold memo (`kernel_search.clear_memo()` before each):

- `exhaustive`: `search(...)`, every tiling of the space priced (what `fuse` ran before);
- `fast`: `best(...)`, the search `fuse` now runs (a kernel's vectorized lower bound prunes
  the space, the survivors are priced by the same cost function; kernels without a bound
  are priced exhaustively);
- `space`: building the space alone (both searches pay it);
- `priced`: how many tilings the fast search priced, of the space's size (median);
- `same`: how many shapes picked the tiling that pricing every tiling of the space picks (it
  must be all of them; `search` beams spaces past its exhaustive limit, `best` does not).

On a checkout without `best` (main before it) only the space and exhaustive columns are
measured: the before numbers.

Times are CPU milliseconds (the process's, so other load on the machine matters less), medians
over the shapes of each kernel (best of `--repeat` runs per shape).

`--fuse` times whole fuses instead, with a cold tuning cache (a fresh file per run): an
EfficientNet-B0-style CNN (`efficientnet`: MBConv stages of expand 1x1 Conv+BN+SiLU, depthwise
3x3 / 5x5 Conv+BN+SiLU, project 1x1 Conv+BN, at 224x224, symbolic batch; hundreds of distinct
Conv+BN decisions), `example:resnet` and the exported fixtures given. Per model: CPU seconds
of `fuse` in-process and of its decisions (`CostModelDecider.decide`), and the wall and CPU
seconds of a whole `fuser fuse` process. It runs on any checkout (it only needs `fuser.api`),
so the same script gives the before numbers on main.

    python benchmarks/search_speed.py [--target ascend910b] [--repeat 3] [--kernels Conv,MatMul]
    python benchmarks/search_speed.py --fuse [MODEL.onnx ...]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cost_model_accuracy as acc
from fuser.kernels import search as kernel_search
from fuser.kernels.npu.machine import load_target


def cases() -> list[tuple[str, str, str, tuple[Any, ...], dict[str, Any]]]:
    """(domain, op, label, metas, attrs) for every kernel benchmarked."""
    out: list[tuple[str, str, str, tuple[Any, ...], dict[str, Any]]] = []
    convs = acc.conv_cases()
    for c in convs:
        out.append(("fuser", c.op, c.label, c.metas, c.attrs))
    for c in convs:  # the unfused Conv of the same shape (no BN parameters, no relu)
        attrs = {k: v for k, v in c.attrs.items() if k not in ("relu", "epsilon")}
        out.append(("", "Conv", c.label, c.metas[:2], attrs))
    lnmm = acc.lnmm_cases()
    for c in lnmm:
        out.append(("fuser", c.op, c.label, c.metas, c.attrs))
    for c in lnmm:  # the same shapes as an RMSNorm (LLaMA's): X, gamma, the Linears
        rms = {"has_bias": c.attrs["has_bias"], "flatten": c.attrs["flatten"]}
        out.append(("fuser", "RmsNormMatMul", c.label, (*c.metas[:2], *c.metas[3:]), rms))
    for c in lnmm:  # the unfused MatMul of the first Linear
        x, w = c.metas[0], c.metas[3]
        assert x is not None
        assert w is not None
        rows = 1
        for d in x.shape[:-1]:
            rows *= d
        out.append(("", "MatMul", c.label, (acc.meta((rows, x.shape[-1])), w), {}))
    for c in lnmm:  # the same Linear as an ONNX Gemm with its bias (C)
        x, w = c.metas[0], c.metas[3]
        assert x is not None
        assert w is not None
        rows = math.prod(x.shape[:-1])
        bias = acc.meta((w.shape[-1],))
        out.append(("", "Gemm", c.label, (acc.meta((rows, x.shape[-1])), w, bias), {}))
    for c in (*acc.softmax_topk_cases(), *acc.allgather_cases()):
        out.append(("fuser", c.op, c.label, c.metas, c.attrs))
    return out


def _timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, value = float("inf"), None
    clear = getattr(kernel_search, "clear_memo", lambda: None)  # main before `best`: no memo
    for _ in range(repeat):
        clear()
        t0 = time.process_time()  # CPU time: the machine is shared, wall time is noisy
        value = fn()
        best = min(best, time.process_time() - t0)
    return best * 1e3, value


def efficientnet(repeat: int = 1) -> Any:
    """An EfficientNet-B0-style CNN (see the module docstring); `repeat` multiplies the blocks
    of each stage."""
    from fuser.models._graph import GraphBuilder
    from fuser.models.cnn import ConvSpec, conv_bn

    b = GraphBuilder("efficientnet_style", opset=13, seed=0)
    x = b.input("input", ["N", 3, 224, 224])

    def silu(v: str) -> str:
        return b.op("Mul", v, b.op("Sigmoid", v))

    x = silu(conv_bn(b, x, 3, ConvSpec(32, 3, stride=2, relu=False)))
    c, size = 32, 112
    # (expand ratio, out channels, blocks, stride, kernel): EfficientNet-B0's stages.
    stages = [(1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 40, 2, 2, 5), (6, 80, 3, 2, 3),
              (6, 112, 3, 1, 5), (6, 192, 4, 2, 5), (6, 320, 1, 1, 3)]  # fmt: skip
    for expand, out, blocks, stride, k in stages:
        for i in range(blocks * repeat):
            s = stride if i == 0 else 1
            with b.scope(f"stage{out}_{i}"):
                y = x
                mid = c * expand
                if expand != 1:
                    y = silu(conv_bn(b, y, c, ConvSpec(mid, 1, relu=False)))
                y = silu(conv_bn(b, y, mid, ConvSpec(mid, k, stride=s, group=mid, relu=False)))
                y = conv_bn(b, y, mid, ConvSpec(out, 1, relu=False))
                if s == 1 and c == out:
                    y = b.op("Add", y, x)
            x, c, size = y, out, size // s
    x = silu(conv_bn(b, x, c, ConvSpec(1280, 1, relu=False)))
    b.graph_output(x, "output", ["N", 1280, size, size])
    return b.build("EfficientNet-B0-style CNN (search_speed benchmark)")


def fuse_times(paths: Sequence[str], target: str) -> None:
    """Whole fuses with a cold tuning cache (see the module docstring)."""
    import subprocess
    import tempfile

    import onnx
    from fuser.models import get_example

    from fuser import api
    from fuser.costmodel import CostModelDecider

    spent = [0.0]
    decide = CostModelDecider.decide

    def timed_decide(self: Any, graph: Any, match: Any) -> Any:
        t0 = time.process_time()
        try:
            return decide(self, graph, match)
        finally:
            spent[0] += time.process_time() - t0

    CostModelDecider.decide = timed_decide  # type: ignore[method-assign]
    fuser_bin = str(Path(sys.executable).with_name("fuser"))
    print(f"# Whole fuse on {target}, cold tuning cache")
    print()
    print("| model | nodes | fused | fuse cpu s | decide cpu s | process wall s | process cpu s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for path in ["efficientnet", "example:resnet", *paths]:
            if path == "efficientnet":
                model = efficientnet()
                source = str(Path(tmp) / "efficientnet.onnx")
                onnx.save(model, source)
            elif path.startswith("example:"):
                model, source = get_example(path.split(":", 1)[1]), path
            else:
                model, source = onnx.load(path), path
            spent[0] = 0.0
            decider = CostModelDecider.for_target(target, cache=False)
            t0 = time.process_time()
            result = api.fuse(model, decider=decider)
            cpu = time.process_time() - t0
            cache = Path(tmp) / f"cache-{len(list(Path(tmp).iterdir()))}.sqlite"
            cmd = [fuser_bin, "fuse", source, "-o", str(Path(tmp) / "out.onnx"), "--target",
                   target, "--cache", str(cache)]  # fmt: skip
            r0, w0 = _children_cpu(), time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            wall, pcpu = time.perf_counter() - w0, _children_cpu() - r0
            name = Path(path).name if not path.startswith("example:") else path
            print(f"| {name} | {len(model.graph.node)} | {len(result.report.fusions)} | "
                  f"{cpu:.2f} | {spent[0]:.2f} | {wall:.2f} | {pcpu:.2f} |")  # fmt: skip


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _row(
    domain: str, op: str, metas: Sequence[Any], attrs: dict[str, Any], machine: Any, repeat: int
) -> dict[str, float]:
    """One shape: space, exhaustive and fast search times, priced count, same pick."""
    model = kernel_search.model_for(domain, op)
    assert model is not None
    space_ms, _ = _timed(lambda: model.space(metas, attrs, machine), repeat)
    full_ms, full = _timed(lambda: kernel_search.search(domain, op, metas, attrs, machine), repeat)
    if not hasattr(kernel_search, "best"):  # a checkout before the fast search: `--before`
        return {"space": space_ms, "full": full_ms, "fast": math.nan, "size": full.space_size,
                "priced": full.space_size, "same": math.nan}  # fmt: skip
    fast_ms, fast = _timed(lambda: kernel_search.best(domain, op, metas, attrs, machine), repeat)
    # The reference is every tiling priced (`search` beams spaces past its exhaustive limit).
    model_, space = kernel_search.candidate_space(domain, op, metas, attrs, machine)
    every = kernel_search.ranked(
        [kernel_search.Priced(t, model_.cost(metas, attrs, t, machine)) for t in space]
    )
    return {
        "space": space_ms,
        "full": full_ms,
        "fast": fast_ms,
        "size": full.space_size,
        "priced": len(fast.candidates),
        "same": float(fast.best.tiling == every[0].tiling),
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="ascend910b")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kernels", default="", help="comma-separated op types (default all)")
    ap.add_argument("--fuse", action="store_true", help="time whole fuses (see above)")
    ap.add_argument("models", nargs="*", help="with --fuse: more ONNX files to fuse")
    args = ap.parse_args(argv)
    if args.fuse:
        fuse_times(args.models, args.target)
        return
    machine = load_target(args.target)
    wanted = set(filter(None, args.kernels.split(",")))
    rows: dict[str, list[dict[str, float]]] = {}
    for domain, op, _label, metas, attrs in cases():
        if wanted and op not in wanted:
            continue
        rows.setdefault(op, []).append(_row(domain, op, metas, attrs, machine, args.repeat))
    print(f"# Tiling search on {args.target}: ms per search (median over shapes)")
    print()
    print("| kernel | shapes | space size | priced (fast) | space ms | exhaustive ms | fast ms "
          "| speed-up | same pick |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for op, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        before = math.isnan(med["fast"])
        same = "-" if before else f"{int(sum(r['same'] for r in rs))}/{len(rs)}"
        fast = "-" if before else f"{med['fast']:.2f}"
        gain = "-" if before else f"{med['full'] / max(med['fast'], 1e-9):.1f}x"
        print(
            f"| {op} | {len(rs)} | {med['size']:.0f} | {med['priced']:.0f} | "
            f"{med['space']:.2f} | {med['full']:.2f} | {fast} | {gain} | {same} |"
        )


if __name__ == "__main__":
    main()
