"""Function bodies of the fused ops: each op's original chain in standard ONNX ops.

One module per fused op family, each with a `build(request) -> Body` that the op declares as
its `FusedOp.body`; `fuser.functions` turns bodies into model-local FunctionProtos. Adding a
body for a new op, or a variant of an existing one, is a change to that op's module alone.
"""
