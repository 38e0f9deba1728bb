"""Count the unfused chains a model contains, structurally, as the test oracle for builders.

This is deliberately not a matcher: it checks only op types and edges (no constants, no
containment rules), so it says how many instances a builder put in, not whether each is legal
to fuse. A chain whose intermediate value has extra readers is still counted.

Keys of the returned mapping:
- ``conv_bn_relu`` / ``conv_bn``: Conv -> BatchNormalization, with / without a Relu reading the BN.
- ``layernorm``: LayerNormalization ops plus decomposed LayerNorms (one per ``Sqrt`` of
  ``Add(ReduceMean(square(x - ReduceMean(x))), eps)``; RMSNorm, without the centering, is not
  counted).
- ``layernorm_matmul``: LayerNorms whose output (through Casts) feeds at least one MatMul (as
  left operand) or Reshape -> Gemm; ``layernorm_matmuls`` counts those MatMuls/Gemms.
  Reshape -> MatMul (GPT-2's lm_head in real exports) is not counted.
- ``rmsnorm``: RMSNormalization / SimplifiedLayerNormalization ops plus decomposed RMSNorms
  (one per ``Sqrt`` of ``Add(ReduceMean(square(x)), eps)`` without the centering);
  ``rmsnorm_matmul`` those whose output (after the optional Mul gamma, through Casts) feeds a
  MatMul (left operand) or Reshape -> Gemm/MatMul; ``rmsnorm_matmuls`` counts those.
- ``softmax_topk``: Softmax -> (Cast ->) TopK; ``topk_softmax``: TopK values -> Softmax.
- ``allgather_matmul``: com.microsoft AllGather -> MatMul or Gemm (as left operand), directly
  or through a Reshape; one per Linear (a QKV gather counts 3).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import onnx


class _Index:
    def __init__(self, graph: onnx.GraphProto) -> None:
        self.producer: dict[str, onnx.NodeProto] = {}
        self.readers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        for node in graph.node:
            for out in node.output:
                self.producer[out] = node
            for i, name in enumerate(node.input):
                self.readers[name].append((node, i))

    def readers_of(
        self, value: str, op_type: str, index: int | None = None
    ) -> list[onnx.NodeProto]:
        return [n for n, i in self.readers[value] if n.op_type == op_type and index in (None, i)]

    def through_casts(self, value: str) -> list[str]:
        """``value`` and every value reached from it through chains of Cast nodes."""
        found, todo = [value], [value]
        while todo:
            for cast in self.readers_of(todo.pop(), "Cast"):
                found.append(cast.output[0])
                todo.append(cast.output[0])
        return found

    def producer_op(self, value: str) -> str:
        node = self.producer.get(value)
        return node.op_type if node is not None else ""


def _skip_casts(idx: _Index, value: str) -> onnx.NodeProto | None:
    """The producer of ``value``, looking back through Cast nodes."""
    node = idx.producer.get(value)
    while node is not None and node.op_type == "Cast":
        node = idx.producer.get(node.input[0])
    return node


def _is_centered_variance(idx: _Index, add: onnx.NodeProto) -> bool:
    """``add`` is ``ReduceMean(Pow(d, 2) or Mul(d, d)) + eps`` with ``d = x - ReduceMean(x)``.

    The centering is what tells LayerNorm from RMSNorm (which has no Sub).
    """
    for v in add.input:
        var = _skip_casts(idx, v)
        if var is None or var.op_type != "ReduceMean":
            continue
        square = _skip_casts(idx, var.input[0])
        if square is None or square.op_type not in ("Pow", "Mul"):
            continue
        sub = _skip_casts(idx, square.input[0])
        if sub is not None and sub.op_type == "Sub":
            mean = _skip_casts(idx, sub.input[1])
            return mean is not None and mean.op_type == "ReduceMean"
    return False


def _decomposed_ln_output(idx: _Index, sqrt: onnx.NodeProto) -> str | None:
    """Walk from the Sqrt of a decomposed LayerNorm to its last value (after the affine part)."""
    add = _skip_casts(idx, sqrt.input[0])
    if add is None or add.op_type != "Add" or not _is_centered_variance(idx, add):
        return None
    out = sqrt.output[0]
    if (div := idx.readers_of(out, "Div", 1)) != []:
        y = div[0].output[0]
    elif (rec := idx.readers_of(out, "Reciprocal")) != [] and idx.readers[rec[0].output[0]]:
        y = idx.readers[rec[0].output[0]][0][0].output[0]
    else:
        return None
    for op_type in ("Mul", "Add"):  # optional affine part: Mul gamma, Add beta
        nxt = [n for v in idx.through_casts(y) for n in idx.readers_of(v, op_type)]
        if len(nxt) != 1:
            break
        y = nxt[0].output[0]
    return y


def _decomposed_rms_output(idx: _Index, sqrt: onnx.NodeProto) -> str | None:
    """Walk from the Sqrt of a decomposed RMSNorm to its last value (after the Mul gamma)."""
    add = _skip_casts(idx, sqrt.input[0])
    if add is None or add.op_type != "Add" or _is_centered_variance(idx, add):
        return None
    means = [m for m in (_skip_casts(idx, v) for v in add.input) if m and m.op_type == "ReduceMean"]
    square = _skip_casts(idx, means[0].input[0]) if means else None
    if square is None or square.op_type not in ("Pow", "Mul"):
        return None
    out = sqrt.output[0]
    inverse = [*idx.readers_of(out, "Reciprocal"), *idx.readers_of(out, "Div", 1)]
    if (div := [d for d in idx.readers_of(out, "Div", 1) if d.input[0] == square.input[0]]) != []:
        y = div[0].output[0]
    elif inverse and (muls := [n for v in idx.through_casts(inverse[0].output[0])
                               for n in idx.readers_of(v, "Mul")]):  # fmt: skip
        y = muls[0].output[0]
    else:
        return None
    gamma = [n for v in idx.through_casts(y) for n in idx.readers_of(v, "Mul")]
    return gamma[0].output[0] if len(gamma) == 1 else y


def _matmuls_on(idx: _Index, value: str, reshape_matmul: bool = False) -> int:
    count = 0
    for v in idx.through_casts(value):
        count += len(idx.readers_of(v, "MatMul", 0))
        for reshape in idx.readers_of(v, "Reshape", 0):
            count += len(idx.readers_of(reshape.output[0], "Gemm", 0))
            if reshape_matmul:
                count += len(idx.readers_of(reshape.output[0], "MatMul", 0))
    return count


KEYS = (
    "conv_bn_relu",
    "conv_bn",
    "layernorm",
    "layernorm_matmul",
    "layernorm_matmuls",
    "rmsnorm",
    "rmsnorm_matmul",
    "rmsnorm_matmuls",
    "softmax_topk",
    "topk_softmax",
    "allgather_matmul",
)


def layernorm_outputs(model: onnx.ModelProto) -> list[str]:
    """The output value of every LayerNorm (op or decomposed) in graph order."""
    idx = _Index(model.graph)
    outs = []
    for node in model.graph.node:
        if node.op_type == "LayerNormalization":
            outs.append(node.output[0])
        elif node.op_type == "Sqrt" and (out := _decomposed_ln_output(idx, node)) is not None:
            outs.append(out)
    return outs


def _count_rms(idx: _Index, out: str, counts: Counter[str]) -> None:
    counts["rmsnorm"] += 1
    if n := _matmuls_on(idx, out, reshape_matmul=True):
        counts["rmsnorm_matmul"] += 1
        counts["rmsnorm_matmuls"] += n


def count_chains(model: onnx.ModelProto) -> dict[str, int]:
    """Count the fusable-family chains in ``model``'s main graph (see the module docstring).

    Every key of ``KEYS`` is present, zero included.
    """
    graph = model.graph
    idx = _Index(graph)
    counts: Counter[str] = Counter()
    for node in graph.node:
        op = node.op_type
        if op == "Conv":
            for bn in idx.readers_of(node.output[0], "BatchNormalization", 0):
                relu = idx.readers_of(bn.output[0], "Relu")
                counts["conv_bn_relu" if relu else "conv_bn"] += 1
        elif op == "LayerNormalization" or op == "Sqrt":
            out = node.output[0] if op == "LayerNormalization" else _decomposed_ln_output(idx, node)
            if out is not None:
                counts["layernorm"] += 1
                if n := _matmuls_on(idx, out):
                    counts["layernorm_matmul"] += 1
                    counts["layernorm_matmuls"] += n
            rms = _decomposed_rms_output(idx, node) if op == "Sqrt" else None
            if rms is not None:
                _count_rms(idx, rms, counts)
        elif op in ("RMSNormalization", "SimplifiedLayerNormalization"):
            _count_rms(idx, node.output[0], counts)
        elif op == "Softmax":
            values = idx.through_casts(node.output[0])
            counts["softmax_topk"] += sum(len(idx.readers_of(v, "TopK", 0)) for v in values)
        elif op == "TopK":
            counts["topk_softmax"] += len(idx.readers_of(node.output[0], "Softmax", 0))
        elif op == "AllGather" and node.domain == "com.microsoft":
            values = [node.output[0]]
            values += [r.output[0] for r in idx.readers_of(node.output[0], "Reshape", 0)]
            for value in values:
                for op in ("MatMul", "Gemm"):
                    counts["allgather_matmul"] += len(idx.readers_of(value, op, 0))
    return {key: counts[key] for key in KEYS}
