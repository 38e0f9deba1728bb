"""Cost model vs simulator: does the analytical model rank tilings as the simulator does?

For each of the four fused kernels (ConvBnRelu, LayerNormMatMul, SoftmaxTopK, AllGatherMatMul)
and 26 shapes each (the models/ examples' shapes scaled to real sizes, and the articles':
ResNet-50 and MobileNet convolutions, BERT / GPT-2 / LLaMA LayerNorm+Linear, Mixtral / Qwen2 /
DeepSeek MoE gating, tensor- and sequence-parallel MLPs; small to large, with tails), every
legal tiling of the kernel's space is priced by the model (`fuser.kernels.search`) and a set of
them is run by the event-level simulator in timing-only mode. Printed per kernel:

1. model quality: median and worst Spearman rank correlation, median and p90 top-1 regret
   (`sim(model's pick) / min sim - 1`), median absolute percentage error;
2. the model's pick against the best of the kernel's fixed default tiling and the articles'
   rule of thumb (MatMul tile_m/tile_n 128, tile_k 256; MoE tileS halved until UB fits), in
   simulated cycles (ratio <= 1.00 is a win or a tie). Both are in the search's space, so the
   model picks them when it rates them best: a loss here is a misprediction of the model;
3. for the large shapes, the pick's simulated cycles against the roofline floor
   (max(Cube FLOPs / peak, compulsory GM bytes / HBM bandwidth); for AllGatherMatMul also the
   ring gather's link time, which no tiling can hide below). SoftmaxTopK has no Cube work:
   its floor is the GM bytes only, and the Vector unit is what bounds it.

Sampling (say so): the spaces hold 40 to ~4,600 tilings and one simulated run takes 10 ms to
2 s, so simulating every tiling of every shape would take hours. Spaces of at most
`--per-shape` tilings are simulated whole; larger ones are sampled: the model's best 6, then
tilings spread evenly over the model's ranking (every i-th of the sorted list), the default and
the rule of thumb. Regret is measured against the best simulated tiling of that sample, which
contains the model's top 6: a better tiling outside the sample would make the true regret
larger. The summary line says how many spaces were simulated whole.

    python benchmarks/cost_model_accuracy.py [--target ascend910b] [--per-shape 18] [--jobs 2]
        [--kernels ConvBnRelu,SoftmaxTopK] [--quick] [--json out.json]
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from fuser.kernels import search as kernel_search  # noqa: E402
from fuser.kernels._link import step_cycles  # noqa: E402
from fuser.kernels.api import TensorMeta, Tiling  # noqa: E402
from fuser.kernels.npu.machine import load_target  # noqa: E402
from fuser.kernels.registry import get_kernel  # noqa: E402

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
MACHINE = load_target("ascend910b")  # link timing of the cases' floors (the 910B links)


@dataclass(frozen=True)
class Case:
    """One (kernel, shape): inputs, attributes, a label, the FLOPs and compulsory bytes."""

    op: str
    label: str
    metas: tuple[TensorMeta | None, ...]
    attrs: dict[str, Any]
    flops: float
    gm_bytes: float
    large: bool
    link_cycles: float = 0.0  # ring AllGather time: no tiling hides the gather itself


def meta(shape: Sequence[int], dtype: np.dtype = F16) -> TensorMeta:
    """A tensor of `shape` and `dtype` (float16 unless told), as the cases' inputs are."""
    return TensorMeta(tuple(shape), dtype)


