"""Kernels against the roofline on the simulated NPU, through `fuser profile` on one-op models.

For each kernel at a large static fp16 shape: a one-op ONNX model (the fused ones are their
unfused chain passed through `fuse`), profiled on the target; per node the simulated time, the
floor `max(FLOPs / peak, compulsory bytes / nominal HBM)`, the fraction floor / time, and the
bottleneck: the busiest pipe of the slowest core, or HBM when the chip's HBM traffic sets the
time. The issue's targets (issue 9): MatMul 4096^3 >= 80%, the fused Conv+BN+ReLU (ResNet-50
conv2_x, batch 32) and LayerNorm+MatMul ([8,512,1024] x [1024,4096]) >= 70%, and no op above
100% (faster than physics).

    python benchmarks/roofline.py [--target ascend910b] [--quick]

`--quick` runs smaller shapes (a smoke test); the targets are for the default shapes.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from fuser.kernels.npu.machine import Machine, load_target
from fuser.kernels.npu.stats import RunStats
from onnx import TensorProto, helper, numpy_helper

from fuser.api import fuse
from fuser.profile import profile_model

#: The nominal HBM bandwidth the issue's floor uses (the target's own figure is the measured
#: copy rate, lower: a kernel can reach at most that share of the nominal floor).
NOMINAL_HBM_BYTES_PER_S = 1.6e12
F16 = TensorProto.FLOAT16


@dataclass(frozen=True)
class Case:
    """One kernel at one shape: a model builder, its FLOPs and compulsory bytes."""

    name: str
    shape: str
    build: Callable[[], onnx.ModelProto]
    flops: float
    nbytes: float
    fused: bool = False
    target: float | None = None


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
           outputs: list[onnx.ValueInfoProto], inits: list[onnx.TensorProto] = (),
           extra_opsets: tuple[tuple[str, int], ...] = ()) -> onnx.ModelProto:  # fmt: skip
    graph = helper.make_graph(nodes, "one_op", inputs, outputs, list(inits))
    opsets = [helper.make_opsetid("", 17), *(helper.make_opsetid(d, v) for d, v in extra_opsets)]
    return helper.make_model(graph, opset_imports=opsets)


def _vi(name: str, shape: tuple[int, ...], dtype: int = F16) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, list(shape))


def _init(name: str, shape: tuple[int, ...], seed: int) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.05).astype(np.float16), name)


def matmul(m: int, k: int, n: int) -> Case:
    def build() -> onnx.ModelProto:
        node = helper.make_node("MatMul", ["A", "B"], ["Y"])
        return _model([node], [_vi("A", (m, k)), _vi("B", (k, n))], [_vi("Y", (m, n))])

    return Case("MatMul", f"{m}x{k}x{n}", build, 2.0 * m * k * n, 2.0 * (m * k + k * n + m * n))


def gemm(m: int, k: int, n: int) -> Case:
    def build() -> onnx.ModelProto:
        node = helper.make_node("Gemm", ["A", "B", "C"], ["Y"], transB=1)
        ins = [_vi("A", (m, k)), _vi("B", (n, k)), _vi("C", (n,))]
        return _model([node], ins, [_vi("Y", (m, n))])

    nbytes = 2.0 * (m * k + k * n + n + m * n)
    return Case("Gemm (transB, bias)", f"{m}x{k}x{n}", build, 2.0 * m * k * n, nbytes)


def conv_bn_relu(n: int, cin: int, h: int, cout: int, kh: int, stride: int) -> Case:
    pad = kh // 2
    ho = (h + 2 * pad - kh) // stride + 1

    def build() -> onnx.ModelProto:
        nodes = [
            helper.make_node("Conv", ["X", "W"], ["c"], pads=[pad] * 4, strides=[stride] * 2),
            helper.make_node("BatchNormalization", ["c", "s", "b", "mu", "var"], ["bn"]),
            helper.make_node("Relu", ["bn"], ["Y"]),
        ]
        inits = [_init("W", (cout, cin, kh, kh), 1)]
        for i, name in enumerate(("s", "b", "mu", "var")):
            t = _init(name, (cout,), 2 + i)
            if name == "var":
                t = numpy_helper.from_array(np.abs(numpy_helper.to_array(t)) + 1, name)
            inits.append(t)
        return _model(nodes, [_vi("X", (n, cin, h, h))], [_vi("Y", (n, cout, ho, ho))], inits)

    flops = 2.0 * n * ho * ho * cout * cin * kh * kh
    nbytes = 2.0 * (n * cin * h * h + cout * cin * kh * kh + n * cout * ho * ho + 4 * cout)
    return Case("ConvBnRelu", f"{n}x{cin}x{h}x{h} {kh}x{kh}/{stride} -> {cout}", build, flops,
                nbytes, fused=True)  # fmt: skip


def layernorm_matmul(b: int, s: int, d: int, n: int) -> Case:
    def build() -> onnx.ModelProto:
        nodes = [
            helper.make_node("LayerNormalization", ["X", "g", "be"], ["ln"], axis=-1),
            helper.make_node("MatMul", ["ln", "W"], ["Y"]),
        ]
        inits = [_init("g", (d,), 1), _init("be", (d,), 2), _init("W", (d, n), 3)]
        return _model(nodes, [_vi("X", (b, s, d))], [_vi("Y", (b, s, n))], inits)

    m = b * s
    nbytes = 2.0 * (m * d + 2 * d + d * n + m * n)
    return Case("LayerNormMatMul", f"[{b},{s},{d}]x[{d},{n}]", build, 2.0 * m * d * n, nbytes,
                fused=True)  # fmt: skip


def softmax_topk(rows: int, experts: int, k: int) -> Case:
    def build() -> onnx.ModelProto:
        kk = numpy_helper.from_array(np.array([k], np.int64), "k")
        nodes = [
            helper.make_node("Softmax", ["X"], ["p"], axis=-1),
            helper.make_node("TopK", ["p", "k"], ["V", "I"], axis=-1),
        ]
        outs = [_vi("V", (rows, k)), _vi("I", (rows, k), TensorProto.INT64)]
        return _model(nodes, [_vi("X", (rows, experts))], outs, [kk])

    nbytes = 2.0 * rows * experts + rows * k * (2 + 8)
    return Case("SoftmaxTopK", f"{rows}x{experts} k={k}", build, 0.0, nbytes, fused=True)


def relu(n: int) -> Case:
    def build() -> onnx.ModelProto:
        node = helper.make_node("Relu", ["X"], ["Y"])
        return _model([node], [_vi("X", (n,))], [_vi("Y", (n,))])

    return Case("Relu", f"{n // 2**20} Mi", build, 0.0, 4.0 * n)


def cases(quick: bool) -> list[Case]:
    """The kernels and shapes of the table (targets on the default, large shapes)."""
    if quick:
        return [matmul(512, 512, 512), conv_bn_relu(2, 64, 56, 64, 3, 1),
                layernorm_matmul(1, 256, 256, 512), relu(1 << 20)]  # fmt: skip
    return [
        _with(matmul(4096, 4096, 4096), 0.8),
        matmul(1024, 4096, 1024),
        gemm(4096, 4096, 4096),
        _with(conv_bn_relu(32, 64, 56, 64, 3, 1), 0.7),
        conv_bn_relu(32, 3, 224, 64, 7, 2),
        conv_bn_relu(32, 512, 7, 512, 3, 1),
        _with(layernorm_matmul(8, 512, 1024, 4096), 0.7),
        softmax_topk(65536, 64, 2),
        relu(64 << 20),
    ]


def _with(case: Case, target: float) -> Case:
    return Case(case.name, case.shape, case.build, case.flops, case.nbytes, case.fused, target)


def floor_us(case: Case, machine: Machine) -> float:
    """max(FLOPs / Cube peak, compulsory bytes / nominal HBM) in microseconds."""
    k0 = machine.cube_k_block(np.dtype(np.float16))
    peak = 2 * machine.cube_m * machine.cube_n * k0 * machine.cube_cores * machine.clock_hz
    return max(case.flops / peak, case.nbytes / NOMINAL_HBM_BYTES_PER_S) * 1e6


def bottleneck(stats: RunStats, machine: Machine) -> str:
    """HBM when the chip's HBM traffic sets the time, else the busiest pipe (per core)."""
    if machine.hbm_cycles(stats.hbm_bytes) >= 0.98 * stats.core_cycles:
        return "HBM"
    busy = {p: b for p, b in stats.pipe_busy.items() if b > 0}
    pipe = max(busy, key=lambda p: busy[p])
    share = busy[pipe] / max(1, stats.cores) / stats.core_cycles
    return f"{pipe} ({share:.0%} busy)"


