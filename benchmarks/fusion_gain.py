"""Fusion gain on the simulated NPU: unfused op chains vs their fused kernel.

Part Conv+BN+ReLU (ResNet-50 shapes, batch 1 by default): the unfused chain runs three kernels
(Conv with bias, BatchNormalization, Relu), each a launch with its output written to GM and read
back by the next; the fused ConvBnRelu runs once, BN folded into the weights (as `fuse` does
when the BN parameters are constant) or applied in the epilogue. Every number comes from the
simulator (timing-only runs, default tilings) on the chosen target. Then the cost of a
functional run against the op's numpy reference, and the speed of timing-only runs.

    python benchmarks/fusion_gain.py [--target ascend910b] [--batch 1] [--dtype float16]

Wall times depend on the machine's load. A functional run does many small matmuls (one per
Cube instruction); on a busy machine multi-threaded BLAS makes those erratic, so for stable
ratios run with OPENBLAS_NUM_THREADS=1 (the reference then runs single-threaded too).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from fuser.kernels import registry
from fuser.kernels.api import Kernel, TensorMeta
from fuser.kernels.npu.machine import Machine, load_target
from fuser.kernels.npu.stats import RunStats, sequence


@dataclass(frozen=True)
class ConvLayer:
    """One convolution of the network: input [N, C, H, W], Cout, kernel, stride, pad."""

    name: str
    c: int
    hw: int
    cout: int
    k: int
    stride: int = 1

    def x(self, batch: int, dtype: np.dtype) -> TensorMeta:
        return TensorMeta((batch, self.c, self.hw, self.hw), dtype)

    def w(self, dtype: np.dtype) -> TensorMeta:
        return TensorMeta((self.cout, self.c, self.k, self.k), dtype)

    def attrs(self) -> dict[str, Any]:
        p = self.k // 2
        return {"pads": [p, p, p, p], "strides": [self.stride, self.stride]}


# The distinct Conv+BN(+ReLU) shapes of ResNet-50 (stem and first block of each stage).
RESNET50 = (
    ConvLayer("conv1 7x7/2", 3, 224, 64, 7, 2),
    ConvLayer("res2 1x1 64->64", 64, 56, 64, 1),
    ConvLayer("res2 3x3 64", 64, 56, 64, 3),
    ConvLayer("res2 1x1 64->256", 64, 56, 256, 1),
    ConvLayer("res3 3x3/2 128", 128, 56, 128, 3, 2),
    ConvLayer("res3 1x1 128->512", 128, 28, 512, 1),
    ConvLayer("res4 3x3 256", 256, 14, 256, 3),
    ConvLayer("res4 1x1 256->1024", 256, 14, 1024, 1),
    ConvLayer("res5 3x3 512", 512, 7, 512, 3),
    ConvLayer("res5 1x1 512->2048", 512, 7, 2048, 1),
)


def _kernel(domain: str, op: str) -> Kernel:
    k = registry.get_kernel(domain, op)
    if k is None:
        raise SystemExit(f"no kernel for {domain or 'ai.onnx'}.{op}")
    return k


def conv_bn_relu_runs(
    layer: ConvLayer, batch: int, dtype: np.dtype, machine: Machine
) -> tuple[RunStats, RunStats, RunStats]:
    """(unfused chain, fused with BN folded, fused with BN in the epilogue), timing-only."""
    x, w = layer.x(batch, dtype), layer.w(dtype)
    vec = TensorMeta((layer.cout,), dtype)
    attrs = layer.attrs()
    conv = _kernel("", "Conv").run(machine, [x, w, vec], attrs, functional=False)
    (y,) = _kernel("", "Conv").infer([x, w, vec], attrs)
    bn = _kernel("", "BatchNormalization").run(machine, [y, vec, vec, vec, vec], {},
                                               functional=False)  # fmt: skip
    relu = _kernel("", "Relu").run(machine, [y], {}, functional=False)
    unfused = sequence([conv.stats, bn.stats, relu.stats])
    fused_op = _kernel("fuser", "ConvBnRelu")
    folded = fused_op.run(machine, [x, w, vec], {**attrs, "relu": 1}, functional=False)
    epilogue = fused_op.run(machine, [x, w, vec, vec, vec, vec, vec], {**attrs, "relu": 1},
                            functional=False)  # fmt: skip
    return unfused, folded.stats, epilogue.stats


def print_conv_bn_relu_table(batch: int, dtype: np.dtype, machine: Machine) -> None:
    print(f"\n## Conv+BN+ReLU on {machine.name}, batch {batch}, {dtype.name} (simulated)\n")
    head = ("layer", "unfused us", "fused us", "speedup", "BN-in-epilogue us",
            "unfused GM MB", "fused GM MB", "launches")  # fmt: skip
    rows: list[tuple[str, ...]] = []
    tot_u = tot_f = tot_e = 0.0
    gm_u = gm_f = 0
    launches_u = launches_f = 0
    for layer in RESNET50:
        u, f, e = conv_bn_relu_runs(layer, batch, dtype, machine)
        tot_u, tot_f, tot_e = tot_u + u.us, tot_f + f.us, tot_e + e.us
        gm_u, gm_f = gm_u + u.gm_bytes, gm_f + f.gm_bytes
        launches_u, launches_f = launches_u + u.launches, launches_f + f.launches
        rows.append((layer.name, f"{u.us:.1f}", f"{f.us:.1f}", f"{u.us / f.us:.2f}x",
                     f"{e.us:.1f}", f"{u.gm_bytes / 1e6:.2f}", f"{f.gm_bytes / 1e6:.2f}",
                     f"{u.launches} -> {f.launches}"))  # fmt: skip
    rows.append(("total", f"{tot_u:.1f}", f"{tot_f:.1f}", f"{tot_u / tot_f:.2f}x",
                 f"{tot_e:.1f}", f"{gm_u / 1e6:.2f}", f"{gm_f / 1e6:.2f}",
                 f"{launches_u} -> {launches_f}"))  # fmt: skip
    _table(head, rows)


def _random_inputs(
    layer: ConvLayer, dtype: np.dtype, rng: np.random.Generator
) -> list[np.ndarray | None]:
    x = rng.standard_normal((1, layer.c, layer.hw, layer.hw)).astype(dtype)
    w = rng.standard_normal((layer.cout, layer.c, layer.k, layer.k)).astype(dtype)
    c = layer.cout
    bn = [rng.uniform(0.5, 1.5, c), rng.standard_normal(c), rng.standard_normal(c),
          rng.uniform(0.5, 2.0, c)]  # fmt: skip
    return [x, w, None, *(p.astype(dtype) for p in bn)]


def _best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def print_simulation_cost(dtype: np.dtype, machine: Machine) -> None:
    """Wall time of a functional ConvBnRelu run over its numpy reference (same inputs)."""
    try:
        from fuser.patterns.conv_bn_relu import reference
    except ImportError as e:  # the pattern lives in another part of the product
        print(f"\n(simulation cost skipped: no ConvBnRelu reference: {e})")
        return
    print(f"\n## Cost of a functional ConvBnRelu run vs its numpy reference ({dtype.name})\n")
    rng = np.random.default_rng(0)
    fused = _kernel("fuser", "ConvBnRelu")
    rows = []
    for layer in RESNET50:
        inputs = _random_inputs(layer, dtype, rng)
        attrs = {**layer.attrs(), "epsilon": 1e-5, "relu": 1}
        t_kernel = _best_of(lambda: fused.run(machine, inputs, attrs, timeline=False))  # noqa: B023
        t_ref = _best_of(lambda: reference(inputs, attrs))  # noqa: B023
        metas: Sequence[TensorMeta | None] = [None if a is None else TensorMeta.of(a)
                                              for a in inputs]  # fmt: skip
        t_timing = _best_of(
            lambda: fused.run(machine, metas, attrs, functional=False, timeline=False)  # noqa: B023
        )
        rows.append((layer.name, f"{t_kernel * 1e3:.1f}", f"{t_ref * 1e3:.1f}",
                     f"{t_kernel / t_ref:.2f}x", f"{t_timing * 1e3:.1f}",
                     f"{60 / t_timing:,.0f}"))  # fmt: skip
    _table(("layer", "functional ms", "reference ms", "ratio", "timing-only ms",
            "timing runs/min"), rows)  # fmt: skip


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="ascend910b", help="target name or JSON file")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    ap.add_argument("--no-cost", action="store_true", help="skip the functional-run timing")
    args = ap.parse_args(argv)
    machine = load_target(args.target)
    dtype = np.dtype(args.dtype)
    print_conv_bn_relu_table(args.batch, dtype, machine)
    if not args.no_cost:
        print_simulation_cost(dtype, machine)


if __name__ == "__main__":
    main()
