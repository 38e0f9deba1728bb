"""AllGatherMatMul's body: com.microsoft AllGather once, then every Linear on the gathered value:
MatMul (+ bias Add), or one Gemm; a flattened Linear reads Flatten(gathered, -1).

Variants: `bias` or `nobias` for the one-Linear form without `has_bias`; else one part per
Linear: `mm` or `gemm`, `b` if it has a bias, `f` if flattened, `t` for trans_b, and for a
Gemm its alpha and beta written in (a body cannot index a floats attribute), e.g.
`mmb_mmb_mmbf` or `gemmbft_a1.0_b1.0`. group_size and axis are passed to AllGather by
reference (the fused op's axis is already non-negative, as onnxruntime's AllGather requires).
"""

from __future__ import annotations

from fuser.patterns.allgather_linears import linears

from .builder import Body, BodyError, BodyGraph, BodyRequest

MS_DOMAIN = "com.microsoft"


def build(request: BodyRequest) -> Body:
    g = BodyGraph(request)
    attrs = request.attributes
    legacy = not attrs.get("has_bias")
    try:
        specs = linears(attrs, [True if p else None for p in request.inputs])
    except ValueError as e:
        raise BodyError(str(e)) from None
    gathered = g.op(
        "AllGather",
        "X",
        out="gathered",
        domain=MS_DOMAIN,
        refs={"group_size": "group_size", "axis": "axis"},
    )
    inputs, outputs, parts = ["X"], ["Y_0", "gathered"], []
    for i, spec in enumerate(specs):
        w, b, y = f"W_{i}", f"b_{i}", f"Y_{i}"
        inputs += [w, *([b] if spec.b is not None else [])]
        if i:
            outputs.append(y)
        if spec.flatten and request.opset < 11:
            raise BodyError(f"Flatten at opset {request.opset} takes no negative axis")
        a = g.op("Flatten", gathered, axis=-1) if spec.flatten else gathered
        part = ("gemm" if spec.gemm else "mm") + "b" * (spec.b is not None)
        part += "f" * spec.flatten + "t" * spec.trans_b
        if spec.gemm:
            g.op(
                "Gemm", a, w, *([b] if spec.b is not None else []), out=y,
                transB=int(spec.trans_b), alpha=spec.alpha, beta=spec.beta,
            )  # fmt: skip
            part += f"_a{spec.alpha!r}_b{spec.beta!r}"
        elif spec.trans_b:
            raise BodyError(f"Linear {i}: trans_b without gemm")
        else:
            mm = g.op("MatMul", a, w, out=None if spec.b is not None else y)
            if spec.b is not None:
                g.op("Add", mm, b, out=y)
        parts.append(part)
    version = request.domains.get(MS_DOMAIN, 1)
    variant = ("bias" if specs[0].b is not None else "nobias") if legacy else "_".join(parts)
    return g.build(inputs, outputs, variant, domains=((MS_DOMAIN, version),))