def run(case: Case, machine: Machine, target: str) -> tuple[str, float, str, float]:
    """(op as profiled, simulated us, bottleneck, profiling seconds) of one case."""
    model = case.build()
    started = time.perf_counter()
    if case.fused:
        result = fuse(model, target=target, cache=False)
        model = result.model
    prof = profile_model(model, target)
    seconds = time.perf_counter() - started
    nodes = [n for n in prof.nodes if n.stats.launches]
    us = sum(n.stats.us for n in nodes)
    ops = "+".join(n.op for n in nodes)
    slowest = max(nodes, key=lambda n: n.stats.cycles)
    return ops, us, bottleneck(slowest.stats, machine), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="ascend910b")
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    args = parser.parse_args()
    machine = load_target(args.target)
    print(f"Roofline on {machine.name}: floor = max(FLOPs / {floor_peak(machine):.1f} TFLOPS, "
          f"bytes / {NOMINAL_HBM_BYTES_PER_S / 1e12:.1f} TB/s)")  # fmt: skip
    head = f"{'kernel':<20} {'shape':<30} {'ran as':<16} {'sim us':>9} {'floor us':>9} "
    print(head + f"{'fraction':>8} {'target':>6}  bottleneck")
    for case in cases(args.quick):
        ops, us, neck, seconds = run(case, machine, args.target)
        fl = floor_us(case, machine)
        frac = fl / us if us else math.inf
        tgt = f">={case.target:.0%}" if case.target else ""
        flag = " FASTER THAN THE FLOOR" if frac > 1.0 + 1e-9 else ""
        miss = " (below target)" if case.target and frac < case.target else ""
        print(f"{case.name:<20} {case.shape:<30} {ops:<16} {us:>9.1f} {fl:>9.1f} {frac:>8.0%} "
              f"{tgt:>6}  {neck}{flag}{miss}  [{seconds:.1f}s]")  # fmt: skip


def floor_peak(machine: Machine) -> float:
    """The Cube's fp16 peak in TFLOPS."""
    k0 = machine.cube_k_block(np.dtype(np.float16))
    return 2 * machine.cube_m * machine.cube_n * k0 * machine.cube_cores * machine.clock_hz / 1e12


if __name__ == "__main__":
    main()