def conv_cases() -> list[Case]:
    # (N, Cin, H, W, Cout, k, stride, group): ResNet-50, MobileNet, the models/ CNNs, 1-D, tails.
    shapes = [
        (1, 3, 224, 224, 64, 7, 2, 1), (1, 64, 56, 56, 64, 3, 1, 1), (1, 64, 56, 56, 256, 1, 1, 1),
        (1, 256, 56, 56, 64, 1, 1, 1), (1, 128, 28, 28, 128, 3, 1, 1),
        (1, 256, 28, 28, 512, 1, 1, 1), (1, 256, 14, 14, 256, 3, 1, 1),
        (1, 512, 14, 14, 1024, 1, 1, 1), (1, 512, 7, 7, 512, 3, 1, 1),
        (1, 1024, 14, 14, 256, 1, 1, 1), (1, 128, 56, 56, 128, 3, 2, 1),
        (1, 32, 112, 112, 32, 3, 1, 32), (1, 32, 112, 112, 64, 1, 1, 1),
        (1, 144, 56, 56, 144, 3, 2, 144), (1, 96, 28, 28, 24, 1, 1, 1),
        (4, 64, 28, 28, 64, 3, 1, 1), (8, 128, 14, 14, 128, 3, 1, 1),
        (1, 48, 30, 30, 80, 3, 1, 1), (1, 96, 17, 17, 112, 3, 1, 1), (2, 40, 27, 27, 72, 3, 2, 1),
        (1, 3, 64, 64, 16, 3, 1, 1), (1, 16, 32, 32, 16, 3, 1, 1), (1, 200, 9, 9, 300, 3, 1, 1),
        (1, 64, 1, 1000, 128, 3, 1, 1), (1, 128, 1, 512, 128, 5, 1, 1),
        (1, 80, 1, 3000, 256, 3, 2, 1),
    ]  # fmt: skip
    out = []
    for n, ci, h, w, co, k, s, g in shapes:
        one_d = h == 1
        x = meta((n, ci, w) if one_d else (n, ci, h, w))
        wt = meta((co, ci // g, k) if one_d else (co, ci // g, k, k))
        p = meta((co,))
        kh = 1 if one_d else k
        attrs = {
            "kernel_shape": [k] if one_d else [k, k], "strides": [s] if one_d else [s, s],
            "pads": [k // 2] * (2 if one_d else 4), "group": g, "relu": 1, "epsilon": 1e-5,
        }  # fmt: skip
        ho = (h + 2 * (k // 2 if not one_d else 0) - kh) // (1 if one_d else s) + 1
        wo = (w + 2 * (k // 2) - k) // s + 1
        flops = 2.0 * n * co * ho * wo * (ci // g) * kh * k
        gm = 2.0 * (n * ci * h * w + co * (ci // g) * kh * k + n * co * ho * wo)
        out.append(
            Case(
                "ConvBnRelu",
                f"{n}x{ci}x{h}x{w}->{co} k{k}s{s}" + (f"g{g}" if g > 1 else ""),
                (x, wt, p, p, p, p, p),
                attrs,
                flops,
                gm,
                flops > 2e8,
            )
        )
    return out


def lnmm_cases() -> list[Case]:
    # (X shape, [N per Linear], bias): BERT-base / large, GPT-2, LLaMA decode and prefill, tails.
    shapes = [
        ((128, 768), [768, 768, 768], True), ((512, 768), [3072], True),
        ((512, 768), [768, 768, 768], True), ((4, 128, 768), [3072], True),
        ((1024, 768), [2304], True), ((256, 1024), [4096], True), ((384, 1024), [1024] * 3, True),
        ((1, 4096), [4096, 4096, 4096], False), ((16, 4096), [11008], False),
        ((8, 4096), [4096], False), ((64, 2048), [2048], False), ((2048, 768), [768], True),
        ((100, 768), [768], True), ((1000, 1024), [1024], True), ((77, 512), [1536], True),
        ((197, 768), [2304], True), ((50, 384), [1152], True), ((300, 256), [1024], True),
        ((2, 64, 512), [512], True), ((33, 1536), [384], False), ((128, 320), [1280], True),
        ((1, 2048), [8192], False), ((4096, 256), [256], True), ((96, 640), [2560], True),
        ((257, 1280), [1280], True), ((24, 5120), [1024], False),
    ]  # fmt: skip
    out = []
    for x, ns, bias in shapes:
        d = x[-1]
        metas: list[TensorMeta | None] = [meta(x), meta((d,)), meta((d,))]
        for n in ns:
            metas += [meta((d, n))] + ([meta((n,))] if bias else [])
        rows = math.prod(x[:-1])
        flops = 2.0 * rows * d * sum(ns)
        gm = 2.0 * (rows * d + d * sum(ns) + rows * sum(ns))
        attrs = {"has_bias": [int(bias)] * len(ns), "flatten": [0] * len(ns), "axis": -1}
        label = f"{'x'.join(map(str, x))} -> {'+'.join(map(str, ns))}"
        out.append(Case("LayerNormMatMul", label, tuple(metas), attrs, flops, gm, flops > 1e9))
    return out


def softmax_topk_cases() -> list[Case]:
    # (points shape, experts, k, dtype, order, renormalize): Mixtral, Qwen2-MoE, DeepSeek, the
    # article's 128 KB sweep input, decode, tails.
    shapes = [
        ((4096,), 8, 2, F16, "softmax_topk", 1), ((4096,), 60, 4, F16, "softmax_topk", 0),
        ((4096,), 64, 6, F16, "softmax_topk", 1), ((2048,), 128, 8, F32, "softmax_topk", 1),
        ((8192,), 16, 2, F32, "softmax_topk", 0), ((1,), 8, 2, F32, "softmax_topk", 1),
        ((16,), 60, 4, F32, "softmax_topk", 0), ((1, 1024), 64, 2, F16, "softmax_topk", 0),
        ((1000,), 60, 4, F16, "softmax_topk", 1), ((3000,), 8, 2, F32, "topk_softmax", 0),
        ((4, 512), 8, 2, F32, "softmax_topk", 1), ((16384,), 8, 2, F16, "softmax_topk", 1),
        ((32768,), 64, 8, F16, "softmax_topk", 1), ((777,), 32, 4, F32, "softmax_topk", 0),
        ((2, 2049), 16, 4, F16, "topk_softmax", 1), ((512,), 256, 8, F16, "softmax_topk", 1),
        ((64,), 160, 6, F16, "softmax_topk", 1), ((12000,), 8, 1, F32, "softmax_topk", 0),
        ((8, 1000), 60, 4, F32, "topk_softmax", 0), ((300,), 4, 2, F32, "softmax_topk", 1),
        ((65536,), 8, 2, F16, "softmax_topk", 0), ((128,), 128, 2, F32, "softmax_topk", 1),
        ((2048,), 32, 4, F16, "softmax_topk", 0), ((5000,), 64, 6, F32, "topk_softmax", 1),
        ((20000,), 16, 4, F16, "softmax_topk", 1), ((97,), 60, 4, F16, "softmax_topk", 0),
    ]  # fmt: skip
    out = []
    for pts, e, k, dt, order, renorm in shapes:
        rows = math.prod(pts)
        gm = rows * (e * dt.itemsize + k * (dt.itemsize + 8))
        attrs = {"k": k, "axis": -1, "order": order, "renormalize": renorm}
        label = f"{'x'.join(map(str, pts))}x{e} k{k} {dt.name} {order}"
        out.append(
            Case("SoftmaxTopK", label, (meta((*pts, e), dt),), attrs, 0.0, gm, rows * e >= 2**19)
        )
    return out


def allgather_cases() -> list[Case]:
    # (ranks, shard [m, k], N, axis): the tp-mlp (K gather) and sp-mlp (sequence gather) shapes
    # at real sizes, small to large, with tails.
    shapes = [
        (2, (128, 512), 512, 0), (2, (256, 1024), 1024, 0), (4, (128, 1024), 1024, 0),
        (4, (64, 768), 3072, 0), (8, (64, 1024), 1024, 0), (8, (128, 512), 2048, 0),
        (8, (32, 4096), 1024, 0), (4, (100, 768), 768, 0), (2, (500, 512), 640, 0),
        (8, (16, 2048), 2048, 0), (4, (256, 256), 4096, 0), (2, (1024, 256), 256, 0),
        (8, (96, 640), 640, 0),
        (2, (128, 512), 1024, 1), (2, (256, 768), 768, 1), (4, (128, 256), 1024, 1),
        (4, (64, 1024), 2048, 1), (8, (128, 128), 1024, 1), (8, (32, 512), 4096, 1),
        (2, (512, 384), 512, 1), (4, (100, 192), 768, 1), (8, (64, 96), 512, 1),
        (2, (16, 2048), 4096, 1), (4, (200, 320), 320, 1), (8, (256, 64), 2048, 1),
        (2, (384, 1024), 1024, 1),
    ]  # fmt: skip
    out = []
    for p, (m, ks), n, axis in shapes:
        k = ks * p if axis == 1 else ks
        x = meta((p, m, ks))
        rows = m * (p if axis == 0 else 1)
        flops = 2.0 * rows * k * n
        gm = 2.0 * (p * m * ks + k * n + rows * n)
        attrs = {"group_size": p, "rank": 0, "axis": axis}
        label = f"p{p} shard {m}x{ks} N{n} {'K' if axis else 'M'}-gather"
        link = (p - 1) * step_cycles(MACHINE, m * ks * 2)
        ins = (x, meta((k, n)), meta((n,)))
        out.append(Case("AllGatherMatMul", label, ins, attrs, flops, gm, flops > 5e8, link))
    return out


def _sample(order: list[int], per_shape: int) -> list[int]:
    """The model's best 6, then tilings spread evenly over its ranking."""
    if len(order) <= per_shape:
        return list(order)
    head = order[:6]
    rest = order[6:]
    want = per_shape - len(head)
    step = len(rest) / want
    spread = [rest[min(len(rest) - 1, int(i * step))] for i in range(want)]
    return head + sorted(set(spread) - set(head), key=order.index)


def _spearman(a: Sequence[float], b: Sequence[float]) -> float:
    ra = np.argsort(np.argsort(a, kind="stable"), kind="stable")
    rb = np.argsort(np.argsort(b, kind="stable"), kind="stable")
    if np.std(ra) == 0 or np.std(rb) == 0:
        return 1.0
    return float(np.corrcoef(ra, rb)[0, 1])


def run_case(args: tuple[Case, str, int]) -> dict[str, Any]:
    """Price the whole space, simulate the sample, the default and the rule of thumb."""
    case, target, per_shape = args
    machine = load_target(target)
    kernel = get_kernel("fuser", case.op)
    model = kernel_search.model_for("fuser", case.op)
    assert kernel is not None
    assert model is not None
    t0 = time.perf_counter()
    result = kernel_search.search("fuser", case.op, case.metas, case.attrs, machine)
    ranked = list(result.candidates)
    order = list(range(len(ranked)))
    picked = _sample(order, per_shape)

    def sim(t: Tiling) -> float:
        run = kernel.run(
            machine, case.metas, case.attrs, tiling=t, functional=False, timeline=False
        )
        return float(run.stats.cycles)

    pred = [ranked[i].cycles for i in picked]
    sims = [sim(ranked[i].tiling) for i in picked]
    default = kernel.default_tiling(case.metas, case.attrs, machine)
    rule = model.rule_of_thumb(case.metas, case.attrs, machine)
    sim_default = sim(default)
    sim_rule = sim(rule) if rule is not None else math.inf
    best = min(sims)
    pick = sims[0]  # the sample starts with the model's pick
    dtype = case.metas[0].dtype  # type: ignore[union-attr]
    floor = max(
        kernel_search.roofline_floor(case.flops, case.gm_bytes, machine, dtype), case.link_cycles
    )
    return {
        "op": case.op,
        "label": case.label,
        "space": len(ranked),
        "simulated": len(picked),
        "whole": len(picked) == len(ranked),
        "spearman": _spearman(pred, sims),
        "regret": pick / best - 1,
        "ape": float(np.median([abs(p - s) / s for p, s in zip(pred, sims, strict=True)])),
        "pick": pick,
        "default": sim_default,
        "rule": sim_rule,
        "vs_baselines": pick / min(sim_default, sim_rule),
        "floor": floor,
        "large": case.large,
        "seconds": time.perf_counter() - t0,
        "chosen": dict(vars(ranked[0].tiling)),
        # What `fuse` runs (the fast search) picks what the whole ranking's head is.
        "fast_same": kernel_search.best(
            "fuser", case.op, case.metas, case.attrs, machine
        ).best.tiling
        == ranked[0].tiling,
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="ascend910b")
    ap.add_argument("--per-shape", type=int, default=18, help="simulated tilings per shape")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--kernels", default="ConvBnRelu,LayerNormMatMul,SoftmaxTopK,AllGatherMatMul")
    ap.add_argument("--quick", action="store_true", help="8 shapes per kernel, 10 tilings each")
    ap.add_argument("--json", help="write every row to this file")
    args = ap.parse_args(argv)
    wanted = set(args.kernels.split(","))
    cases = [
        c
        for c in (*conv_cases(), *lnmm_cases(), *softmax_topk_cases(), *allgather_cases())
        if c.op in wanted
    ]
    per_shape = args.per_shape
    if args.quick:
        by_op: dict[str, list[Case]] = {}
        for c in cases:
            by_op.setdefault(c.op, []).append(c)
        cases = [c for cs in by_op.values() for c in cs[:: max(1, len(cs) // 8)][:8]]
        per_shape = 10
    t0 = time.perf_counter()
    jobs = [(c, args.target, per_shape) for c in cases]
    if args.jobs > 1:
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            rows = pool.map(run_case, jobs, chunksize=1)
    else:
        rows = [run_case(j) for j in jobs]
    wall = time.perf_counter() - t0
    report(rows, args.target, per_shape, wall)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=float)


def report(rows: list[dict[str, Any]], target: str, per_shape: int, wall: float) -> None:
    """Print the three tables (markdown)."""
    ops = sorted({r["op"] for r in rows})
    whole = sum(r["whole"] for r in rows)
    print(f"# Cost model vs simulator on {target}: {len(rows)} shapes, {wall:.0f} s")
    print(
        f"(every tiling priced by the model; {whole} of {len(rows)} spaces simulated whole, the "
        f"rest sampled: model's top 6 + {per_shape - 6} spread over its ranking)\n"
    )
    print("## 1. Ranking quality (targets: median Spearman >= 0.9, median regret <= 3%, "
          "p90 <= 10%)\n")  # fmt: skip
    print("| kernel | shapes | tilings/space (median) | simulated | Spearman median | worst "
          "| regret median | p90 | max | APE median |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for op in ops:
        rs = [r for r in rows if r["op"] == op]
        sp = np.array([r["spearman"] for r in rs])
        rg = np.array([r["regret"] for r in rs])
        ape = np.array([r["ape"] for r in rs])
        print(
            f"| {op} | {len(rs)} | {int(np.median([r['space'] for r in rs]))} "
            f"| {sum(r['simulated'] for r in rs)} | {np.median(sp):.3f} | {sp.min():.3f} "
            f"| {_pct(float(np.median(rg)))} | {_pct(float(np.percentile(rg, 90)))} "
            f"| {_pct(float(rg.max()))} | {_pct(float(np.median(ape)))} |"
        )
    fast = sum(r["fast_same"] for r in rows)
    print(
        f"\nThe search `fuse` runs (`search.best`) picks the ranking's first tiling on {fast} of "
        f"{len(rows)} shapes (so these numbers are the decisions' too)."
    )
    print("\n## 2. Model's pick vs best of (fixed default, rule of thumb), simulated cycles\n")
    print("| kernel | wins | ties (within 1%) | losses | median ratio | worst ratio |")
    print("|---|---|---|---|---|---|")
    for op in ops:
        rs = [r for r in rows if r["op"] == op]
        ratio = np.array([r["vs_baselines"] for r in rs])
        print(
            f"| {op} | {(ratio < 0.99).sum()} | {((ratio >= 0.99) & (ratio <= 1.01)).sum()} "
            f"| {(ratio > 1.01).sum()} | {np.median(ratio):.3f} | {ratio.max():.3f} |"
        )
    losses = [r for r in rows if r["vs_baselines"] > 1.01]
    for r in losses:
        print(
            f"  loss: {r['op']} {r['label']}: pick {r['pick']:,.0f} vs default "
            f"{r['default']:,.0f} / rule {r['rule']:,.0f}"
        )
    print("\n## 3. Large shapes: pick's simulated cycles vs the roofline floor\n")
    print("| kernel | shape | floor cycles | pick cycles | floor / pick (1 = at the floor) |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r["large"]:
            print(
                f"| {r['op']} | {r['label']} | {r['floor']:,.0f} | {r['pick']:,.0f} "
                f"| {r['floor'] / r['pick']:.2f} |"
            )
    print("\n## Per shape\n")
    print("| kernel | shape | space | sim | Spearman | regret | APE | vs baselines | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['op']} | {r['label']} | {r['space']} | {r['simulated']} "
            f"| {r['spearman']:.3f} | {_pct(r['regret'])} | {_pct(r['ape'])} "
            f"| {r['vs_baselines']:.3f} | {r['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
