"""AllGatherMatMul's body: com.microsoft AllGather, MatMul, and the bias Add when present.

Variants: `bias` or `nobias`. group_size and axis are passed to AllGather by reference (the
fused op's axis is already non-negative, as onnxruntime's AllGather requires).
"""

from __future__ import annotations

from .builder import Body, BodyGraph, BodyRequest

MS_DOMAIN = "com.microsoft"


def build(request: BodyRequest) -> Body:
    g = BodyGraph(request)
    bias = request.has_input(2)
    gathered = g.op(
        "AllGather",
        "X",
        out="gathered",
        domain=MS_DOMAIN,
        refs={"group_size": "group_size", "axis": "axis"},
    )
    y = g.op("MatMul", gathered, "W", out=None if bias else "Y")
    if bias:
        g.op("Add", y, "B", out="Y")
    version = request.domains.get(MS_DOMAIN, 1)
    return g.build(
        ("X", "W", "B") if bias else ("X", "W"),
        ("Y", "gathered"),
        "bias" if bias else "nobias",
        domains=((MS_DOMAIN, version),),
    )
